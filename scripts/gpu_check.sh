#!/usr/bin/env bash
# Everything a lent GPU checks (../shared/gpu/README.md), in one device command, logs under $1 (default $OUT):
#   bash .gpu-carry/run.sh bash scripts/gpu_check.sh
# 1. the tests marked `cuda` (fidelity against transformers, graphs and overlap on vs off, grammars);
# 2. the triton kernel tests, natively (no interpreter where a GPU is);
# 3. benchmarks/gpu.py on the 1b model (SIGINT at its bound: it saves what it measured);
# 4. benchmarks/host_overhead.py on CUDA (the scheduler's host work per step beside a real device);
# 5. scripts/server_smoke.py: the HTTP server on CUDA (/generate, streamed chat, json_schema, a 400).
# Each part has its own bound in seconds (T_CUDA, T_KERNELS, T_BENCH, T_HOST, T_SERVER; 0 skips it), so a
# slow part leaves the others their time. The defaults add up to more than one 600 s device call: run the
# tests in one call (T_BENCH=0 T_HOST=0 T_SERVER=0) and the rest in a second (T_CUDA=0 T_KERNELS=0). BENCH_ARGS and HOST_ARGS are added to gpu.py's and
# host_overhead.py's arguments; CUDA_K and KERNELS_K select tests (-k).
# Build .gpu-carry first with scripts/gpu_prepare.sh (once per machine, here).
set -o pipefail
out="${1:-${OUT:?give a folder or set OUT}}"
mkdir -p "$out"
: "${T_CUDA:=300}" "${T_KERNELS:=150}" "${T_BENCH:=240}" "${T_HOST:=60}" "${T_SERVER:=90}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$out/env.log"
part() { [ "$1" != 0 ]; }
part "$T_CUDA" && timeout -s INT "$T_CUDA" python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 150 -m cuda ${CUDA_K:+-k "$CUDA_K"} \
  tests/test_cuda.py tests/test_cuda_graph.py tests/test_step_isolation.py 2>&1 | tee "$out/cuda_tests.log"
part "$T_KERNELS" && timeout -s INT "$T_KERNELS" python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 60 ${KERNELS_K:+-k "$KERNELS_K"} \
  tests/test_triton_attention.py tests/test_moe_triton.py tests/test_triton_layer_ops.py 2>&1 | tee "$out/kernel_tests.log"
part "$T_BENCH" && timeout -s INT "$T_BENCH" python3 benchmarks/gpu.py --model 1b --no-progress ${BENCH_ARGS:-} \
  --out "$out/gpu.json" 2>&1 \
  | tee "$out/gpu.log"
part "$T_HOST" && timeout -s INT "$T_HOST" python3 benchmarks/host_overhead.py --device cuda --no-progress ${HOST_ARGS:-} --json "$out/host.json" 2>&1 \
  | tail -n 40 | tee "$out/host.log"
part "$T_SERVER" && timeout -s INT "$T_SERVER" python3 scripts/server_smoke.py --model "${RADIXLM_GPU_MODELS:-/tmp/models}/tiny" \
  --device cuda 2>&1 | tail -n 40 | tee "$out/server.log"
exit 0
