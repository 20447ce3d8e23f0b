"""The shape every service has: an async context manager that starts, serves, drains.

``BusService`` is the base of the engine's services (the bus lifecycle, subscriptions, tasks,
answering pings); ``run_service`` runs one until SIGTERM/SIGINT, then stops it. What pings
tell (another instance serves; the engine is ready) is ``pings.py``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, NamedTuple, Protocol

from nats.aio.subscription import Subscription

from shared import subjects
from shared.bus import Bus, Handler, M
from shared.config import Settings
from shared.logging import get_logger
from shared.model_source import ModelInfo
from shared.pings import answer_pings, refuse_if_served

log = get_logger(__name__)


class Service(Protocol):
    name: str

    async def start(self) -> None:
        """Connect, subscribe, and begin serving."""

    async def stop(self) -> None:
        """Drain subscriptions and release resources."""

    async def failed(self) -> BaseException:
        """Return the error of a task the service cannot go on without, when one fails."""


class FatalServiceError(RuntimeError):
    """The service cannot go on (e.g. the scheduler refused an executor group): ``run_service``
    stops it and raises this, and ``pagedllm service`` exits with its message."""


async def run_service(service: Service) -> None:
    """Start ``service``, serve until SIGTERM or SIGINT, then stop it. A signal while it is
    still starting (connecting to a NATS server that is not up yet, say) cancels the start; a
    start that ends all the same (the cancel came in the turn it ended, or was lost in a
    Python 3.11 ``wait_for``) is stopped.

    Raises:
        BaseException: what a failed start raised, or the error of a task of the service
            that failed while it served (``Service.failed``; it is stopped first).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await _serve_until_stopped(service, stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _serve_until_stopped(service: Service, stop: asyncio.Event) -> None:
    starting = asyncio.ensure_future(service.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        if not starting.cancelled() and starting.exception() is None:  # started all the same
            await service.stop()
        return
    if starting.exception() is not None:
        stopping.cancel()
        raise starting.exception()
    failure = asyncio.ensure_future(service.failed())
    try:
        await asyncio.wait({stopping, failure}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        error = failure.result() if failure.done() and not failure.cancelled() else None
        for waiter in (stopping, failure):
            waiter.cancel()
        await service.stop()
    if error is not None:
        raise error


class Exclusive(NamedTuple):
    """What ``refuse_if_served`` checks before a service serves: its ping name, what it is (in
    the error), and the advice the error gives."""

    ping_name: str
    what: str
    advice: str = "run one per model and NATS server"


class BusService:
    """Base of the engine's services: owns the bus lifecycle, so that each service's module
    holds only its handlers.

    ``start``: ``load`` (what needs no NATS: a model, a tokenizer); connect to
    ``settings.nats_url`` unless a bus was given; refuse to start if another instance already
    serves what this one would (``exclusive``); ``serve`` (the subclass subscribes with
    :meth:`subscribe` and starts its tasks with :meth:`spawn`); flush, so that every message
    published after ``start`` returns is received; answer pings on each of ``ping_names``.

    ``stop``: cancel the tasks, drain the subscriptions this service made (their pending
    messages are handled; all at once), ``on_stop`` (the bus still up: tell the clients what is
    lost), then close the bus if this service opened it. ``async with service:`` does both. A
    failed ``start`` stops what it had started.

    A task started with :meth:`spawn` that raises is logged (``service_task_failed``) and ends
    the service: :meth:`failed` returns its error, and ``run_service`` stops the service and
    raises it, so the process exits (its supervisor restarts it) rather than serve on without it.

    Args:
        settings: engine settings (``nats_url`` is used when ``bus`` is None).
        model_info: the served model (its name selects the subjects).
        bus: a connected bus to share (it stays open); None: connect in ``start``, close in
            ``stop``.
    """

    name = "service"

    def __init__(self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None) -> None:
        self.settings = settings
        self.model_info = model_info
        self.subjects = subjects.Subjects(model_info.name)
        self.bus = bus
        self._own_bus = bus is None
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task] = []
        self._failure: asyncio.Future[BaseException] | None = None  # the first failed task's error

    @property
    def connection_name(self) -> str:
        """The NATS connection's name (server logs, monitoring)."""
        return self.name

    def exclusive(self) -> Exclusive | None:
        """What only one instance may serve (checked before serving); None: replicas share."""
        return None

    def ping_names(self) -> tuple[str, ...]:
        """The names this service answers pings on once serving (``subjects.ping``)."""
        return (self.name,)

    async def load(self) -> None:
        """Prepare what needs no NATS (called first by ``start``)."""

    async def serve(self) -> None:
        """Subscribe to this service's subjects and start its tasks."""

    async def on_stop(self) -> None:
        """Called by ``stop`` once the subscriptions are drained, the bus still up."""

    async def start(self) -> None:
        """Load, connect (if needed) and serve.

        Raises:
            ValueError: no bus was given and ``settings.nats_url`` is None.
            NatsAuthorizationError: the NATS server refused the credentials (``nats_url``'s
                user and password or token, ``nats_creds``).
            ServiceConflictError: another instance already serves what ``exclusive`` names.
        """
        await self.load()
        if self.bus is None:
            if not self.settings.nats_url:
                raise ValueError(f"{type(self).__name__} needs settings.nats_url (or a connected bus)")
            self.bus = await Bus.connect(self.settings.nats_url, name=self.connection_name,
                                         creds=self.settings.nats_creds)
        try:
            if (exclusive := self.exclusive()) is not None:
                await refuse_if_served(self.bus, self.model_info.name, exclusive.ping_name, exclusive.what,
                                       advice=exclusive.advice)
            await self.serve()
            await self.bus.flush()
            for ping_name in self.ping_names():
                await self.answer_pings(ping_name)
        except BaseException:
            await self.stop()  # the tasks, subscriptions and bus it had started
            raise

    async def stop(self) -> None:
        """Cancel the tasks, drain the subscriptions, ``on_stop``, close an owned bus."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        subs, self._subs = self._subs, []
        await asyncio.gather(*(_drain(sub) for sub in subs))
        if self.bus is None:
            return
        await self.on_stop()
        if self._own_bus:
            await self.bus.close()
            self.bus = None

    async def __aenter__(self) -> BusService:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def subscribe(self, subject: str, message_type: type[M], handler: Handler,
                        queue: str = "") -> Subscription:
        """``Bus.subscribe``, drained by ``stop``."""
        assert self.bus is not None
        sub = await self.bus.subscribe(subject, message_type, handler, queue=queue)
        self._subs.append(sub)
        return sub

    async def answer_pings(self, ping_name: str) -> None:
        """:func:`answer_pings` on ``ping_name``, until ``stop``."""
        assert self.bus is not None
        self._subs.append(await answer_pings(self.bus, self.model_info.name, ping_name))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as a task of this service, cancelled by ``stop``; if it raises, the
        service cannot go on (:meth:`failed`)."""
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._task_done)
        return task

    async def failed(self) -> BaseException:
        """Return the error of the first task of :meth:`spawn` that raised (waits until one does)."""
        return await asyncio.shield(self._failure_future())

    def _failure_future(self) -> asyncio.Future[BaseException]:
        if self._failure is None:
            self._failure = asyncio.get_running_loop().create_future()
        return self._failure

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or (error := task.exception()) is None:
            return
        log.error("service_task_failed", service=self.name, error=str(error) or type(error).__name__,
                  exc_info=error)
        failure = self._failure_future()
        if not failure.done():
            failure.set_result(error)


async def _drain(sub: Subscription) -> None:
    try:
        await sub.drain()
    except Exception:  # the connection is closed, draining or gone
        pass
