"""The detokenizer service: one shard of the requests' incremental detokenization state.

recv ``DetokStep`` (one per scheduler step for this shard) -> register new requests, feed
each update's tokens to its ``IncrementalDetokenizer`` -> send one ``GatewayStep`` per
gateway (a ``RequestDelta`` per updated request) and, when stop strings matched, one
``AbortRequests(reason="stop")`` so the scheduler frees those requests' blocks.
A finished request's state is dropped at once, as is that of a request the scheduler ended
without a last output (``DetokStep.released``); later updates for it are ignored. An update
for a request this shard never registered (its state went with a detokenizer that was
replaced, or its first output was sent while none served the shard), or one that skips
tokens (``TokenUpdate.num_output_tokens``: an update lost in a NATS outage), fails it: a
``FailRequests`` with a 503 ``request_lost``, which the scheduler reports to its gateway
(whose ``EngineClient`` resubmits it with the tokens its client has).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

from services.detokenizer.incremental import IncrementalDetokenizer
from services.detokenizer.token_text import TokenTexts
from shared import subjects as subj
from shared.bus import Bus
from shared.config import Settings
from shared.logging import get_logger
from shared.messages import (
    AbortRequests,
    DecodedLogprobs,
    DetokNewRequest,
    DetokStep,
    FailRequests,
    GatewayStep,
    RequestDelta,
    ServiceError,
    TokenUpdate,
)
from shared.model_source import ModelInfo, load_tokenizer
from shared.service import BusService, Exclusive

log = get_logger(__name__)

#: finished request ids remembered, so that an update still in flight for one is not taken
#: for a request whose state was lost
RECENTLY_FINISHED = 4096


@dataclass
class DetokRequest:
    """The state of one live request in this shard: the scheduler's ``DetokNewRequest`` as it
    came (held, not copied: its ids, prompt length and ``DetokenizeParams``) and what has been
    decoded since."""

    new: DetokNewRequest
    detok: IncrementalDetokenizer
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[DecodedLogprobs] | None = None  # sent with its first delta, then dropped

    @property
    def request_id(self) -> str:
        return self.new.request_id

    @property
    def gateway_id(self) -> str:
        return self.new.gateway_id

    @property
    def client_request_id(self) -> str:
        """The id its client knows: an n > 1 sample's parent's, else its own."""
        return self.new.parent_request_id or self.new.request_id


@dataclass
class StepOutputs:
    """What one ``DetokStep`` produced: deltas per gateway, requests to abort (stop string),
    requests never registered here (their state was lost)."""

    by_gateway: dict[str, list[RequestDelta]]
    aborted: list[str]
    lost: list[str]


class DetokenizerService(BusService):
    """Serves ``Subjects(model).detok(settings.detokenizer_shard)``.

    Args:
        settings: engine settings (``detokenizer_shard``; ``nats_url`` when ``bus`` is None).
        model_info: the served model; its ``path`` holds the Hugging Face tokenizer.
        bus: a connected bus to share; None = connect in ``start()`` and close in ``stop()``.
        tokenizer: an already loaded tokenizer (tests); None = ``AutoTokenizer.from_pretrained``.
    """

    name = "detokenizer"

    def __init__(
        self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None, tokenizer: Any = None
    ) -> None:
        super().__init__(settings, model_info, bus)
        self.tokenizer = tokenizer
        self.shard = settings.detokenizer_shard
        self._token_texts: TokenTexts | None = None
        self.requests: dict[str, DetokRequest] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # the last RECENTLY_FINISHED ids

    @property
    def connection_name(self) -> str:
        return f"{self.name}-{self.shard}"

    def exclusive(self) -> Exclusive:
        return Exclusive(f"{self.name}.{self.shard}", f"detokenizer of shard {self.shard}")

    def ping_names(self) -> tuple[str, ...]:
        return f"{self.name}.{self.shard}", self.name

    async def load(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = await load_tokenizer(self.model_info.path)

    async def serve(self) -> None:
        await self.subscribe(self.subjects.detok(self.shard), DetokStep, self.handle)

    async def start(self) -> None:
        """Load the tokenizer, connect (if needed) and serve this shard's subject.

        Raises:
            ValueError: no bus was given and ``settings.nats_url`` is None.
            ServiceConflictError: another detokenizer already serves this shard.
        """
        await super().start()
        log.info("detokenizer_started", model=self.model_info.name, subject=self.subjects.detok(self.shard))

    async def on_stop(self) -> None:
        """The subscription is drained: end the requests still live here. Their text state goes
        with this process: each fails at once with a 503 ``request_lost`` to its gateway and is
        aborted at the scheduler (else it would run on, for nobody, until the client's liveness
        check noticed)."""
        if self.requests:
            await self._fail_live_requests()

    async def _fail_live_requests(self) -> None:
        lost = ServiceError(message="the detokenizer stopped before this request finished; send it again",
                            type="server_error", code="request_lost", status=503)
        by_gateway: dict[str, list[RequestDelta]] = defaultdict(list)
        for req in self.requests.values():
            by_gateway[req.gateway_id].append(RequestDelta(
                request_id=req.client_request_id, index=req.new.index, finished=True,
                finish_reason="error", error=lost))
        try:
            await self.bus.publish(self.subjects.abort, AbortRequests(request_ids=list(self.requests)))
            for gateway_id, deltas in by_gateway.items():
                await self.bus.publish(subj.gateway(gateway_id), GatewayStep(outputs=deltas))
            await self.bus.flush()
        except Exception:  # NATS already gone: the clients' liveness checks end the requests
            log.warning("stop_notify_failed", requests=len(self.requests))
        self.requests.clear()

    async def handle(self, step: DetokStep) -> None:
        """Process one step and publish its outputs (abort first, then one message per gateway)."""
        out = self.process(step)
        assert self.bus is not None
        if out.aborted:
            await self.bus.publish(self.subjects.abort, AbortRequests(request_ids=out.aborted, reason="stop"))
        if out.lost:
            log.warning("request_state_lost", request_ids=out.lost)
            await self.bus.publish(self.subjects.fail, FailRequests(request_ids=out.lost, error=ServiceError(
                message="the detokenizer lost this request's state (it was restarted); send it again",
                type="server_error", code="request_lost", status=503)))
        for gateway_id, deltas in out.by_gateway.items():
            await self.bus.publish(subj.gateway(gateway_id), GatewayStep(outputs=deltas))

    # ------------------------------------------------------------------ no I/O below

    def process(self, step: DetokStep) -> StepOutputs:
        """Apply one ``DetokStep`` to the shard's state (no I/O)."""
        for request_id in step.released:  # ended by the scheduler: nothing to say
            self.requests.pop(request_id, None)
            self._remember_finished(request_id)
        for new in step.new_requests:
            self._register(new)
        by_gateway: dict[str, list[RequestDelta]] = defaultdict(list)
        aborted: list[str] = []
        lost: list[str] = []
        for update in step.updates:
            req = self.requests.get(update.request_id)
            if req is not None and update.num_output_tokens and \
                    req.num_output_tokens + len(update.new_token_ids) != update.num_output_tokens:
                # an update before this one was lost (a NATS outage): its text would be missing
                log.warning("update_missed", request_id=req.request_id, have=req.num_output_tokens,
                            total=update.num_output_tokens, new=len(update.new_token_ids))
                del self.requests[req.request_id]
                req = None
            if req is None:
                if update.request_id in self._finished:
                    log.debug("update_ignored", request_id=update.request_id, reason="finished")
                elif update.finish_reason is None:  # a last update needs no abort
                    lost.append(update.request_id)
                    self._remember_finished(update.request_id)  # reported once
                continue
            delta = self._apply(req, update)
            by_gateway[req.gateway_id].append(delta)
            if delta.finished:
                del self.requests[req.request_id]
                self._remember_finished(req.request_id)
                if update.finish_reason is None:  # we ended it (stop string): the scheduler must too
                    aborted.append(req.request_id)
                log.info("request_detokenized", request_id=req.request_id, finish_reason=delta.finish_reason,
                         stop_reason=delta.stop_reason, num_output_tokens=delta.num_output_tokens)
        return StepOutputs(by_gateway=dict(by_gateway), aborted=aborted, lost=lost)

    def _remember_finished(self, request_id: str) -> None:
        self._finished[request_id] = None
        if len(self._finished) > RECENTLY_FINISHED:
            self._finished.popitem(last=False)

    def _register(self, new: DetokNewRequest) -> None:
        if new.request_id in self.requests:
            log.warning("duplicate_new_request", request_id=new.request_id)
            return
        params = new.params
        self.requests[new.request_id] = DetokRequest(
            new=new,
            num_output_tokens=new.num_output_tokens,
            detok=IncrementalDetokenizer(
                self.tokenizer,
                new.prompt_tail_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=max(0, params.min_tokens - new.num_output_tokens),
            ),
            prompt_logprobs=self._decode_prompt_logprobs(new),
        )
        new.prompt_logprobs = None  # decoded: only the text travels on

    def _apply(self, req: DetokRequest, update: TokenUpdate) -> RequestDelta:
        det = req.detok
        before = det.num_consumed_tokens
        text = det.add_tokens(update.new_token_ids, stop_terminated=update.finish_reason == "stop")
        consumed = det.num_consumed_tokens - before
        req.num_output_tokens += consumed
        req.num_cached_tokens = max(req.num_cached_tokens, update.num_cached_tokens)
        finish_reason = stop_reason = error = None
        if det.stop_matched is None and update.finish_reason is not None:
            text += det.finish()
        if det.stop_matched is not None:
            finish_reason, stop_reason = "stop", det.stop_matched
        elif update.finish_reason is not None:
            finish_reason, stop_reason = update.finish_reason, update.stop_reason
            if finish_reason == "error":
                error = ServiceError(message="the engine failed while generating this request",
                                     type="internal_server_error", status=500)
        delta = RequestDelta(
            request_id=req.client_request_id,
            index=req.new.index,
            text=text,
            token_ids=list(update.new_token_ids[:consumed]),
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=req.new.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=error,
            logprobs=self._decode_logprobs(update, consumed),
            prompt_logprobs=req.prompt_logprobs or [],
        )
        req.prompt_logprobs = None
        return delta

    def _texts(self) -> TokenTexts:
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.tokenizer)
        return self._token_texts

    def _decode_prompt_logprobs(self, new: DetokNewRequest) -> list[DecodedLogprobs] | None:
        """One entry per prompt token, the first without a log probability; None if not asked
        (or, after a bug upstream, not whole: logged, the request goes on without them)."""
        chunk = new.prompt_logprobs
        if chunk is None or new.first_prompt_token_id is None:
            return None
        if chunk.start != 1 or len(chunk.token_ids) != len(chunk.logprobs):
            log.error("prompt_logprobs_misaligned", request_id=new.request_id, start=chunk.start,
                      num_tokens=len(chunk.token_ids), num_logprobs=len(chunk.logprobs))
            return None
        texts = self._texts()
        try:
            first = DecodedLogprobs(sampled=texts.token(new.first_prompt_token_id, None, None))
            return [first, *(texts.decode(t, lp) for t, lp in zip(chunk.token_ids, chunk.logprobs, strict=True))]
        except Exception:
            log.exception("logprobs_decode_failed", request_id=new.request_id)
            return None

    def _decode_logprobs(self, update: TokenUpdate, consumed: int) -> list[DecodedLogprobs]:
        """The decoded log probabilities of the update's first ``consumed`` tokens (those after
        a matched stop string are dropped with their tokens)."""
        if not update.logprobs:
            return []
        if len(update.logprobs) != len(update.new_token_ids):  # a bug upstream: the text still goes out
            log.error("logprobs_misaligned", request_id=update.request_id, num_tokens=len(update.new_token_ids),
                      num_logprobs=len(update.logprobs))
            return []
        try:
            return [self._texts().decode(t, lp)
                    for t, lp in zip(update.new_token_ids[:consumed], update.logprobs[:consumed], strict=True)]
        except Exception:  # a tokenizer that fails on a token: this request's logprobs only are lost
            log.exception("logprobs_decode_failed", request_id=update.request_id)
            return []

