#!/usr/bin/env bash
# Builds .gpu-carry/ for a lent GPU (../shared/gpu/README.md), after scripts/setup.sh:
# ../shared/gpu/prepare.sh, then what it misses for this tree: the built-in model's tokenizer
# (prepare.sh looks it up through a module path this tree has since moved, and stops there, before
# copying run.sh and make_model.py) and llguidance >= 1.7 (its wheels' manylinux tags stop at 2_28,
# which gives 1.6.1: one EOS id, so every constrained request failed). FlashInfer's archive is left out
# (GPU_FLASHINFER=1 keeps it). Then, with the device tool:
#   run(carry=[".gpu-carry"], command="bash .gpu-carry/run.sh bash scripts/gpu_check.sh")
set -uo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
shared="${GPU_SHARED:-$root/../shared/gpu}"
carry="$root/.gpu-carry"
export HF_HUB_OFFLINE=1
bash "$shared/prepare.sh" >/dev/null 2>&1  # wheels and FlashInfer; its tokenizer step fails here
[ -d "$carry/whl" ] || { echo "prepare.sh made no $carry/whl" >&2; exit 1; }
src=$(.venv/bin/python -c "from radixlm.runtime.executor.loader import resolve_model
print(resolve_model('smollm2-135m').folder)" | tail -n 1)
mkdir -p "$carry/tok"
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
  [ -f "$src/$f" ] && cp "$src/$f" "$carry/tok/"
done
cp "$shared/run.sh" "$shared/make_model.py" "$carry/"
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llguidance'))")
rm -f "$carry"/whl/llguidance-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 -d "$carry/whl" "llguidance==$version" \
  2>&1 | grep -v '^WARNING' || true
# No attention backend uses FlashInfer yet, and its 47 MB archive takes the carry over the device
# tool's 64 MiB: it stays out unless GPU_FLASHINFER=1.
[ "${GPU_FLASHINFER:-0}" = 1 ] || rm -f "$carry/flashinfer.tgz"
ls "$carry"/tok/tokenizer.json "$carry"/run.sh "$carry"/whl/llguidance-*.whl || exit 1
du -sh "$carry"
