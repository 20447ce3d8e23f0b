"""Before / after in one run: ``throughput.py --skip-hf`` and ``serve_latency.py`` on two
checkouts, alternated, so that both sides see the same machine state.

    .venv/bin/python benchmarks/ab.py --baseline ../baseline [--rounds 3] [--throughput-args "..."]
        [--latency-args "..."]

``--baseline`` is another checkout of this repository (``git worktree add ../baseline REV``);
this checkout is "after". Each round runs, in order, baseline then after (odd rounds) or
after then baseline (even rounds), so that a drift of the machine does not favour one side.
Each script runs in its own checkout with ``PYTHONPATH`` set to it, on this interpreter. At
the end it prints every round's figures and their medians per side: generated tokens/s of
``LLM.generate``, and each concurrency level's TTFT p50 and TPOT p50 through ``pagedllm serve``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THROUGHPUT = re.compile(r"pagedllm\s+LLM\.generate: .* = ([0-9.]+) generated tokens/s")
LATENCY = re.compile(r"concurrency\s+(\d+): TTFT p50\s+([0-9.]+) ms.*?TPOT p50\s+([0-9.]+) ms")


def run(checkout: Path, script: str, extra: str) -> str:
    """One benchmark script's output, run in ``checkout`` on its own code."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(checkout / "benchmarks" / script), *shlex.split(extra)]
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {checkout} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def figures(throughput_out: str, latency_out: str) -> dict[str, float]:
    """The figures one side's two scripts printed, by name."""
    out: dict[str, float] = {}
    if m := THROUGHPUT.search(throughput_out):
        out["throughput tok/s"] = float(m.group(1))
    for level, ttft, tpot in LATENCY.findall(latency_out):
        out[f"c={level} TTFT p50 ms"] = float(ttft)
        out[f"c={level} TPOT p50 ms"] = float(tpot)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--throughput-args", default="--skip-hf")
    parser.add_argument("--latency-args", default="--concurrency 1,8 --output-len 64")
    args = parser.parse_args()
    sides = {"baseline": args.baseline.resolve(), "after": ROOT}
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in range(args.rounds):
        order = ["baseline", "after"] if r % 2 == 0 else ["after", "baseline"]
        for side in order:
            checkout = sides[side]
            got = figures(run(checkout, "throughput.py", args.throughput_args),
                          run(checkout, "serve_latency.py", args.latency_args))
            results[side].append(got)
            print(f"round {r + 1} {side:8s}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    print(f"\nmedians over {args.rounds} rounds (baseline {sides['baseline']}, after {ROOT}):")
    for name in results["baseline"][0]:
        base = statistics.median(f[name] for f in results["baseline"])
        after = statistics.median(f[name] for f in results["after"])
        print(f"  {name:22s} baseline {base:8.1f}  after {after:8.1f}  ({(after / base - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
