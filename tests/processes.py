"""Test helpers for the engine as real processes: ``pagedllm serve``, one service, stopping a
set of them, checking that none is left running, and the nats-server of docker-compose.yml
(deploy/nats.conf, one user per service)."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import string
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from shared.nats_server import find_nats_server, free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_NATS_CONF = ROOT / "deploy" / "nats.conf"


def clean_env(**settings: str) -> dict[str, str]:
    """This process's environment without its ``PAGEDLLM_*`` variables, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    env.update(settings)
    return env


def start_serve(cache_dir: Path, *args: str, timeout: float = 240) -> tuple[subprocess.Popen, int, str]:
    """``pagedllm serve --port <free> *args`` in its own session (``cache_dir`` holds the model),
    once it prints that it serves: (process, port, the line it printed). stdout and stderr
    are pipes (text)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--port", str(port), *args],
        env=clean_env(PAGEDLLM_CACHE_DIR=str(cache_dir)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    deadline, line = time.monotonic() + timeout, ""
    while "serving" not in line:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"serve did not start: {proc.stderr.read()[-3000:]}")
        line = proc.stdout.readline()
    return proc, port, line


def start_service(name: str, env: dict[str, str], stderr: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    """``pagedllm service NAME`` with ``env`` (stdout discarded; ``stderr`` a pipe on request)."""
    return subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "service", name], env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def stop_all(procs: Iterable[subprocess.Popen], timeout: float = 15) -> None:
    """SIGTERM every process still running, wait for each, kill what outlives ``timeout``."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def left_running(procs: Iterable[psutil.Process], timeout: float = 20) -> list[str]:
    """The command lines of ``procs`` still running after ``timeout`` (a dead orphan may stay a
    zombie until init reaps it: not running); those are killed."""
    def running(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    procs = list(procs)
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = []
    for p in alive:
        try:
            names.append(" ".join(p.cmdline()))
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return names


def compose_nats_passwords() -> dict[str, str]:
    """A new password for each variable that deploy/nats.conf reads (``<SERVICE>_NATS_PASSWORD``),
    each starting with a letter as the compose file's header asks."""
    names = re.findall(r"\$([A-Z_]+_NATS_PASSWORD)\b", COMPOSE_NATS_CONF.read_text())
    return {name: "p" + secrets.token_hex(16) for name in names}


def start_compose_nats(workdir: Path, passwords: dict[str, str], timeout: float = 10) -> tuple[subprocess.Popen, int]:
    """deploy/nats.conf's nats-server on 127.0.0.1 (a free port, monitoring on another, JetStream
    in ``workdir / "jetstream"``, its log in ``workdir / "nats-server.log"``) with ``passwords``
    in its environment, once it accepts connections: (process, port)."""
    port = free_port()
    text = COMPOSE_NATS_CONF.read_text()
    assert 'store_dir: "/data/jetstream"' in text  # the compose volume's: ours here
    conf = workdir / "nats.conf"
    conf.write_text(text.replace('store_dir: "/data/jetstream"', f"store_dir: {json.dumps(str(workdir / 'jetstream'))}"))
    with open(workdir / "nats-server.log", "w") as log:
        proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port), "-m", str(free_port())],
            env={**os.environ, **passwords}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"deploy/nats.conf's nats-server exited: {(workdir / 'nats-server.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("deploy/nats.conf's nats-server did not start") from None
            time.sleep(0.05)


def compose_nats_url(url: str, passwords: dict[str, str], port: int) -> str:
    """A service's ``PAGEDLLM_NATS_URL`` of docker-compose.yml (``nats://<user>:${VAR}@nats:4222``)
    for the server of :func:`start_compose_nats`: the password filled in, the host ours."""
    filled = string.Template(url).substitute(passwords)
    assert filled.endswith("@nats:4222"), url
    return filled.removesuffix("@nats:4222") + f"@127.0.0.1:{port}"
