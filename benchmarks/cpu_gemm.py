"""The native bf16-weight GEMM (``kernels/cpu/csrc/cpu_gemm_bf16.c``) against torch's matmuls, same run.

    .venv/bin/python benchmarks/cpu_gemm.py [--rows 1,16,64,256] [--repeats 10]

For SmolLM2-135M's matmul shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
lm_head 49152x576) and each row count, prints the time, GFLOP/s and (one row) the weight
bytes streamed per second of ``gemm_bf16w`` on bf16 weights, of torch's ``F.linear`` on the
same bf16 values (oneDNN: native on CPUs with AVX512-BF16 / AMX, emulated elsewhere) and on
float32 copies. Threads: torch's default (``--threads`` to change).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.cpu import ops  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def seconds(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-torch-bf16", action="store_true", help="leave out torch's (possibly emulated) bf16")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if ops.load() is None:
        sys.exit("the native CPU kernels did not build (see the log)")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"native bf16 matmul: {ops.native_bf16_matmul()}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen).bfloat16()
        packed, w32 = ops.pack_bf16_weight(w), w.float()
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, generator=gen).bfloat16()
            x32 = x.float()
            flop = 2 * m * n * k
            reps = max(1, args.repeats // (4 if flop > 2e9 else 1))
            runs = {"ours (bf16 weights)": partial(ops.gemm_bf16w, x, packed, n, validate=False),
                    "torch fp32": partial(F.linear, x32, w32)}
            if not args.skip_torch_bf16:
                runs["torch bf16"] = partial(F.linear, x, w)
            cells = []
            for label, fn in runs.items():
                s = seconds(fn, reps)
                extra = f", {n * k * 2 / s / 1e9:.1f} GB/s bf16" if m == 1 and label.startswith("ours") else ""
                cells.append(f"{label} {s * 1e3:8.3f} ms {flop / s / 1e9:6.1f} GFLOP/s{extra}")
            print(f"{name:>8} {n}x{k} M={m:<4} " + " | ".join(cells))


if __name__ == "__main__":
    main()
