#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two workers, a test file each at a time (module-scoped servers stay in one process); the few tests
# that compare timings within themselves run afterwards, alone. RADIXLM_TEST_WORKERS=0 runs them in this process.
workers=${RADIXLM_TEST_WORKERS:-2}
python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile -m "not serial" "$@"
python -m pytest -q -p no:cacheprovider -m serial "$@" || [ $? = 5 ]  # 5: no serial test selected
