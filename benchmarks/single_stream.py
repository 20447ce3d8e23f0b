"""Single-stream decode speed through the engine: one request, greedy, ``ignore_eos``.

    .venv/bin/python benchmarks/single_stream.py [--output-len 128] [--dtype bfloat16]

Prints generated tokens/s of the decode phase (time to first token excluded) and the TTFT.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, ahead of benchmarks/


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate("warm-up", SamplingParams(max_tokens=4), use_tqdm=False)

    async def one() -> tuple[float, float, int]:
        rid = f"single-{time.monotonic_ns()}"
        t0 = time.perf_counter()
        await llm._client.submit(rid, prompt="Tell me about the history of Paris.", sampling_params=params)
        first, n = None, 0
        async for delta in llm._client.stream(rid):
            n += len(delta.token_ids)
            if first is None and delta.token_ids:
                first = time.perf_counter()
        return first - t0, time.perf_counter() - first, n

    for _ in range(args.repeats):
        ttft, decode_s, n = llm._services.run(one())
        print(f"TTFT {ttft * 1000:.1f} ms; decode {n - 1} tokens in {decode_s:.2f} s = "
              f"{(n - 1) / decode_s:.1f} tokens/s ({args.dtype})")
    llm.close()


if __name__ == "__main__":
    main()
