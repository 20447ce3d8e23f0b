"""The K-quants' 16-row interleaved int8 kernel (``cpu_gguf_r16k.c``) against the file layout's
float32 path that served them (``cpu_gguf_gemm.c``), bf16 activations and output.

    .venv/bin/python benchmarks/gguf_r16k.py [--types q4_k,q5_k,q6_k] [--rows 1,16] [--threads 1] [--runs 5]

SmolLM2-135M-like shapes N x K: down 576x1536 and up 1536x768 (its 1536x576 has K = 576, not a
multiple of the K-quants' 256: the nearest above). Random valid super-blocks
(``tests/gguf_fixtures.py``). Each cell is timed ``--runs`` times (``gguf_gemm.ms``: the fastest
of repeated calls over ~0.3 s); prints the best and the median of the runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from gguf_fixtures import random_blocks  # noqa: E402
from gguf_gemm import ms  # noqa: E402

from kernels.cpu import native, quant_ops  # noqa: E402
from services.executor.layers.quantization import gguf as G  # noqa: E402
from services.executor.layers.quantization.gguf import r16 as gguf_r16  # noqa: E402

SHAPES = {"down": (576, 1536), "up": (1536, 768)}
TYPES = {"q4_k": G.Q4_K, "q5_k": G.Q5_K, "q6_k": G.Q6_K}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--rows", default="1,16")
    p.add_argument("--threads", default="1")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    lib = native.load()
    if lib is None:
        sys.exit("the native CPU kernels did not build (see the log)")
    for tname in args.types.split(","):
        fmt = TYPES[tname]
        for sname, (n, k) in SHAPES.items():
            blocks = random_blocks(fmt, n, k, seed=0, scale=0.05)
            packed = gguf_r16.pack(blocks, fmt)
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k).bfloat16()
                for threads in [int(t) for t in args.threads.split(",")]:
                    torch.set_num_threads(threads)
                    cells = []
                    for label, w, r16 in (("file f32", blocks, False), ("r16 int8", packed, True)):
                        call = partial(quant_ops.gemm_gguf, x, w, fmt, k, torch.bfloat16, lib=lib, validate=False,
                                       r16=r16)
                        runs = [ms(call) for _ in range(args.runs)]
                        cells.append((label, min(runs), statistics.median(runs)))
                    ratio = cells[0][1] / cells[1][1]
                    text = " | ".join(f"{label} best {b:7.3f} median {med:7.3f} ms" for label, b, med in cells)
                    print(f"{tname} {sname:>4} {n}x{k} M={m:<2} {threads}t  {text} | {ratio:4.1f}x", flush=True)


if __name__ == "__main__":
    main()
