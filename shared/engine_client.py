"""``EngineClient``: submit requests to the services over NATS and receive their outputs.

Used by the HTTP gateway and by the offline ``LLM`` API, so it knows nothing of HTTP.
One client is one gateway id: the detokenizer publishes one ``GatewayStep`` per step to
``pagedllm.gw.<gateway_id>``, and the client routes each ``RequestDelta`` in it to the
queue of its request (one ``_Pending`` per request in flight, as SGLang's ``ReqState``)::

    client = EngineClient(bus, model_info.name)
    await client.start()
    reply = await client.submit("cmpl-1", prompt="Hello", sampling_params=SamplingParams())
    if reply.error is None:
        async for delta in client.stream("cmpl-1"):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.subscription import Subscription

from shared import subjects
from shared.bus import Bus
from shared.liveness import MissCounter
from shared.logging import get_logger
from shared.messages import (
    AbortRequests,
    FinishReason,
    GatewayStep,
    Ping,
    Pong,
    RequestDelta,
    RequestsKnown,
    RequestsQuery,
    SamplingParams,
    ServiceError,
    TokenizeReply,
    TokenizeRequest,
)
from shared.subjects import Subjects

log = get_logger(__name__)


def new_request_id(kind: str) -> str:
    """A fresh request id: ``cmpl-<uuid hex>`` for ``kind="cmpl"``, ``chatcmpl-<uuid hex>`` for chat."""
    return f"{kind}-{uuid.uuid4().hex}"


@dataclass
class _Pending:
    """One request in flight: submitted, its stream not ended yet."""

    queue: asyncio.Queue[RequestDelta]  # its deltas, for ``stream``
    num_samples: int  # n: the stream ends when all n are finished
    last_output: float  # time.monotonic() of its last delta (of its submission before any)
    # the scheduler's verdict (None: accepted), for submit(notify_accepted=True); None when
    # not asked for, or once ``wait_accepted`` has it
    verdict: asyncio.Future[ServiceError | None] | None = None


class EngineClient:
    """Talks to the tokenizer (requests), the detokenizer (outputs) and the scheduler (aborts).

    Args:
        bus: a connected bus; the client does not close it.
        model: the served model name (selects the subjects).
        gateway_id: this client's id in ``pagedllm.gw.<gateway_id>``; default a new uuid hex.
        tokenize_timeout_s: how long ``submit`` waits for the tokenizer's reply.

    Requests are watched so that none hangs when a service dies: a request with no output
    for ``liveness_idle_s`` seconds is checked with the scheduler every ``liveness_check_s``;
    one that the scheduler does not hold (or that goes unanswered) twice in a row ends with
    a 503 error (its scheduler restarted, or its detokenizer died with its outputs).
    """

    liveness_idle_s = 10.0
    liveness_check_s = 5.0

    def __init__(
        self, bus: Bus, model: str, *, gateway_id: str | None = None, tokenize_timeout_s: float = 30.0
    ) -> None:
        self.bus = bus
        self.model = model
        self.subjects = Subjects(model)
        self.gateway_id = gateway_id or uuid.uuid4().hex
        self.tokenize_timeout_s = tokenize_timeout_s
        self._pending: dict[str, _Pending] = {}  # request id -> its state
        self._misses: MissCounter[str] = MissCounter(limit=2)  # liveness checks it was missing in a row
        self._sub: Subscription | None = None
        self._ping_sub: Subscription | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        """Subscribe to this gateway's subject (flushed, so no output can be missed)."""
        self._sub = await self.bus.subscribe(subjects.gateway(self.gateway_id), GatewayStep, self._on_step)
        # the scheduler's check that this gateway still wants its requests (it aborts them when
        # nobody answers here: the gateway died without aborting them)
        self._ping_sub = await self.bus.subscribe(subjects.gateway_ping(self.gateway_id), Ping, self._on_ping)
        await self.bus.flush()
        self._watch = asyncio.create_task(self._watch_liveness())

    async def stop(self) -> None:
        """Abort every request still in flight (their streams end) and unsubscribe."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        pending = list(self._pending)
        if pending:
            try:
                await self.abort(pending)
            except Exception:  # the connection is gone: the streams still end
                log.warning("abort_on_stop_failed", num_requests=len(pending))
        for sub in (self._sub, self._ping_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # already closed or draining
                    pass
        self._sub = self._ping_sub = None

    async def _on_ping(self, _: Ping) -> Pong:
        return Pong(service="gateway")

    @property
    def connected(self) -> bool:
        """Whether the NATS connection is up."""
        return self.bus.nc.is_connected

    @property
    def num_in_flight(self) -> int:
        """Requests submitted whose stream has not ended."""
        return len(self._pending)

    async def _on_step(self, step: GatewayStep) -> None:
        now = time.monotonic()
        for request_id in step.accepted:
            self._accept(request_id, now)
        for delta in step.outputs:
            self._deliver(delta, now)

    def _accept(self, request_id: str, now: float) -> None:
        """The scheduler queued the request: the verdict for ``wait_accepted`` (nothing is queued
        for ``stream``)."""
        pending = self._pending.get(request_id)
        if pending is None:  # unknown ids: finished, aborted or someone else's
            return
        pending.last_output = now
        if pending.verdict is not None and not pending.verdict.done():
            pending.verdict.set_result(None)

    def _deliver(self, delta: RequestDelta, now: float) -> None:
        """Queue one delta for ``stream``; the first output or error is also the scheduler's
        verdict for ``wait_accepted``."""
        pending = self._pending.get(delta.request_id)
        if pending is None:  # unknown ids: finished, aborted or someone else's
            return
        pending.last_output = now
        if pending.verdict is not None and not pending.verdict.done():
            pending.verdict.set_result(delta.error)
        pending.queue.put_nowait(delta)

    async def _watch_liveness(self) -> None:
        """End requests the engine lost (see the class docstring)."""
        while True:
            await asyncio.sleep(self.liveness_check_s)
            now = time.monotonic()
            idle = [rid for rid, p in self._pending.items() if now - p.last_output > self.liveness_idle_s]
            self._misses.retain(idle)  # output since: "in a row" starts again
            if not idle:
                continue
            try:
                reply = await self.bus.request(self.subjects.requests_get, RequestsQuery(request_ids=idle),
                                               RequestsKnown, timeout=2.0)
                known = set(reply.known)
            except Exception:  # no scheduler answers: it holds nothing for us now
                known = set()
            for rid in idle:
                if rid in known:
                    self._misses.hit(rid)
                elif self._misses.miss(rid) and rid in self._pending:
                    log.warning("request_lost", request_id=rid)
                    self._deliver(RequestDelta(
                        request_id=rid, finished=True, finish_reason="error",
                        error=ServiceError(message="the engine lost this request (a scheduler or detokenizer "
                                                   "restarted or is unreachable); send it again",
                                           type="server_error", code="request_lost", status=503)), now)

    async def submit(
        self,
        request_id: str,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        add_generation_prompt: bool = True,
        cap_at_max_model_len: bool = False,
        return_prompt: bool = False,
        notify_accepted: bool = False,
        background: bool = False,
    ) -> TokenizeReply:
        """Send a request to the tokenizer; its outputs then arrive for ``stream(request_id)``.

        The output queue is registered before the request is sent, so no output is lost.
        ``cap_at_max_model_len``: a prompt + ``max_tokens`` over ``max_model_len`` is accepted
        and stops there with finish_reason "length" (the offline API, as vLLM's ``LLM``)
        instead of being refused (the OpenAI server). ``return_prompt``: the reply carries the
        prompt text (a chat request's as the template rendered it; token ids decoded).
        ``notify_accepted``: the scheduler says when it accepts the request; ``wait_accepted``
        waits for that. ``background``: a batch line, which the scheduler admits after every
        interactive request and preempts first.

        Returns:
            The tokenizer's reply. When ``reply.error`` is set the request was refused and
            its queue is dropped (the caller maps the error to an HTTP status).

        Raises:
            nats.errors.TimeoutError: no tokenizer replied within ``tokenize_timeout_s``.
            nats.errors.NoRespondersError: no tokenizer serves this model.
            shared.bus.RemoteError: the tokenizer's handler failed on the request (it may have
                submitted it: abort it).
            ValueError: ``request_id`` is already in flight.
        """
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        message = TokenizeRequest(
            request_id=request_id,
            gateway_id=self.gateway_id,
            prompt=prompt,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            sampling_params=sampling_params,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=time.time(),
            cap_at_max_model_len=cap_at_max_model_len,
            return_prompt=return_prompt,
            notify_accepted=notify_accepted,
            background=background,
        )
        pending = self._pending[request_id] = _Pending(
            queue=asyncio.Queue(), num_samples=sampling_params.n, last_output=time.monotonic(),
            verdict=asyncio.get_running_loop().create_future() if notify_accepted else None)
        try:
            reply = await self.bus.request(
                self.subjects.tokenize, message, TokenizeReply, timeout=self.tokenize_timeout_s
            )
        except BaseException:
            self._drop(request_id, pending)
            raise
        if reply.error is not None:
            self._drop(request_id, pending)
        return reply

    async def wait_accepted(self, request_id: str) -> ServiceError | None:
        """Wait for the scheduler's verdict on a request submitted with ``notify_accepted``:
        None once it is queued (or has output), else the error it was refused with (its
        queue is then dropped). Returns None at once for a request submitted without it."""
        pending = self._pending.get(request_id)
        if pending is None or pending.verdict is None:
            return None
        try:
            error = await pending.verdict
        finally:
            pending.verdict = None
        if error is not None:
            self._forget(request_id)
        return error

    async def stream(self, request_id: str) -> AsyncIterator[RequestDelta]:
        """Yield the request's outputs until every sample (``n``; ``delta.index``) is
        ``finished`` or an error arrives, then drop its queue.

        A request aborted through this client ends with a ``finish_reason="abort"`` delta.
        Closing the iterator early drops the queue but does not abort the request: call
        ``abort`` for that.

        Raises:
            KeyError: ``request_id`` was not submitted, or has already ended.
        """
        pending = self._pending.get(request_id)
        if pending is None:
            raise KeyError(f"request {request_id!r} is not in flight")
        remaining = pending.num_samples
        try:
            while True:
                delta = await pending.queue.get()
                yield delta
                if delta.finished:
                    remaining -= 1
                    if remaining <= 0 or delta.error is not None:
                        return
        finally:
            self._drop(request_id, pending)

    async def abort(self, request_ids: list[str], reason: FinishReason = "abort") -> None:
        """Tell the scheduler to stop these requests; their streams end with an abort delta."""
        for request_id in request_ids:
            pending = self._pending.get(request_id)
            self._forget(request_id)
            if pending is not None:
                for index in range(pending.num_samples):
                    pending.queue.put_nowait(
                        RequestDelta(request_id=request_id, index=index, finished=True, finish_reason="abort")
                    )
        if request_ids:
            await self.bus.publish(self.subjects.abort, AbortRequests(request_ids=request_ids, reason=reason))

    async def fail_all(self, error: ServiceError) -> None:
        """End every request in flight with ``error`` (each stream yields it and ends) and
        abort them at the scheduler: a gateway shutting down answers its clients."""
        pending = list(self._pending)
        now = time.monotonic()
        for request_id in pending:
            self._deliver(RequestDelta(request_id=request_id, finished=True, finish_reason="error", error=error), now)
        if pending:
            await self.bus.publish(self.subjects.abort, AbortRequests(request_ids=pending))

    def _drop(self, request_id: str, pending: _Pending) -> None:
        """Forget ``request_id`` if ``pending`` is still its state (not a later request's)."""
        if self._pending.get(request_id) is pending:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """Drop the client's state about ``request_id`` (a ``wait_accepted`` still waiting
        gets an error)."""
        pending = self._pending.pop(request_id, None)
        self._misses.hit(request_id)  # its row of misses ends with it
        verdict = pending.verdict if pending is not None else None
        if verdict is not None and not verdict.done():
            verdict.set_result(ServiceError(message="the request was aborted before the scheduler accepted it",
                                            type="server_error", code="request_aborted", status=503))
