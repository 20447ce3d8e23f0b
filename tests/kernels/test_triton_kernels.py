"""Triton paged-attention kernels vs the torch reference (kernels/reference.py).

On a machine without a GPU the kernels run under the Triton CPU interpreter. Triton 3.9 reads
``TRITON_INTERPRET`` whenever ``@triton.jit`` decorates a function: for triton.language's own
jit helpers (``tl.max``, ``tl.sum``, ``tl.zeros``, ``tl.cdiv``...) that is at ``import triton``,
for ours at ``import kernels.triton.*``; it is not read at launch. So:

* without a GPU the variable is set at the top of this module, before it imports triton (and by
  ``tests/conftest.py``, before collecting other modules imports triton: transformers does);
* if triton was already imported in this process without it (another test module, a plugin),
  the in-process kernel tests skip and ``test_kernel_tests_in_fresh_process`` runs them in a
  fresh ``python -m pytest`` with ``TRITON_INTERPRET=1`` instead;
* kernel modules imported earlier in the other mode are re-imported (``_kernel_modules``).

With a GPU the same tests run natively on it (no interpreter); ``PAGEDLLM_KERNEL_TEST_DEVICE=cpu``
or ``=cuda`` forces the choice.
``test_kernels_compile_for_cuda_targets`` compiles the planned launches for sm_90 / sm_80
(PTX + cubin, no GPU needed) in a subprocess without the interpreter: it catches what the
interpreter cannot (layouts, register pressure, MLIR verifier errors).
"""

from __future__ import annotations

import importlib
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch  # does not import triton

# cuda: natively on the GPU; cpu: under the interpreter. One process holds triton in one mode
# only, so the interpreter is never forced on a machine whose other tests could use the GPU.
DEVICE = os.environ.get("PAGEDLLM_KERNEL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see the module docstring)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton.utils import is_interpreted  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = {  # per-dtype (atol, rtol); fp16/bf16 include P rounded to the cache dtype before P @ V
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 1e-2),
}
# False when triton itself was imported in the other mode (its tl.max etc. are then unusable)
IN_PROCESS = is_interpreted(tl.max) == (DEVICE == "cpu")
in_process = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported in the other TRITON_INTERPRET mode: see the fresh-process test",
)


def _kernel_modules():
    """(triton_cache, triton_attention), built for this run's mode (interpreter or not)."""
    mods = []
    for name, kernel in (
        ("kernels.triton.cache", "_reshape_and_cache_kernel"),
        ("kernels.triton.attention_kernels", "_paged_attn_kernel"),
        ("kernels.triton.attention", "_paged_attn_kernel"),  # after its kernels: takes the reloaded ones
    ):
        mod = importlib.import_module(name)
        if IN_PROCESS and is_interpreted(getattr(mod, kernel)) != is_interpreted(tl.max):
            mod = importlib.reload(mod)  # imported earlier in this process in the other mode
        mods.append(mod)
    return mods[0], mods[2]


triton_cache, triton_attention = _kernel_modules()


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_kernel_tests_in_fresh_process():
    """Runs this module's in-process tests in a fresh process when this one cannot (the
    benchmark and split-count tests run in this process either way: not again there)."""
    env = dict(
        os.environ, PAGEDLLM_KERNEL_TEST_DEVICE=DEVICE, TRITON_INTERPRET="1" if DEVICE == "cpu" else "0"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "not fresh_process and not cuda_targets and not benchmark and not choose_num_splits"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------- reshape_and_cache


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_matches_reference(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 7, 16, 3, 80, 37
    # K and V as strided views of one fused projection, as a model produces them
    qkv = torch.randn(num_tokens, 5, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 3]  # [T, Hkv, D], token stride 5 * Hkv * D
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 36]] = torch.tensor([-1, -7, -1])  # skipped tokens (padding)
    slots[9] = num_blocks * block_size - 1  # the very last slot
    slots = slots.to(slot_dtype).to(DEVICE)
    key_cache = (
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    )
    value_cache = torch.randn(key_cache.shape, generator=gen).to(dtype).to(DEVICE)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), expected_k, expected_v, slots)

    triton_cache.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots)

    torch.testing.assert_close(key_cache, expected_k, atol=0, rtol=0)  # a copy: bit exact
    torch.testing.assert_close(value_cache, expected_v, atol=0, rtol=0)


@in_process
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_reshape_and_cache_casts_to_cache_dtype(cache_dtype):
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(10, 2, 64, generator=gen).to(DEVICE)  # fp32 activations
    value = torch.randn(10, 2, 64, generator=gen).to(DEVICE)
    slots = torch.arange(10, dtype=torch.int64, device=DEVICE) * 3 - 4  # first two skipped
    key_cache = torch.zeros(2, 16, 2, 64, dtype=cache_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)

    triton_cache.reshape_and_cache(key, value, key_cache, value_cache, slots)

    # fp16 rounds to nearest even like torch; the interpreter truncates fp32 -> bf16 (the GPU
    # rounds), so bf16 is allowed one bf16 ulp there.
    exact = cache_dtype == torch.float16 or DEVICE != "cpu"
    atol, rtol = (0.0, 0.0) if exact else (1e-6, 2**-7)
    torch.testing.assert_close(key_cache, expected_k, atol=atol, rtol=rtol)
    torch.testing.assert_close(value_cache, expected_v, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- paged_attention


@dataclass(frozen=True)
class Case:
    """One mixed batch: sequence b has ctx_lens[b] cached tokens and q_lens[b] new ones."""

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float16
    sliding_window: int | None = None
    soft_cap: float | None = None

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        extra = (f"-sw{self.sliding_window}" if self.sliding_window else "") + (
            f"-cap{self.soft_cap}" if self.soft_cap else ""
        )
        return (
            f"{dt}-d{self.head_dim}-h{self.num_heads}:{self.num_kv_heads}-bs{self.block_size}"
            f"-q{'.'.join(map(str, self.q_lens))}-ctx{'.'.join(map(str, self.ctx_lens))}{extra}"
        )


def _random_lens(seed: int, batch: int, max_q: int, max_ctx: int, block_size: int) -> tuple[tuple, tuple]:
    """Seeded mixed lengths, biased towards block boundaries (on, one past, one before)."""
    rng = random.Random(seed)
    q_lens, ctx_lens = [], []
    for _ in range(batch):
        q = rng.choice([1, 1, rng.randint(2, max_q), max_q])
        if rng.random() < 0.5:  # make the total length hit a block boundary exactly or +-1
            total = rng.randint(1, (max_ctx + q) // block_size) * block_size + rng.choice([0, 1, -1])
            ctx = max(0, min(max_ctx, total - q))
        else:
            ctx = rng.randint(0, max_ctx)
        q_lens.append(q)
        ctx_lens.append(ctx)
    return tuple(q_lens), tuple(ctx_lens)


CASES = [
    # decode only, GQA 4:1 / 8:1, lengths on and one past block boundaries
    Case(q_lens=(1, 1, 1, 1), ctx_lens=(15, 16, 31, 32), num_heads=8, num_kv_heads=2, dtype=torch.bfloat16),
    Case(q_lens=(1, 1, 1), ctx_lens=(0, 63, 300), num_heads=8, num_kv_heads=1, head_dim=128, block_size=32),
    # a single long prefill (no context) and prefill after a prefix-cache hit, MHA
    Case(q_lens=(64,), ctx_lens=(0,), num_heads=2, num_kv_heads=2, head_dim=80, dtype=torch.float32),
    Case(q_lens=(33,), ctx_lens=(32,), num_heads=2, num_kv_heads=2, head_dim=96, block_size=32),
    # mixed batches (decode + chunked prefill + fresh prefill) from a seeded generator
    Case(*_random_lens(0, 8, 64, 300, 16), num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float16),
    Case(
        *_random_lens(1, 5, 40, 200, 32),
        num_heads=8,
        num_kv_heads=1,
        head_dim=64,
        block_size=32,
        dtype=torch.bfloat16,
    ),
    Case(*_random_lens(2, 3, 20, 150, 16), num_heads=4, num_kv_heads=4, head_dim=128, dtype=torch.float32),
    Case(*_random_lens(3, 4, 17, 100, 16), num_heads=6, num_kv_heads=2, head_dim=256, dtype=torch.bfloat16),
    Case(
        *_random_lens(4, 2, 16, 90, 32),
        num_heads=4,
        num_kv_heads=2,
        head_dim=80,
        block_size=32,
        dtype=torch.float16,
    ),
    # a sequence with no new tokens this step (q_len 0) between two that have some
    Case(
        q_lens=(3, 0, 2),
        ctx_lens=(20, 40, 16),
        num_heads=4,
        num_kv_heads=2,
        head_dim=96,
        dtype=torch.bfloat16,
    ),
    # sliding window (Mistral) and soft cap (Gemma 2), alone and together, decode and prefill
    Case(q_lens=(1, 24, 1), ctx_lens=(100, 40, 7), num_heads=4, num_kv_heads=1, sliding_window=32),
    Case(
        q_lens=(40,),
        ctx_lens=(0,),
        num_heads=2,
        num_kv_heads=2,
        head_dim=128,
        block_size=32,
        dtype=torch.float32,
        sliding_window=17,
    ),
    Case(
        q_lens=(5, 1),
        ctx_lens=(60, 129),
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        soft_cap=2.0,
    ),
    Case(
        q_lens=(1, 30),
        ctx_lens=(77, 33),
        num_heads=4,
        num_kv_heads=2,
        head_dim=256,
        block_size=32,
        dtype=torch.float16,
        sliding_window=20,
        soft_cap=3.0,
    ),
    # MQA with a query-head group wider than the 16-row minimum tile (one token per tile)
    Case(q_lens=(1, 9), ctx_lens=(50, 20), num_heads=32, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16),
]
_HEADS = [(4, 4), (4, 2), (8, 2), (8, 1), (16, 2), (6, 2), (32, 1)]  # GQA 1, 2, 4, 8, 8, 3 and MQA 32
for _i, (_dtype, _head_dim) in enumerate(
    (dt, d) for dt in (torch.float32, torch.float16, torch.bfloat16) for d in (64, 80, 96, 128, 256)
):  # seeded sweep: every dtype x head_dim, rotating head ratio, block size, batch, window, cap
    _bs = (16, 32)[_i % 2]
    _heads, _kv_heads = _HEADS[_i % len(_HEADS)]
    CASES.append(
        Case(
            # long queries only for narrow groups: the interpreter pays per (token x group) tile
            *_random_lens(100 + _i, 1 + _i % 8, 64 if _i % 3 and _heads <= 4 * _kv_heads else 8, 300, _bs),
            num_heads=_heads,
            num_kv_heads=_kv_heads,
            head_dim=_head_dim,
            block_size=_bs,
            dtype=_dtype,
            sliding_window=(None, None, 48, None, 100)[_i % 5],
            soft_cap=(None, None, None, 4.0)[_i % 4],
        )
    )


def _make_batch(case: Case, seed: int = 0):
    """Random query and caches, block tables in shuffled physical order, NaN poison elsewhere.

    Padding entries of the block tables point at a block full of NaN and every slot past a
    sequence's length holds NaN too: any read the kernel should not make shows up as NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    seq_lens = [c + q for c, q in zip(case.ctx_lens, case.q_lens, strict=True)]
    blocks_per_seq = [max(1, math.ceil(s / bs)) for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the poison block
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    key_cache[0] = value_cache[0] = float("nan")
    used = 0
    for b, (n, s) in enumerate(zip(blocks_per_seq, seq_lens, strict=True)):
        block_tables[b, :n] = perm[used : used + n].int()
        used += n
        last, fill = block_tables[b, n - 1], s - (n - 1) * bs
        key_cache[last, fill:] = value_cache[last, fill:] = float("nan")  # past the sequence end
    query = torch.randn(sum(case.q_lens), case.num_heads, case.head_dim, generator=gen) * 2.0
    qsl = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        query.to(case.dtype).to(DEVICE),
        key_cache.to(case.dtype).to(DEVICE),
        value_cache.to(case.dtype).to(DEVICE),
        block_tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        qsl.to(DEVICE),
    )


@in_process
@pytest.mark.parametrize("path", ["single", "split_k"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_attention_matches_reference(case: Case, path: str):
    args = _make_batch(case)
    scale = case.head_dim**-0.5
    kwargs = dict(sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    expected = reference.paged_attention(*args, scale, **kwargs)

    got = triton_attention.paged_attention(
        *args, scale, **kwargs, path=path, num_splits=4 if path == "split_k" else None
    )

    atol, rtol = TOL[case.dtype]
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


@in_process
def test_paged_attention_auto_path_long_context_decode():
    """Few long decodes: "auto" takes split-K (8 splits on the CPU's pretend 132 SMs) and agrees."""
    case = Case(q_lens=(1, 1), ctx_lens=(700, 2047), num_heads=8, num_kv_heads=1, head_dim=64, block_size=32)
    args = _make_batch(case, seed=5)
    scale = case.head_dim**-0.5
    _, launches = triton_attention.plan_paged_attention(*args, scale, max_query_len=1, max_seq_len=2048)
    assert launches[0].grid[2] == 8 and len(launches) == 2  # split-K + reduce
    expected = reference.paged_attention(*args, scale)

    got = triton_attention.paged_attention(*args, scale, max_query_len=1, max_seq_len=2048)

    torch.testing.assert_close(got, expected, atol=TOL[case.dtype][0], rtol=TOL[case.dtype][1])


@in_process
@pytest.mark.parametrize("path", ["single", "split_k"])
def test_paged_attention_writes_into_out_and_leaves_padding_rows(path: str):
    case = Case(q_lens=(2, 3), ctx_lens=(5, 0))
    query, *rest = _make_batch(case)
    padded = torch.cat([query, torch.zeros_like(query[:2])])  # 2 padding rows past qsl[B]
    out = torch.full_like(padded, 7.0)
    scale = case.head_dim**-0.5

    got = triton_attention.paged_attention(padded, *rest, scale, out=out, path=path)

    assert got is out
    torch.testing.assert_close(out[:5], reference.paged_attention(query, *rest, scale), atol=2e-3, rtol=2e-3)
    assert bool((out[5:] == 7.0).all())


@in_process
@pytest.mark.parametrize(
    "case, path, tiles",
    [  # decode rows in a 32-row tile (4 tokens x GQA 8) over 16-key iterations, single and split-K
        (Case(q_lens=(1, 1, 1), ctx_lens=(15, 33, 64), num_heads=8, num_kv_heads=1, head_dim=64), "single",
         dict(block_m=32, tile_n=16)),
        (Case(q_lens=(1, 1, 1), ctx_lens=(15, 33, 64), num_heads=8, num_kv_heads=1, head_dim=64), "split_k",
         dict(block_m=16, tile_n=128, num_warps=8, num_stages=3)),
        # a prefill tile of 64 rows (32 tokens x GQA 2) over 16-key iterations, chunk on a context
        (Case(q_lens=(40, 3), ctx_lens=(17, 31), num_heads=4, num_kv_heads=2, head_dim=80), "single",
         dict(block_m=64, tile_n=16)),
    ],
    ids=["decode-single", "decode-split_k", "prefill"],
)
def test_paged_attention_tile_overrides_match_reference(case: Case, path: str, tiles: dict):
    """Every tile shape the benchmark's --sweep may pick computes the same attention."""
    args = _make_batch(case, seed=11)
    scale = case.head_dim**-0.5
    overrides = triton_attention.AttentionTiles(**tiles)
    _, launches = triton_attention.plan_paged_attention(
        *args, scale, path=path, num_splits=2 if path == "split_k" else None, tiles=overrides)
    group_pad = triton.next_power_of_2(case.num_heads // case.num_kv_heads)
    kw = launches[0].kwargs
    assert (kw["BLOCK_M"], kw["BLOCK_Q"], kw["TILE_N"]) == (
        tiles["block_m"], tiles["block_m"] // group_pad, tiles["tile_n"])
    assert (kw["num_warps"], kw["num_stages"]) == (tiles.get("num_warps", 4), tiles.get("num_stages", 2))

    got = triton_attention.paged_attention(
        *args, scale, path=path, num_splits=2 if path == "split_k" else None, tiles=overrides)

    torch.testing.assert_close(got, reference.paged_attention(*args, scale), atol=2e-3, rtol=2e-3)


@in_process
@pytest.mark.parametrize(
    "tiles, field",
    [(dict(block_m=8), "block_m"), (dict(block_m=48), "block_m"), (dict(tile_n=8), "tile_n"),
     (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages")],
)
def test_paged_attention_rejects_bad_tiles(tiles: dict, field: str):
    case = Case(q_lens=(2,), ctx_lens=(3,))
    args = _make_batch(case)
    with pytest.raises(ValueError, match=f"tiles.{field}"):
        triton_attention.paged_attention(*args, 1.0, tiles=triton_attention.AttentionTiles(**tiles))


def test_choose_num_splits():
    choose = triton_attention.choose_num_splits
    assert choose(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=32768, num_sms=132) == 32
    assert choose(num_seqs=4, num_kv_heads=4, max_query_len=1, max_seq_len=8192, num_sms=132) == 16
    assert choose(num_seqs=4, num_kv_heads=4, max_query_len=1, max_seq_len=1024, num_sms=132) == 4
    assert (
        choose(num_seqs=64, num_kv_heads=8, max_query_len=1, max_seq_len=32768, num_sms=132) == 1
    )  # full GPU
    assert (
        choose(num_seqs=1, num_kv_heads=8, max_query_len=512, max_seq_len=32768, num_sms=132) == 1
    )  # prefill
    assert choose(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=300, num_sms=132) == 1  # short


@in_process
def test_launcher_rejects_bad_arguments():
    case = Case(q_lens=(2,), ctx_lens=(3,))
    query, key_cache, value_cache, block_tables, seq_lens, qsl = _make_batch(case)
    with pytest.raises(AssertionError):  # int64 block tables
        triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables.long(), seq_lens, qsl, 1.0
        )
    with pytest.raises(AssertionError):  # 3 query heads over 2 KV heads
        triton_attention.paged_attention(
            query[:, :3], key_cache, value_cache, block_tables, seq_lens, qsl, 1.0
        )
    with pytest.raises(AssertionError):  # split count not a power of two
        triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, qsl, 1.0, path="split_k", num_splits=3
        )


# ---------------------------------------------------------------- CUDA compile check, benchmark

_COMPILE_SCRIPT = r"""
import torch
from kernels.triton.attention import AttentionTiles, plan_paged_attention
from kernels.triton.cache import plan_reshape_and_cache
from kernels.triton.utils import compile_launch, is_interpreted

def attn(dtype, heads, kv_heads, head_dim, q_lens, ctx, **kw):
    q = torch.empty(sum(q_lens), heads, head_dim, dtype=dtype)
    cache = torch.empty(64, 16, kv_heads, head_dim, dtype=dtype)
    b = len(q_lens)
    _, launches = plan_paged_attention(
        q, cache, cache, torch.zeros(b, 8, dtype=torch.int32), torch.zeros(b, dtype=torch.int32),
        torch.zeros(b + 1, dtype=torch.int32), 0.1, max_query_len=max(q_lens), max_seq_len=ctx, **kw)
    return launches

launches = []
launches += attn(torch.bfloat16, 32, 4, 128, [1] * 4, 8192)  # decode, auto -> split-K + reduce
launches += attn(torch.bfloat16, 32, 4, 128, [2048], 2048)  # prefill
launches += attn(torch.float16, 8, 1, 256, [64], 64, sliding_window=8, soft_cap=5.0)
launches += attn(torch.float32, 8, 2, 80, [1], 64, path="split_k")
launches += attn(torch.bfloat16, 32, 4, 128, [2048], 2048,  # the largest tiles benchmarks/kernels.py --sweep tries
                 tiles=AttentionTiles(block_m=128, tile_n=128, num_warps=8, num_stages=4))
key = torch.empty(4, 8, 128, dtype=torch.bfloat16)
launches += plan_reshape_and_cache(key, key, torch.empty(4, 16, 8, 128, dtype=torch.bfloat16),
                                   torch.empty(4, 16, 8, 128, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64))
assert not any(is_interpreted(launch.kernel) for launch in launches)
for arch in (90, 80):
    for launch in launches:
        compiled = compile_launch(launch, arch)
        assert compiled.asm["cubin"], launch.kernel
        print(arch, launch.kernel.fn.__name__, "ok")
"""


def test_kernels_compile_for_cuda_targets():
    """The planned launches compile to cubin for sm_90 and sm_80 (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" ok") == 16, proc.stdout


def test_benchmark_smoke_prints_figures():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--smoke", "--sweep"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    decode = [line for line in lines if line.startswith("decode")]
    prefill = [line for line in lines if line.startswith("prefill")]
    assert decode and prefill, proc.stdout
    assert all("TB/s" in line for line in decode), proc.stdout
    assert all("TFLOP/s" in line for line in prefill), proc.stdout
    # --sweep: a line per candidate (default, 4 + 2 decode, 2 + 1 prefill), each agreeing with SDPA,
    # then the fastest of each shape against the default
    swept = [line for line in lines if line.startswith("  sweep")]
    assert len(swept) == 7 + 4 and not [line for line in swept if "failed" in line], proc.stdout
    assert all(float(line.split("max|diff| ")[1].split()[0]) < 0.05 for line in swept), proc.stdout
    best = [line for line in lines if line.startswith("best")]
    assert [line.split("|")[0].split()[1] for line in best] == ["decode", "prefill"], proc.stdout
    assert all(" default " in line and " sdpa " in line for line in best), proc.stdout


SWEEP_FAULT_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("kernels_bench", sys.argv[1])
kb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kb)
FAULT, SHAPE = sys.argv[2], sys.argv[3]
broken = []
original_run = kb.Case.run

def run(self, **options):  # FAULT on SHAPE breaks the context; every later call fails
    if broken or (kb.describe(options) == FAULT and self.label.startswith(SHAPE)):
        broken.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return original_run(self, **options)

kb.Case.run = run
kb.cuda_alive = lambda device: not broken
kb.main(["--smoke", "--sweep"])
"""


@pytest.mark.parametrize("fault,shape", [
    ("path=single splits=- block_m=32 tile_n=16 warps=- stages=-", "prefill"),  # the second shape
    ("path=auto splits=-", "decode"),  # the default launch of the first shape
])
def test_benchmark_sweep_goes_on_after_a_sticky_fault(tmp_path, fault, shape):
    """A sweep candidate that leaves the CUDA context unusable (simulated: it and every later
    call fail, and ``cuda_alive`` says so) is excluded on its shape and the sweep goes on in a
    new process from that shape; the grid and the shapes done before are not run again, and
    the other shapes still try the candidate."""
    script = tmp_path / "fault.py"
    script.write_text(SWEEP_FAULT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(ROOT / "benchmarks" / "kernels.py"), fault, shape],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines if line.startswith(("decode", "prefill"))] == ["decode", "prefill"]
    assert len([line for line in lines if fault in line and "failed: RuntimeError: CUDA error" in line]) == 1
    assert len([line for line in lines if f"the CUDA context is lost after {fault}" in line]) == 1
    assert len([line for line in lines if fault in line and "excluded" in line]) == 1
    best = [line.split("|")[0].split()[1] for line in lines if line.startswith("best")]
    assert best == ["decode", "prefill"], proc.stdout  # each shape once: prefill in the new process
    resumed = lines[next(i for i, line in enumerate(lines) if "the CUDA context is lost" in line):]
    if shape == "prefill":
        assert not [line for line in resumed if "sweep decode" in line], proc.stdout
    else:  # the prefill shape still runs its own default launch
        assert len([line for line in resumed if "sweep prefill" in line and "| path=auto splits=- |" in line]) == 1
