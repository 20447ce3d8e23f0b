"""``pagedllm serve``'s services as supervised child processes: one that dies is started
again, with backoff, while the others keep running; a crash loop ends the server with a
message naming the service and its last log lines.

The policy is Erlang/OTP's one-for-one restart strategy with a restart intensity (at most
``max_restarts`` within ``window_s``), and systemd's ``RestartSec`` backoff doubling up to a
ceiling. Each child's stderr goes through a pipe: a reader thread copies every line to
serve's stderr and keeps the last ``TAIL_LINES`` for the crash-loop message.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from shared.config import Settings
from shared.logging import get_logger
from shared.nats_server import die_with_parent

log = get_logger(__name__)

TAIL_LINES = 20  # of a child's stderr, kept for the crash-loop message


class CrashLoopError(RuntimeError):
    """A service died ``max_restarts`` times within ``window_s``: the message names it, its
    exit status and its last log lines."""


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead service starts again.

    ``backoff_s`` is the wait before the first restart; it doubles with each death that comes
    less than ``stable_s`` seconds after the start before it, up to ``max_backoff_s``. More
    than ``max_restarts`` deaths within ``window_s`` seconds is a crash loop.
    """

    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 60.0


@dataclass
class Child:
    """One supervised service process and its history."""

    label: str  # "scheduler", "detokenizer.1", ...
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic()
    restart_at: float | None = None  # dead, to start again then
    backoff_s: float = 0.0
    deaths: collections.deque[float] = field(default_factory=collections.deque)  # monotonic times
    tail: collections.deque[str] = field(default_factory=collections.deque)  # its current run's last lines
    restarts: int = 0


def _pump(stream, tail: collections.deque[str]) -> None:
    """Copy a child's stderr to ours line by line, keeping the last lines."""
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip("\n"))
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):  # our stderr is gone: keep draining the child's
            pass
    stream.close()


class ServiceProcesses:
    """Each service in its own child process (``python -m pagedllm.cli service NAME``), one
    per detokenizer shard (``launcher.service_instances``), supervised: call ``supervise()``
    every fraction of a second.

    Args:
        settings: the pinned settings every child gets as ``PAGEDLLM_*`` variables.
        names: the services to run.
        policy: when a dead child starts again (see :class:`RestartPolicy`).
    """

    def __init__(self, settings: Settings, names: tuple[str, ...] | None = None,
                 policy: RestartPolicy | None = None) -> None:
        from pagedllm.launcher import SERVICE_NAMES

        self.settings = settings
        self.names = names or SERVICE_NAMES
        self.policy = policy or RestartPolicy()
        self.children: dict[str, Child] = {}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """The running (or last) process of each child, by label."""
        return {label: child.proc for label, child in self.children.items() if child.proc is not None}

    def start(self) -> None:
        from pagedllm.launcher import service_instances

        base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
        for name in self.names:
            for label, settings in service_instances(name, self.settings):
                child = Child(label, [sys.executable, "-m", "pagedllm.cli", "service", name],
                              {**base, **settings.to_env()})
                self.children[label] = child
                self._spawn(child)

    def _spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            child.argv, env=child.env, start_new_session=True, stderr=subprocess.PIPE, text=True,
            errors="replace", bufsize=1,
            # serve gone means its NATS server too: nothing is left to drain, so no graceful stop
            preexec_fn=functools.partial(die_with_parent, signal.SIGKILL),
        )
        child.started_at = time.monotonic()
        child.restart_at = None
        child.tail = collections.deque(maxlen=TAIL_LINES)  # this run's lines only
        if child.proc.stderr is not None:
            threading.Thread(target=_pump, args=(child.proc.stderr, child.tail), daemon=True,
                             name=f"log-{child.label}").start()

    def supervise(self, now: float | None = None) -> list[str]:
        """Note the children that died (each to start again after its backoff) and start those
        whose backoff is over. Returns the labels started again.

        Raises:
            CrashLoopError: a child died more than ``max_restarts`` times within ``window_s``.
        """
        now = time.monotonic() if now is None else now
        restarted = []
        for child in self.children.values():
            if child.restart_at is None and child.proc is not None and child.proc.poll() is not None:
                self._note_death(child, now)
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                log.warning("service_restarting", service=child.label, restart=child.restarts)
                self._spawn(child)
                restarted.append(child.label)
        return restarted

    def _note_death(self, child: Child, now: float) -> None:
        policy = self.policy
        status = child.proc.returncode if child.proc is not None else None
        child.deaths.append(now)
        while child.deaths and now - child.deaths[0] > policy.window_s:
            child.deaths.popleft()
        if len(child.deaths) > policy.max_restarts:
            last = "\n".join(f"  {line}" for line in child.tail) or "  (nothing)"
            raise CrashLoopError(
                f"service {child.label} died {len(child.deaths)} times within {policy.window_s:.0f} s "
                f"(last exit status {_describe(status)}); giving up. Its last log lines:\n{last}")
        quick = now - child.started_at < policy.stable_s
        child.backoff_s = min(policy.max_backoff_s, child.backoff_s * 2) if quick and child.backoff_s else policy.backoff_s
        child.restart_at = now + child.backoff_s
        log.error("service_died", service=child.label, status=_describe(status), restart_in_s=child.backoff_s)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the gateway first and wait while it drains (its requests in flight finish,
        the engine still behind it), then the other services; kill what outlives ``timeout``."""
        procs = self.procs
        first = [p for label, p in procs.items() if label == "gateway"]
        rest = [p for label, p in procs.items() if label != "gateway"]
        for group in (first, rest):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _describe(status: int | None) -> str:
    """An exit status as a person reads it: ``1``, ``killed by SIGKILL``."""
    if status is None:
        return "unknown"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return str(status)
