"""``GatewayService``: the OpenAI-compatible HTTP/WebSocket server as a pagedllm service.

It runs uvicorn in-process (a task on the running event loop) on ``settings.host`` and
``settings.port`` (``port=0`` picks a free port; see ``GatewayService.port``), with one
``EngineClient`` on the NATS bus. The bus lifecycle is ``shared.service.BusService``'s; signals
are left to ``shared.service.run_service``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import uvicorn

from gateway.app import create_app
from gateway.batch.store import BatchStore
from gateway.serving import OpenAIServing
from shared.bus import Bus
from shared.config import Settings
from shared.engine_client import EngineClient
from shared.logging import get_logger
from shared.messages import ServiceError
from shared.model_source import ModelInfo
from shared.service import BusService

log = get_logger(__name__)

#: after the drain: how long the requests ended by ``stop`` get to send their answer, and
#: uvicorn then its connections to close
SHUTDOWN_GRACE_S = 3.0


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service's owner handles SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def _open_batch_store(bus: Bus) -> BatchStore | None:
    """The Files and Batch API's JetStream store, or None (its routes answer 503) when the NATS
    server has no JetStream."""
    try:
        return await asyncio.wait_for(BatchStore(bus.nc).setup(), 10)
    except Exception as exc:
        log.warning("batch_api_unavailable", error=str(exc) or type(exc).__name__)
        return None


class GatewayService(BusService):
    """The gateway: FastAPI app + uvicorn + ``EngineClient``. It answers no engine ping name
    (the scheduler pings its ``EngineClient`` on the gateway's own subject).

    Args:
        settings: ``host``, ``port``, ``nats_url`` (used when ``bus`` is None), ``log_level``,
            ``gateway_drain_timeout_s`` (on ``stop``, the seconds in-flight HTTP requests may
            take to finish).
        model_info: the served model (its name selects the NATS subjects).
        bus: a connected bus to use (not closed by ``stop``); None = connect to ``settings.nats_url``.
    """

    name = "gateway"

    def __init__(
        self,
        settings: Settings,
        model_info: ModelInfo,
        bus: Bus | None = None,
    ) -> None:
        super().__init__(settings, model_info, bus)
        self.client: EngineClient | None = None
        self._server: _UvicornServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._serving: OpenAIServing | None = None

    def ping_names(self) -> tuple[str, ...]:
        return ()

    async def start(self) -> None:
        """Connect, subscribe, and listen; returns once the socket accepts connections.

        Raises:
            ValueError: no bus was given and ``settings.nats_url`` is None.
            OSError: the address is in use or cannot be bound.
        """
        await super().start()  # a failed start stops what it started (the client, an owned bus)
        log.info(
            "gateway_started", url=self.url, model=self.model_info.name, gateway_id=self.client.gateway_id
        )

    async def serve(self) -> None:
        assert self.bus is not None
        self.client = EngineClient(self.bus, self.model_info.name)
        await self.client.start()
        app = create_app(self.settings, self.model_info, self.client)
        app.state.batch_store = await _open_batch_store(self.bus)
        self._serving = app.state.serving
        await self._serving.metrics.subscribe(self.bus)
        config = uvicorn.Config(
            app,
            host=self.settings.host,
            port=self.settings.port,
            log_config=None,
            log_level=self.settings.log_level.lower(),
            access_log=False,
            lifespan="off",
            # ``stop`` drains the requests first (uvicorn would close WebSockets at once and
            # cancel HTTP requests at its timeout, without a proper answer)
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        self._server = _UvicornServer(config)
        self._task = asyncio.create_task(self._serve(), name="gateway-uvicorn")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise OSError(f"gateway stopped while starting on {self.settings.host}:{self.settings.port}")
            await asyncio.sleep(0.01)

    async def _serve(self) -> None:
        assert self._server is not None
        try:
            await self._server.serve()
        except SystemExit:  # uvicorn exits the process when it cannot bind
            raise OSError(
                f"gateway cannot listen on {self.settings.host}:{self.settings.port} (address in use?)"
            ) from None

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when ``settings.port`` is 0)."""
        if self._server is not None and self._server.started:
            for server in self._server.servers:
                for sock in server.sockets:
                    if sock.family in (socket.AF_INET, socket.AF_INET6):
                        return int(sock.getsockname()[1])
        return self.settings.port

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:8000`` (the OpenAI base URL adds ``/v1``)."""
        host = self.settings.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def ready(self) -> bool:
        """True while the server listens and the NATS connection is up."""
        return bool(
            self._server is not None
            and self._server.started
            and self._task is not None
            and not self._task.done()
            and self.client is not None
            and self.client.connected
        )

    async def stop(self) -> None:
        """Drain, stop listening, stop the client, then close the bus if this service opened it.

        Draining: new requests get a 503 ``server_shutting_down`` (``/health`` too), those in
        flight, HTTP and WebSocket, may finish for up to ``settings.gateway_drain_timeout_s``;
        the rest then end with a 503 ``server_shutting_down`` (an OpenAI error body; an SSE
        stream gets the error event and ``[DONE]``, a WebSocket request an ``error``
        message) and are aborted."""
        if self._server is not None and self._task is not None:
            await self._drain()
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), SHUTDOWN_GRACE_S + 2.0)
            except (TimeoutError, OSError):
                pass
            except Exception:
                log.exception("gateway_server_failed")
            if not self._task.done():
                self._server.force_exit = True
                self._task.cancel()
                await asyncio.wait({self._task})
        await super().stop()  # on_stop: the client ends what is left
        self._server = None
        self._task = None
        self._serving = None
        self.client = None
        log.info("gateway_stopped")

    async def _drain(self) -> None:
        """Refuse new requests and wait for those in flight (see ``stop``)."""
        if self._serving is None or self.client is None or self._task is None or self._task.done():
            return
        self._serving.draining = True
        loop, client = asyncio.get_running_loop(), self.client
        deadline = loop.time() + self.settings.gateway_drain_timeout_s
        while client.num_in_flight and loop.time() < deadline and not self._task.done():
            await asyncio.sleep(0.02)
        if not client.num_in_flight:
            return
        log.warning("gateway_drain_timeout", requests=client.num_in_flight)
        with contextlib.suppress(Exception):  # NATS gone: the streams still end
            await client.fail_all(ServiceError(message="the server is shutting down; send the request again",
                                               type="server_error", code="server_shutting_down", status=503))
        deadline = loop.time() + SHUTDOWN_GRACE_S  # their answers go out
        while client.num_in_flight and loop.time() < deadline and not self._task.done():
            await asyncio.sleep(0.02)

    async def on_stop(self) -> None:
        """Wait for the aborts of closed responses, stop the metrics and the client (it aborts
        what is still in flight), the bus still up."""
        if self._serving is not None:
            await asyncio.sleep(0)  # let responses closed by the shutdown spawn their aborts
            await self._serving.wait_background()
            await self._serving.metrics.close()
        if self.client is not None:
            await self.client.stop()

    async def __aenter__(self) -> GatewayService:
        await self.start()
        return self
