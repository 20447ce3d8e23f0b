"""The requests an ``EngineClient`` holds in flight, and their recovery when the engine loses
one: ``RequestTable`` routes the engine's ids to the client's requests and resubmits a lost
request with the tokens its client already has (the state of one request and its
resubmission message: ``shared/inflight.py``; the public API: ``shared/engine_client.py``).
"""

from __future__ import annotations

import asyncio
import time

from shared.bus import Bus
from shared.inflight import InFlight
from shared.liveness import MissCounter
from shared.logging import get_logger
from shared.messages import (
    AbortRequests,
    RequestDelta,
    RequestsKnown,
    RequestsQuery,
    SchedulerStarted,
    ServiceError,
    TokenizeReply,
)
from shared.subjects import Subjects

log = get_logger(__name__)


class RequestTable:
    """The client's requests in flight by request id (``pending``) and by the id the engine
    knows them by (``engine_ids``), and the recovery of the ones the engine loses (see
    ``EngineClient``'s docstring for when a request counts as lost). ``EngineClient`` holds
    one as ``requests``.

    Args:
        bus: a connected bus.
        subjects: the served model's subjects.
        tokenize_timeout_s: how long a resubmission waits for the tokenizer's reply.
    """

    liveness_idle_s = 10.0  # a request without output this long is checked
    liveness_check_s = 5.0  # how often
    held_query_timeout_s = 2.0  # a scheduler that does not answer a check in this long holds nothing

    def __init__(self, bus: Bus, subjects: Subjects, tokenize_timeout_s: float) -> None:
        self.bus = bus
        self.subjects = subjects
        self.tokenize_timeout_s = tokenize_timeout_s
        self.pending: dict[str, InFlight] = {}  # the client's request id -> its state
        self.engine_ids: dict[str, str] = {}  # the id the engine knows -> the client's request id
        self.misses: MissCounter[str] = MissCounter(limit=2)  # liveness checks it was missing in a row
        self.tasks: set[asyncio.Task] = set()  # resubmissions, liveness checks
        self.num_resubmitted = 0  # resubmissions over the client's life

    def spawn(self, coro) -> None:
        """Run ``coro`` as a task the table keeps (``tasks``) until it ends."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def current(self, engine_id: str) -> InFlight | None:
        """The request the engine knows as ``engine_id``, if that is its current attempt."""
        request_id = self.engine_ids.get(engine_id)
        return self.pending.get(request_id) if request_id is not None else None

    @staticmethod
    def settle(pending: InFlight, error: ServiceError | None) -> None:
        """The scheduler's verdict for ``wait_accepted``: the first acceptance, output or error."""
        if pending.verdict is not None and not pending.verdict.done():
            pending.verdict.set_result(error)

    def lost(self, pending: InFlight, why: str) -> None:
        """The engine lost the request: resubmit it (in a task), or end it with a 503."""
        if not pending.recoverable:
            log.warning("request_lost", request_id=pending.request_id, attempts=pending.attempts, reason=why)
            self.end(pending, ServiceError(
                message="the engine lost this request (a scheduler or detokenizer restarted or is unreachable); "
                        "send it again", type="server_error", code="request_lost", status=503))
            return
        if pending.submitted:  # not already being resubmitted
            pending.submitted = False
            log.warning("request_resubmitting", request_id=pending.request_id, reason=why,
                        output_tokens=len(pending.outputs[0]), attempt=pending.attempts + 1)
            self.spawn(self._resubmit(pending))

    def end(self, pending: InFlight, error: ServiceError) -> None:
        """End every sample's stream with ``error``."""
        self.settle(pending, error)
        pending.queue.put_nowait(RequestDelta(request_id=pending.request_id, finished=True, finish_reason="error",
                                              error=error))

    async def _resubmit(self, pending: InFlight) -> None:
        """Send the request's next attempt through the tokenizer; the attempt before it is
        aborted at the scheduler (if it still runs there, for nobody)."""
        old = pending.engine_id
        message = pending.resubmission()
        self.engine_ids.pop(old, None)
        self.engine_ids[pending.engine_id] = pending.request_id
        self.num_resubmitted += 1
        try:
            await self.bus.publish(self.subjects.abort, AbortRequests(request_ids=[old]))
            reply = await self.bus.request(self.subjects.tokenize, message, TokenizeReply,
                                           timeout=self.tokenize_timeout_s)
        except Exception as exc:  # no tokenizer or NATS away: the liveness check tries again
            log.warning("resubmit_failed", request_id=pending.request_id, error=repr(exc))
            reply = None
        if self.pending.get(pending.request_id) is not pending:  # ended meanwhile (aborted)
            return
        pending.last_output = time.monotonic()
        pending.submitted = True
        if reply is not None and reply.error is not None:  # refused now (it was accepted before)
            self.end(pending, reply.error)

    async def on_scheduler_started(self, _: SchedulerStarted) -> None:
        """A scheduler (re)started: resubmit at once what it does not hold."""
        self.spawn(self._check_held([p for p in self.pending.values() if p.submitted], rounds=1))

    async def watch_liveness(self) -> None:
        """Resubmit idle requests the scheduler does not hold (see the class docstring)."""
        while True:
            await asyncio.sleep(self.liveness_check_s)
            now = time.monotonic()
            idle = [p for p in self.pending.values() if p.submitted and now - p.last_output > self.liveness_idle_s]
            self.misses.retain([p.engine_id for p in idle])  # output since: "in a row" starts again
            if idle:
                await self._check_held(idle, rounds=self.misses.limit)

    async def _check_held(self, requests: list[InFlight], rounds: int) -> None:
        """Ask the scheduler which of ``requests`` it holds; one missing ``rounds`` checks in a
        row (a scheduler that does not answer holds nothing) is lost."""
        if not requests:
            return
        try:
            reply = await self.bus.request(self.subjects.requests_get,
                                           RequestsQuery(request_ids=[p.engine_id for p in requests]),
                                           RequestsKnown, timeout=self.held_query_timeout_s)
            known = set(reply.known)
        except Exception:  # no scheduler answers: it holds nothing for us now
            known = set()
        for pending in requests:
            engine_id = pending.engine_id
            if engine_id in known:
                self.misses.hit(engine_id)
            elif self.pending.get(pending.request_id) is pending and pending.submitted and \
                    (rounds == 1 or self.misses.miss(engine_id)):
                self.misses.hit(engine_id)
                self.lost(pending, why="its scheduler does not hold it")

    def drop(self, request_id: str, pending: InFlight) -> None:
        """Forget ``request_id`` if ``pending`` is still its state (not a later request's)."""
        if self.pending.get(request_id) is pending:
            self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """Drop the client's state about ``request_id`` (a ``wait_accepted`` still waiting
        gets an error)."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return
        self.engine_ids.pop(pending.engine_id, None)
        self.misses.hit(pending.engine_id)  # its row of misses ends with it
        self.settle(pending, ServiceError(message="the request was aborted before the scheduler accepted it",
                                           type="server_error", code="request_aborted", status=503))
