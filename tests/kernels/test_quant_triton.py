"""The Triton quantized matmuls vs torch references: the int4 group-quantized weight of
``layers/quantization/int4.py`` (``kernels/triton/gemm_w4.py``) and GGUF Q4_0 / Q4_1 / Q8_0 / K-quant
blocks (``kernels/triton/gemm_gguf.py``, reference ``layers/quantization/gguf/``'s ``dequantize``).

The kernel tests run natively on a GPU, else under the Triton CPU interpreter, set up as in
``test_triton_kernels.py`` (whose docstring explains why ``TRITON_INTERPRET`` must be set
before triton is imported, and the fresh-process fallback). On a GPU the linear methods'
CUDA paths are checked too. Shapes are small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_fixtures import random_blocks

DEVICE = os.environ.get("PAGEDLLM_KERNEL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton.language as tl  # noqa: E402

from kernels.triton.utils import is_interpreted  # noqa: E402
from services.executor.layers.quantization import gguf  # noqa: E402
from services.executor.layers.quantization.int4 import Int4Weights, int4_matmul, pack_int4  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IN_PROCESS = is_interpreted(tl.max) == (DEVICE == "cpu")
in_process = pytest.mark.skipif(not IN_PROCESS, reason="triton was imported in the other TRITON_INTERPRET mode")
# (atol, rtol) vs a float32 product of the same operands (the weight rounded to the operand
# dtype, as the kernel does): only the sums' order and the output's rounding differ
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _kernel(name: str, kernel: str):
    mod = importlib.import_module(name)
    if IN_PROCESS and is_interpreted(getattr(mod, kernel)) != is_interpreted(tl.max):
        mod = importlib.reload(mod)  # imported earlier in this process in the other mode
    return mod


def _int4_weights(n: int, k: int, group: int, seed: int) -> Int4Weights:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float()
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
    return Int4Weights(q, zeros, scales, torch.arange(k) // group)


def _gguf_blocks(fmt: gguf.BlockFormat, n: int, k: int, seed: int) -> torch.Tensor:
    """Random ``[N, K / block_size * block_bytes]`` rows of ``fmt`` blocks with finite fp16 scales."""
    scale = {gguf.Q8_0: 0.002, gguf.Q4_K: 5e-4, gguf.Q5_K: 5e-4, gguf.Q6_K: 2e-4}.get(fmt, 0.02)  # |w| ~ 1
    return random_blocks(fmt, n, k, seed, scale=scale)


# ---------------------------------------------------------------- int4


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "strided"),
    [
        (1, 40, 64, 32, False),  # decode row, N off the 64-column tile, 32-column steps
        (3, 72, 192, 64, True),  # 3 groups of 64, x a column slice of a wider tensor
        (37, 24, 256, 128, False),  # 64-row tiles, M and N off them
    ],
)
def test_triton_gemm_w4_matches_reference(dtype, m, n, k, group, strided):
    gemm_w4 = _kernel("kernels.triton.gemm_w4", "_gemm_w4_kernel")
    w = _int4_weights(n, k, group, seed=m)
    packed = pack_int4(w)
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k + 16 if strided else k, generator=gen).to(dtype)[:, :k]
    g = w.g_idx
    weight = w.q.float() * w.scales[:, g] - (w.zeros * w.scales)[:, g]  # [N, K] as the kernel, then rounded
    expected = x.float() @ weight.to(dtype).float().T  # [M, N]

    dev = (x.to(DEVICE), packed.qweight.to(DEVICE), packed.scales.to(DEVICE), packed.szeros.to(DEVICE))
    out = gemm_w4.gemm_w4(*dev, group)

    assert out.dtype == dtype and out.shape == (m, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- GGUF


@in_process
@pytest.mark.parametrize("fmt", [gguf.Q4_0, gguf.Q4_1, gguf.Q8_0], ids=lambda f: f.name)
@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.bfloat16, torch.float32)],  # the last: logits, float32 operands
    ids=["f32", "f16", "bf16", "bf16-logits"],
)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (37, 72, 128)])  # odd block count; 2 blocks a step
def test_triton_gemm_gguf_matches_reference(fmt, dtype, out_dtype, m, n, k):
    gemm_gguf = _kernel("kernels.triton.gemm_gguf", "_gemm_gguf_kernel")
    blocks = _gguf_blocks(fmt, n, k, seed=m + fmt.ggml_type)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    operand = torch.float32 if out_dtype == torch.float32 else dtype
    expected = x.float() @ gguf.dequantize(blocks, fmt, operand).float().T  # [M, N]

    out = gemm_gguf.gemm_gguf(x.to(DEVICE), blocks.to(DEVICE), fmt, out_dtype)

    assert out.dtype == out_dtype and out.shape == (m, n)
    atol, rtol = TOL[out_dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


@in_process
@pytest.mark.parametrize("fmt", [gguf.Q4_K, gguf.Q5_K, gguf.Q6_K], ids=lambda f: f.name)
@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.bfloat16, torch.float32)],
    ids=["f32", "f16", "bf16", "bf16-logits"],
)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 512), (5, 24, 256), (64, 72, 512)])  # M off and on the tiles
def test_triton_gemm_gguf_k_quants_match_gguf_dequantize(fmt, dtype, out_dtype, m, n, k):
    """Random valid super-blocks against ``gguf.quants.dequantize`` and a float32 matmul."""
    from gguf import GGMLQuantizationType, quants

    gemm_gguf = _kernel("kernels.triton.gemm_gguf", "_gemm_gguf_k_kernel")
    blocks = _gguf_blocks(fmt, n, k, seed=m + fmt.ggml_type)
    weight = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType(fmt.ggml_type)))  # [N, K]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    operand = torch.float32 if out_dtype == torch.float32 else dtype
    expected = x.float() @ weight.to(operand).float().T  # [M, N]

    out = gemm_gguf.gemm_gguf(x.to(DEVICE), blocks.to(DEVICE), fmt, out_dtype)

    assert out.dtype == out_dtype and out.shape == (m, n)
    atol, rtol = TOL[out_dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- the linear methods on CUDA


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA paths of the linear methods need a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_methods_use_triton_on_cuda(dtype, monkeypatch):
    """int4_matmul and GGUFLinearMethod on CUDA tensors give the reference through the Triton kernels."""
    import kernels.triton.gemm_gguf as triton_gguf
    import kernels.triton.gemm_w4 as triton_w4

    calls = []
    for mod, name in ((triton_w4, "gemm_w4"), (triton_gguf, "gemm_gguf")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **kw: calls.append(_real) or _real(*a, **kw))
    w = _int4_weights(48, 128, 64, seed=5)
    packed = pack_int4(w)
    for f in ("qweight", "scales", "szeros"):
        setattr(packed, f, getattr(packed, f).cuda())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6)).to(dtype)
    bias = torch.randn(48).to(dtype)
    out = int4_matmul(x.cuda(), packed, bias.cuda())
    expected = x.float() @ w.dequantize(dtype).float().T + bias.float()
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=1e-2)

    layer = torch.nn.Module()
    method = gguf.GGUFLinearMethod(gguf.Q4_1, dtype)
    method.install(layer, _gguf_blocks(gguf.Q4_1, 48, 128, seed=7).cuda(), 128)
    out = method.apply(layer, x.cuda())
    logits = method.apply_logits(layer, x.cuda())
    weight = gguf.dequantize(layer.weight.cpu(), gguf.Q4_1)  # [48, 128] float32
    assert out.dtype == dtype and logits.dtype == torch.float32
    torch.testing.assert_close(out.float().cpu(), x.float() @ weight.to(dtype).float().T, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(logits.cpu(), x.float() @ weight.T, atol=1e-4, rtol=1e-4)
    assert len(calls) == 3


# ---------------------------------------------------------------- fallback and CUDA targets


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_kernel_tests_in_fresh_process():
    """Runs this module's in-process tests in a fresh process when this one cannot."""
    env = dict(os.environ, PAGEDLLM_KERNEL_TEST_DEVICE=DEVICE, TRITON_INTERPRET="1" if DEVICE == "cpu" else "0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "matches_reference or match_gguf_dequantize"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


_COMPILE_SCRIPT = r"""
import torch
from kernels.triton.gemm_gguf import plan_gemm_gguf
from kernels.triton.gemm_w4 import plan_gemm_w4
from kernels.triton.utils import compile_launch, is_interpreted
from services.executor.layers.quantization.gguf import FORMATS

n, k = 2048, 1024
launches = []
for dtype, m in ((torch.bfloat16, 64), (torch.float32, 1)):
    x = torch.empty(m, k, dtype=dtype)
    launches.append(plan_gemm_w4(x, torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // 128),
                                 torch.empty(n, k // 128), 128, torch.empty(m, n, dtype=dtype)))
for ggml_type, dtype, out_dtype in ((2, torch.bfloat16, torch.bfloat16), (8, torch.float16, torch.float16),
                                    (3, torch.bfloat16, torch.float32), (12, torch.bfloat16, torch.bfloat16),
                                    (13, torch.float16, torch.float16), (14, torch.bfloat16, torch.float32)):
    fmt = FORMATS[ggml_type]
    blocks = torch.empty(n, fmt.row_bytes(k), dtype=torch.uint8)
    launches.append(plan_gemm_gguf(torch.empty(16, k, dtype=dtype), blocks, fmt,
                                   torch.empty(16, n, dtype=out_dtype)))
assert not any(is_interpreted(launch.kernel) for launch in launches)
for arch in (90, 80):
    for launch in launches:
        assert compile_launch(launch, arch).asm["cubin"]
        print(arch, "ok")
"""


def test_quant_kernels_compile_for_cuda_targets():
    """The planned launches compile to cubin for sm_90 and sm_80 (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok") == 16, proc.stdout
