"""A fake engine for the gateway's tests.

Its answers, with no I/O: the tokenizer's reply (one token per prompt word) and the deltas
that spell "The capital of France is Paris." (one word per token, cut at ``max_tokens``).
The tests of ``gateway/generation.py`` fold them directly; ``FakeBackend`` (a tokenizer +
detokenizer stand-in on a real nats-server, for the HTTP, SSE and WebSocket tests) publishes
them. A prompt (a chat's last message) that starts with "SAY:" is answered with the rest of
it instead, in pieces of ``SAY_PIECE`` characters. Prompts containing "slow" produce one delta and then wait for an abort; with
"children first" the samples of n > 1 come last to first; prompts containing "fail" end with
an engine error, "refuse" is refused by the scheduler after tokenization, "lost once" is
lost by the engine (a ``request_lost`` error) before any output and answered when the gateway
sends it again; ``max_tokens`` above 100 is refused by the fake tokenizer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from shared import subjects
from shared.bus import Bus
from shared.messages import (
    AbortRequests,
    DecodedLogprobs,
    GatewayStep,
    GroupStats,
    RequestDelta,
    SamplingParams,
    SchedulerStats,
    ServiceError,
    StatsQuery,
    TokenizeReply,
    TokenizeRequest,
    TokenLogprob,
)
from shared.pings import answer_pings, engine_ping_names
from shared.subjects import TOKENIZER_QUEUE, Subjects

ANSWER = ["The", " capital", " of", " France", " is", " Paris."]
FULL = "".join(ANSWER)
PROMPT = "What is the capital of France?"  # 6 words = 6 prompt tokens


def fake_logprobs(i: int, piece: str, num_top: int) -> DecodedLogprobs:
    """Output token ``i`` (text ``piece``): log probability -i / 10 (the first is -inf: JSON
    has none), rank 1; alternatives "alt0", "alt1", ... at -1, -2, ..."""
    sampled = TokenLogprob(token_id=100 + i, token=piece, bytes=piece.encode(),
                           logprob=-i / 10 if i else float("-inf"), rank=1)
    alts = [TokenLogprob(token_id=900 + k, token=f"alt{k}", bytes=f"alt{k}".encode(), logprob=-1.0 - k,
                         rank=k + 1) for k in range(num_top)]
    return DecodedLogprobs(sampled=sampled, top=alts)


def fake_prompt_logprobs(text: str, num_top: int) -> list[DecodedLogprobs]:
    """Prompt word ``i`` (text " word" but the first): log probability -i, the first None."""
    words = text.split()
    out = []
    for i, w in enumerate(words):
        piece = w if i == 0 else " " + w
        token = TokenLogprob(token_id=i, token=piece, bytes=piece.encode(), logprob=-float(i) if i else None,
                             rank=1 if i else None)
        alts = [] if not i else [TokenLogprob(token_id=900 + k, token=f"alt{k}", bytes=f"alt{k}".encode(),
                                              logprob=-10.0 - k, rank=k + 1) for k in range(num_top)]
        out.append(DecodedLogprobs(sampled=token, top=alts))
    return out


def fake_tokenize(prompt: str | list[int] | None = None,
                  messages: list[dict[str, Any]] | None = None, return_prompt: bool = False
                  ) -> tuple[str, TokenizeReply]:
    """(the prompt's text, the tokenizer's reply): token ids as given, or one per word of the
    prompt (a chat's: its last message's content); the text back with ``return_prompt``."""
    if isinstance(prompt, list):
        text, prompt_ids = "", prompt
    else:
        text = prompt if prompt is not None else str(messages[-1]["content"])  # type: ignore[index]
        prompt_ids = list(range(len(text.split())))
    return text, TokenizeReply(prompt_token_ids=prompt_ids, prompt=text if return_prompt else None)


SAY_PIECE = 5


def answer_of(text: str) -> list[str]:
    """The pieces of the answer to ``text``: ``ANSWER``, or what follows "SAY:" cut in pieces."""
    if text.startswith("SAY:"):
        said = text.removeprefix("SAY:")
        return [said[i:i + SAY_PIECE] for i in range(0, len(said), SAY_PIECE)]
    return ANSWER


def answer_steps(request_id: str, text: str, num_prompt: int, params: SamplingParams) -> list[list[RequestDelta]]:
    """The deltas of one engine request, one list per step (a piece of ``answer_of(text)`` for
    every sample; with "children first" in the prompt the samples come last to first). Every
    sample gets the same answer; the prompt's log probabilities come with sample 0's first."""
    answer = answer_of(text)
    pieces = answer[:params.max_tokens or len(answer)]
    order = range(params.n)[::-1] if "children first" in text else range(params.n)
    steps = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        steps.append([RequestDelta(
            request_id=request_id,
            index=index,
            text=piece,
            token_ids=[100 + i],
            logprobs=[] if params.logprobs is None else [fake_logprobs(i, piece, params.logprobs)],
            prompt_logprobs=(fake_prompt_logprobs(text, params.prompt_logprobs)
                             if params.prompt_logprobs is not None and i == 0 and index == 0 else []),
            finished=last,
            finish_reason=("stop" if len(pieces) == len(answer) else "length") if last else None,
            num_prompt_tokens=num_prompt,
            num_output_tokens=i + 1,
        ) for index in order])
    return steps


class FakeBackend:
    """Tokenizer + detokenizer stand-in that records what the gateway sends."""

    def __init__(self, bus: Bus, model: str) -> None:
        self.bus = bus
        self.model = model
        self.subjects = Subjects(model)
        self.requests: dict[str, TokenizeRequest] = {}
        self.aborted: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.bus.subscribe(
            self.subjects.tokenize, TokenizeRequest, self._on_tokenize, queue=TOKENIZER_QUEUE
        )
        await self.bus.subscribe(self.subjects.abort, AbortRequests, self._on_abort)
        await self.bus.subscribe(self.subjects.stats_get, StatsQuery, self._on_stats)
        for service in engine_ping_names(1):
            await answer_pings(self.bus, self.model, service)
        await self.bus.flush()

    async def _on_stats(self, _: StatsQuery) -> SchedulerStats:
        group = GroupStats(group_id="g0", num_blocks=8, num_free_blocks=8, block_size=16, num_running=0)
        return SchedulerStats(num_running=0, num_waiting=0, groups=[group])

    async def _on_abort(self, message: AbortRequests) -> None:
        for request_id in message.request_ids:
            self.aborted.append(request_id)
            self._abort_events.setdefault(request_id, asyncio.Event()).set()

    async def wait_aborted(self, request_id: str, timeout: float = 5.0) -> None:
        await asyncio.wait_for(self._abort_events.setdefault(request_id, asyncio.Event()).wait(), timeout)

    async def _on_tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        self.requests[req.spec.request_id] = req
        if req.prompt == "tokenizer-bug":  # a tokenizer whose handler fails on this request
            raise RuntimeError("tokenizer bug")
        params = req.spec.sampling_params
        if params.max_tokens is not None and params.max_tokens > 100:
            error = ServiceError(
                message=f"max_tokens={params.max_tokens} is too large: prompt + max_tokens exceeds max_model_len=106",
                param="max_tokens",
            )
            return TokenizeReply(error=error)
        text, reply = fake_tokenize(req.prompt, req.messages, req.return_prompt)
        task = asyncio.create_task(self._generate(req, text, len(reply.prompt_token_ids)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return reply

    async def _send(self, req: TokenizeRequest, **fields: Any) -> None:
        await self._publish(req, RequestDelta(request_id=req.spec.request_id, **fields))

    async def _publish(self, req: TokenizeRequest, delta: RequestDelta) -> None:
        await self.bus.publish(subjects.gateway(req.spec.gateway_id), GatewayStep(outputs=[delta]))

    async def _generate(self, req: TokenizeRequest, text: str, num_prompt: int) -> None:
        await asyncio.sleep(0.01)
        if "refuse" in text:  # as the scheduler refuses (priority, KV cache too small) after tokenizing
            error = ServiceError(message="priority=-1 needs --scheduling-policy priority", param="priority")
            await self._send(req, finished=True, finish_reason="error", error=error)
            return
        if req.spec.notify_accepted:  # as the scheduler, once queued
            await self.bus.publish(subjects.gateway(req.spec.gateway_id), GatewayStep(accepted=[req.spec.request_id]))
        if "lost once" in text and "~" not in req.spec.request_id:  # a first attempt, not a resubmission
            error = ServiceError(message="the detokenizer stopped", type="server_error", code="request_lost",
                                 status=503)
            await self._send(req, finished=True, finish_reason="error", error=error)
            return
        if "slow" in text:
            await self._send(
                req, text="Hello", token_ids=[7], num_prompt_tokens=num_prompt, num_output_tokens=1
            )
            await self.wait_aborted(req.spec.request_id, timeout=10)
            return
        if "fail" in text:
            await self._send(
                req, text="Oops", token_ids=[7], num_prompt_tokens=num_prompt, num_output_tokens=1
            )
            error = ServiceError(message="executor group g0 failed", type="internal_error", status=500)
            await self._send(req, finished=True, finish_reason="error", error=error)
            return
        for step in answer_steps(req.spec.request_id, text, num_prompt, req.spec.sampling_params):
            for delta in step:
                await self._publish(req, delta)
            await asyncio.sleep(0.005)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The error object of an OpenAI error body with ``status`` (and ``param``, if given)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]
