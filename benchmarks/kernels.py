"""Paged-attention kernel benchmark: the Triton kernels against ``F.scaled_dot_product_attention``.

    .venv/bin/python benchmarks/kernels.py              # on a CUDA GPU: the full decode/prefill grid
    .venv/bin/python benchmarks/kernels.py --smoke      # a tiny config in seconds (CPU interpreter w/o CUDA)
    .venv/bin/python benchmarks/kernels.py --sweep      # also tune: tile shapes, warps, stages, splits

Decode: B sequences, one new token each over ``ctx`` cached tokens (paged, block size 16, block
tables in shuffled physical order); figure: achieved memory bandwidth in TB/s = (bytes of K/V
read + bytes of q and out) / time. Prefill: B sequences of ``len`` new tokens each, no context;
figure: TFLOP/s of causal attention, 4 * B * H * len^2 * D / 2. SDPA runs on the same data in
contiguous ``[B, H, S, D]`` layout (GQA through ``enable_gqa``) in the same run; ``max|diff|`` is
the largest difference between the two outputs. GPU timing: CUDA events around each call,
the L2 cache flushed before each, median of ``--iters``. Needs only torch and triton.

``--sweep`` then times the launch options of :class:`kernels.triton.attention.AttentionTiles`
(and the split-K factor) on the shapes of ``--sweep-decode`` / ``--sweep-prefill``, one
parameter group at a time from the heuristic's choice (coordinate descent): a line per
candidate with its time, ``max|diff|`` against SDPA and, on a GPU, its registers, spills and
shared memory; then the fastest against the default, measured in the same run. A candidate
that fails (out of shared memory, say) prints why and the sweep goes on; so does a grid entry.
A candidate whose fault leaves the CUDA context unusable (an illegal memory access is sticky:
every later call fails) is excluded on that shape and the sweep goes on in a new process
(``exec``, same arguments plus ``--resume-sweep`` and ``--exclude``), from the shape it broke.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `kernels`

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _pairs(text: str) -> list[tuple[int, int]]:
    """"64:4096,1:32768" -> [(64, 4096), (1, 32768)]"""
    return [(int(a), int(b)) for a, b in (item.split(":") for item in text.split(",") if item)]


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
    p.add_argument("--sweep", action="store_true", help="also tune the launch options (see the docstring)")
    p.add_argument("--sweep-decode", type=_pairs, default=[(64, 4096), (1, 32768)], help="B:ctx,...")
    p.add_argument("--sweep-prefill", type=_pairs, default=[(4, 4096)], help="B:len,...")
    p.add_argument("--resume-sweep", type=int, default=None,
                   help="skip the grid and the first N sweep shapes (set by the sweep's own restart)")
    p.add_argument("--exclude", action="append", default=[],
                   help="SHAPE:CANDIDATE, a sweep candidate not to run on sweep shape number SHAPE, as its "
                        "line prints it (set by the restart)")
    args = p.parse_args(argv)
    if args.smoke:
        args.decode_batch, args.decode_context = [2], [40]
        args.prefill_batch, args.prefill_len = [1], [24]
        args.num_heads, args.num_kv_heads = 8, 1
        args.iters = 2
        args.sweep_decode, args.sweep_prefill = [(2, 40)], [(1, 24)]
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


class Case(NamedTuple):
    """One benchmark configuration, its data already on the device."""

    label: str  # "decode  B=  64 ctx=  4096"
    call: tuple  # positional arguments of paged_attention / plan_paged_attention
    call_kw: dict  # their keyword arguments (max_query_len, max_seq_len)
    sdpa: Callable[[], torch.Tensor]  # SDPA on the same data, as [T, H, D]
    work: float  # bytes moved (decode) or FLOPs (prefill) per call
    unit: str  # "TB/s" or "TFLOP/s": work / ms / 1e9

    def run(self, **options) -> torch.Tensor:  # [T, H, D]
        from kernels.triton.attention import paged_attention

        return paged_attention(*self.call, **self.call_kw, **options)


def decode_case(args, device, batch: int, ctx: int) -> Case:
    """B sequences, one new token each over ``ctx`` cached tokens."""
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

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=kv_heads != heads)
        return out.view(batch, heads, dim)

    nbytes = (2 * k.numel() + 2 * q.numel()) * k.element_size()  # K + V read, q read + out written
    call = (query, key_cache, value_cache, block_tables, seq_lens, qsl, scale)
    return Case(f"decode  B={batch:4d} ctx={ctx:6d}", call, dict(max_query_len=1, max_seq_len=ctx), sdpa,
                nbytes, "TB/s")


def prefill_case(args, device, batch: int, length: int) -> Case:
    """B sequences of ``length`` new tokens each, no cached context."""
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

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=kv_heads != heads)
        return out.transpose(1, 2).reshape(batch * length, heads, dim)

    flops = 4 * batch * heads * length * length * dim / 2  # QK^T and PV, causal half
    call = (query, key_cache, value_cache, block_tables, seq_lens, qsl, scale)
    return Case(f"prefill B={batch:4d} len={length:6d}", call, dict(max_query_len=length, max_seq_len=length),
                sdpa, flops, "TFLOP/s")


def bench_case(case: Case, iters: int, device: torch.device) -> str:
    """The grid's line: the default (heuristic) launch against SDPA, same data, same run."""
    t_triton = time_ms(case.run, iters, device)
    line = f"{case.label} | triton {t_triton:9.3f} ms {case.work / t_triton / 1e9:7.3f} {case.unit}"
    try:  # SDPA may pick a backend that runs out of memory where ours does not
        diff = (case.run().float() - case.sdpa().float()).abs().max().item()
        t_sdpa = time_ms(case.sdpa, iters, device)
    except Exception as exc:  # noqa: BLE001
        return f"{line} | sdpa failed: {type(exc).__name__}"
    return f"{line} | sdpa {t_sdpa:9.3f} ms {case.work / t_sdpa / 1e9:7.3f} {case.unit} | max|diff| {diff:.1e}"


def describe(options: dict) -> str:
    """"path=split_k splits=4 block_m=- tile_n=64 warps=4 stages=2" ('-': the heuristic's)."""
    tiles = options.get("tiles")
    fields = [f"path={options.get('path', 'auto')}", f"splits={options.get('num_splits') or '-'}"]
    if tiles is not None:
        fields += [f"{name}={value or '-'}" for name, value in zip(
            ("block_m", "tile_n", "warps", "stages"), tiles, strict=True)]
    return " ".join(fields)


def build_info(case: Case, options: dict) -> str:
    """Registers, spills and shared memory of each launch's build (on a GPU; '' elsewhere)."""
    from kernels.triton.attention import plan_paged_attention

    _, launches = plan_paged_attention(*case.call, **case.call_kw, **options)
    info = []
    for launch in launches:
        compiled = launch()
        regs = getattr(compiled, "n_regs", None)
        if regs is not None:
            info.append(f"{launch.kernel.fn.__name__}: regs {regs} spills {compiled.n_spills} "
                        f"smem {compiled.metadata.shared}")
    return "; ".join(info)


class CudaContextLost(Exception):
    """A sweep candidate's fault left the CUDA context unusable; ``candidate`` is its
    :func:`describe` string."""

    def __init__(self, candidate: str) -> None:
        super().__init__(candidate)
        self.candidate = candidate


def cuda_alive(device: torch.device) -> bool:
    """Whether ``device`` still runs work (always True off CUDA). After an illegal memory
    access every CUDA call fails, this one included."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # noqa: BLE001
        return False


def try_options(case: Case, options: dict, iters: int, device: torch.device, expected: torch.Tensor) -> float | None:
    """Print one sweep line; the median ms, or None where the launch failed.

    Raises:
        CudaContextLost: the failure left the CUDA context unusable.
    """
    try:
        info = build_info(case, options)
        diff = (case.run(**options).float() - expected.float()).abs().max().item()
        ms = time_ms(lambda: case.run(**options), iters, device)
    except Exception as exc:  # noqa: BLE001 - a config the GPU cannot take is a result too
        print(f"  sweep {case.label} | {describe(options)} | failed: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:160] if str(exc) else ''}", flush=True)
        if not cuda_alive(device):
            raise CudaContextLost(describe(options)) from exc
        return None
    print(f"  sweep {case.label} | {describe(options)} | {ms:9.3f} ms {case.work / ms / 1e9:7.3f} {case.unit}"
          f" | max|diff| {diff:.1e} | {info}", flush=True)
    return ms


def sweep(case: Case, stages: list[list[dict]], iters: int, device: torch.device, exclude: frozenset[str] = frozenset()
          ) -> None:
    """Coordinate descent: each stage's candidates extend the best options so far; those whose
    :func:`describe` is in ``exclude`` are skipped (they broke the CUDA context before)."""
    from kernels.triton.attention import AttentionTiles

    try:
        expected = case.sdpa()
        t_sdpa = time_ms(case.sdpa, iters, device)
        sdpa = f"sdpa {t_sdpa:9.3f} ms {case.work / t_sdpa / 1e9:7.3f}"
    except Exception as exc:  # noqa: BLE001 - then max|diff| is against the default launch
        expected, sdpa = case.run(), f"sdpa failed: {type(exc).__name__}"
    if describe({}) in exclude:
        print(f"  sweep {case.label} | {describe({})} | excluded: it broke the CUDA context", flush=True)
        t_default = None
    else:
        t_default = try_options(case, {}, iters, device, expected)
    best_ms, best = t_default, {"tiles": AttentionTiles()}  # the heuristic's choice is a candidate too
    for stage in stages:
        base = best
        for change in stage:
            options = {**base, **change}
            if "tiles" in change:  # merge tile fields: set ones replace, None ones keep the base's
                merged = [c if c is not None else b for c, b in zip(change["tiles"], base["tiles"], strict=True)]
                options["tiles"] = AttentionTiles(*merged)
            if describe(options) in exclude:
                print(f"  sweep {case.label} | {describe(options)} | excluded: it broke the CUDA context", flush=True)
                continue
            ms = try_options(case, options, iters, device, expected)
            if ms is not None and (best_ms is None or ms < best_ms):
                best_ms, best = ms, options
    if best_ms is None:
        print(f"best  {case.label} | every candidate failed", flush=True)
        return
    default = f"{t_default:9.3f} ms {case.work / t_default / 1e9:7.3f}" if t_default else "failed"
    print(f"best  {case.label} | {describe(best)} | {best_ms:9.3f} ms {case.work / best_ms / 1e9:7.3f} {case.unit}"
          f" | default {default} | {sdpa}", flush=True)


def decode_stages(ctx: int, smoke: bool) -> list[list[dict]]:
    """Split-K factor x keys per iteration, then warps x pipelining stages."""
    from kernels.triton.attention import AttentionTiles

    splits = [1, 2] if smoke else [s for s in (1, 2, 4, 8, 16, 32) if s == 1 or ctx // s >= 256]
    tile_ns = [16, 32] if smoke else [32, 64, 128]
    first = [
        {"path": "single" if n == 1 else "split_k", "num_splits": None if n == 1 else n,
         "tiles": AttentionTiles(tile_n=t)}
        for n in splits for t in tile_ns
    ]
    warps, depths = ([4], [1, 2]) if smoke else ([2, 4, 8], [1, 2, 3, 4])
    second = [{"tiles": AttentionTiles(num_warps=w, num_stages=d)} for w in warps for d in depths]
    return [first, second]


def prefill_stages(smoke: bool) -> list[list[dict]]:
    """Rows per program x keys per iteration, then warps x pipelining stages."""
    from kernels.triton.attention import AttentionTiles

    block_ms, tile_ns = ([16, 32], [16]) if smoke else ([64, 128], [32, 64, 128])
    first = [{"path": "single", "tiles": AttentionTiles(block_m=m, tile_n=t)} for m in block_ms for t in tile_ns]
    warps, depths = ([4], [2]) if smoke else ([4, 8], [2, 3, 4])
    second = [{"tiles": AttentionTiles(num_warps=w, num_stages=d)} for w in warps for d in depths]
    return [first, second]


def run_guarded(label: str, fn: Callable[[], None], device: torch.device) -> None:
    """Run one grid entry or sweep; a failure (out of memory, say) prints and the run goes on.

    Raises:
        CudaContextLost: from a sweep; the context is gone, nothing else can run here.
    """
    try:
        fn()
    except CudaContextLost:
        raise
    except Exception as exc:  # noqa: BLE001
        print(f"{label} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
              flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. imported below
    else:
        sys.exit("no CUDA device: run with --smoke for the CPU interpreter")
    import triton

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(
        f"# {where}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, "
        f"{args.num_heads} q heads / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, "
        f"block size {args.block_size}", flush=True,
    )
    elem = DTYPES[args.dtype].itemsize

    def too_big(batch: int, tokens: int) -> float | None:
        gib = 4 * batch * tokens * args.num_kv_heads * args.head_dim * elem / 2**30  # contiguous + paged K, V
        return gib if gib > args.max_gib else None

    for batch in args.decode_batch if args.resume_sweep is None else []:
        for ctx in args.decode_context:
            label = f"decode  B={batch:4d} ctx={ctx:6d}"
            if gib := too_big(batch, ctx):
                print(f"{label} | skipped: {gib:.0f} GiB > --max-gib")
                continue
            run_guarded(label, lambda b=batch, c=ctx: print(
                bench_case(decode_case(args, device, b, c), args.iters, device), flush=True), device)
    for batch in args.prefill_batch if args.resume_sweep is None else []:
        for length in args.prefill_len:
            run_guarded(f"prefill B={batch:4d} len={length:6d}", lambda b=batch, n=length: print(
                bench_case(prefill_case(args, device, b, n), args.iters, device), flush=True), device)
    if not args.sweep:
        return
    excluded = [item.split(":", 1) for item in args.exclude]  # [shape index, candidate]

    def exclude(index: int) -> frozenset[str]:
        return frozenset(candidate for shape, candidate in excluded if int(shape) == index)

    shapes = [(f"sweep decode B={batch} ctx={ctx}", lambda i, b=batch, c=ctx: sweep(
        decode_case(args, device, b, c), decode_stages(c, args.smoke), args.iters, device, exclude(i)))
        for batch, ctx in args.sweep_decode]
    shapes += [(f"sweep prefill B={batch} len={length}", lambda i, b=batch, n=length: sweep(
        prefill_case(args, device, b, n), prefill_stages(args.smoke), args.iters, device, exclude(i)))
        for batch, length in args.sweep_prefill]
    for index, (label, fn) in enumerate(shapes):
        if index < (args.resume_sweep or 0):
            continue
        try:
            run_guarded(label, lambda f=fn, i=index: f(i), device)
        except CudaContextLost as lost:
            if lost.candidate in exclude(index):  # cannot happen (it is skipped); never loop on it
                sys.exit(f"{label} | the CUDA context is lost again after {lost.candidate}; stopping")
            print(f"{label} | the CUDA context is lost after {lost.candidate}; the sweep goes on in a new "
                  "process without it", flush=True)
            os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv,
                                      "--resume-sweep", str(index), "--exclude", f"{index}:{lost.candidate}"])


if __name__ == "__main__":
    main()
