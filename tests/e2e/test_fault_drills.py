"""Fault drills on ``pagedllm serve`` as a user runs it (real processes, a real nats-server):
with 16 greedy streams in flight, ``kill -9`` one part of the server. After each:

- every stream completes with exactly the text of an undisturbed run (a client of the killed
  gateway itself gets a closed connection instead), none hangs;
- ``/health`` said what was degraded while it was, and says ok again once the part is back
  (serve restarted it);
- a new request succeeds, and no request or KV block is left behind (``/metrics``);
- the part died under running streams: it is killed as soon as every stream has its first
  text (its process found beforehand), whatever the machine's speed, and the streams that had
  not ended then got more text afterwards. The gateway sent again the requests that a dead
  scheduler or detokenizer lost (``pagedllm:request_resubmissions_total`` rose); running
  streams never touch the tokenizer, so its death had none sent again.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from processes import start_serve

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Story {i}: once upon a time, in a land of {thing}," for i, thing in enumerate(
    ["rivers", "mountains", "glass", "robots", "bread", "snow", "music", "clocks",
     "cats", "ships", "lanterns", "books", "storms", "gardens", "stars", "bridges"])]
MAX_TOKENS = 40
#: what /health names while the part is gone (the gateway's own death: no answer at all)
DEGRADED = {"executor": "executor", "tokenizer": "tokenizer", "detokenizer": "detokenizer.0",
            "scheduler": "scheduler", "nats-server": "NATS connection is down"}
#: the parts whose death loses the requests they hold, which the gateway's ``EngineClient`` then
#: sends again. Not the executor's (the scheduler requeues its group's requests), nor
#: nats-server's (every part reconnects and holds its requests still; one whose deltas were lost
#: in the outage may be sent again); the tokenizer's never (running streams do not touch it)
RESENT = {"scheduler", "detokenizer"}


@pytest.fixture(scope="module")
def server(smollm2_path):
    proc, port, _ = start_serve(smollm2_path.parent, "--dtype", "float32", "--kv-cache-memory-bytes",
                                str(64 << 20), "--log-level", "WARNING", "--heartbeat-timeout-s", "3")
    logs: list[str] = []
    # serve's stderr carries every service's log lines: read it, or a full pipe blocks them
    reader = threading.Thread(target=lambda: logs.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    yield port, logs, proc.pid
    proc.send_signal(signal.SIGCONT)  # a drill that died while serve was stopped
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except Exception:
        proc.kill()


class Progress:
    """A stream's text so far and whether it ended."""

    def __init__(self) -> None:
        self.text, self.done = "", False


async def stream(client: httpx.AsyncClient, port: int, prompt: str, first: asyncio.Event,
                 progress: Progress | None = None) -> str:
    """One streaming completion's text (SSE), setting ``first`` at its first text (and keeping
    ``progress``)."""
    progress = progress or Progress()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            progress.text = text
            if text:
                first.set()
    progress.done = True
    return text


async def run_streams(port: int, on_started=None) -> list[str | BaseException]:
    """The 16 streams at once; ``on_started(progress)`` runs once each has its first text."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(240.0)) as client:
        firsts = [asyncio.Event() for _ in PROMPTS]
        progress = [Progress() for _ in PROMPTS]
        tasks = [asyncio.create_task(stream(client, port, p, e, g))
                 for p, e, g in zip(PROMPTS, firsts, progress, strict=True)]
        if on_started is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
            await on_started(progress)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)


@pytest.fixture(scope="module")
def reference(server):
    port, _, _ = server
    texts = asyncio.run(run_streams(port))
    assert all(isinstance(t, str) and t for t in texts), texts
    return texts


def victim(port: int, name: str) -> psutil.Process:
    """The process of ``name`` (a service, or nats-server) under the serve listening on ``port``."""
    serve = next(p for p in psutil.process_iter(["cmdline"])
                 if p.info["cmdline"] and "serve" in p.info["cmdline"] and str(port) in p.info["cmdline"])
    for child in serve.children(recursive=True):
        cmd = child.cmdline()
        if (name == "nats-server" and "nats-server" in cmd[0]) or cmd[-2:] == ["service", name]:
            return child
    raise AssertionError(f"no {name} process under serve")


async def health(port: int) -> tuple[int | None, str]:
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.get(f"http://127.0.0.1:{port}/health")
        return r.status_code, r.text
    except httpx.HTTPError as exc:
        return None, repr(exc)


async def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        if result := await check():
            return result
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.25)


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def resubmissions(port: int) -> float:
    """The gateway's ``pagedllm:request_resubmissions_total``."""
    async with httpx.AsyncClient(timeout=5) as client:
        return metric((await client.get(f"http://127.0.0.1:{port}/metrics")).text,
                      "pagedllm:request_resubmissions_total")


async def idle(port: int) -> bool:
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return False
    return (metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
            and metric(text, "vllm:kv_cache_usage_perc") == 0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tokenizer", "detokenizer", "scheduler", "executor", "nats-server", "gateway"])
def test_a_killed_part_is_restarted_and_no_stream_is_lost(server, reference, name):
    port, logs, serve_pid = server
    seen: dict[str, object] = {}
    proc = victim(port, name)  # found before the streams start: the kill follows their first text at once

    async def kill_and_watch(progress: list[Progress]) -> None:
        seen["at_kill"] = [None if p.done else p.text for p in progress]  # None: that stream had ended
        if name == "gateway":
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            return
        # /health says what is missing while it is. serve restarts nats-server within half a
        # second, quicker than a poll may look: serve waits (SIGSTOP) until /health was seen.
        os.kill(serve_pid, signal.SIGSTOP)
        try:  # (the killed child stays a zombie until serve runs again to reap it)
            proc.send_signal(signal.SIGKILL)
            seen["degraded"] = await until(
                lambda: _degraded(port), 10, f"/health naming {name} as degraded")
        finally:
            os.kill(serve_pid, signal.SIGCONT)

    async def drill() -> list[str | BaseException]:
        seen["resubmitted_before"] = await resubmissions(port)
        texts = await run_streams(port, on_started=kill_and_watch)
        seen["healthy"] = await until(lambda: _healthy(port), 240, "/health ok again")
        async with httpx.AsyncClient(timeout=120) as client:
            seen["after"] = await stream(client, port, PROMPTS[0], asyncio.Event())
        seen["idle"] = await until(lambda: idle(port), 60, "no request running or waiting, every block free")
        seen["resubmitted"] = await resubmissions(port) - seen["resubmitted_before"]
        return texts

    texts = asyncio.run(drill())
    if name == "gateway":  # its own clients lose their connection: every one, and only that
        assert all(isinstance(t, httpx.HTTPError) for t in texts), texts
    else:
        assert texts == reference
        status, body = seen["degraded"]
        assert status == 503 and DEGRADED[name] in body, body
        # the part died under running streams, and those went on after its death
        running = [i for i, text in enumerate(seen["at_kill"]) if text is not None]
        assert running, "every stream had ended before the kill"
        assert all(len(texts[i]) > len(seen["at_kill"][i]) for i in running), (seen["at_kill"], texts)
        if name in RESENT:
            assert seen["resubmitted"] > 0, "the gateway sent none of the requests the part lost again"
        if name == "tokenizer":  # no running stream touches it: none was sent again
            assert seen["resubmitted"] == 0
    assert seen["after"] == reference[0]
    restarted = "nats_server_restarted" if name == "nats-server" else f"service='{name}'"
    assert any("service_restarting" in line or "nats_server_restarted" in line for line in logs
               if restarted in line), logs[-20:]


@pytest.mark.timeout(300)
def test_mixed_traffic_with_client_aborts_leaves_nothing_behind(server):
    """``benchmarks/soak.py``'s traffic for 20 s (the benchmark runs minutes and checks memory):
    no 5xx, client aborts among the requests, and then no request running or waiting and
    every block free."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from soak import soak

    port, _, pid = server
    counts, _, running, usage = asyncio.run(soak(port, 20, 16, seed=1, root=psutil.Process(pid)))
    assert counts["5xx"] == 0 and counts["2xx"] > 16 and counts["aborted"] > 0, counts
    assert running == 0 and usage == 0


async def _degraded(port: int):
    status, body = await health(port)
    return (status, body) if status == 503 or status is None else None


async def _healthy(port: int):
    status, body = await health(port)
    return (status, body) if status == 200 else None
