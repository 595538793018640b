#!/usr/bin/env bash
# A new user's path, checked: the project installed as `bash scripts/serve.sh` installs it (no extras)
# in a fresh virtualenv, then every program in examples/ run as a script. Each must exit with 0 and
# leave no traceback, crash or abort on stderr (its log lines are fine).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-serve}
rm -rf "$VENV"
VENV="$VENV" bash scripts/setup.sh serve
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RADIXLM_EXAMPLE_MAX_TOKENS=8
failed=0
for example in examples/*.py; do
    err=$(mktemp)
    rc=0
    "$VENV/bin/python" "$example" >/dev/null 2>"$err" || rc=$?
    if [ "$rc" != 0 ]; then
        echo "FAILED $example (exit code $rc):" >&2; tail -20 "$err" >&2; failed=1
    elif grep -qE "Traceback|terminate called|Fatal Python error|Error: " "$err"; then
        echo "FAILED $example (exit code 0, but stderr says):" >&2; grep -E -A5 "Traceback|terminate called|Fatal Python error|Error: " "$err" | head -20 >&2; failed=1
    else
        echo "ok $example"
    fi
    rm -f "$err"
done
exit $failed
