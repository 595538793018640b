#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# every test worker, server process and subprocess imports the project and the test modules: compiled
# once and cached, where an environment that turns bytecode caching off has each process compile them
unset PYTHONDONTWRITEBYTECODE
# a compiled forward's kernels built in the compiling process: inductor's own pool of compile processes
# would take the cores the other worker and the servers use, for no gain in wall time
export TORCHINDUCTOR_COMPILE_THREADS=1
# Two workers, a test file each at a time (module-scoped servers stay in one process); the few tests
# that compare timings within themselves run afterwards, alone. RADIXLM_TEST_WORKERS=0 runs them in this process.
workers=${RADIXLM_TEST_WORKERS:-2}
# The workers and the servers they start share the cores: torch's OpenMP threads would spin at the end
# of every op waiting for a descheduled peer, burning the slices the other processes need; passive
# waits hand them over. The timing tests keep the default.
OMP_WAIT_POLICY=PASSIVE python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile -m "not serial" "$@"
# from the files that hold one (collecting the whole suite again costs a minute on a busy machine),
# unless the arguments name the files
serial=$(grep -l "pytest.mark.serial" tests/test_*.py || true)
for arg in "$@"; do case $arg in tests*|*.py*) serial="" ;; esac; done
python -m pytest -q -p no:cacheprovider -m serial "$@" $serial || [ $? = 5 ]  # 5: no serial test selected
