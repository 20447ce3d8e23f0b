"""Paged-attention kernel benchmark: the Triton kernels against ``F.scaled_dot_product_attention``.

    .venv/bin/python benchmarks/kernels.py              # on a CUDA GPU: the full decode/prefill grid
    .venv/bin/python benchmarks/kernels.py --smoke      # a tiny config in seconds (CPU interpreter w/o CUDA)

Decode: B sequences, one new token each over ``ctx`` cached tokens (paged, block size 16, block
tables in shuffled physical order); figure: achieved memory bandwidth in TB/s = (bytes of K/V
read + bytes of q and out) / time. Prefill: B sequences of ``len`` new tokens each, no context;
figure: TFLOP/s of causal attention, 4 * B * H * len^2 * D / 2. SDPA runs on the same data in
contiguous ``[B, H, S, D]`` layout (GQA through ``enable_gqa``) in the same run; ``max|diff|`` is
the largest difference between the two outputs. GPU timing: CUDA events around each call,
the L2 cache flushed before each, median of ``--iters``. Needs only torch and triton.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `kernels`

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny config; CPU interpreter when there is no CUDA")
    p.add_argument("--decode-batch", type=_ints, default=[1, 16, 64, 256])
    p.add_argument("--decode-context", type=_ints, default=[512, 2048, 8192, 32768])
    p.add_argument("--prefill-batch", type=_ints, default=[1, 4, 16])
    p.add_argument("--prefill-len", type=_ints, default=[1024, 2048, 4096, 8192])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-gib", type=float, default=40.0, help="skip configs whose tensors exceed this")
    args = p.parse_args(argv)
    if args.smoke:
        args.decode_batch, args.decode_context = [2], [40]
        args.prefill_batch, args.prefill_len = [1], [24]
        args.num_heads, args.num_kv_heads = 8, 1
        args.iters = 2
    return args


def time_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median milliseconds per call: CUDA events (L2 flushed before each call) or wall clock."""
    fn()  # warm-up (and compile)
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # > the L2 of any current GPU
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends, strict=True):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def make_paged(
    k: torch.Tensor,  # [B, Hkv, S, D] contiguous
    v: torch.Tensor,  # [B, Hkv, S, D] contiguous
    block_size: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same K/V in a paged cache: (key_cache, value_cache, block_tables [B, S/bs] int32)."""
    batch, num_kv_heads, seq, head_dim = k.shape
    blocks_per_seq = -(-seq // block_size)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen, device=k.device)  # shuffled physical order
    block_tables = perm.view(batch, blocks_per_seq).int()
    caches = []
    for src in (k, v):
        cache = torch.zeros(
            num_blocks, block_size, num_kv_heads, head_dim, dtype=src.dtype, device=src.device
        )
        padded = torch.zeros(
            batch, blocks_per_seq * block_size, num_kv_heads, head_dim, dtype=src.dtype, device=src.device
        )
        padded[:, :seq] = src.transpose(1, 2)  # [B, S, Hkv, D]
        cache[perm] = padded.view(num_blocks, block_size, num_kv_heads, head_dim)
        caches.append(cache)
    return caches[0], caches[1], block_tables


def bench_decode(args, paged_attention, device, batch: int, ctx: int) -> str:
    dtype, heads, kv_heads, dim = DTYPES[args.dtype], args.num_heads, args.num_kv_heads, args.head_dim
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(batch, heads, 1, dim, generator=gen, device=device, dtype=dtype)  # [B, H, 1, D]
    k = torch.randn(batch, kv_heads, ctx, dim, generator=gen, device=device, dtype=dtype)  # [B, Hkv, S, D]
    v = torch.randn(batch, kv_heads, ctx, dim, generator=gen, device=device, dtype=dtype)
    key_cache, value_cache, block_tables = make_paged(k, v, args.block_size, gen)
    query = q.view(batch, heads, dim).contiguous()  # [T = B, H, D]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    scale = dim**-0.5

    def triton_fn():
        return paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            qsl,
            scale,
            max_query_len=1,
            max_seq_len=ctx,
        )

    def sdpa_fn():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=kv_heads != heads)

    diff = (triton_fn().float() - sdpa_fn().view(batch, heads, dim).float()).abs().max().item()
    t_triton = time_ms(triton_fn, args.iters, device)
    t_sdpa = time_ms(sdpa_fn, args.iters, device)
    nbytes = (2 * k.numel() + 2 * q.numel()) * k.element_size()  # K + V read, q read + out written
    return (
        f"decode  B={batch:4d} ctx={ctx:6d} | triton {t_triton:9.3f} ms {nbytes / t_triton / 1e9:7.3f} TB/s"
        f" | sdpa {t_sdpa:9.3f} ms {nbytes / t_sdpa / 1e9:7.3f} TB/s | max|diff| {diff:.1e}"
    )


def bench_prefill(args, paged_attention, device, batch: int, length: int) -> str:
    dtype, heads, kv_heads, dim = DTYPES[args.dtype], args.num_heads, args.num_kv_heads, args.head_dim
    gen = torch.Generator(device).manual_seed(1)
    q = torch.randn(batch, heads, length, dim, generator=gen, device=device, dtype=dtype)  # [B, H, S, D]
    k = torch.randn(batch, kv_heads, length, dim, generator=gen, device=device, dtype=dtype)  # [B, Hkv, S, D]
    v = torch.randn(batch, kv_heads, length, dim, generator=gen, device=device, dtype=dtype)
    key_cache, value_cache, block_tables = make_paged(k, v, args.block_size, gen)
    query = q.transpose(1, 2).reshape(batch * length, heads, dim)  # [T = B * S, H, D]
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)
    scale = dim**-0.5

    def triton_fn():
        return paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            qsl,
            scale,
            max_query_len=length,
            max_seq_len=length,
        )

    def sdpa_fn():
        return F.scaled_dot_product_attention(
            q, k, v, scale=scale, is_causal=True, enable_gqa=kv_heads != heads
        )

    expected = sdpa_fn().transpose(1, 2).reshape(batch * length, heads, dim)
    diff = (triton_fn().float() - expected.float()).abs().max().item()
    t_triton = time_ms(triton_fn, args.iters, device)
    t_sdpa = time_ms(sdpa_fn, args.iters, device)
    flops = 4 * batch * heads * length * length * dim / 2  # QK^T and PV, causal half
    return (
        f"prefill B={batch:4d} len={length:6d} | triton {t_triton:9.3f} ms {flops / t_triton / 1e9:7.2f} TFLOP/s"
        f" | sdpa {t_sdpa:9.3f} ms {flops / t_sdpa / 1e9:7.2f} TFLOP/s | max|diff| {diff:.1e}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. imported below
    else:
        sys.exit("no CUDA device: run with --smoke for the CPU interpreter")
    from kernels.triton_attention import paged_attention

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(
        f"# {where}, {args.dtype}, {args.num_heads} q heads / {args.num_kv_heads} kv heads, "
        f"head_dim {args.head_dim}, block size {args.block_size}"
    )
    elem = DTYPES[args.dtype].itemsize
    for batch in args.decode_batch:
        for ctx in args.decode_context:
            gib = (
                4 * batch * ctx * args.num_kv_heads * args.head_dim * elem / 2**30
            )  # contiguous + paged K, V
            if gib > args.max_gib:
                print(f"decode  B={batch:4d} ctx={ctx:6d} | skipped: {gib:.0f} GiB > --max-gib")
                continue
            print(bench_decode(args, paged_attention, device, batch, ctx), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for batch in args.prefill_batch:
        for length in args.prefill_len:
            print(bench_prefill(args, paged_attention, device, batch, length), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
