#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -p no:cacheprovider "$@"
