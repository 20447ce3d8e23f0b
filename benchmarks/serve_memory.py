"""Peak memory (RSS) of the ``pagedllm serve`` stack with the default model.

    .venv/bin/python benchmarks/serve_memory.py [--requests 16]

Starts ``pagedllm serve`` (embedded nats-server + every service as its own process), sends
concurrent chat requests, samples the RSS of the whole process tree every 100 ms, and
prints the peak total and each process's peak.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.nats_server import free_port  # noqa: E402


def chat(port: int, i: int) -> str:
    body = json.dumps({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": f"Write a short poem about the number {i}."}],
        "max_tokens": 64, "temperature": 0,
    }).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port),
                             "--dtype", args.dtype, "--log-level", "WARNING"])
    peaks: dict[str, int] = {}
    peak_total = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_total
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                total = 0
                for q in procs:
                    try:
                        rss = q.memory_info().rss
                        name = " ".join(q.cmdline()[-2:]) if "service" in q.cmdline() else q.name()
                    except psutil.Error:
                        continue
                    total += rss
                    peaks[name] = max(peaks.get(name, 0), rss)
                peak_total = max(peak_total, total)
            except psutil.Error:
                pass
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        time.sleep(1.0)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            texts = list(pool.map(lambda i: chat(port, i), range(args.requests)))
        print(f"{len(texts)} chat requests answered in {time.perf_counter() - t0:.1f} s")
    finally:
        stop.set()
        sampler.join()
        proc.terminate()
        proc.wait(30)
    mib = 1024 * 1024
    for name, rss in sorted(peaks.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} peak RSS {rss / mib:8.1f} MiB")
    print(f"pagedllm serve stack peak RSS (sum over processes): {peak_total / mib:.1f} MiB")


if __name__ == "__main__":
    main()
