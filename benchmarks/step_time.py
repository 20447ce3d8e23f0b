"""Executor step time: ``ModelRunner.execute`` on synthetic step plans (no scheduler, no NATS).

    .venv/bin/python benchmarks/step_time.py [--dtype bfloat16] [--batches 1,16,64] [--context 128]

Prints the median (and min / max) wall time of one step, which includes the runner's input
building, the model forward, the logits of the sampled rows and greedy sampling:

* decode at each batch size, every sequence at ``--context`` tokens of context (the decode
  steps run ``--steps`` times from there; the prompt prefill is not timed);
* one prefill of ``--prefill-seqs`` prompts of random lengths (``--prefill-min``..
  ``--prefill-max`` tokens; the defaults, 64 prompts of 23-66 tokens, ~2,900 tokens in all,
  match the token lengths of ``throughput.py``'s default prompts).

``--thread`` runs every step on one worker thread, as the executor service does.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, ahead of benchmarks/

import torch  # noqa: E402

from shared.messages import CachedRequests, NewRequestData, SamplingParams, StepPlan  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)


class Driver:
    """Plays the scheduler: hands out blocks from a counter and builds the plans."""

    def __init__(self, runner, call: Callable) -> None:
        self.runner = runner
        self.call = call  # runs runner.execute (here or on the worker thread)
        self.bs = runner.block_size
        self.free = list(range(runner.num_blocks))
        self.step_id = 0
        self.blocks: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}  # tokens known (computed + the last sampled)

    def _take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def _plan(self, **kw) -> StepPlan:
        self.step_id += 1
        return StepPlan(step_id=self.step_id, group_id="bench", **kw)

    def prefill(self, prompts: dict[str, list[int]]) -> float:
        """Schedule ``prompts`` whole in one step; returns its seconds."""
        new = []
        for rid, ids in prompts.items():
            self.blocks[rid] = self._take(-(-len(ids) // self.bs))
            self.num_tokens[rid] = len(ids)
            new.append(NewRequestData(request_id=rid, prompt_token_ids=ids, sampling_params=GREEDY,
                                      block_ids=self.blocks[rid], num_computed_tokens=0))
        plan = self._plan(new_requests=new, num_scheduled_tokens={r: len(p) for r, p in prompts.items()})
        return self._timed(plan)

    def decode(self, rids: list[str]) -> float:
        """One decode step of ``rids`` (new blocks appended as in the scheduler)."""
        cached = CachedRequests()
        for rid in rids:
            computed = self.num_tokens[rid]  # after this step; its K/V goes to slot computed - 1
            extra = []
            if len(self.blocks[rid]) * self.bs < computed:
                extra = self._take(1)
                self.blocks[rid] += extra
            cached.append(rid, extra, computed - 1)
        plan = self._plan(cached_requests=cached, num_scheduled_tokens={r: 1 for r in rids})
        return self._timed(plan)

    def _timed(self, plan: StepPlan) -> float:
        """Run ``plan``, count each sampled token; returns the step's seconds."""
        t0 = time.perf_counter()
        out = self.call(plan)
        elapsed = time.perf_counter() - t0
        for rid in out.sampled_token_ids:
            self.num_tokens[rid] += 1
        return elapsed

    def finish(self, rids: list[str]) -> None:
        for rid in rids:
            self.free += self.blocks.pop(rid)
            self.num_tokens.pop(rid)
        self.call(self._plan(finished_request_ids=list(rids)))


def summary(name: str, times: list[float], extra: str = "") -> str:
    ms = [t * 1000 for t in times]
    return (f"{name:<34} median {statistics.median(ms):8.2f} ms  (min {min(ms):.2f}, max {max(ms):.2f}, "
            f"n={len(ms)}){extra}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=128, help="tokens of context of every decode sequence")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--prefill-seqs", type=int, default=64)
    p.add_argument("--prefill-min", type=int, default=23)
    p.add_argument("--prefill-max", type=int, default=66)
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--thread", action="store_true", help="run the steps on one worker thread (as the service)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from services.executor.model_runner import ModelRunner
    from shared.config import Settings
    from shared.model_source import load_model_info

    pool = ThreadPoolExecutor(max_workers=1) if args.thread else None

    def on_worker(fn, *a):
        return pool.submit(fn, *a).result() if pool is not None else fn(*a)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
        on_worker(torch.set_num_threads, args.threads)
    settings = Settings(model=args.model, dtype=args.dtype, log_level="WARNING")
    runner = on_worker(ModelRunner, settings, load_model_info(settings))
    driver = Driver(runner, lambda plan: on_worker(runner.execute, plan))
    vocab = runner.model_info.vocab_size
    rng = random.Random(args.seed)
    print(f"# dtype={runner.dtype}, torch threads={on_worker(torch.get_num_threads)}, "
          f"worker thread={args.thread}, block_size={runner.block_size}, torch {torch.__version__}")

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    warm = {"warm": prompt(20)}
    driver.prefill(warm)
    for _ in range(3):
        driver.decode(["warm"])
    driver.finish(["warm"])

    for batch in [int(b) for b in args.batches.split(",") if b]:
        rids = [f"d{batch}-{i}" for i in range(batch)]
        driver.prefill({rid: prompt(args.context - 1) for rid in rids})  # + 1 sampled = context
        for _ in range(2):  # warm-up at this shape
            driver.decode(rids)
        times = [driver.decode(rids) for _ in range(args.steps)]
        print(summary(f"decode batch {batch} (context ~{args.context})", times,
                      f"  = {batch / statistics.median(times):.0f} tok/s"))
        driver.finish(rids)

    if args.prefill_seqs:
        times, total = [], 0
        for r in range(args.prefill_repeats + 1):
            lens = [rng.randint(args.prefill_min, args.prefill_max) for _ in range(args.prefill_seqs)]
            prompts = {f"p{r}-{i}": prompt(n) for i, n in enumerate(lens)}
            t = driver.prefill(prompts)
            if r:  # the first one warms up
                times.append(t)
                total = sum(lens)
            driver.finish(list(prompts))
        print(summary(f"prefill {args.prefill_seqs} prompts (~{total} tok)", times,
                      f"  = {total / statistics.median(times):.0f} tok/s"))


if __name__ == "__main__":
    main()
