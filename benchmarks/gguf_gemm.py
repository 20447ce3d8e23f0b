"""The native GGUF-block GEMM (``kernels/cpu/csrc/cpu_gguf_gemm.c``) on SmolLM2-135M-like shapes.

    .venv/bin/python benchmarks/gguf_gemm.py [--types q4_0,q4_1,q8_0] [--rows 1,16] [--threads 1,2]

For each weight type, shape (N x K: down 576x1536, gate_up-like 1536x576, lm_head 49152x576),
row count M and thread count, prints the milliseconds per call of ``quant_ops.gemm_gguf`` with
bf16 activations on the file's row layout (``bf16``: int8 activations, ``cpu_gguf_q8.c``) and on
the 16-row interleaved layout the CPU serves from (``r16``: ``cpu_gguf_r16.c``), and with
float32 activations (``float32``: the float32 path), random weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType, quants  # noqa: E402

from kernels.cpu import native, quant_ops  # noqa: E402
from services.executor.layers.quantization import gguf as G  # noqa: E402
from services.executor.layers.quantization.gguf import r16 as gguf_r16  # noqa: E402

SHAPES = {"down": (576, 1536), "up": (1536, 576), "lm_head": (49152, 576)}
TYPES = {"q4_0": G.Q4_0, "q4_1": G.Q4_1, "q8_0": G.Q8_0}


def ms(fn, budget_s: float = 0.3) -> float:
    """The fastest of repeated calls' milliseconds, running about ``budget_s`` in all (the fastest:
    other processes on a shared machine only ever add time)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    times = []
    for _ in range(max(3, min(200, int(budget_s / once)))):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="q4_0,q4_1,q8_0")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--library", default=None, help="another build of the kernels (a .so) to time")
    args = p.parse_args()
    lib = native.bind(args.library) if args.library else native.load()
    if lib is None:
        sys.exit("the native CPU kernels did not build (see the log)")
    rng = np.random.default_rng(0)
    for tname in args.types.split(","):
        fmt = TYPES[tname]
        for sname in args.shapes.split(","):
            n, k = SHAPES[sname]
            blocks = torch.from_numpy(quants.quantize(rng.standard_normal((n, k)).astype(np.float32),
                                                      GGMLQuantizationType(fmt.ggml_type)))
            packed = gguf_r16.pack(blocks, fmt)
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k)
                cells = []
                for threads in [int(t) for t in args.threads.split(",")]:
                    torch.set_num_threads(threads)
                    for name, dtype, w, r16 in (("bf16", torch.bfloat16, blocks, False),
                                                ("r16", torch.bfloat16, packed, True),
                                                ("float32", torch.float32, blocks, False)):
                        t = ms(partial(quant_ops.gemm_gguf, x.to(dtype), w, fmt, k, dtype, lib=lib, validate=False,
                                       r16=r16))
                        cells.append(f"{threads}t {name:>7} {t:7.3f} ms")
                print(f"{tname} {sname:>7} {n}x{k} M={m:<3} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
