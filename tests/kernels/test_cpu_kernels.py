"""The native CPU decode-attention kernel against the reference paged attention."""

from __future__ import annotations

import random

import pytest
import torch
from native_builds import NEEDS_KERNEL, NO_AVX512_BF16, build_library, library_params

from kernels import reference
from kernels.cpu import ops


@pytest.fixture(scope="module", params=library_params(NO_AVX512_BF16))
def lib(request):
    """The library as built for this CPU, and a build without AVX512-BF16 (the portable
    float32 score path every bf16 model takes on CPUs without that extension)."""
    return build_library(request)


TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _decode(lib, query, key_cache, value_cache, table, nblk, seq_lens, scale, **kw) -> torch.Tensor:
    """One new token per sequence: row ``b`` is sequence ``b``, attending all ``seq_lens[b]`` positions."""
    row_seq = torch.arange(query.shape[0])
    return ops.paged_attention_rows(query, key_cache, value_cache, table, nblk, row_seq, seq_lens, scale,
                                            lib=lib, **kw)


def _shuffled_tables(rng: random.Random, seq_lens: list[int], block_size: int) -> tuple[list[list[int]], int, int]:
    """Block tables in shuffled physical order: (tables, num_blocks in the pool, nblk)."""
    nblk = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * nblk + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens], num_blocks, nblk


def _case(
    lib,
    seed: int,
    dtype: torch.dtype,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seq_lens: list[int],
) -> None:
    """Decode one token for each of ``seq_lens``: shuffled block tables, every block the
    sequences do not use NaN-poisoned (the kernel must never read them), the query a strided
    view of a wider [T, H + 2 Hkv, D] tensor as in the model (its qkv projection)."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks, nblk = _shuffled_tables(random.Random(seed), seq_lens, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    for table, n in zip(tables, seq_lens, strict=True):
        for i, blk in enumerate(table):
            used = min(block_size, n - i * block_size)
            key_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen).to(dtype)
            value_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_heads = num_kv_heads * group
    batch = len(seq_lens)
    qkv = torch.randn(batch, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_heads]  # token stride (H + 2 Hkv) * D
    scale = head_dim**-0.5

    padded = torch.tensor([t + [0] * (nblk - len(t)) for t in tables], dtype=torch.int64)  # [B, nblk]
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    assert ops.supports(query, key_cache)
    out = _decode(lib, query, key_cache, value_cache, padded, nblk, lens, scale)

    qsl = torch.arange(batch + 1, dtype=torch.int32)
    expected = reference.paged_attention(
        query.contiguous(), key_cache, value_cache, padded.to(torch.int32), lens.to(torch.int32), qsl, scale
    )
    assert out.shape == (batch, num_heads, head_dim) and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"),
    [(3, 3, 64), (2, 1, 64), (1, 4, 64), (2, 2, 128), (1, 8, 128), (2, 5, 80), (1, 16, 256), (4, 1, 32)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_decode_matches_reference(lib, dtype, num_kv_heads, group, head_dim, block_size):
    """Specialised shapes (SmolLM2's 3x3x64, GQA 1..8 at 64 / 128) and the generic path
    (group 5 at head_dim 80, group 16 at 256, 32); lengths 1, on and one past block
    boundaries, and long ones with many online-softmax rescales."""
    bs = block_size
    lens = [1, bs, bs + 1, 2 * bs - 1, 3 * bs, 150, 7]
    seed = hash((num_kv_heads, group, head_dim, block_size)) % 1000
    _case(lib, seed, dtype, num_kv_heads, group, head_dim, block_size, lens)


def test_decode_long_context_and_large_scores(lib):
    """3,000 tokens, scores far above exp's range: the online softmax stays finite."""
    _case(lib, 7, torch.float32, 3, 3, 64, 16, [3000, 17])
    _case(lib, 8, torch.bfloat16, 1, 4, 128, 64, [2000, 64, 65])
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(4, 16, 1, 64, generator=gen) * 30  # logits in the thousands
    query = torch.randn(1, 2, 64, generator=gen) * 30
    table = torch.tensor([[2, 0, 3]])
    lens = torch.tensor([40])
    out = _decode(lib, query, cache, cache, table, 3, lens, 1.0)
    expected = reference.paged_attention(query, cache, cache, table.int(), lens.int(),
                                         torch.tensor([0, 1], dtype=torch.int32), 1.0)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@NEEDS_KERNEL
def test_supports_refuses_what_the_kernel_does_not_do():
    cache = torch.zeros(2, 16, 2, 64)
    assert ops.supports(torch.zeros(3, 4, 64), cache)
    assert not ops.supports(torch.zeros(3, 4, 64, dtype=torch.float16), cache.half())  # fp16
    assert not ops.supports(torch.zeros(3, 4, 64, dtype=torch.bfloat16), cache)  # mixed dtypes
    assert not ops.supports(torch.zeros(3, 34, 64), cache)  # 17 query heads per KV head
    assert not ops.supports(torch.zeros(3, 4, 64), torch.zeros(2, 256, 2, 64))  # block 256
    assert not ops.supports(torch.zeros(3, 64, 4).transpose(1, 2), cache)  # heads not dense


@NEEDS_KERNEL
def test_bad_arguments_are_refused_by_name():
    cache = torch.zeros(4, 16, 1, 64)
    query = torch.zeros(2, 2, 64)
    table = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([20, 5])
    def attend(*args, **kw):
        return _decode(None, *args, **kw)

    with pytest.raises(ValueError, match="block_index must hold"):
        attend(query, cache, cache, table, 3, lens, 1.0)
    with pytest.raises(ValueError, match="row_seq must index"):
        ops.paged_attention_rows(query, cache, cache, table, 2, torch.tensor([0, 2]), lens, 1.0)
    with pytest.raises(ValueError, match="row_len must be"):
        attend(query, cache, cache, table, 2, lens.int(), 1.0)
    with pytest.raises(ValueError, match="row_len exceeds"):
        attend(query, cache, cache, table, 2, torch.tensor([33, 5]), 1.0)
    with pytest.raises(ValueError, match="value_cache"):
        attend(query, cache, cache.bfloat16(), table, 2, lens, 1.0)
    with pytest.raises(ValueError, match="out"):
        attend(query, cache, cache, table, 2, lens, 1.0, out=torch.empty(2, 2, 32))
    wide = torch.tensor([[0, 9, 1], [2, 9, 3]])[:, ::2]  # a non-contiguous table is copied, not misread
    torch.testing.assert_close(attend(query, cache, cache, wide, 2, lens, 1.0),
                               attend(query, cache, cache, table, 2, lens, 1.0))


def test_torch_path_when_the_kernel_is_unavailable(monkeypatch):
    """No library: supports() is False and the torch backend's decodes use torch ops."""
    from services.executor.attention import AttentionMetadata, TorchBackend

    monkeypatch.setattr(ops, "load", lambda: None)
    assert not ops.supports(torch.zeros(1, 2, 64), torch.zeros(2, 16, 1, 64))
    meta = AttentionMetadata.build([1, 1], [20, 5], [[1, 0], [2]], 16)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(3, 16, 1, 64, generator=gen), torch.randn(3, 16, 1, 64, generator=gen)
    q, k, v = (torch.randn(2, h, 64, generator=gen) for h in (2, 1, 1))
    out = TorchBackend(native=True).forward(q, k, v, k_cache, v_cache, meta, 0.125)
    expected = reference.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, 0.125)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("hkv", "group", "d", "bs", "shuffle"),
    [(3, 3, 64, 16, False), (3, 3, 64, 16, True), (2, 8, 128, 32, False), (1, 5, 96, 8, True),
     (2, 1, 32, 128, False), (4, 4, 64, 16, True), (1, 16, 256, 16, False), (1, 12, 192, 32, True)],
    ids=lambda v: str(v),
)
def test_rows_of_prefills_chunks_and_decodes_match_reference(lib, dtype, hkv, group, d, bs, shuffle):
    """Query rows of several kinds in one call, each row attending causally: prefills (no
    context), chunks over cached context (on and one past block boundaries), decodes. The
    bf16 kernel reads each K/V chunk once for a tile of up to 8 rows of one sequence: runs of
    1..30 rows, tiles cut at 8, group 8 x head_dim 128 (accumulators beyond the registers),
    a shape without a specialised kernel (group 5 x 96), group x head_dim past 2,048 (fewer
    rows per tile: 8 would overflow the accumulators) and, shuffled, rows of one sequence out
    of order and apart."""
    gen = torch.Generator().manual_seed(5)
    kinds = [(0, 7), (0, 16), (16, 16), (17, 3), (40, 1), (0, 1), (5, 30), (100, 1)]  # (context, new tokens)
    seq_lens = [c + n for c, n in kinds]
    tables, num_blocks, nblk = _shuffled_tables(random.Random(5), seq_lens, bs)
    shape = (num_blocks, bs, hkv, d)
    key_cache = torch.randn(shape, generator=gen).to(dtype)  # every new token's K/V already written
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    unused = torch.ones(num_blocks, bs, dtype=torch.bool)  # NaN there: the kernel must never read it
    for table, n in zip(tables, seq_lens, strict=True):
        unused.view(-1)[torch.tensor(table).repeat_interleave(bs) * bs + torch.arange(len(table) * bs).remainder(bs)
                        ] = torch.arange(len(table) * bs) >= n
    key_cache[unused], value_cache[unused] = float("nan"), float("nan")
    t = sum(n for _, n in kinds)
    query = torch.randn(t, hkv * group, d, generator=gen).to(dtype)
    row_seq = torch.tensor([b for b, (_, n) in enumerate(kinds) for _ in range(n)])
    row_len = torch.tensor([c + i + 1 for c, n in kinds for i in range(n)])
    padded = torch.tensor([tb + [0] * (nblk - len(tb)) for tb in tables])
    qsl = torch.tensor([0] + [sum(n for _, n in kinds[: i + 1]) for i in range(len(kinds))], dtype=torch.int32)
    expected = reference.paged_attention(query, key_cache, value_cache, padded.int(),
                                         torch.tensor(seq_lens, dtype=torch.int32), qsl, 0.125)
    if shuffle:  # the kernel takes rows in any order
        perm = torch.randperm(t, generator=gen)
        query, row_seq, row_len, expected = query[perm], row_seq[perm], row_len[perm], expected[perm]
    out = ops.paged_attention_rows(query, key_cache, value_cache, padded, nblk, row_seq, row_len, 0.125,
                                           lib=lib)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@NEEDS_KERNEL
def test_a_block_id_outside_the_cache_is_refused_before_the_kernel_reads_it():
    from services.executor.attention import AttentionMetadata, TorchBackend

    meta = AttentionMetadata.build([1], [20], [[7, 1]], 16)  # reads block 7 of a 3-block cache (writes block 1)
    cache = torch.zeros(3, 16, 1, 64)
    q, k, v = (torch.zeros(1, h, 64) for h in (2, 1, 1))
    with pytest.raises(ValueError, match="block 7 outside"):
        TorchBackend(native=True).forward(q, k, v, cache, cache.clone(), meta, 0.125)


@NEEDS_KERNEL
@pytest.mark.parametrize("rows", [1, 64, 200])  # 200 x 576 > NORM_PARALLEL_MIN_ELEMENTS: all threads
def test_add_rms_norm_equals_torch_add_then_rms_norm(rows):
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=gen) * 4).to(torch.bfloat16)
    delta = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(576, generator=gen).to(torch.bfloat16)
    expected_h = h + delta  # torch's bf16 add: float32 sum, one rounding
    expected = torch.nn.functional.rms_norm(expected_h, (576,), w, 1e-5)
    out = ops.add_rms_norm(h, w, 1e-5, delta)
    assert torch.equal(h, expected_h)  # the residual stream, updated in place
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)  # at most 1 ulp
    assert (out != expected).float().mean() < 1e-3
    plain = ops.add_rms_norm(expected_h.clone(), w, 1e-5)  # no residual
    torch.testing.assert_close(plain, expected, atol=0, rtol=2**-7)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.add_rms_norm(h.float(), w, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        ops.add_rms_norm(h, w, 1e-5, delta[:, :100].contiguous())


def test_no_query_heads_and_no_rows_return_empty(lib):
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    table, lens = torch.tensor([[0], [1]]), torch.tensor([5, 3])
    out = _decode(lib, torch.zeros(2, 0, 64, dtype=torch.bfloat16), cache, cache, table, 1, lens, 0.125)
    assert out.shape == (2, 0, 64)
    out = _decode(lib, torch.zeros(0, 2, 64, dtype=torch.bfloat16), cache, cache, table[:0], 1, lens[:0], 0.125)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("poison", ["k_nan", "q_nan", "k_inf"])
def test_nan_and_inf_inputs_give_nan_rows_like_the_reference(lib, dtype, poison):
    """A NaN or infinite score makes that row's output NaN (as the float32 math does) and
    leaves the other rows alone; the bf16 kernel's max and exp would otherwise hide it."""
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(4, 16, 1, 64, generator=gen).to(dtype)
    values = torch.randn(4, 16, 1, 64, generator=gen).to(dtype)
    query = torch.randn(2, 3, 64, generator=gen).to(dtype)
    table, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 30])
    if poison == "k_nan":
        cache[1, 2, 0, 5] = float("nan")  # sequence 0, position 18
    elif poison == "q_nan":
        query[0, 1, 7] = float("nan")  # row 0, head 1
    else:
        cache[1, 2, 0] = float("inf")
    out = _decode(lib, query, cache, values, table, 2, lens, 0.125)
    expected = reference.paged_attention(query, cache, values, table.int(), lens.int(),
                                         torch.tensor([0, 1, 2], dtype=torch.int32), 0.125)
    assert torch.equal(out.isnan().any(-1), expected.isnan().any(-1))
    assert expected[0].isnan().any() and not expected[1].isnan().any()
    torch.testing.assert_close(out[1], expected[1], **TOLERANCES[dtype])
