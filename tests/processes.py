"""Test helpers for the engine as real processes: ``pagedllm serve``, one service, stopping a
set of them, and checking that none is left running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from shared.nats_server import free_port


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
