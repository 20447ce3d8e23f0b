"""Starting services: by name in this process (``pagedllm service NAME``, the offline
``LLM``); as supervised child processes (``pagedllm serve``) see ``pagedllm/supervisor.py``."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any

from shared.bus import Bus
from shared.config import Settings
from shared.logging import get_logger
from shared.model_source import ModelInfo, load_model_info

log = get_logger(__name__)

SERVICE_NAMES = ("scheduler", "tokenizer", "detokenizer", "executor", "gateway", "batch")


def build_service(name: str, settings: Settings, model_info: ModelInfo, bus: Bus | None = None):
    """The service object called ``name`` (imports only what that service needs).

    Raises:
        ValueError: unknown service name.
    """
    if name == "scheduler":
        from services.scheduler.service import SchedulerService as cls
    elif name == "tokenizer":
        from services.tokenizer.service import TokenizerService as cls
    elif name == "detokenizer":
        from services.detokenizer.service import DetokenizerService as cls
    elif name == "executor":
        from services.executor.service import ExecutorService as cls
    elif name == "gateway":
        from gateway.service import GatewayService as cls
    elif name == "batch":
        from gateway.batch.worker import BatchService as cls
    else:
        raise ValueError(f"unknown service {name!r}; choose from {', '.join(SERVICE_NAMES)}")
    return cls(settings, model_info, bus)


def pinned_settings(settings: Settings, model_info: ModelInfo, nats_url: str) -> Settings:
    """Settings with the model directory, name and context length resolved, so every
    process agrees on them."""
    return settings.model_copy(
        update=dict(
            model=str(model_info.path),
            served_model_name=model_info.name,
            max_model_len=model_info.max_model_len,
            nats_url=nats_url,
        )
    )


def service_instances(name: str, settings: Settings) -> list[tuple[str, Settings]]:
    """The instances to start for service ``name``: one, or for the detokenizer one per shard
    (``detokenizer.<n>``, its ``detokenizer_shard`` set) when ``num_detokenizer_shards`` > 1,
    since the engine is ready only when every shard answers."""
    shards = settings.num_detokenizer_shards
    if name != "detokenizer" or shards == 1:
        return [(name, settings)]
    return [(f"{name}.{n}", settings.model_copy(update={"detokenizer_shard": n})) for n in range(shards)]


class InProcessServices:
    """Services as tasks of one event loop on a background thread (the offline ``LLM``), one
    per detokenizer shard (see :func:`service_instances`).

    They talk over the same NATS subjects as separate processes would.
    """

    def __init__(self, settings: Settings, model_info: ModelInfo, names: tuple[str, ...]) -> None:
        self.settings = settings
        self.model_info = model_info
        self.names = names
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pagedllm-services", daemon=True)
        self.services: list[Any] = []

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the services' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self._thread.start()

        async def _start() -> None:
            for name in self.names:
                for _, settings in service_instances(name, self.settings):
                    service = build_service(name, settings, self.model_info)
                    await service.start()
                    self.services.append(service)

        self.run(_start())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def _stop() -> None:
            for service in reversed(self.services):
                try:
                    await service.stop()
                except Exception:
                    pass
            try:  # its idle threads would outlive the loop
                await asyncio.wait_for(self.loop.shutdown_default_executor(), 10)
            except Exception:  # a job still running (Python 3.11 then waits for it anyway)
                log.warning("default_executor_shutdown_failed")

        try:
            self.run(_stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()


def model_info_or_exit(settings: Settings, prefix: str) -> ModelInfo:
    """:func:`load_model_info` for a command line: a model that is not there or a
    ``max_model_len`` over the model's limit ends the command with one line.

    Raises:
        SystemExit: ``<prefix>: <reason>`` (status 1).
    """
    try:
        return load_model_info(settings)
    except ValueError as exc:  # ModelNotFoundError too
        raise SystemExit(f"{prefix}: {exc}") from None


def run_one_service(name: str, settings: Settings) -> None:
    """Run one service in this process until SIGTERM (``pagedllm service NAME``).

    Raises:
        SystemExit: one line ``pagedllm service NAME: <reason>`` (status 1) when the service
            cannot start: no ``nats_url``, a model that is not there or too short for
            ``max_model_len``, another instance already serving the same thing, or an
            ``OSError`` such as the gateway's port in use or NATS refusing the credentials
            (``NatsAuthorizationError``); or cannot go on
            (``FatalServiceError``: the scheduler refused the executor's group).
    """
    from shared.logging import configure_logging
    from shared.pings import ServiceConflictError
    from shared.service import FatalServiceError, run_service

    prefix = f"pagedllm service {name}"
    configure_logging(settings.log_level, service=name)
    if name == "executor" and settings.tensor_parallel_rank:  # a rank other than 0: no NATS, rank 0 drives it
        from services.executor.tp_group.ranks import run_rank

        try:
            run_rank(settings, model_info_or_exit(settings, prefix))
        except (RuntimeError, ValueError, OSError) as exc:
            raise SystemExit(f"{prefix} (tensor-parallel rank {settings.tensor_parallel_rank}): {exc}") from None
        return
    if not settings.nats_url:
        raise SystemExit(f"{prefix}: needs --nats-url (or PAGEDLLM_NATS_URL)")
    model_info = model_info_or_exit(settings, prefix)
    try:
        asyncio.run(run_service(build_service(name, settings, model_info)))
    except FatalServiceError as exc:
        # the service cannot go on; a thread of it may be stuck (a tensor-parallel collective
        # with a dead rank), which a normal exit would wait for: leave now
        sys.stderr.write(f"{prefix}: {exc}\n")
        sys.stderr.flush()
        os._exit(1)
    except (ServiceConflictError, OSError) as exc:
        raise SystemExit(f"{prefix}: {exc}") from None
