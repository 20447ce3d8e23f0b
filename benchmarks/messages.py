"""Encode + decode time of the four per-step messages (``shared/bus.py``'s ``encode`` / ``decode``).

    .venv/bin/python benchmarks/messages.py [--requests 256] [--reps 300] [--baseline DIR]

Builds the messages of one decode step with ``--requests`` running requests, as the engine
sends them: a ``StepPlan`` of cached requests (one token each, a new block every 16th), its
``StepResult`` (one sampled token each), the ``DetokStep`` (one token update each) and the
``GatewayStep`` (one short text delta each); with ``--logprobs K`` every request also carries
K alternatives in the result, the detokenizer step and the gateway step. Prints the median
encode and decode time of each message, its size, and the total per step.

``--baseline DIR`` runs the same measurement on another checkout (its ``shared/`` package,
e.g. the commit before a change) in a subprocess first, so both figures come from one run.
The messages are built from keyword arguments only, so any version of ``shared.messages``
with these fields can be measured (a plan's running requests as ``CachedRequests`` columns, or
as one ``CachedRequestData`` each before them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(num: int, logprobs: int) -> list:
    """The four messages of one decode step of ``num`` requests."""
    import shared.messages as messages
    from shared.messages import (
        DecodedLogprobs,
        DetokStep,
        GatewayStep,
        RequestDelta,
        SampleLogprobs,
        StepPlan,
        StepResult,
        TokenLogprob,
        TokenUpdate,
    )

    ids = [f"chatcmpl-{i:032x}" for i in range(num)]
    new_blocks, computed = [[i] if i % 16 == 0 else [] for i in range(num)], [100 + i for i in range(num)]
    if hasattr(messages, "CachedRequests"):  # the running requests as columns
        cached = messages.CachedRequests(req_ids=ids, new_block_ids=new_blocks, num_computed_tokens=computed)
    else:  # before: one CachedRequestData per request
        cached = [messages.CachedRequestData(request_id=rid, new_block_ids=blocks, num_computed_tokens=c)
                  for rid, blocks, c in zip(ids, new_blocks, computed, strict=True)]
    plan = StepPlan(step_id=7, group_id="host-1234", cached_requests=cached, num_scheduled_tokens=dict.fromkeys(ids, 1))
    sample = [SampleLogprobs(logprob=-0.5, rank=1, top_token_ids=list(range(logprobs)),
                             top_logprobs=[-0.5 - k for k in range(logprobs)])] if logprobs else []
    result = StepResult(step_id=7, group_id="host-1234", sampled_token_ids={rid: 1000 + i for i, rid in enumerate(ids)},
                        logprobs={rid: sample[0] for rid in ids} if logprobs else {})
    detok = DetokStep(updates=[TokenUpdate(request_id=rid, new_token_ids=[1000 + i], logprobs=sample)
                               for i, rid in enumerate(ids)])

    def token(token_id: int) -> TokenLogprob:
        return TokenLogprob(token_id=token_id, token=" hello", bytes=b" hello", logprob=-0.5, rank=1)

    decoded = [DecodedLogprobs(sampled=token(1000), top=[token(k) for k in range(logprobs)])] if logprobs else []
    gateway = GatewayStep(outputs=[RequestDelta(request_id=rid, text=" hello", token_ids=[1000 + i],
                                                num_prompt_tokens=20, num_output_tokens=5, logprobs=decoded)
                                   for i, rid in enumerate(ids)])
    return [plan, result, detok, gateway]


def measure(num: int, logprobs: int, reps: int) -> None:
    """Print each message's median encode and decode time, its size and the total."""
    from shared.bus import decode, encode

    total = 0.0
    for message in build(num, logprobs):
        data = encode(message)
        assert decode(data, type(message)) == message
        enc, dec = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            encode(message)
            t1 = time.perf_counter()
            decode(data, type(message))
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
        e, d = statistics.median(enc) * 1e3, statistics.median(dec) * 1e3
        total += e + d
        print(f"  {type(message).__name__:12s} {len(data):7d} bytes  encode {e:6.3f} ms  decode {d:6.3f} ms")
    print(f"  per step: {total:.3f} ms encode + decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--logprobs", type=int, default=0, help="alternatives per token (0: no logprobs)")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure first, in a subprocess")
    args = parser.parse_args()
    if args.baseline is not None:
        print(f"baseline {args.baseline}:", flush=True)
        env = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
        subprocess.run([sys.executable, __file__, "--requests", str(args.requests), "--logprobs",
                        str(args.logprobs), "--reps", str(args.reps)], env=env, check=True)
        print(f"this checkout {ROOT}:")
    else:
        print(f"{os.environ.get('PYTHONPATH') or ROOT}: {args.requests} requests, logprobs {args.logprobs}")
    sys.path.insert(0, os.environ.get("PYTHONPATH") or str(ROOT))
    measure(args.requests, args.logprobs, args.reps)


if __name__ == "__main__":
    main()
