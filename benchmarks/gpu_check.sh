#!/usr/bin/env bash
# The one prepared command for a session that is lent a GPU (an H200 here). First, on the
# development machine: bash benchmarks/gpu_prepare.sh (fills .gpu/); then with the device tool:
#
#     run(command="bash benchmarks/gpu_check.sh", carry=[".gpu"], timeout_s=600)
#
# 1. benchmarks/kernels.py: the decode / prefill grid against SDPA (120 s), then --sweep (tile
#    shapes, warps, stages, split-K factor on decode 64 x 4k, 1 x 32k and prefill 4 x 4k; 150 s);
# 2. benchmarks/gpu_engine_check.py: the whole engine on CUDA (executor, paged KV cache on the
#    GPU, Triton and torch attention backends) against Hugging Face greedy tokens (90 s);
# 3. the Triton kernel tests natively on the GPU (tests/kernels/test_triton_kernels.py, test_fused_moe.py and
#    test_quant_triton.py; 120 s: each parametrization compiles its own kernel);
# 4. with 2 or more GPUs, tensor parallelism on NCCL: gpu_engine_check.py --tensor-parallel-size 2
#    (one GPU per rank; 90 s); skipped, saying so, on a machine with one GPU.
# Each step has its own time limit: about 490 s in all, under the device tool's 10 minutes,
# leaving room to start a machine and, if needed, run once more within 15 minutes;
# output goes to $OUT (the device tool brings that folder back), else /tmp/gpu_check.
# Needs the machine's python3 with torch, triton, transformers and pytest; the engine's other
# dependencies come from .gpu/whl (steps 1 and 3 run without them).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
if [ -d .gpu/whl ]; then
    $PY -m pip install -q --no-index --find-links .gpu/whl --no-compile --no-cache-dir --target /tmp/site \
        -r .gpu/requirements.txt \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# the issue's grid, trimmed to what fits: decode 64 x 4k is the bandwidth target
timeout 120 $PY benchmarks/kernels.py --decode-batch 1,16,64,256 --decode-context 512,4096,32768 \
    --prefill-batch 1,4,16 --prefill-len 1024,4096,8192 2>&1 | tee "$OUT/kernels.txt"
echo "kernels.py exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernels.txt"
timeout 150 $PY benchmarks/kernels.py --decode-batch= --prefill-batch= --sweep 2>&1 | tee "$OUT/sweep.txt"
echo "kernels.py --sweep exit: ${PIPESTATUS[0]}" | tee -a "$OUT/sweep.txt"
timeout 90 $PY benchmarks/gpu_engine_check.py --tokenizer .gpu/tokenizer 2>&1 | grep -v "Loading weights\|Writing model" \
    | tail -40 | tee "$OUT/engine.txt"
echo "gpu_engine_check.py exit: ${PIPESTATUS[0]}" | tee -a "$OUT/engine.txt"
timeout 120 $PY -m pytest -q -x -p no:cacheprovider tests/kernels/test_triton_kernels.py tests/kernels/test_fused_moe.py \
    tests/kernels/test_quant_triton.py 2>&1 | tail -40 | tee "$OUT/tests.txt"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tests.txt"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$NGPU" -ge 2 ]; then
    timeout 90 $PY benchmarks/gpu_engine_check.py --tokenizer .gpu/tokenizer --backends triton --skip-bf16 \
        --tensor-parallel-size 2 2>&1 | grep -v "Loading weights\|Writing model" | tail -20 | tee "$OUT/tp.txt"
    echo "gpu_engine_check.py --tensor-parallel-size 2 exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tp.txt"
else
    echo "tensor parallelism on NCCL: $NGPU GPU(s), one per rank needed for TP=2; a one-rank NCCL group instead" \
        | tee "$OUT/tp.txt"
    timeout 60 $PY - <<'PYEOF' 2>&1 | tail -5 | tee -a "$OUT/tp.txt"
import torch
from services.executor.parallel.group import TensorParallelGroup
from shared.nats_server import free_port
tp = TensorParallelGroup.connect(0, 1, "127.0.0.1", free_port(), torch.device("cuda", 0), 60)
t = torch.ones(4, 8, device="cuda", dtype=torch.bfloat16)
tp.device_group.allreduce([t]).wait()  # the backend itself, past the one-rank shortcuts
import torch.distributed as dist
opts = dist.GatherOptions(); opts.rootRank = 0
parts = [torch.empty(4, 8, device="cuda", dtype=torch.bfloat16)]
tp.device_group.gather([parts], [t], opts).wait()
torch.cuda.synchronize()
print("NCCL one-rank group:", type(tp.device_group).__name__, "all_reduce + gather ok:", bool((parts[0] == 1).all()))
PYEOF
fi
