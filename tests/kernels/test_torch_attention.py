"""The fast torch attention backend against the reference paged attention (the oracle)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import reference
from kernels.cpu import attention_plan, ops
from kernels.cpu.attention_plan import NATIVE_MAX_QUERY_LEN
from services.executor.attention import (
    AttentionMetadata,
    ReferenceBackend,
    TorchBackend,
    get_attention_backend,
)

TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
HEAD_DIM = 32


def _random_batch(
    rng: random.Random, block_size: int, kinds: list[tuple[str, int, int]], num_blocks: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """Lengths and shuffled block tables for ``(kind, context, new)`` sequences."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, seq_lens, tables = [], [], []
    for _, context, new in kinds:
        seq_len = context + new
        n = -(-seq_len // block_size)
        tables.append([free.pop() for _ in range(n)])
        query_lens.append(new)
        seq_lens.append(seq_len)
    return query_lens, seq_lens, tables


def _mixed_kinds(rng: random.Random, bs: int) -> list[tuple[str, int, int]]:
    """Decodes, prefills and chunks with cached context, lengths on / one past block boundaries."""
    kinds = [
        ("decode", bs - 1, 1),  # seq_len == bs: exactly on a boundary
        ("decode", bs, 1),  # one past a boundary
        ("decode", 2 * bs - 1, 1),
        ("decode", 0, 1),  # a 1-token prompt
        ("decode", rng.randint(1, 3 * bs), 1),
        ("prefill", 0, bs),
        ("prefill", 0, bs + 1),
        ("prefill", 0, rng.randint(2, 2 * bs)),
        ("chunk", bs, bs),  # context and chunk on boundaries
        ("chunk", bs + 1, 3),
        ("chunk", rng.randint(1, 2 * bs), rng.randint(2, bs)),
    ]
    rng.shuffle(kinds)
    return kinds


def _run_both(  # the reference against the torch backend, without and with the native decode kernel
    kinds: list[tuple[str, int, int]],
    *,
    dtype: torch.dtype,
    group: int,
    block_size: int,
    seed: int,
    num_kv_heads: int = 2,
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for _, c, n in kinds) + 7
    query_lens, seq_lens, tables = _random_batch(rng, block_size, kinds, num_blocks)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    t, h = sum(query_lens), num_kv_heads * group
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(dtype)  # stands in for cached context
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(t, h, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5

    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, meta.slot_mapping)
    expected = reference.paged_attention(
        query, ref_k, ref_v, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
    )
    calls = []
    kernel = ops.paged_attention_rows
    for native in (False, True):  # torch ops only, then decodes and short prefills in the C kernel
        ops.paged_attention_rows = lambda *a, **k: calls.append(1) or kernel(*a, **k)
        try:
            out = TorchBackend(native=native).forward(query, key, value, key_cache, value_cache, meta, scale)
        finally:
            ops.paged_attention_rows = kernel
        has_rows = any(0 < new <= NATIVE_MAX_QUERY_LEN for _, _, new in kinds)
        assert len(calls) == (native and has_rows and ops.load() is not None), (native, calls)
        assert out.shape == expected.shape and out.dtype == dtype
        torch.testing.assert_close(key_cache, ref_k, atol=0, rtol=0)
        torch.testing.assert_close(value_cache, ref_v, atol=0, rtol=0)
        torch.testing.assert_close(out, expected, **TOLERANCES[dtype], msg=lambda m, native=native: f"native={native}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_reference(dtype, group, block_size, seed):
    kinds = _mixed_kinds(random.Random(1000 + seed), block_size)
    _run_both(kinds, dtype=dtype, group=group, block_size=block_size, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_pure_decode_batch(dtype, group):
    """All-decode steps take the no-copy path; equal and unequal lengths (mask / no mask)."""
    bs = 16
    unequal = [("decode", c, 1) for c in (0, 15, 16, 31, 32, 47, 100)]
    _run_both(unequal, dtype=dtype, group=group, block_size=bs, seed=3)
    equal = [("decode", 40, 1)] * 5
    _run_both(equal, dtype=dtype, group=group, block_size=bs, seed=4)
    _run_both([("decode", 99, 1)], dtype=dtype, group=group, block_size=bs, seed=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(8, 1), (5, 2), (1, 4)])
def test_decode_batch_exact_and_all_pairs_paths(dtype, num_kv_heads, group):
    """Many decodes: the all-pairs bmm (few KV heads) and the exact GQA product (MHA, 5 KV
    heads), with and without padding masks; 2-4 decodes take the masked SDPA path."""
    bs = 16
    unequal = [("decode", c, 1) for c in (0, 15, 16, 31, 47, 100, 129, 5)]
    _run_both(unequal, dtype=dtype, group=group, block_size=bs, seed=11, num_kv_heads=num_kv_heads)
    equal = [("decode", 31, 1)] * 6  # every length a multiple of the block size: no mask
    _run_both(equal, dtype=dtype, group=group, block_size=bs, seed=12, num_kv_heads=num_kv_heads)
    few = [("decode", c, 1) for c in (3, 40, 17)]
    _run_both(few, dtype=dtype, group=group, block_size=bs, seed=13, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_prefills_batched_by_length(dtype):
    """A prefill-only step: short prompts of similar lengths share padded SDPA batches, a long
    one runs alone, lengths straddle the grouping thresholds; and the same prompts mixed with
    decodes, chunks and a sequence with no new tokens (the index_copy path)."""
    rng = random.Random(14)
    lens = [2, 3, 7, 8, 9, 10, 12, 16, 17, 30, 31, 40, 100, 128, 129, 200] + [rng.randint(2, 60) for _ in range(8)]
    rng.shuffle(lens)
    prefills = [("prefill", 0, n) for n in lens]
    _run_both(prefills, dtype=dtype, group=3, block_size=16, seed=15)
    mixed = prefills + [("decode", 20, 1), ("decode", 3, 1), ("chunk", 16, 5), ("idle", 9, 0)]
    rng.shuffle(mixed)
    _run_both(mixed, dtype=dtype, group=3, block_size=16, seed=16)


def test_decodes_not_first_and_single_prefill():
    """Decode rows interleaved with prefills (index path), and a lone prompt (SDPA only)."""
    kinds = [("prefill", 0, 7), ("decode", 20, 1), ("chunk", 5, 4), ("decode", 3, 1), ("prefill", 0, 2)]
    _run_both(kinds, dtype=torch.float32, group=3, block_size=16, seed=6, num_kv_heads=3)
    _run_both([("prefill", 0, 33)], dtype=torch.float32, group=4, block_size=32, seed=7)


def test_negative_slots_are_not_written():
    """Padding tokens (slot -1) are skipped like the reference skips them."""
    bs, hkv, group = 16, 2, 2
    gen = torch.Generator().manual_seed(8)
    meta = AttentionMetadata.build([1, 1], [10, 20], [[3], [1, 5]], bs)
    meta.slot_mapping = torch.tensor([3 * bs + 9, -1])
    meta.seq_lens = torch.tensor([10, 19], dtype=torch.int32)
    meta.seq_lens_list = [10, 19]
    cache_k = torch.randn(6, bs, hkv, HEAD_DIM, generator=gen)
    cache_v = torch.randn(6, bs, hkv, HEAD_DIM, generator=gen)
    q = torch.randn(2, hkv * group, HEAD_DIM, generator=gen)
    k = torch.randn(2, hkv, HEAD_DIM, generator=gen)
    v = torch.randn(2, hkv, HEAD_DIM, generator=gen)
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    expected = ReferenceBackend().forward(q, k, v, ref_k, ref_v, meta, 0.2)
    meta.backend_state.clear()
    out = TorchBackend().forward(q, k, v, cache_k, cache_v, meta, 0.2)
    torch.testing.assert_close(cache_k, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_plan_is_built_once_and_shared_across_layers(monkeypatch):
    built = []
    build = attention_plan.build_plan
    monkeypatch.setattr(attention_plan, "build_plan", lambda *a, **k: built.append(1) or build(*a, **k))
    meta = AttentionMetadata.build([1, 3], [5, 3], [[0], [1]], 16)
    backend = TorchBackend()
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 16, 2, HEAD_DIM)
    for _ in range(3):  # three layers of one step
        q, k, v = (torch.randn(4, h, HEAD_DIM, generator=gen) for h in (4, 2, 2))
        backend.forward(q, k, v, cache, cache.clone(), meta, 0.2)
    assert len(built) == 1 and len(meta.backend_state) == 1
    assert meta.num_decodes == 1 and meta.max_seq_len == 5 and meta.max_query_len == 3


def test_backend_registry():
    assert isinstance(get_attention_backend("torch", "cpu"), TorchBackend)
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), TorchBackend)
    assert isinstance(get_attention_backend("reference", "cpu"), ReferenceBackend)
    with pytest.raises(ValueError, match="nope"):
        get_attention_backend("nope", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_rows_mixed_with_a_prefill_too_long_for_them(dtype):
    """A prefill one token longer than NATIVE_MAX_QUERY_LEN takes SDPA while the decodes and
    the short chunk around it take the C kernel (rows written back by index)."""
    kinds = [("decode", 30, 1), ("prefill", 0, NATIVE_MAX_QUERY_LEN + 1), ("chunk", 16, 5), ("decode", 3, 1)]
    _run_both(kinds, dtype=dtype, group=3, block_size=16, seed=21)
