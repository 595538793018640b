#!/usr/bin/env bash
# Sets up (idempotent) and starts the server on the built-in model (SmolLM2-135M) on 127.0.0.1:30000.
# Extra arguments go to the server, e.g. --port 8000 --api-key secret.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m radixlm.server --model smollm2-135m "$@"
