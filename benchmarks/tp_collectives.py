"""What tensor parallelism's collectives cost per step: their latency between real processes.

    .venv/bin/python benchmarks/tp_collectives.py [--tensor-parallel-size 2] [--model DIR] [--rows 1,64]

Starts N ranks on gloo (as the executor does on a CPU) and times, for the model's sizes, each
collective of one decode step of ``rows`` sequences: the all-reduce of a ``[rows, hidden]``
activation (two per decoder layer, after ``o_proj`` and ``down_proj``, and one after the
vocab-parallel embedding), rank 0's gather of the LM head's ``[rows, vocab / N]`` float32
logits, and rank 0's broadcast of the step message (one 4 KiB header). Prints each one's
median latency and their sum per step, to set against a step's time (``benchmarks/step_time.py``,
or TPOT from ``throughput.py --tensor-parallel-size N``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANK = """
import json, statistics, sys, time, torch
from services.executor.parallel.group import TensorParallelGroup
rank, world, port, hidden, vocab, dtype, rows_list, iters = json.loads(sys.argv[1])
dtype = getattr(torch, dtype)
torch.set_num_threads(1)
tp = TensorParallelGroup.connect(rank, world, "127.0.0.1", port, torch.device("cpu"), 120)
def timed(fn):
    for _ in range(5):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter(); fn(); out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3
res = {}
sizes = [vocab // world + (r < vocab % world) for r in range(world)]
for rows in rows_list:
    x = torch.randn(rows, hidden).to(dtype)
    logits = torch.randn(rows, sizes[rank])
    res[rows] = {
        "all_reduce": timed(lambda: tp.all_reduce(x)),
        "gather": timed(lambda: tp.gather_last_dim(logits, sizes)),
        "broadcast": timed(lambda: tp.broadcast_bytes(b"x" * 2000 if rank == 0 else None)),
    }
print(json.dumps(res))
"""


def main() -> None:
    from transformers import AutoConfig

    from shared.config import Settings
    from shared.model_source import load_model_info
    from shared.nats_server import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default="1,64")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    config = AutoConfig.from_pretrained(load_model_info(Settings(model=args.model)).path)
    hidden, vocab, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    rows = [int(r) for r in args.rows.split(",")]
    world, port = args.tensor_parallel_size, free_port()
    spec = lambda r: json.dumps([r, world, port, hidden, vocab, args.dtype, rows, args.iters])  # noqa: E731
    procs = [subprocess.Popen([sys.executable, "-c", RANK, spec(r)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [json.loads(proc.communicate(timeout=600)[0].splitlines()[-1]) for proc in procs]
    print(f"# {world} ranks on gloo, {args.dtype}, hidden {hidden}, vocab {vocab}, {layers} layers: "
          f"{2 * layers + 1} all-reduces, 1 gather and 1 broadcast per step (median of {args.iters}, rank 0)")
    for r in rows:
        lat = outs[0][str(r)]
        step = (2 * layers + 1) * lat["all_reduce"] + lat["gather"] + lat["broadcast"]
        print(f"rows {r:4d}: all_reduce [{r}, {hidden}] {lat['all_reduce']:.3f} ms, gather [{r}, {vocab // world}] "
              f"f32 {lat['gather']:.3f} ms, broadcast 2 KB {lat['broadcast']:.3f} ms -> {step:.1f} ms of "
              f"collectives per decode step")


if __name__ == "__main__":
    main()
