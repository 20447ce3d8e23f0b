"""A bounded soak of ``pagedllm serve``: minutes of mixed traffic with random client aborts,
then checks that memory stayed flat and every KV block is free.

    .venv/bin/python benchmarks/soak.py [--minutes 3] [--concurrency 16] [--seed 0]

Traffic (seeded): completions and chat, streamed and not, 8 to 96 output tokens, some with
n=2, logprobs or stop strings; one stream in four is closed by its client after a few chunks
(an abort). The RSS of every process of the server is sampled after a warm-up minute's
first requests and at the end; the script prints both per process and fails (exit status 1)
if the total grew more than ``--max-growth`` (default 10 %), if any request got a 5xx, or if
requests are still running or blocks in use 60 s after the traffic stops.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.nats_server import free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["rivers", "robots", "bread", "snow", "music", "clocks", "ships", "gardens", "stars", "bridges"]


def request_body(rng: random.Random) -> tuple[str, dict]:
    """A random request: (path, JSON body)."""
    topic = rng.choice(TOPICS)
    body: dict = {"model": MODEL, "max_tokens": rng.randint(8, 96), "temperature": rng.choice([0, 0.8]),
                  "stream": rng.random() < 0.6}
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.2:
        body["logprobs"] = 2 if rng.random() < 0.5 else True
    if rng.random() < 0.2:
        body["stop"] = ["\n\n"]
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"Write a few lines about {topic}."}]
        if body.get("logprobs") is not None:
            body["top_logprobs"], body["logprobs"] = 2, True
        return "/v1/chat/completions", body
    body["prompt"] = f"A short story about {topic}:" * rng.randint(1, 8)
    if body.get("logprobs") is True:
        body["logprobs"] = 1
    return "/v1/completions", body


async def one(client: httpx.AsyncClient, port: int, rng: random.Random, counts: dict[str, int]) -> None:
    path, body = request_body(rng)
    abort_after = rng.randint(1, 6) if body["stream"] and rng.random() < 0.25 else None
    url = f"http://127.0.0.1:{port}{path}"
    if not body["stream"]:
        r = await client.post(url, json=body)
        counts[f"{r.status_code // 100}xx"] += 1
        return
    async with client.stream("POST", url, json=body) as r:
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    counts["aborted"] += 1
                    return  # closing the connection aborts the request
        counts[f"{r.status_code // 100}xx"] += 1


def rss(root: psutil.Process) -> dict[str, int]:
    """RSS in bytes of every process of the server, by a short name."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = p.cmdline()
            name = "nats-server" if "nats-server" in cmd[0] else (cmd[-1] if "service" in cmd else "serve")
            out[f"{name}:{p.pid}"] = p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def soak(port: int, seconds: float, concurrency: int, seed: int,
               root: psutil.Process) -> tuple[dict[str, int], float, float, float]:
    """Run the traffic, wait for the engine to go idle; returns (counts, RSS growth, requests
    left, KV cache usage left)."""
    rng = random.Random(seed)
    counts: dict[str, int] = {"2xx": 0, "4xx": 0, "5xx": 0, "aborted": 0}
    deadline = time.monotonic() + seconds
    warm_at = time.monotonic() + min(60.0, seconds / 3)
    warm: dict[str, int] | None = None
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        async def worker(k: int) -> None:
            worker_rng = random.Random(rng.random() + k)
            while time.monotonic() < deadline:
                try:
                    await one(client, port, worker_rng, counts)
                except httpx.HTTPError as exc:
                    counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1

        tasks = [asyncio.create_task(worker(k)) for k in range(concurrency)]
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if warm is None and time.monotonic() >= warm_at:
                warm = rss(root)
        await asyncio.gather(*tasks)
        idle_by = time.monotonic() + 60
        while True:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            running = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")
            usage = metric(text, "vllm:kv_cache_usage_perc")
            if (running == 0 and usage == 0) or time.monotonic() > idle_by:
                break
            await asyncio.sleep(0.5)
    end = rss(root)
    warm = warm or end
    print(f"requests: {counts}")
    print(f"{'process':<24}{'RSS after warm-up MiB':>24}{'RSS at end MiB':>18}")
    for name in sorted(end):
        print(f"{name:<24}{warm.get(name, 0) / 2**20:>24.1f}{end[name] / 2**20:>18.1f}")
    total_warm, total_end = sum(warm.values()), sum(end.values())
    growth = total_end / total_warm - 1
    print(f"{'total':<24}{total_warm / 2**20:>24.1f}{total_end / 2**20:>18.1f}   growth {growth * 100:+.1f} %")
    print(f"after the traffic: running+waiting {running:.0f}, KV cache usage {usage:.3f}")
    return counts, growth, running, usage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-growth", type=float, default=0.10)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port), "--dtype",
                             args.dtype, "--log-level", "ERROR"], stdout=subprocess.PIPE, text=True)
    try:
        while "serving" not in (line := proc.stdout.readline()):
            if proc.poll() is not None:
                raise SystemExit("serve did not start")
        print(line.strip())
        counts, growth, running, usage = asyncio.run(
            soak(port, args.minutes * 60, args.concurrency, args.seed, psutil.Process(proc.pid)))
    finally:
        proc.terminate()
        proc.wait(60)
    failures = []
    if counts["5xx"]:
        failures.append(f"{counts['5xx']} requests got a 5xx")
    if growth > args.max_growth:
        failures.append(f"memory grew {growth * 100:.1f} % (limit {args.max_growth * 100:.0f} %)")
    if running or usage:
        failures.append("requests or blocks left after the traffic")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
