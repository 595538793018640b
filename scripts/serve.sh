#!/usr/bin/env bash
# Sets up (idempotent) and starts the server on the built-in model (SmolLM2-135M) on 127.0.0.1:30000.
# Extra arguments go to the server, e.g. --port 8000 --api-key secret.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve
. .venv/bin/activate
# the tokenizer's own threads stay on: a batch of prompts is tokenized on every core (the server's
# processes are spawned, never forked, so they cannot deadlock)
export HF_HUB_OFFLINE=1
exec python -m radixlm.server --model smollm2-135m "$@"
