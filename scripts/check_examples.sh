#!/usr/bin/env bash
# A new user's path, checked: the project installed as `bash scripts/serve.sh` installs it (no extras)
# in a fresh virtualenv, then every program in examples/ run as a script. Each must exit with 0 and
# leave no traceback, crash or abort on stderr (its log lines are fine).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-serve}
# REUSE_VENV=1: the caller made $VENV fresh for this run (.ci/run installs its torch while the tests set up)
[ "${REUSE_VENV:-0}" = 1 ] || rm -rf "$VENV"
VENV="$VENV" bash scripts/setup.sh serve
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RADIXLM_EXAMPLE_MAX_TOKENS=8
unset PYTHONDONTWRITEBYTECODE  # the project's modules compiled once for all the examples (scripts/test.sh)
# one example: "ok NAME", or what went wrong (printed whole, so two running at once do not interleave)
check() {
    local example=$1 err rc=0
    err=$(mktemp)
    "$VENV/bin/python" "$example" >/dev/null 2>"$err" || rc=$?
    if [ "$rc" != 0 ]; then
        printf 'FAILED %s (exit code %s):\n%s\n' "$example" "$rc" "$(tail -20 "$err")" >&2
    elif grep -qE "Traceback|terminate called|Fatal Python error|Error: " "$err"; then
        printf 'FAILED %s (exit code 0, but stderr says):\n%s\n' "$example" \
            "$(grep -E -A5 "Traceback|terminate called|Fatal Python error|Error: " "$err" | head -20)" >&2
        rc=1
    else
        echo "ok $example"
    fi
    rm -f "$err"
    return $(( rc != 0 ))
}
export -f check
export VENV
# two at a time: each is mostly its own start-up (imports, the model's load)
printf '%s\n' examples/*.py | xargs -P 2 -I{} bash -c 'check "$1"' _ {}
