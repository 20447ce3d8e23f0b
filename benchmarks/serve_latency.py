"""Streaming latency through the HTTP server: TTFT, TPOT and ITL of concurrent streams.

    .venv/bin/python benchmarks/serve_latency.py [--concurrency 1,8] [--output-len 128] [--url URL]

Starts ``pagedllm serve`` (every service its own process, embedded nats-server) unless
``--url`` names a running server, then for each concurrency level streams that many
``/v1/completions`` requests at once (greedy, ``ignore_eos``, ``stream_options.include_usage``)
and prints, over all streams: TTFT (request sent -> first token), TPOT ((last token - first
token) / (tokens - 1)) and the inter-token latency (ITL, gaps between SSE chunks) p50 / p99,
plus decode tokens/s per stream (1 / TPOT). vLLM's ``benchmark_serving`` uses the same
definitions. Needs ``httpx`` (test extras).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.nats_server import free_port  # noqa: E402

PROMPT = "Tell me about the history of Paris, from its founding to the present day."


async def stream_one(client: httpx.AsyncClient, model: str, output_len: int) -> tuple[float, list[float], int]:
    """One streamed completion: (TTFT s, token arrival times, completion tokens)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    return arrivals[0] - t0, arrivals, tokens


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(url: str, levels: list[int], output_len: int, repeats: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(1200):  # wait for the engine
            try:
                if (await client.get("/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await stream_one(client, model, 8)  # warm-up
        for level in levels:
            ttfts, tpots, itls = [], [], []
            for _ in range(repeats):
                results = await asyncio.gather(*[stream_one(client, model, output_len) for _ in range(level)])
                for ttft, arrivals, tokens in results:
                    ttfts.append(ttft)
                    tpots.append((arrivals[-1] - arrivals[0]) / max(tokens - 1, 1))
                    itls.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
            tpot = statistics.median(tpots)
            print(f"concurrency {level:3d}: TTFT p50 {pct(ttfts, 0.5) * 1e3:7.1f} ms  p99 {pct(ttfts, 0.99) * 1e3:7.1f} ms"
                  f" | TPOT p50 {tpot * 1e3:6.2f} ms = {1 / tpot:5.1f} tok/s per stream"
                  f" | ITL p50 {pct(itls, 0.5) * 1e3:6.2f} ms  p99 {pct(itls, 0.99) * 1e3:6.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server; default: start `pagedllm serve`")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port),
                                 "--dtype", args.dtype, "--log-level", "WARNING"])
    print(f"# {url}, {args.output_len} tokens per stream, greedy, {args.repeats} rounds per level")
    try:
        asyncio.run(run(url, [int(x) for x in args.concurrency.split(",")], args.output_len, args.repeats))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
