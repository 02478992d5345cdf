#!/usr/bin/env bash
# The GPU checks of issue 16 (item 7) in one call of a lent GPU machine, as a session runs them:
#
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# The machine has torch, transformers and accelerate but not every dependency: zstandard and
# constriction come as wheels in .whl/ (`pip download --only-binary=:all: --python-version 3.12
# --no-deps -d .whl zstandard==0.25.0 constriction==0.5.0` here; .whl/ is in .git/info/exclude),
# installed into /tmp/site, never into the machine's own site-packages. The C kernels are built
# there. Each step's output goes to $OUT (it comes back even when a step fails or the call runs
# out of time): the CUDA tests (about 15 s), then bench_gpu's DynaQuant, plain and
# torch.distributed.checkpoint.async_save arms at 300 steps (session 44's DynaQuant and plain
# arms took 68 and 46 s of training each, and some 100 s together beside), each step under a
# timeout so that the whole stays inside one call's 10 minutes. SETTLE=1 also runs bench_settle
# (about a minute; session 44 measured it: RESULTS.md, "On a GPU, session 44"); STEPS and ARMS
# override bench_gpu's.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
} 2>&1 | tee "$OUT/machine.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tee -a "$OUT/machine.log"
export PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace 2>&1 | tail -5 | tee -a "$OUT/machine.log"
python3 -c "import hf_dynaquant.core.kernels as k; assert k.native is not None, 'the C kernels did not build'" \
    2>&1 | tee -a "$OUT/machine.log" || exit 1

echo "## tests" | tee "$OUT/tests.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_device_search.py 2>&1 | tee -a "$OUT/tests.log"

if [ "${SETTLE:-0}" = 1 ]; then
    echo "## bench_settle" | tee "$OUT/settle.log"
    timeout 100 python3 benchmarks/bench_settle.py --json "$OUT/settle.json" --plot "$OUT/settle.png" 2>&1 | tee -a "$OUT/settle.log"
fi

echo "## bench_gpu" | tee "$OUT/gpu.log"
timeout 380 python3 benchmarks/bench_gpu.py --steps "${STEPS:-300}" --search-seconds 40 --arms "${ARMS:-dynaquant,plain,dcp}" \
    --arm-timeout 150 --json "$OUT/gpu.json" --plot "$OUT/gpu.png" 2>&1 | tee -a "$OUT/gpu.log"
