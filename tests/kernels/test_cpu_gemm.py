"""The native bf16-weight GEMM (kernels/cpu/csrc/cpu_gemm_bf16.c) against float32 matmuls of the same values."""

from __future__ import annotations

import pytest
import torch
from native_builds import NEEDS_KERNEL, NO_AVX512_BF16, build_library, library_params

from kernels.cpu import ops

HAS_AVX512_BF16 = "avx512_bf16" in ops.cpu_flags().split()


@pytest.fixture(scope="module", params=[
    *library_params(("-mno-avx2", "-mno-fma")),
    pytest.param(("fma", NO_AVX512_BF16), id="fma", marks=pytest.mark.skipif(
        not HAS_AVX512_BF16, reason="without AVX512-BF16 the native build is the AVX2 + FMA one")),
])
def lib(request):
    """The library as built for this CPU (AVX512-BF16 dot-product tiles where the CPU has them,
    else AVX2 + FMA tiles on x86), a build without AVX512-BF16 on such CPUs (the AVX2 + FMA
    tiles), and a build without AVX2 / FMA (the portable C tiles)."""
    return build_library(request)


def _pack(w, lib):  # in the layout this library reads
    return ops.pack_bf16_weight(w, ops.gemm_layout(lib))


def _data(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    return x, w, bias


def _reference(x, w, bias):  # float32 products and sums of the bf16 values
    out = x.float() @ w.float().t()
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 6, 7, 13, 64, 100])  # 100 rows: 3 row chunks at k = 576 (FMA tiles)
@pytest.mark.parametrize("n,k", [(16, 1), (33, 17), (100, 64), (584, 576)])  # 33, 100, 584: a partial last panel
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_gemm_matches_float32_matmul(lib, m, n, k, with_bias):
    """Float32 output equals the float32 matmul of the bf16 values (up to summation order);
    bf16 output is that value rounded, within one bf16 ulp (a different summation order can
    cross a rounding boundary)."""
    x, w, bias = _data(m, n, k)
    bias = bias if with_bias else None
    packed = _pack(w, lib)
    ref = _reference(x, w, bias)
    out32 = ops.gemm_bf16w(x, packed, n, bias, torch.float32, lib=lib)
    assert out32.shape == (m, n) and out32.dtype == torch.float32
    torch.testing.assert_close(out32, ref, atol=1e-4 * k**0.5, rtol=1e-5)
    out16 = ops.gemm_bf16w(x, packed, n, bias, lib=lib)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, atol=1e-4 * k**0.5, rtol=2**-7)
    if m:  # most outputs are exactly the correctly rounded value
        assert (out16 == ref.bfloat16()).float().mean() > 0.95


def test_gemm_float32_input_strided_rows_and_threads(lib):
    """A float32 input, rows with a stride wider than K (a slice of a wider tensor) and any
    thread count give the same values; each output's sum runs on one thread in one order, so
    1 and 2 threads agree bit for bit."""
    x, w, bias = _data(13, 200, 96)
    packed = _pack(w, lib)
    wide = torch.randn(13, 160).bfloat16()
    wide[:, 32:128] = x
    strided = wide[:, 32:128]
    assert strided.stride(0) == 160
    ref = _reference(x, w, bias)
    torch.testing.assert_close(ops.gemm_bf16w(strided, packed, 200, bias, torch.float32, lib=lib), ref,
                               atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(ops.gemm_bf16w(x.float(), packed, 200, bias, torch.float32, lib=lib), ref,
                               atol=1e-3, rtol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.gemm_bf16w(x, packed, 200, bias, torch.float32, lib=lib)
        torch.set_num_threads(2)
        two = ops.gemm_bf16w(x, packed, 200, bias, torch.float32, lib=lib)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_nan_and_inf_stay_in_their_row(lib):
    """A NaN in one input row makes that row's outputs NaN (kept NaN through the bf16
    rounding) and no other; an infinite weight gives +-inf or NaN only in its column."""
    x, w, _ = _data(7, 40, 32)
    x[3, 5] = float("nan")
    w[9, 0] = float("inf")
    packed = _pack(w, lib)
    for dtype in (torch.float32, torch.bfloat16):
        out = ops.gemm_bf16w(x, packed, 40, None, dtype, lib=lib).float()
        assert out[3].isnan().all()
        others = torch.cat([out[:3], out[4:]])
        assert others[:, 9].isinf().all()
        assert torch.cat([others[:, :9], others[:, 10:]], dim=1).isfinite().all()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_tile_shape_thread_count_and_row_chunk(lib, threads):
    """6 panels (the last one partial) on 1-3 threads give each thread 6, 3 or 2 panels, so every
    panel-group width meets the partial panel; 250 rows x K = 576 take more than one row chunk in
    every build (bf16 and float32 input); rows 1-6 cover every row-tile height. All against the
    float32 matmul."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m, n, k in ((7, 81, 40), (250, 81, 576), (6, 90, 3)):
            x, w, bias = _data(m, n, k, seed=m)
            packed = _pack(w, lib)
            ref = _reference(x, w, bias)
            for a in (x, x.float()):
                out = ops.gemm_bf16w(a, packed, n, bias, torch.float32, lib=lib)
                torch.testing.assert_close(out, ref, atol=1e-4 * k**0.5, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_float32_input_inf_and_overflow(lib):
    """Float32 inputs beyond bf16's range: an infinite input times a positive weight gives inf,
    and 3.4e38 (which rounds up to inf in bf16) stays finite, as in a float32 matmul."""
    w = torch.ones(16, 2).bfloat16()
    x = torch.tensor([[float("inf"), 1.0], [3.4e38, 0.0], [-3.4e38, 1.0]])
    out = ops.gemm_bf16w(x, _pack(w, lib), 16, None, torch.float32, lib=lib)
    assert out[0].isposinf().all()
    torch.testing.assert_close(out[1:], (x.double() @ w.double().t()).float()[1:], rtol=1e-5, atol=0)


def test_gemm_float32_input_with_low_bits(lib):
    """A float32 input whose values are not bf16 numbers: its low bits count (AVX512-BF16 tiles
    split it into bf16 high and low halves; the FMA tiles use it as is), to about 2^-16 of
    sum |x| |w| against a float64 matmul, far below bf16's 2^-8."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 301, generator=gen)  # odd K: padded pairs
    w = torch.randn(70, 301, generator=gen).bfloat16()
    ref = x.double() @ w.double().t()
    out = ops.gemm_bf16w(x, _pack(w, lib), 70, None, torch.float32, lib=lib).double()
    bound = (x.double().abs() @ w.double().abs().t()) * 2.0**-16
    assert ((out - ref).abs() <= bound).all()
    rounded = x.bfloat16().double() @ w.double().t()  # what rounding x to bf16 first would give
    assert (rounded - ref).abs().max() > 10 * (out - ref).abs().max()


def test_pack_layout_is_panels_of_sixteen_permuted_columns():
    """LAYOUT_FMA: [ceil(N / 16), K, 16], zero-padded, columns 0-3, 8-11, 4-7, 12-15."""
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3).bfloat16()
    packed = ops.pack_bf16_weight(w, ops.LAYOUT_FMA)
    assert packed.shape == (2, 3, 16) == ops.packed_shape(20, 3, ops.LAYOUT_FMA)
    order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    assert packed[0, 1].tolist() == [float(3 * c + 1) for c in order]
    assert packed[1, 2].tolist() == [3 * (16 + c) + 2 if c < 4 else 0 for c in order]


def test_pack_layout_pairs_holds_k_pairs_side_by_side():
    """LAYOUT_PAIRS: [ceil(N / 16), ceil(K / 2), 32]: per k-pair j, (W[c, 2j], W[c, 2j + 1]) for
    c = 0..15, an odd K and the missing columns padded with zero."""
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3).bfloat16()
    packed = ops.pack_bf16_weight(w, ops.LAYOUT_PAIRS)
    assert packed.shape == (2, 2, 32) == ops.packed_shape(20, 3, ops.LAYOUT_PAIRS)
    assert packed[0, 0].tolist() == [float(v) for c in range(16) for v in (3 * c, 3 * c + 1)]
    assert packed[0, 1].tolist() == [float(v) for c in range(16) for v in (3 * c + 2, 0)]
    assert packed[1, 0].tolist() == [float(v) for c in range(16, 32)
                                     for v in ((3 * c, 3 * c + 1) if c < 20 else (0, 0))]


@pytest.mark.parametrize("layout", [0, 1], ids=["fma", "pairs"])
def test_unpack_gives_back_the_weight(layout):
    """unpack_bf16_weight inverts pack_bf16_weight in either layout (padding dropped), bit for bit."""
    for n, k in ((20, 3), (16, 5), (16, 6), (584, 576)):
        w = torch.randn(n, k).bfloat16()
        assert torch.equal(ops.unpack_bf16_weight(ops.pack_bf16_weight(w, layout), n, k), w)


def test_unpack_needs_a_k_the_packed_shape_can_hold():
    w = torch.randn(20, 5).bfloat16()
    pairs = ops.pack_bf16_weight(w, ops.LAYOUT_PAIRS)  # 3 k-pairs: K is 5 or 6
    for k in (None, 4, 7):
        with pytest.raises(ValueError, match="k must be"):
            ops.unpack_bf16_weight(pairs, 20, k)
    with pytest.raises(ValueError, match="k must be"):
        ops.unpack_bf16_weight(ops.pack_bf16_weight(w, ops.LAYOUT_FMA), 20, 6)


def test_which_cpus_use_the_native_gemm(monkeypatch):
    """prefer_native_gemm: where torch emulates bf16 (no oneDNN bf16), or where our GEMM has
    AVX512-BF16 and the CPU no AMX; never without the library."""
    layouts = {"pairs": ops.LAYOUT_PAIRS, "fma": ops.LAYOUT_FMA}
    cases = [  # (oneDNN bf16, our layout, cpu flags) -> prefer
        ((False, "fma", "avx2 fma"), True),
        ((True, "fma", "avx512f avx2"), False),
        ((True, "pairs", "avx512f avx512_bf16"), True),
        ((True, "pairs", "avx512f avx512_bf16 amx_bf16 amx_tile"), False),
    ]
    monkeypatch.setattr(ops, "load", lambda: object())
    for (onednn, layout, flags), prefer in cases:
        monkeypatch.setattr(ops, "native_bf16_matmul", lambda v=onednn: v)
        monkeypatch.setattr(ops, "gemm_layout", lambda lib=None, v=layouts[layout]: v)
        monkeypatch.setattr(ops, "cpu_flags", lambda v=flags: f"flags\t: {v}")
        assert ops.prefer_native_gemm() is prefer, (onednn, layout, flags)
    monkeypatch.setattr(ops, "load", lambda: None)
    assert not ops.prefer_native_gemm()


@NEEDS_KERNEL
def test_a_weight_packed_for_the_other_layout_is_refused(lib):
    x, w, _ = _data(4, 48, 32)
    other = 1 - ops.gemm_layout(lib)
    with pytest.raises(ValueError, match="packed must be"):
        ops.gemm_bf16w(x, ops.pack_bf16_weight(w, other), 48, lib=lib)


@NEEDS_KERNEL
def test_bad_arguments_are_refused_by_name():
    x, w, bias = _data(4, 48, 32)
    packed = ops.pack_bf16_weight(w)
    with pytest.raises(ValueError, match="packed"):
        ops.gemm_bf16w(x, packed, 20)  # 48 columns were packed
    with pytest.raises(ValueError, match="packed"):
        ops.gemm_bf16w(x[:, :16], packed, 48)  # K mismatch
    with pytest.raises(ValueError, match="x must be"):
        ops.gemm_bf16w(x.t(), packed, 48)
    with pytest.raises(ValueError, match="x must be"):
        ops.gemm_bf16w(x.half(), packed, 48)
    with pytest.raises(ValueError, match="bias"):
        ops.gemm_bf16w(x, packed, 48, bias.float())
    with pytest.raises(ValueError, match="out_dtype"):
        ops.gemm_bf16w(x, packed, 48, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="weight must be"):
        ops.pack_bf16_weight(w[0])
    with pytest.raises(ValueError, match="weight must be"):
        ops.pack_bf16_weight(w.float())


@NEEDS_KERNEL
def test_benchmark_prints_a_line_per_shape_and_row_count():
    """benchmarks/cpu_gemm.py runs (small settings) and prints GFLOP/s for ours and torch's."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "cpu_gemm.py"), "--rows", "1,3", "--repeats", "1",
                           "--skip-torch-bf16"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " M=" in line]
    assert len(lines) == 10, proc.stdout  # 5 shapes x 2 row counts
    assert all("ours (bf16 weights)" in line and "torch fp32" in line and "GFLOP/s" in line for line in lines)
    assert all("GB/s" in line for line in lines if " M=1 " in line)
