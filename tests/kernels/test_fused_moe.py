"""The fused mixture-of-experts op vs its per-token torch reference
(``services/executor/layers/fused_moe.py``): the router's top-k softmax vs Hugging Face's
routers, the batched CPU path, and the Triton grouped GEMM (``kernels/triton/fused_moe.py``).

The Triton tests run natively on a GPU, else under the Triton CPU interpreter, set up as in
``test_triton_kernels.py`` (whose docstring explains why ``TRITON_INTERPRET`` must be set
before triton is imported, and the fresh-process fallback). Their shapes are small: the
interpreter runs each program in Python.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("PAGEDLLM_KERNEL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton.language as tl  # noqa: E402

from kernels.triton.utils import is_interpreted  # noqa: E402
from services.executor.layers.fused_moe import fused_moe_cpu, fused_moe_reference, topk_softmax  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IN_PROCESS = is_interpreted(tl.max) == (DEVICE == "cpu")
in_process = pytest.mark.skipif(not IN_PROCESS, reason="triton was imported in the other TRITON_INTERPRET mode")
# (atol, rtol) vs the float32 reference; the interpreter truncates fp32 -> bf16 where the GPU
# rounds, and the kernel rounds gate | up, the activation and each expert's output to the dtype
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (1e-1, 5e-2)}


def _triton_fused_moe():
    mod = importlib.import_module("kernels.triton.fused_moe")
    if IN_PROCESS and is_interpreted(mod._fused_moe_kernel) != is_interpreted(tl.max):
        mod = importlib.reload(mod)  # imported earlier in this process in the other mode
    return mod


def _case(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, seed: int = 0,
          skip_expert: int | None = None):
    """Random inputs, weights and a routing (``skip_expert``: an expert no token picks)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9
    weights, ids = topk_softmax(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


# ---------------------------------------------------------------- routing and the CPU path


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe-norm", "qwen2_moe"])
def test_topk_softmax_matches_hugging_face_router(arch):
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    if arch == "mixtral":
        config, router_cls = MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2), MixtralTopKRouter
    else:
        config = Qwen2MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=arch.endswith("norm"))
        router_cls = Qwen2MoeTopKRouter
    router = router_cls(config)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(3))
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(4))
    logits, ref_weights, ref_ids = router(x)
    renormalize = arch == "mixtral" or config.norm_topk_prob
    weights, ids = topk_softmax(logits, config.num_experts_per_tok, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), atol=0, rtol=0)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "top_k", "skip_expert"), [(1, 1, None), (9, 2, 2), (40, 3, None)])
def test_cpu_path_matches_reference(dtype, num_tokens, top_k, skip_expert):
    x, w13, w2, weights, ids = _case(num_tokens, 48, 40, 5, top_k, skip_expert=skip_expert)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    out = fused_moe_cpu(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    atol, rtol = TOL[dtype] if dtype != torch.bfloat16 else (5e-2, 2e-2)  # torch rounds bf16 to nearest
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- Triton


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "num_experts", "top_k", "skip_expert"),
    [
        (3, 48, 40, 4, 2, 1),  # decode-sized, an expert with no token, sizes off the tiles
        (37, 64, 24, 4, 2, None),  # 74 pairs: 64-row blocks, padding in every group
        (5, 32, 16, 6, 1, None),  # top-1
    ],
)
def test_triton_fused_moe_matches_reference(dtype, num_tokens, hidden, inter, num_experts, top_k, skip_expert):
    triton_moe = _triton_fused_moe()
    x, w13, w2, weights, ids = _case(num_tokens, hidden, inter, num_experts, top_k, seed=num_tokens,
                                     skip_expert=skip_expert)
    x, w13, w2 = (t.to(dtype) for t in (x, w13, w2))
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    out = triton_moe.fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


@in_process
def test_moe_align_block_size_groups_pairs_by_expert():
    triton_moe = _triton_fused_moe()
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5; expert 1 has none
    sorted_ids, block_experts = triton_moe.moe_align_block_size(ids, 4, 4)
    # groups: expert 0 -> pairs 1, 4; expert 2 -> 0, 2, 5; expert 3 -> 3; each padded to 4 with 6
    assert sorted_ids.tolist()[:12] == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
    assert block_experts.tolist()[:3] == [0, 2, 3] and set(block_experts.tolist()[3:]) == {-1}
    assert sorted_ids.numel() == block_experts.numel() * 4 and set(sorted_ids.tolist()[12:]) <= {6}


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_kernel_tests_in_fresh_process():
    """Runs this module's in-process tests in a fresh process when this one cannot."""
    env = dict(os.environ, PAGEDLLM_KERNEL_TEST_DEVICE=DEVICE, TRITON_INTERPRET="1" if DEVICE == "cpu" else "0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "triton or align"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


_COMPILE_SCRIPT = r"""
import torch
from kernels.triton.fused_moe import moe_align_block_size, plan_grouped_gemm
from kernels.triton.utils import compile_launch, is_interpreted

ids = torch.zeros(64, 2, dtype=torch.int64)
weights = torch.empty(128)
launches = []
for dtype, block_m in ((torch.bfloat16, 64), (torch.float16, 16), (torch.float32, 16)):
    sorted_ids, block_experts = moe_align_block_size(ids, 8, block_m)
    x, w13 = torch.empty(64, 1024, dtype=dtype), torch.empty(8, 2 * 768, 1024, dtype=dtype)
    act, w2 = torch.empty(128, 768, dtype=dtype), torch.empty(8, 1024, 768, dtype=dtype)
    launches.append(plan_grouped_gemm(x, w13, torch.empty(128, 1536, dtype=dtype), weights, sorted_ids,
                                      block_experts, 2, False, block_m))
    launches.append(plan_grouped_gemm(act, w2, torch.empty(128, 1024, dtype=dtype), weights, sorted_ids,
                                      block_experts, 1, True, block_m))
assert not any(is_interpreted(launch.kernel) for launch in launches)
for arch in (90, 80):
    for launch in launches:
        assert compile_launch(launch, arch).asm["cubin"]
        print(arch, "ok")
"""


def test_fused_moe_kernel_compiles_for_cuda_targets():
    """The planned launches compile to cubin for sm_90 and sm_80 (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok") == 12, proc.stdout
