"""Structured outputs' cost: 64 requests constrained by a JSON schema against the same 64
unconstrained, through ``LLM.generate`` in one run (goal: at most 10% slower).

    .venv/bin/python benchmarks/structured_outputs.py [--num-prompts 64] [--output-len 64]
        [--dtype auto] [--repeats 2]

Both runs are greedy with ``ignore_eos`` (every request makes exactly ``--output-len``
tokens); the schema (an object holding a long array of short strings) cannot complete in
that many tokens, so every step of every constrained request fills and applies a real mask.
The grammar is compiled in a warm-up first (its time printed apart). The runs alternate,
``--repeats`` times each; the best of each is printed, as generated tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, ahead of benchmarks/

from benchmarks.throughput import make_prompts  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 40}},
    "required": ["title", "items"], "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    prompts = [f"Write a JSON list about: {p}" for p in make_prompts(args.num_prompts, 4, 24, seed=0)]
    free = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    with LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1)) as llm:
        llm.generate(["warm-up prompt one", "warm-up prompt two"], SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(["warm-up"], SamplingParams(temperature=0, max_tokens=2, structured_outputs=constrained
                                                 .structured_outputs), use_tqdm=False)
        print(f"first constrained request (grammar compile included): {time.perf_counter() - t0:.2f} s")
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, params in (("unconstrained", free), ("json schema", constrained)):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                best[name] = max(best.get(name, 0.0), tokens / elapsed)
                print(f"{name:>14}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s")
    ratio = best["json schema"] / best["unconstrained"]
    print(f"best: unconstrained {best['unconstrained']:.1f} tok/s, json schema {best['json schema']:.1f} tok/s, "
          f"constrained/unconstrained = {ratio:.3f} ({(1 - ratio) * 100:.1f}% slower)")


if __name__ == "__main__":
    main()
