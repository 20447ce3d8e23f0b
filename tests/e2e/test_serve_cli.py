"""`pagedllm serve` as a user runs it: embedded nats-server, every service as a process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from processes import left_running
from processes import start_serve as serve

from shared.nats_server import free_port


def start_serve(smollm2_path) -> tuple[subprocess.Popen, int, str]:
    """``pagedllm serve`` of the default model in float32 (``processes.start_serve``)."""
    return serve(smollm2_path.parent, "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20),
                 "--log-level", "WARNING")


def test_serve_answers_and_shuts_down_cleanly(smollm2_path):
    proc, port, line = start_serve(smollm2_path)
    try:
        assert f"http://127.0.0.1:{port}/v1" in line
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for service in ("scheduler", "tokenizer", "detokenizer", "executor", "gateway", "nats-server"):
            assert service in names
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
                  "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].strip().startswith("Paris")
        # a request in flight when serve is stopped still completes: the gateway drains first
        in_flight: dict = {}
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count: one, two,", "max_tokens": 48,
                "temperature": 0, "ignore_eos": True}
        sender = threading.Thread(target=lambda: in_flight.update(r=httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)))
        sender.start()
        time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # a second signal during the cleanup (make forwards one)
        assert proc.wait(30) == 0
    sender.join(30)
    assert in_flight["r"].status_code == 200, in_flight["r"].text
    assert in_flight["r"].json()["usage"]["completion_tokens"] == 48
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
    # nats-server outlives the services (its own session): none of them lost its connection
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr and "nats: encountered error" not in stderr, stderr[-3000:]


def test_boolean_flags_take_true_or_false_only():
    from pagedllm.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--enable-prefix-caching", "false", "--async-scheduling", "ON", "m"])
    assert (args.enable_prefix_caching, args.async_scheduling, args.model) == (False, True, "m")
    assert parser.parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True
    for bad in (["serve", "--enable-prefix-caching", "maybe"], ["serve", "--enable-prefix-caching", "/models/x"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(bad)
        assert exc.value.code == 2  # argparse's usage error, naming the flag


def test_serve_killed_with_sigkill_leaves_no_orphans(smollm2_path):
    """Every child of serve (services, embedded nats-server) dies with it, even on SIGKILL."""
    proc, _, _ = start_serve(smollm2_path)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 6  # five services and nats-server
    finally:
        proc.kill()
        proc.wait(10)
    alive = left_running(children)
    assert not alive, alive


def test_an_embedded_nats_server_dies_with_its_owner():
    """The embedded nats-server of a process (an offline LLM's, a test session's) that is
    killed with SIGKILL goes too, instead of running on as an orphan."""
    code = ("import sys, time; from shared.nats_server import EmbeddedNats; "
            "s = EmbeddedNats().start(); print(s._proc.pid, flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    server = psutil.Process(int(owner.stdout.readline()))
    assert server.is_running() and "nats-server" in server.name()
    owner.kill()
    owner.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if server.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        server.kill()
        raise AssertionError("the nats-server outlived its owner")


def test_serve_prefills_in_small_chunks_on_a_cpu_unless_told():
    from pagedllm.cli import CPU_SERVE_MAX_NUM_BATCHED_TOKENS, serving_defaults
    from shared.config import Settings

    assert serving_defaults(Settings(device="cpu")).max_num_batched_tokens == CPU_SERVE_MAX_NUM_BATCHED_TOKENS == 512
    assert serving_defaults(Settings(device="cpu", max_num_batched_tokens=4096)).max_num_batched_tokens == 4096
    assert serving_defaults(Settings(device="cuda")).max_num_batched_tokens == Settings().max_num_batched_tokens


@pytest.mark.parametrize("after_first_error_s", [None, 0.0, 1.5])
def test_a_service_still_connecting_to_nats_stops_on_sigterm(smollm2_path, after_first_error_s):
    """`pagedllm service` waiting for a NATS server that is not up ends on SIGTERM (docker
    stop), instead of running on until the server appears: sent 4 s after it began (imports
    done, retrying), or some seconds after its first failed attempt was logged. 1.5 s after it
    is the turn of its fourth attempt (one per 0.5 s): a SIGTERM there was lost about one time
    in five (nats.py's connect retried for ever, see ``Bus.connect``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    env["PAGEDLLM_CACHE_DIR"] = str(smollm2_path.parent)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "service", "scheduler", "--nats-url",
         f"nats://127.0.0.1:{free_port()}", "--log-level", "WARNING"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen: list[str] = []
    try:
        if after_first_error_s is None:
            time.sleep(4)
        else:
            while not seen or "nats_connection_error" not in seen[-1]:
                seen.append(proc.stderr.readline())
                assert seen[-1], "exited before its first connection attempt"
            time.sleep(after_first_error_s)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # several attempts failed (one per 0.5 s); the first is one short line, the rest are quiet
    stderr = "".join(seen) + proc.stderr.read()
    assert "Traceback" not in stderr and "nats: encountered error" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "nats_connection_error" in line]
    assert len(lines) == 1 and "errors=1" in lines[0] and "level='warning'" in lines[0], stderr[-3000:]


class _RecordingLog:
    """Stands in for a module's structlog logger: records ``(event, level, fields)``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.events.append((event, level, fields))


async def test_a_nats_outage_is_logged_as_one_line_per_event(monkeypatch):
    """A lost NATS server: one disconnected line, one line for the first connection error (not
    one traceback per reconnect attempt), one reconnected line with the number of errors."""
    from shared import bus as bus_module
    from shared.bus import Bus
    from shared.nats_server import EmbeddedNats

    log = _RecordingLog()  # structlog's capture_logs misses loggers cached by earlier tests
    monkeypatch.setattr(bus_module, "log", log)
    server = EmbeddedNats().start()
    bus = await Bus.connect(server.url, name="outage-test")
    try:
        server.stop()
        await asyncio.sleep(2)  # about four reconnect attempts
        server = EmbeddedNats(port=server.port, token=server.token).start()
        deadline = time.monotonic() + 20
        while not any(e[0] == "nats_reconnected" for e in log.events):  # logged by a callback task
            assert time.monotonic() < deadline, log.events
            await asyncio.sleep(0.05)
        events = sorted((event, level) for event, level, _ in log.events)
        assert events == [("nats_connection_error", "warning"), ("nats_disconnected", "warning"),
                          ("nats_reconnected", "info")], log.events
        error = next(fields for event, _, fields in log.events if event == "nats_connection_error")
        assert error["errors"] == 1 and "exc_info" not in error
        assert log.events[-1][0] == "nats_reconnected" and log.events[-1][2]["errors"] >= 3, log.events
    finally:
        log.events.clear()
        await bus.close()
        for _ in range(100):  # the callback runs in its own task
            if log.events:
                break
            await asyncio.sleep(0.02)
        assert [(event, level) for event, level, _ in log.events] == [("nats_closed", "debug")]  # not a warning
        server.stop()


def test_a_detokenizer_shard_outside_the_shard_count_is_refused(monkeypatch):
    """detokenizer_shard must be below num_detokenizer_shards (flags, keyword or environment):
    shard 5 of 2 would never receive a request."""
    from pydantic import ValidationError

    from shared.config import Settings

    assert Settings(detokenizer_shard=1, num_detokenizer_shards=2).detokenizer_shard == 1
    with pytest.raises(ValidationError, match="detokenizer_shard=5 must be less than num_detokenizer_shards=2"):
        Settings(detokenizer_shard=5, num_detokenizer_shards=2)
    with pytest.raises(ValidationError, match="detokenizer_shard=1 must be less than num_detokenizer_shards=1"):
        Settings(detokenizer_shard=1)
    monkeypatch.setenv("PAGEDLLM_DETOKENIZER_SHARD", "2")
    monkeypatch.setenv("PAGEDLLM_NUM_DETOKENIZER_SHARDS", "2")
    with pytest.raises(ValidationError, match="detokenizer_shard=2 must be less than num_detokenizer_shards=2"):
        Settings()


def test_log_level_is_one_of_five_names_in_any_case():
    from pydantic import ValidationError

    from shared.config import Settings

    assert Settings(log_level="warning").log_level == "WARNING"
    assert Settings().log_level == "INFO"
    with pytest.raises(ValidationError, match="log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        Settings(log_level="foo")


@pytest.mark.parametrize("argv,message", [
    (["service", "executor", "--model", "/no/such/model"],
     "pagedllm service executor: model='/no/such/model' is not a local Hugging Face directory"),
    (["service", "tokenizer", "--max-model-len", "9000"],
     "pagedllm service tokenizer: max_model_len=9000 exceeds the model's max_position_embeddings=8192"),
    (["service", "scheduler", "--log-level", "foo"],
     "pagedllm service scheduler: invalid settings: log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    (["service", "detokenizer", "--detokenizer-shard", "5", "--num-detokenizer-shards", "2"],
     "pagedllm service detokenizer: invalid settings: detokenizer_shard=5 must be less than num_detokenizer_shards=2"),
    (["prepare-model", "/no/such/model"],
     "pagedllm prepare-model: model='/no/such/model' is not a local Hugging Face directory"),
])
def test_a_service_that_cannot_start_says_why_in_one_line(smollm2_path, argv, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    env.update(PAGEDLLM_CACHE_DIR=str(smollm2_path.parent), PAGEDLLM_NATS_URL=f"nats://127.0.0.1:{free_port()}")
    proc = subprocess.run([sys.executable, "-m", "pagedllm.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(message), proc.stderr


def test_a_gateway_whose_port_is_taken_says_so_in_one_line(nats_url, smollm2_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    env["PAGEDLLM_CACHE_DIR"] = str(smollm2_path.parent)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "pagedllm.cli", "service", "gateway", "--nats-url", nats_url, "--port", str(port),
             "--log-level", "WARNING"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"pagedllm service gateway: gateway cannot listen on 127.0.0.1:{port} (address in use?)"), proc.stderr


def test_serve_and_llm_start_one_detokenizer_per_shard(monkeypatch):
    """With two shards, serve (child processes) and LLM (in-process services) start shards 0
    and 1: readiness waits for every shard, so one detokenizer would never be ready."""
    from pagedllm import launcher, supervisor
    from shared.config import Settings

    settings = Settings(num_detokenizer_shards=2, nats_url="nats://127.0.0.1:1")
    started: list[tuple[str, str]] = []

    class Popen:
        stderr = None

        def __init__(self, argv, env, **_):
            started.append((argv[-1], env.get("PAGEDLLM_DETOKENIZER_SHARD", "")))

    monkeypatch.setattr(supervisor.subprocess, "Popen", Popen)
    procs = supervisor.ServiceProcesses(settings, names=("scheduler", "detokenizer"))
    procs.start()
    assert started == [("scheduler", "0"), ("detokenizer", "0"), ("detokenizer", "1")]
    assert list(procs.procs) == ["scheduler", "detokenizer.0", "detokenizer.1"]

    class Fake:
        def __init__(self, settings):
            self.shard = settings.detokenizer_shard

        async def start(self):
            pass

        async def stop(self):
            pass

    monkeypatch.setattr(launcher, "build_service", lambda name, settings, info: Fake(settings))
    services = launcher.InProcessServices(settings, None, ("detokenizer",))
    services.start()
    try:
        assert [s.shard for s in services.services] == [0, 1]
    finally:
        services.stop()
    assert [name for name, _ in launcher.service_instances("detokenizer", Settings())] == ["detokenizer"]
