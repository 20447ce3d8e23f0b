"""``EngineClient``: submit requests to the services over NATS and receive their outputs.

Used by the HTTP gateway and by the offline ``LLM`` API, so it knows nothing of HTTP.
One client is one gateway id: the detokenizer publishes one ``GatewayStep`` per step to
``pagedllm.gw.<gateway_id>``, and the client routes each ``RequestDelta`` in it to the
queue of its request (one ``InFlight`` per request, as SGLang's ``ReqState``)::

    client = EngineClient(bus, model_info.name)
    await client.start()
    reply = await client.submit("cmpl-1", prompt="Hello", sampling_params=SamplingParams())
    if reply.error is None:
        async for delta in client.stream("cmpl-1"):
            print(delta.text, end="")

A request the engine loses (its scheduler or detokenizer died, a NATS outage dropped an
update) is resubmitted with the tokens its client already has, so its stream continues
where it stopped (``shared/inflight.py``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
from nats.aio.subscription import Subscription

from shared import subjects
from shared.bus import Bus, decode, encode
from shared.inflight import InFlight, Received
from shared.logging import get_logger
from shared.messages import (
    AbortRequests,
    FinishReason,
    GatewayStep,
    Ping,
    Pong,
    RequestDelta,
    RequestSpec,
    SamplingParams,
    SchedulerStarted,
    ServiceError,
    TokenizeReply,
    TokenizeRequest,
)
from shared.request_recovery import RequestTable
from shared.subjects import Subjects

log = get_logger(__name__)


def new_request_id(kind: str) -> str:
    """A fresh request id: ``cmpl-<uuid hex>`` for ``kind="cmpl"``, ``chatcmpl-<uuid hex>`` for chat."""
    return f"{kind}-{uuid.uuid4().hex}"


class EngineClient:
    """Talks to the tokenizer (requests), the detokenizer (outputs) and the scheduler (aborts).

    Args:
        bus: a connected bus; the client does not close it.
        model: the served model name (selects the subjects).
        gateway_id: this client's id in ``pagedllm.gw.<gateway_id>``; default a new uuid hex.
        tokenize_timeout_s: how long ``submit`` waits for the tokenizer's reply (and retries
            while no tokenizer is there: one restarting).

    No request hangs or is lost when a service dies. A request the engine says it lost (a
    ``request_lost`` error: its detokenizer or scheduler stopped), one whose deltas skip
    tokens, and one the scheduler does not hold (asked when a scheduler starts, and for a
    request with no output for ``RequestTable.liveness_idle_s`` seconds every ``liveness_check_s``, twice
    in a row) is resubmitted with its client's tokens so far (``InFlight.resubmission``);
    after ``MAX_RESUBMITS`` attempts, or for an n > 1 request with output already, it ends
    with a 503 ``request_lost`` error.
    """

    def __init__(
        self, bus: Bus, model: str, *, gateway_id: str | None = None, tokenize_timeout_s: float = 30.0
    ) -> None:
        self.bus = bus
        self.model = model
        self.subjects = Subjects(model)
        self.tokenize_timeout_s = tokenize_timeout_s
        self.requests = RequestTable(bus, self.subjects, tokenize_timeout_s)
        self.gateway_id = gateway_id or uuid.uuid4().hex
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        """Subscribe to this gateway's subject (flushed, so no output can be missed)."""
        self._subs = [
            await self.bus.subscribe(subjects.gateway(self.gateway_id), GatewayStep, self._on_step),
            # the scheduler's check that this gateway still wants its requests (it aborts them when
            # nobody answers here: the gateway died without aborting them)
            await self.bus.subscribe(subjects.gateway_ping(self.gateway_id), Ping, self._on_ping),
            await self.bus.subscribe(self.subjects.scheduler_started, SchedulerStarted, self.requests.on_scheduler_started),
        ]
        await self.bus.flush()
        self.requests.spawn(self.requests.watch_liveness())

    async def stop(self) -> None:
        """Abort every request still in flight (their streams end) and unsubscribe."""
        for task in list(self.requests.tasks):
            task.cancel()
        pending = list(self.requests.pending)
        if pending:
            try:
                await self.abort(pending)
            except Exception:  # the connection is gone: the streams still end
                log.warning("abort_on_stop_failed", num_requests=len(pending))
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # already closed or draining
                pass
        self._subs = []

    async def _on_ping(self, _: Ping) -> Pong:
        return Pong(service="gateway")

    @property
    def connected(self) -> bool:
        """Whether the NATS connection is up."""
        return self.bus.nc.is_connected

    @property
    def num_resubmitted(self) -> int:
        """Resubmissions over the client's life."""
        return self.requests.num_resubmitted

    @property
    def num_in_flight(self) -> int:
        """Requests submitted whose stream has not ended."""
        return len(self.requests.pending)

    async def _on_step(self, step: GatewayStep) -> None:
        now = time.monotonic()
        for engine_id in step.accepted:
            if (pending := self.requests.current(engine_id)) is not None:
                pending.last_output = now
                self.requests.settle(pending, None)
        for delta in step.outputs:
            if (pending := self.requests.current(delta.request_id)) is None:
                continue  # finished, aborted, an earlier attempt's or someone else's
            delta.request_id = pending.request_id
            pending.last_output = now
            if pending.receive(delta) is Received.LOST:
                self.requests.lost(pending, why=delta.error.message if delta.error else "it skipped output tokens")
                continue
            self.requests.settle(pending, delta.error)
            pending.queue.put_nowait(delta)

    async def submit(
        self,
        request_id: str,
        *,
        sampling_params: SamplingParams,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        cap_at_max_model_len: bool = False,
        return_prompt: bool = False,
        **options: Any,
    ) -> TokenizeReply:
        """Build the request's ``RequestSpec`` (this client's gateway id, the arrival time
        now, ``sampling_params`` as they are: checked where they were built) and send it with
        its prompt to the tokenizer; its outputs then arrive for ``stream(request_id)``.

        ``options`` are the spec's other fields (``priority``, ``cache_salt``, ``background``,
        ``notify_accepted``, ...: ``shared/messages/request.py``), carried to the scheduler
        untouched. ``notify_accepted``: the scheduler says when it accepts the request;
        ``wait_accepted`` waits for that. The output queue is registered before the request is
        sent, so no output is lost.

        The prompt's fields go to the tokenizer: ``prompt`` or chat ``messages`` (with
        ``add_generation_prompt``, the ``tools`` the template lists and a ``chat_template``
        used instead of the server's); ``cap_at_max_model_len``: a prompt + ``max_tokens`` over
        ``max_model_len`` is accepted and stops there with finish_reason "length" (the offline
        API, as vLLM's ``LLM``) instead of being refused (the OpenAI server);
        ``return_prompt``: the reply carries the prompt text (a chat request's as the template
        rendered it; token ids decoded). While no tokenizer serves the model (one
        restarting), the request is sent again every 0.25 s until ``tokenize_timeout_s``.

        Returns:
            The tokenizer's reply. When ``reply.error`` is set the request was refused and
            its queue is dropped (the caller maps the error to an HTTP status).

        Raises:
            nats.errors.TimeoutError: no tokenizer replied within ``tokenize_timeout_s``.
            nats.errors.NoRespondersError: no tokenizer served this model within it.
            shared.bus.RemoteError: the tokenizer's handler failed on the request (it may have
                submitted it: abort it).
            ValueError: ``request_id`` is already in flight, or a field is of the wrong type
                (``msgspec.ValidationError``, naming it: nothing is sent).
            TypeError: ``sampling_params`` is not a ``SamplingParams``, or an option is not a
                field of ``RequestSpec``.
        """
        if request_id in self.requests.pending:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if not isinstance(sampling_params, SamplingParams):  # its values were checked where it was built
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        spec = RequestSpec(request_id=request_id, gateway_id=self.gateway_id, sampling_params=sampling_params,
                           arrival_time=time.time(), **options)
        message = TokenizeRequest(
            spec=spec, prompt=prompt, messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            chat_template=chat_template, cap_at_max_model_len=cap_at_max_model_len, return_prompt=return_prompt)
        decode(encode(message), TokenizeRequest)  # the types, as the tokenizer will decode them
        pending = self.requests.pending[request_id] = InFlight(
            message=message, queue=asyncio.Queue(), last_output=time.monotonic(),
            verdict=asyncio.get_running_loop().create_future() if spec.notify_accepted else None)
        self.requests.engine_ids[request_id] = request_id
        deadline = time.monotonic() + self.tokenize_timeout_s
        try:
            while True:
                try:
                    reply = await self.bus.request(self.subjects.tokenize, message, TokenizeReply,
                                                   timeout=max(0.1, deadline - time.monotonic()))
                    break
                except nats.errors.NoRespondersError:
                    if time.monotonic() + 0.25 >= deadline:
                        raise
                    await asyncio.sleep(0.25)
        except BaseException:
            self.requests.drop(request_id, pending)
            raise
        if reply.error is not None:
            self.requests.drop(request_id, pending)
        else:
            pending.submitted = True
            pending.last_output = time.monotonic()
        return reply

    async def wait_accepted(self, request_id: str) -> ServiceError | None:
        """Wait for the scheduler's verdict on a request submitted with ``notify_accepted``:
        None once it is queued (or has output), else the error it was refused with (its
        queue is then dropped). Returns None at once for a request submitted without it."""
        pending = self.requests.pending.get(request_id)
        if pending is None or pending.verdict is None:
            return None
        try:
            error = await pending.verdict
        finally:
            pending.verdict = None
        if error is not None:
            self.requests.forget(request_id)
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
        pending = self.requests.pending.get(request_id)
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
            self.requests.drop(request_id, pending)

    async def abort(self, request_ids: list[str], reason: FinishReason = "abort") -> None:
        """Tell the scheduler to stop these requests; their streams end with an abort delta."""
        engine_ids = []
        for request_id in request_ids:
            pending = self.requests.pending.get(request_id)
            self.requests.forget(request_id)
            engine_ids.append(pending.engine_id if pending is not None else request_id)
            if pending is not None:
                for index in range(pending.num_samples):
                    pending.queue.put_nowait(
                        RequestDelta(request_id=request_id, index=index, finished=True, finish_reason="abort")
                    )
        if engine_ids:
            await self.bus.publish(self.subjects.abort, AbortRequests(request_ids=engine_ids, reason=reason))

    async def fail_all(self, error: ServiceError) -> None:
        """End every request in flight with ``error`` (each stream yields it and ends) and
        abort them at the scheduler: a gateway shutting down answers its clients."""
        pending = list(self.requests.pending.values())
        for request in pending:
            self.requests.end(request, error)
        if pending:
            await self.bus.publish(self.subjects.abort, AbortRequests(request_ids=[p.engine_id for p in pending]))
