#!/usr/bin/env bash
# The one prepared command for a session that is lent a GPU (an H200 here):
#
#     bash benchmarks/gpu_check.sh          # the device tool: run(command="bash benchmarks/gpu_check.sh", timeout_s=600)
#
# 1. benchmarks/kernels.py: the decode / prefill grid against SDPA, then --sweep (tile shapes,
#    warps, pipelining stages, split-K factor on decode 64 x 4k, 1 x 32k and prefill 4 x 4k);
# 2. the Triton kernel tests natively on the GPU (tests/test_triton_kernels.py).
# Each step has its own time limit so that the whole stays under the device tool's 10 minutes;
# output goes to $OUT (the device tool brings that folder back), else /tmp/gpu_check.
# Needs only the machine's python3 with torch, triton and pytest (no project venv).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
timeout 360 $PY benchmarks/kernels.py --sweep 2>&1 | tee "$OUT/kernels.txt"
echo "kernels.py exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernels.txt"
timeout 170 $PY -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tail -40 | tee "$OUT/tests.txt"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tests.txt"
