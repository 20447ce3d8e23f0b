"""The native GGUF-block GEMM (kernels/cpu/csrc/cpu_gguf_gemm.c) against the torch path
(services/executor/layers/quantization/gguf/formats.py: dequantize, then a float32 matmul), and its int8-activation
path for bf16 activations (cpu_gguf_q8.c) against a torch reference quantizing the same way."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf_fixtures import random_blocks
from native_builds import X86

from kernels.cpu import native, quant_ops
from services.executor.layers.quantization import gguf as G
from services.executor.layers.quantization.gguf import r16 as gguf_r16


def _portable_kernel(tmp_path, flag: str = "-mno-avx512f") -> ctypes.CDLL:
    """``cpu_gguf_gemm.c``, ``cpu_gguf_q8.c``, ``cpu_gguf_r16.c`` and ``cpu_gguf_r16k.c`` alone, compiled without
    AVX-512 (the portable C loops): a second build of the whole library would cost ~20 s; these files alone, about
    one."""
    so = tmp_path / "gguf_portable.so"
    sources = [str(native.CSRC / f) for f in ("cpu_gguf_gemm.c", "cpu_gguf_q8.c", "cpu_gguf_r16.c", "cpu_gguf_r16k.c")]
    cmd = [native.find_compiler(), "-O3", "-march=native", flag, "-fopenmp", "-ffast-math", "-fPIC",
           "-shared", *sources, "-o", str(so)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedllm_gemm_gguf.argtypes = [c_int, p, c_int, p, i64, c_int, p, i64, i64, i64, i64, c_int]
    lib.pagedllm_gemm_gguf.restype = c_int
    lib.pagedllm_gguf_int8_dot.argtypes, lib.pagedllm_gguf_int8_dot.restype = [], c_int
    return lib


@pytest.fixture(scope="module")
def portable_kernel(tmp_path_factory) -> ctypes.CDLL:
    """:func:`_portable_kernel`, compiled once for this module's tests."""
    return _portable_kernel(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def no_vnni_kernel(tmp_path_factory) -> ctypes.CDLL:
    """The same files with AVX-512 but without VNNI (Skylake-SP's set), compiled once."""
    return _portable_kernel(tmp_path_factory.mktemp("gguf"), "-mno-avx512vnni")


@pytest.fixture(scope="module", params=[
    pytest.param("native", id="native"),
    pytest.param("portable", id="portable", marks=pytest.mark.skipif(not X86, reason="-mno-avx512f is x86")),
])
def lib(request):
    """The library as built for this CPU (AVX-512 blocks where the CPU has them, int8 dot products
    with VNNI) and the kernel built without AVX-512 (the portable C loop, bf16 activations widened)."""
    session_lib = request.getfixturevalue("kernel_library")
    return session_lib if request.param == "native" else request.getfixturevalue("portable_kernel")


def _blocks(fmt: G.BlockFormat, n: int, k: int, seed: int) -> torch.Tensor:  # [n, k / 32 * block_bytes]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(quants.quantize(w, GGMLQuantizationType(fmt.ggml_type)))


@pytest.mark.parametrize("fmt", [G.Q4_0, G.Q4_1, G.Q8_0], ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3, 11])  # one row, a partial tile, a full tile and a partial one
def test_gemm_gguf_matches_the_torch_path(lib, fmt, m):
    """float32 activations: the float32 path (bf16 ones take the int8 path, tested below)."""
    n, k = 37, 96
    blocks = _blocks(fmt, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    reference = x @ G.dequantize(blocks, fmt).t()  # [m, n] float32
    torch.testing.assert_close(quant_ops.gemm_gguf(x, blocks, fmt, k, torch.float32, lib=lib), reference,
                               rtol=1e-5, atol=1e-4)


def _quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 -> (qa [M, K / 32, 32] float64 integers in [-127, 127], d_a [M, K / 32] float64),
    as cpu_gguf_q8.c: float32 amax, d_a = amax * fl(1/127), qa = round-half-even(x * fl(127 / amax))."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1)  # [M, K / 32]
    one, f127 = torch.tensor(1.0), torch.tensor(127.0)
    inv = torch.where(amax > 0, f127 / amax, torch.zeros(()))
    qa = torch.round(xf * inv[..., None])
    return qa.double(), (amax * (one / f127)).double()


def _integer_blocks(blocks: torch.Tensor, fmt: G.BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF rows [N, K / 32 * bytes] -> (qw [N, K / 32, 32] as multiplied, d_w, m_w [N, K / 32]), float64:
    qw = the nibbles 0..15 (Q4_0, Q4_1) or the int8 (Q8_0); m_w = Q4_1's m, else 0."""
    b = blocks.view(blocks.shape[0], -1, fmt.block_bytes)
    half = lambda lo: b[..., lo:lo + 2].contiguous().view(torch.float16)[..., 0].double()  # noqa: E731
    if fmt.ggml_type == G.Q8_0.ggml_type:
        return b[..., 2:].contiguous().view(torch.int8).double(), half(0), torch.zeros_like(half(0))
    q = b[..., 4:] if fmt.ggml_type == G.Q4_1.ggml_type else b[..., 2:]
    qw = torch.cat([q & 15, q >> 4], dim=-1).double()
    return qw, half(0), half(2) if fmt.ggml_type == G.Q4_1.ggml_type else torch.zeros_like(half(0))


def _int8_reference(x: torch.Tensor, blocks: torch.Tensor, fmt: G.BlockFormat) -> torch.Tensor:  # [M, N] float64
    """The exact result of the int8 path's operands: sum over blocks of d_w d_a (qw - 8 for Q4_0) . qa
    (+ m_w d_a sum(qa) for Q4_1), float64 (the integer dots exact)."""
    qa, da = _quantize_activations(x)
    qw, dw, mw = _integer_blocks(blocks, fmt)
    dot = torch.einsum("mbe,nbe->mnb", qa, qw)  # [M, N, blocks]
    sa = qa.sum(-1)[:, None, :]  # [M, 1, blocks]
    if fmt.ggml_type == G.Q4_0.ggml_type:
        dot = dot - 8 * sa
    return (dw[None] * da[:, None] * dot + mw[None] * da[:, None] * sa).sum(-1)


@pytest.mark.parametrize("fmt", [G.Q4_0, G.Q4_1, G.Q8_0], ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17])  # tiles of 16 rows: partial, full, one more
@pytest.mark.parametrize("k", [96, 576])  # an odd and an even number of blocks per row
def test_gemm_gguf_bf16_activations(lib, fmt, m, k):
    """bf16 activations, with VNNI: the int8 path equals the exact sum of its quantized operands up
    to float32 rounding, and the float32 matmul of the dequantized weight within the quantization's
    bound; without: the float32 path of the widened activations."""
    n = 37
    blocks = _blocks(fmt, n, k, seed=m + k)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).bfloat16()
    x[0, :32] = 0  # a block of zeros: d_a = 0
    if not quant_ops.gguf_int8_dot(lib):
        _check_widened(lib, x, blocks, False, blocks, fmt)
        return
    exact = _int8_reference(x, blocks, fmt)
    out32 = quant_ops.gemm_gguf(x, blocks, fmt, k, torch.float32, lib=lib)
    torch.testing.assert_close(out32.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    out = quant_ops.gemm_gguf(x, blocks, fmt, k, torch.bfloat16, lib=lib)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, out32.bfloat16(), rtol=0, atol=0)  # one rounding of the same sums
    # |x - d_a qa| <= d_a / 2 per element: against the unquantized activations
    weight = G.dequantize(blocks, fmt).double()  # [n, k]
    _, da = _quantize_activations(x)
    bound = 0.5 * torch.einsum("mb,nb->mn", da, weight.abs().view(n, -1, 32).sum(-1))
    assert ((out32.double() - x.double() @ weight.t()).abs() <= bound * (1 + 1e-4) + 1e-5).all()


def _check_widened(lib, x: torch.Tensor, weight: torch.Tensor, r16: bool, blocks: torch.Tensor,
                   fmt: G.BlockFormat) -> None:
    """A library without int8 dot products: bf16 ``x [m, k]`` times ``weight`` (the file's ``blocks``, or
    their interleaved rows where ``r16``) is the float32 path of ``x`` widened, bit for bit (float32 out;
    bf16 out one rounding of it)."""
    k = x.shape[1]
    widened = quant_ops.gemm_gguf(x.float(), blocks, fmt, k, torch.float32, lib=lib)
    assert torch.equal(quant_ops.gemm_gguf(x, weight, fmt, k, torch.float32, lib=lib, r16=r16), widened)
    assert torch.equal(quant_ops.gemm_gguf(x, weight, fmt, k, torch.bfloat16, lib=lib, r16=r16), widened.bfloat16())


@pytest.mark.skipif(not X86, reason="-mno-avx512f is x86")
@pytest.mark.parametrize("build", ["portable_kernel", "no_vnni_kernel"])
@pytest.mark.parametrize("fmt", [G.Q4_0, G.Q4_1, G.Q8_0, G.Q4_K, G.Q5_K, G.Q6_K], ids=lambda f: f.name)
def test_a_build_without_vnni_widens_bf16_activations(kernel_library, request, build, fmt):
    """Only a build with AVX512-VNNI multiplies bf16 activations as int8; the portable build (no AVX-512) and
    one with AVX-512 but no VNNI widen them to float32, in the file's layout and the interleaved one (each group
    unpacked)."""
    assert quant_ops.gguf_int8_dot(kernel_library) == ("avx512_vnni" in native.cpu_flags().split())
    lib = request.getfixturevalue(build)
    assert not quant_ops.gguf_int8_dot(lib)
    m, n, k = 17, 32, 1536
    blocks = random_blocks(fmt, n, k, seed=7, scale=0.05)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    _check_widened(lib, x, blocks, False, blocks, fmt)
    packed = gguf_r16.pack(blocks, fmt)
    _check_widened(lib, x, packed, True, blocks, fmt)


def test_the_layer_interleaves_rows_only_with_int8_dot_products(monkeypatch, kernel_library):
    """``GGUFLinearMethod`` keeps the file's layout where the library has no int8 dot products (the
    interleaved layout only pays with VNNI), and interleaves rows by 16 where it has them."""
    blocks = _blocks(G.Q4_1, 32, 64, seed=1)
    for int8_dot in (True, False):
        monkeypatch.setattr(quant_ops, "gguf_int8_dot", lambda lib=None, v=int8_dot: v)
        layer, method = torch.nn.Module(), G.GGUFLinearMethod(G.Q4_1, torch.bfloat16, native=True)
        method.install(layer, blocks, 64)
        assert method.r16 is int8_dot
        assert torch.equal(layer.weight, gguf_r16.pack(blocks, G.Q4_1) if int8_dot else blocks)
        assert torch.equal(method.file_blocks(layer), blocks)


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K, G.Q6_K], ids=lambda f: f.name)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 256), (5, 24, 768), (64, 19, 512)])
def test_gemm_gguf_k_quants_match_gguf_dequantize(lib, fmt, m, n, k):
    """Random valid K-quant blocks (every quant and scale bit pattern) against
    ``gguf.quants.dequantize`` and a float32 matmul; bf16 activations and output too."""
    blocks = random_blocks(fmt, n, k, seed=m + fmt.ggml_type)
    weight = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType(fmt.ggml_type)))  # [n, k]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    reference = x @ weight.t()
    torch.testing.assert_close(quant_ops.gemm_gguf(x, blocks, fmt, k, torch.float32, lib=lib), reference,
                               rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()
    out = quant_ops.gemm_gguf(xb, blocks, fmt, k, torch.bfloat16, lib=lib)
    torch.testing.assert_close(out, (xb.float() @ weight.t()).bfloat16(), rtol=1.6e-2, atol=1e-2)


def test_gemm_gguf_reads_strided_rows(lib):
    blocks = _blocks(G.Q4_1, 16, 64, seed=5)
    x = torch.randn(4, 128)[:, 32:96]  # [4, 64], row stride 128
    torch.testing.assert_close(quant_ops.gemm_gguf(x, blocks, G.Q4_1, 64, torch.float32, lib=lib),
                               x @ G.dequantize(blocks, G.Q4_1).t(), rtol=1e-5, atol=1e-4)


def test_gemm_gguf_refuses_bad_arguments(lib):
    blocks = _blocks(G.Q4_1, 4, 64, seed=0)
    with pytest.raises(ValueError, match="ggml_type"):
        quant_ops.gemm_gguf(torch.randn(1, 64), blocks, G.Q4_K, 64, lib=lib)
    with pytest.raises(ValueError, match="blocks must be"):
        quant_ops.gemm_gguf(torch.randn(1, 64), blocks, G.Q8_0, 64, lib=lib)
    with pytest.raises(ValueError, match="multiple of its block size"):  # K-quants: super-blocks of 256
        quant_ops.gemm_gguf(torch.randn(1, 64), blocks, G.Q4_K, 64, lib=lib)


def _check_r16(lib, x: torch.Tensor, blocks: torch.Tensor, packed: torch.Tensor, fmt: G.BlockFormat,
               exact: torch.Tensor) -> None:
    """The interleaved ``packed`` (of the file's ``blocks``) times bf16 ``x [m, k]``: the exact sum of the int8
    operands (``exact``, float64) up to float32 rounding; bf16 out one rounding of the float32 out; float32
    activations: the file layout's float32 path bit for bit (the same code on the unpacked rows). A library
    without int8 dot products: :func:`_check_widened`."""
    m, k = x.shape
    if not quant_ops.gguf_int8_dot(lib):
        _check_widened(lib, x, packed, True, blocks, fmt)
        return
    out32 = quant_ops.gemm_gguf(x, packed, fmt, k, torch.float32, lib=lib, r16=True)
    torch.testing.assert_close(out32.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    out = quant_ops.gemm_gguf(x, packed, fmt, k, torch.bfloat16, lib=lib, r16=True)
    torch.testing.assert_close(out, out32.bfloat16(), rtol=0, atol=0)
    xf = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
    assert torch.equal(quant_ops.gemm_gguf(xf, packed, fmt, k, torch.float32, lib=lib, r16=True),
                       quant_ops.gemm_gguf(xf, blocks, fmt, k, torch.float32, lib=lib))


@pytest.mark.parametrize("fmt", [G.Q4_0, G.Q4_1, G.Q8_0], ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])  # tiles of 8 activation rows: partial, full, one more, several
@pytest.mark.parametrize("k", [96, 576])
def test_gemm_gguf_r16_int8_equals_exact_sums(lib, fmt, m, k):
    """The 16-row interleaved layout (gguf_r16): bf16 activations give the exact sum of the int8
    path's operands up to float32 rounding, bf16 out one rounding of the float32 out; float32
    activations give the file layout's float32 path bit for bit (the same code on unpacked rows)."""
    n = 48
    blocks = _blocks(fmt, n, k, seed=m + k)
    packed = gguf_r16.pack(blocks, fmt)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).bfloat16()
    x[0, :32] = 0  # a block of zeros: d_a = 0
    _check_r16(lib, x, blocks, packed, fmt, _int8_reference(x, blocks, fmt))


def test_gemm_gguf_r16_reads_strided_rows_and_refuses_bad_layouts(lib):
    blocks = _blocks(G.Q8_0, 32, 64, seed=5)
    packed = gguf_r16.pack(blocks, G.Q8_0)
    x = torch.randn(4, 128)[:, 32:96].bfloat16()  # [4, 64], row stride 128
    reference = (_int8_reference(x, blocks, G.Q8_0) if quant_ops.gguf_int8_dot(lib)
                 else x.double() @ G.dequantize(blocks, G.Q8_0).double().t())
    torch.testing.assert_close(quant_ops.gemm_gguf(x, packed, G.Q8_0, 64, torch.float32, lib=lib, r16=True).double(),
                               reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        quant_ops.gemm_gguf(x, packed[:24], G.Q8_0, 64, lib=lib, r16=True)
    with pytest.raises(ValueError, match="ggml_type"):  # interleaved K-quants: super-blocks of 256 too
        quant_ops.gemm_gguf(x, packed, G.Q4_K, 64, lib=lib, r16=True)
    with pytest.raises(ValueError, match="no 16-row interleaved layout"):
        gguf_r16.pack(blocks[:24], G.Q8_0)


def _k_integer_blocks(blocks: torch.Tensor, fmt: G.BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K-quant rows [N, K / 256 * bytes] -> (q [N, K / 32, 32] the unsigned quants as multiplied (0..15, 0..31,
    0..63), scale [N, K / 32, 2] of each half sub-block (Q4_K / Q5_K: d sc_j twice; Q6_K: d sc[2 j], d sc[2 j + 1]),
    offset [N, K / 32] subtracted per element (Q4_K / Q5_K: dmin m_j; Q6_K: 0)), float64; Q6_K's w is
    scale (q - 32). Read from the bytes as cpu_gguf_gemm.c's header lays them out."""
    n = blocks.shape[0]
    b = blocks.view(n, -1, fmt.block_bytes).long()  # [N, S, bytes]
    half = lambda lo: b[..., lo:lo + 2].to(torch.uint8).contiguous().view(torch.float16).double()  # noqa: E731  [N, S, 1]
    if fmt.ggml_type == G.Q6_K.ggml_type:
        ql, qh = b[..., 0:128], b[..., 128:192]
        subs = []
        for j in range(8):  # sub-block j = 4 h + s: elements 128 h + 32 s + e
            h, sh = divmod(j, 4)
            low = (ql[..., 64 * h + 32 * (sh % 2):][..., :32] >> (4 * (sh // 2))) & 15
            subs.append(low | (((qh[..., 32 * h:32 * h + 32] >> (2 * sh)) & 3) << 4))
        q = torch.stack(subs, dim=2)  # [N, S, 8, 32]
        sc = b[..., 192:208].to(torch.uint8).view(torch.int8).double()  # [N, S, 16]
        scale = (half(208) * sc).view(n, -1, 8, 2)
        return q.view(n, -1, 32).double(), scale.view(n, -1, 2), torch.zeros(q.shape[:3], dtype=torch.float64).view(n, -1)
    s = b[..., 4:16]
    sc = [s[..., j] & 63 if j < 4 else (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4) for j in range(8)]
    mn = [s[..., j + 4] & 63 if j < 4 else (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4) for j in range(8)]
    qs = b[..., 48:176] if fmt.ggml_type == G.Q5_K.ggml_type else b[..., 16:144]
    q = torch.stack([(qs[..., 32 * (j // 2):32 * (j // 2) + 32] >> (4 * (j % 2))) & 15 for j in range(8)], dim=2)
    if fmt.ggml_type == G.Q5_K.ggml_type:
        q = q | torch.stack([((b[..., 16:48] >> j) & 1) << 4 for j in range(8)], dim=2)
    dsc = half(0) * torch.stack(sc, dim=-1).double()  # [N, S, 8]
    dm = half(2) * torch.stack(mn, dim=-1).double()
    return q.view(n, -1, 32).double(), dsc.view(n, -1, 1).expand(-1, -1, 2), dm.view(n, -1)


def _k_int8_reference(x: torch.Tensor, blocks: torch.Tensor, fmt: G.BlockFormat) -> torch.Tensor:  # [M, N] float64
    """The exact result of the interleaved K-quant kernel's operands: per 32-block b and half h (16 elements),
    scale[n, b, h] d_a[m, b] (q . qa over the half, less 32 sum qa there for Q6_K), less offset[n, b] d_a s_a
    (Q4_K / Q5_K), summed in float64 (the integer dots exact)."""
    qa, da = _quantize_activations(x)  # [M, B, 32], [M, B]
    q, scale, offset = _k_integer_blocks(blocks, fmt)
    qa2, q2 = qa.view(*qa.shape[:2], 2, 16), q.view(*q.shape[:2], 2, 16)
    dot = torch.einsum("mbhe,nbhe->mnbh", qa2, q2)  # [M, N, B, 2]
    sa = qa2.sum(-1)[:, None]  # [M, 1, B, 2]
    if fmt.ggml_type == G.Q6_K.ggml_type:
        dot = dot - 32 * sa
    out = (scale[None] * da[:, None, :, None] * dot).sum((-1, -2))
    return out - (offset[None] * da[:, None] * sa.sum(-1)).sum(-1)


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K, G.Q6_K], ids=lambda f: f.name)
def test_k_integer_blocks_are_the_dequantized_weight(fmt):
    """The reference's integer reading of the K-quant bytes gives ``gguf.quants.dequantize``'s weight."""
    blocks = random_blocks(fmt, 4, 512, seed=fmt.ggml_type)
    q, scale, offset = _k_integer_blocks(blocks, fmt)
    w = scale.repeat_interleave(16, dim=-1) * (q - 32 * (fmt.ggml_type == G.Q6_K.ggml_type)) - offset[..., None]
    reference = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType(fmt.ggml_type)))
    torch.testing.assert_close(w.view(4, -1), reference.double(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K, G.Q6_K], ids=lambda f: f.name)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 256), (3, 48, 512), (8, 32, 768), (9, 16, 512), (20, 48, 768)])
def test_gemm_gguf_r16k_int8_equals_exact_sums(lib, fmt, m, n, k):
    """Q4_K / Q5_K / Q6_K in the 16-row interleaved layout (gguf_r16, cpu_gguf_r16k.c): bf16 activations give
    the exact sum of the int8 operands up to float32 rounding (tiles of 8 activation rows: one, partial, full, one
    more, several), bf16 out one rounding of the float32 out; float32 activations give the file layout's float32
    path bit for bit (the same code on the unpacked rows)."""
    blocks = random_blocks(fmt, n, k, seed=m + k + fmt.ggml_type, scale=0.05)
    packed = gguf_r16.pack(blocks, fmt)
    assert packed.shape == blocks.shape and torch.equal(gguf_r16.unpack_rows(packed, fmt), blocks)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).bfloat16()
    x[0, :32] = 0  # a block of zeros: d_a = 0
    _check_r16(lib, x, blocks, packed, fmt, _k_int8_reference(x, blocks, fmt))
