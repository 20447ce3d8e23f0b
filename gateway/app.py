"""The OpenAI-compatible API: ``create_app(settings, model_info, client) -> FastAPI``.

HTTP endpoints (shapes of the OpenAI API reference and of vLLM's OpenAI server):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON, or Server-Sent Events
  with ``"stream": true`` (``data: {chunk}`` lines, an optional usage chunk with
  ``stream_options.include_usage``, then ``data: [DONE]``).
- ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health`` (200 when the engine is ready).
- ``GET /metrics``: Prometheus text format, vLLM's metric names (see ``gateway/metrics.py``).

Every error body is OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.
Invalid bodies are 400 (never FastAPI's 422), an unknown model is 404, an engine
failure keeps its status (500 when unknown). A client that disconnects before its
request finished has the request aborted.

WebSocket protocol (``/v1/stream``)
-----------------------------------
Several requests can run on one connection, concurrently. Each client message is one
JSON text frame::

    {"type": "completion" | "chat", "id": <any JSON value, optional>, "request": {...}}

``request`` is the body of ``POST /v1/completions`` (``"completion"``) or of
``POST /v1/chat/completions`` (``"chat"``); its ``stream`` field is ignored (results are
always streamed) and ``stream_options.include_usage`` adds the usage chunk. ``id`` is
the client's tag for the request; every server message about the request carries it
(``null`` when none was given). The server answers with JSON text frames:

- ``{"type": "chunk", "id": <tag>, "chunk": {...}}``: one streaming chunk, exactly the
  object an SSE ``data:`` line carries (``text_completion`` or ``chat.completion.chunk``);
- ``{"type": "done", "id": <tag>, "response": {...}}``: the request finished; ``response``
  is the full non-streaming response object (``text_completion`` / ``chat.completion``);
- ``{"type": "error", "id": <tag>, "error": {"message", "type", "param", "code"}}``:
  the request failed (invalid, unknown model, engine error); no ``done`` follows.
  A malformed client message gets an error with the tag it had (``null`` if unreadable).

Errors never close the connection. When the client disconnects, its unfinished
requests are aborted.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats.errors
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from gateway.client import EngineClient, new_request_id
from gateway.metrics import CONTENT_TYPE, GatewayMetrics, RequestTimer
from gateway.protocol import (
    KNOWN_PARAMS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    json_logprob,
)
from shared.config import Settings
from shared.logging import get_logger
from shared.messages import (
    DecodedLogprobs,
    RequestDelta,
    SamplingParams,
    ServiceError,
    TokenizeReply,
    TokenLogprob,
)
from shared.model_source import ModelInfo
from shared.service import engine_ready

log = get_logger(__name__)
T = TypeVar("T")
AnyRequest = CompletionRequest | ChatCompletionRequest
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with an OpenAI-shaped body and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(
            message=message,
            type=type or ("invalid_request_error" if status < 500 else "server_error"),
            param=param,
            code=code,
        )

    @classmethod
    def from_service_error(cls, error: ServiceError) -> APIError:
        return cls(error.status, error.message, type=error.type, param=error.param, code=error.code)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 from pydantic/FastAPI validation errors; ``param`` names the first bad field."""
    parts: list[str] = []
    param: str | None = None
    for err in errors:
        loc = list(err.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error")
            parts.append(f"Invalid JSON body: {detail}" if detail else "Invalid JSON body")
            continue
        named = [x for x in loc if isinstance(x, str)]
        if param is None:
            if named:
                param = named[0]
            elif (m := re.match(r"[A-Za-z_]+", msg)) and m.group(0) in KNOWN_PARAMS:
                param = m.group(0)
        where = ".".join(str(x) for x in loc)
        if where and not (named and msg.startswith(named[0])):
            msg = f"{where}: {msg}"
        elif not where and err.get("type") == "model_attributes_type":  # not a JSON object
            msg = "the body must be a JSON object, sent with Content-Type: application/json"
        elif not where and err.get("type") != "value_error":
            msg = f"body: {msg}"
        if msg not in parts:
            parts.append(msg)
    return APIError(400, "; ".join(parts[:4]) or "invalid request", param=param)


def _prompt_error(error: ServiceError, p: int, num_prompts: int) -> APIError:
    """The error of prompt ``p`` of a request, naming the prompt when the request is a batch."""
    if num_prompts > 1:
        error = error.model_copy(update={"message": f"prompt {p} of the batch: {error.message}"})
    return APIError.from_service_error(error)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


# ---------------------------------------------------------------- one request's output


@dataclass
class _Choice:
    """One sample (``index``) of a request."""

    pieces: list[str] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0
    echoed: bool = False  # its prompt was streamed (echo)
    # streamed echo with logprobs: deltas (and their first text_offset past the prompt) that
    # came before the prompt's log probabilities (sample 0's first delta), sent after them
    held: list[tuple[RequestDelta, int]] = field(default_factory=list)
    logprobs: list[DecodedLogprobs] = field(default_factory=list)  # one per token, if asked
    tokens_text_len: int = 0  # characters in the texts of the tokens of ``logprobs``


@dataclass
class _Part:
    """One prompt of a request and the engine request that serves it (``n`` samples)."""

    engine_id: str
    num_prompt_tokens: int
    timer: RequestTimer
    echo: str = ""  # the prompt text, echoed before each of its samples (completions' echo)
    num_cached_tokens: int = 0
    echo_only: bool = False  # echo with max_tokens 0: what the engine generates is not shown
    # echo with logprobs: the prompt tokens', from sample 0's first delta (None: not yet come)
    prompt_logprobs: list[DecodedLogprobs] | None = None
    prompt_text_len: int = 0  # characters of their tokens' texts: where text_offset goes on

    def take_prompt_logprobs(self, delta: RequestDelta) -> None:
        """Keep the prompt's log probabilities: sample 0's first delta has them (or none)."""
        if self.prompt_logprobs is None and (delta.prompt_logprobs or delta.index == 0):
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_text_len = _tokens_text_len(delta.prompt_logprobs)


class _Generation:
    """One request in flight: folds the ``RequestDelta``s of its engine requests (one per
    prompt, ``parts``; ``n`` samples each, told apart by ``delta.index``) into OpenAI chunks
    and the response. Choice ``p * n + i`` is sample ``i`` of prompt ``p``, as in vLLM."""

    def __init__(self, request_id: str, model: str, include_usage: bool, parts: list[_Part], n: int = 1,
                 continuous_usage: bool = False, logprobs: bool = False, tokens_as_ids: bool = False) -> None:
        self.request_id = request_id
        self.logprobs = logprobs  # choices carry log probabilities
        self.tokens_as_ids = tokens_as_ids  # their tokens named token_id:<id> (return_tokens_as_token_ids)
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far
        self.created = int(time.time())
        self.n = n
        self.parts = parts
        self._part_of = {part.engine_id: p for p, part in enumerate(parts)}
        self.choices = [_Choice() for _ in range(len(parts) * n)]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(part.num_prompt_tokens for part in self.parts)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def unfinished_parts(self) -> list[_Part]:
        """The parts the engine has not ended yet (each sample not finished)."""
        return [part for p, part in enumerate(self.parts)
                if not all(c.finished for c in self.choices[p * self.n:(p + 1) * self.n])]

    def update(self, delta: RequestDelta) -> int:
        """Fold in one delta of one of the parts; its choice index.

        Raises:
            APIError: the engine reported an error for this request (that part has ended).
        """
        p = self._part_of[delta.request_id]
        part = self.parts[p]
        part.timer.observe(delta)
        if delta.error is not None or delta.finish_reason == "error":
            for c in self.choices[p * self.n:(p + 1) * self.n]:
                c.finished = True
            if delta.error is not None:
                raise _prompt_error(delta.error, p, len(self.parts))
            raise APIError(500, "the engine failed while generating this request")
        index = p * self.n + delta.index
        choice = self.choices[index]
        choice.finished = choice.finished or delta.finished
        part.take_prompt_logprobs(delta)
        part.num_prompt_tokens = delta.num_prompt_tokens or part.num_prompt_tokens
        part.num_cached_tokens = max(part.num_cached_tokens, delta.num_cached_tokens)
        if part.echo_only:  # the prompt alone: the token the engine had to generate is not shown
            if delta.finished:
                choice.finish_reason, choice.stop_reason = "length", None
            return index
        choice.pieces.append(delta.text)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
            choice.tokens_text_len += _tokens_text_len(delta.logprobs)
        choice.num_tokens = max(delta.num_output_tokens, choice.num_tokens + len(delta.token_ids))
        if delta.finished:
            choice.finish_reason = delta.finish_reason or "stop"
            choice.stop_reason = delta.stop_reason
        return index

    def usage(self) -> UsageInfo:
        cached = sum(part.num_cached_tokens for part in self.parts)
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            total_tokens=self.num_prompt_tokens + self.num_output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None,
        )

    def choice_usage(self, index: int) -> UsageInfo:
        """The usage so far of choice ``index`` alone: its prompt's tokens and its own output
        (vLLM's ``continuous_usage_stats`` chunks)."""
        part, completion = self.parts[index // self.n], self.choices[index].num_tokens
        return UsageInfo(
            prompt_tokens=part.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=part.num_prompt_tokens + completion,
            prompt_tokens_details=(PromptTokensDetails(cached_tokens=part.num_cached_tokens)
                                   if part.num_cached_tokens else None),
        )

    def echo(self, index: int) -> str:
        """The prompt text choice ``index`` starts with (completions' ``echo``; else "")."""
        return self.parts[index // self.n].echo

    def dump(self, chunk: BaseModel) -> dict[str, Any]:
        """A chunk as JSON-able dict (``usage`` only with ``include_usage``, as OpenAI does)."""
        return chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"})

    def dump_json(self, chunk: BaseModel) -> str:
        return chunk.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def start_chunks(self) -> list[BaseModel]:
        return []

    def delta_chunks(self, delta: RequestDelta, index: int) -> list[BaseModel]:
        """The chunks of one delta folded in as choice ``index``."""
        raise NotImplementedError

    def _has_news(self, delta: RequestDelta) -> bool:
        """Whether a delta makes a chunk: text, an end, or tokens whose log probabilities
        were asked for (their text may still be held back)."""
        return bool(delta.text or delta.finished or (self.logprobs and delta.logprobs))

    def usage_chunk(self) -> BaseModel:
        raise NotImplementedError

    def response(self) -> BaseModel:
        raise NotImplementedError


class _CompletionGeneration(_Generation):
    def _chunk(self, choices: list[CompletionChoice]) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices
        )

    def start_chunks(self) -> list[BaseModel]:
        """The echoed prompts; with logprobs they wait for the prompt's (in the first delta)."""
        if self.logprobs:
            return []
        for c in self.choices:
            c.echoed = True
        return [self._chunk([CompletionChoice(index=i, text=self.echo(i))])
                for i in range(len(self.choices)) if self.echo(i)]

    def delta_chunks(self, delta: RequestDelta, index: int) -> list[BaseModel]:
        p = index // self.n
        part = self.parts[p]
        c = self.choices[index]
        offset = c.tokens_text_len - _tokens_text_len(delta.logprobs)  # its first token's, past the prompt
        if self.logprobs and part.echo and part.prompt_logprobs is None:  # a sample > 0 came first
            c.held.append((delta, offset))
            return []
        chunks: list[BaseModel] = []
        for i in range(p * self.n, (p + 1) * self.n):  # those that waited for the prompt's
            waiting, self.choices[i].held = self.choices[i].held, []
            for d, offset in waiting:
                chunks += self._choice_chunks(d, i, offset)
        return chunks + self._choice_chunks(delta, index, offset)

    def _choice_chunks(self, delta: RequestDelta, index: int, offset: int) -> list[BaseModel]:
        """The chunks of one delta of choice ``index`` (whose first token's text_offset past
        the prompt is ``offset``): the echo first, once."""
        c, part = self.choices[index], self.parts[index // self.n]
        chunks: list[BaseModel] = []
        if not c.echoed:
            c.echoed = True
            if part.echo:
                chunks.append(self._chunk([CompletionChoice(
                    index=index, text=part.echo,
                    logprobs=completion_logprobs(part.prompt_logprobs or [], 0, self.tokens_as_ids))]))
        if part.echo_only:
            news = delta.finished
            text, logprobs = "", None
        else:
            news = self._has_news(delta)
            text = delta.text
            logprobs = (completion_logprobs(delta.logprobs, part.prompt_text_len + offset, self.tokens_as_ids)
                        if self.logprobs else None)
        if news:
            chunks.append(self._chunk([CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason if delta.finished else None,
                stop_reason=c.stop_reason if delta.finished else None,
            )]))
        return chunks

    def usage_chunk(self) -> BaseModel:
        chunk = self._chunk([])
        chunk.usage = self.usage()
        return chunk

    def response(self) -> BaseModel:
        choices = [
            CompletionChoice(index=i, text=self.echo(i) + "".join(c.pieces), finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason,
                             logprobs=completion_logprobs([*(self.parts[i // self.n].prompt_logprobs or ()),
                                                           *c.logprobs], 0, self.tokens_as_ids)
                             if self.logprobs else None)
            for i, c in enumerate(self.choices)
        ]
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )


class _ChatGeneration(_Generation):
    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices
        )

    def start_chunks(self) -> list[BaseModel]:
        return [
            self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(len(self.choices))
        ]

    def delta_chunks(self, delta: RequestDelta, index: int) -> list[BaseModel]:
        if not self._has_news(delta):
            return []
        c = self.choices[index]
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=delta.text or None),
            logprobs=chat_logprobs(delta.logprobs, self.tokens_as_ids) if self.logprobs else None,
            finish_reason=c.finish_reason if delta.finished else None,
            stop_reason=c.stop_reason if delta.finished else None,
        )
        return [self._chunk([choice])]

    def usage_chunk(self) -> BaseModel:
        chunk = self._chunk([])
        chunk.usage = self.usage()
        return chunk

    def response(self) -> BaseModel:
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content="".join(c.pieces)),
                logprobs=chat_logprobs(c.logprobs, self.tokens_as_ids) if self.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(self.choices)
        ]
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )


def _tokens_text_len(items: list[DecodedLogprobs]) -> int:
    """Characters in the texts of the tokens of ``items`` (what a text_offset goes on by)."""
    return sum(len(lp.sampled.token) for lp in items)


def _token_str(t: TokenLogprob, as_ids: bool) -> str:
    """A token as the response names it: its text, or ``token_id:<id>`` with vLLM's
    ``return_tokens_as_token_ids`` (tokens with the same text, parts of one character, stay
    apart)."""
    return f"token_id:{t.token_id}" if as_ids else t.token


def completion_logprobs(items: list[DecodedLogprobs], offset: int, as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's completion ``logprobs`` of ``items``: per token its text, its offset (from
    ``offset``, adding each token's text length, as vLLM), its log probability, and the sampled
    and most likely tokens' log probabilities by text (None for the first prompt token of an
    echo). Where tokens share a text (parts of characters all read U+FFFD) the largest log
    probability is kept, as in vLLM, so the entry's maximum is the true one;
    ``return_tokens_as_token_ids`` (``as_ids``) keeps them apart."""
    out = CompletionLogprobs()
    for lp in items:
        sampled = lp.sampled
        out.text_offset.append(offset)
        offset += len(sampled.token)
        out.tokens.append(_token_str(sampled, as_ids))
        if sampled.logprob is None:  # the first prompt token (echo): nothing before it
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(json_logprob(sampled.logprob))
        top: dict[str, float] = {}
        for t in (sampled, *lp.top):
            key, value = _token_str(t, as_ids), json_logprob(t.logprob)  # type: ignore[arg-type]
            if key not in top or value > top[key]:
                top[key] = value
        out.top_logprobs.append(top)
    return out


def chat_logprobs(items: list[DecodedLogprobs], as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` of ``items``: per token its text (or ``token_id:<id>``,
    ``as_ids``), bytes and log probability, with the ``top_logprobs`` most likely tokens'."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=_token_str(lp.sampled, as_ids), logprob=json_logprob(lp.sampled.logprob),  # type: ignore[arg-type]
            bytes=list(lp.sampled.bytes),
            top_logprobs=[TopLogprob(token=_token_str(t, as_ids), logprob=json_logprob(t.logprob),  # type: ignore[arg-type]
                                     bytes=list(t.bytes))
                          for t in lp.top],
        )
        for lp in items
    ])


# ---------------------------------------------------------------- serving


class _AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls ``on_close`` however the response ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _WebSocketClosed(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    """Return when the HTTP client disconnects (the body has already been read)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
            await asyncio.sleep(0.1)  # a server that repeats body messages: do not spin
    except Exception:  # cannot tell: never report a disconnect
        await asyncio.Future()


class OpenAIServing:
    """The request logic behind the endpoints, shared by HTTP, SSE and WebSocket."""

    def __init__(self, settings: Settings, model_info: ModelInfo, client: EngineClient) -> None:
        self.settings = settings
        self.model_info = model_info
        self.client = client
        self.model_names = {model_info.name, "HuggingFaceTB/" + model_info.name}
        self._background: set[asyncio.Task[None]] = set()
        self.metrics = GatewayMetrics(model_info.name)
        self.draining = False  # set by GatewayService.stop: new requests get a 503

    def check_model(self, name: str | None) -> None:
        """Raises: APIError(404) for a model this gateway does not serve (None: the served one)."""
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def model_card(self) -> ModelCard:
        return ModelCard(
            id=self.model_info.name,
            root=str(self.model_info.path),
            max_model_len=self.model_info.max_model_len,
        )

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort without awaiting (safe inside a cancelled task or a ``finally``)."""
        task = asyncio.get_running_loop().create_task(self._abort(request_ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_background(self) -> None:
        """Wait for the aborts still being published."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _abort(self, request_ids: list[str]) -> None:
        log.info("requests_aborted", request_ids=request_ids)
        try:
            await self.client.abort(request_ids)
        except Exception:
            log.exception("abort_failed", request_ids=request_ids)

    async def begin(self, body: AnyRequest) -> _Generation:
        """Validate ``body`` and submit it: one engine request per prompt (a completions
        batch has several), all accepted or none (the others are aborted).

        Raises:
            APIError: unknown model (404), invalid parameters or a refused prompt (400; a
                streaming request also once the scheduler refused it), no tokenizer or the
                gateway shutting down (503), or no answer from the tokenizer (504).
        """
        arrival = time.perf_counter()
        if self.draining:
            raise APIError(503, "the server is shutting down; send the request to another replica",
                           code="server_shutting_down")
        self.check_model(body.model)
        try:
            params = body.sampling_params()
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        chat = isinstance(body, ChatCompletionRequest)
        request_id = new_request_id("chatcmpl" if chat else "cmpl")
        inputs: list[dict[str, Any]]
        if isinstance(body, ChatCompletionRequest):
            inputs = [dict(messages=body.messages_input(), add_generation_prompt=body.add_generation_prompt)]
        else:
            inputs = [dict(prompt=prompt, return_prompt=body.echo) for prompt in body.prompt_inputs()]
        # one prompt: the engine request has the response's id; a batch: one id per prompt
        engine_ids = [request_id] if len(inputs) == 1 else [f"{request_id}-{p}" for p in range(len(inputs))]
        # a stream: no 200 before the scheduler can no longer refuse it (priority, KV cache
        # size); a batch: every prompt accepted before any output counts
        notify = body.stream or len(inputs) > 1
        running = engine_ids  # those that may run: aborted if the request fails here
        try:
            outcomes = await asyncio.gather(  # a batch's prompts tokenized concurrently
                *(self._submit(engine_id, fields, params, body, notify)
                  for engine_id, fields in zip(engine_ids, inputs, strict=True)),
                return_exceptions=True)
            running = [engine_id for engine_id, outcome in zip(engine_ids, outcomes, strict=True)
                       if not (isinstance(outcome, TokenizeReply) and outcome.error is not None)]
            replies: list[TokenizeReply] = []
            for p, outcome in enumerate(outcomes):
                if isinstance(outcome, BaseException):
                    raise outcome
                if outcome.error is not None:
                    raise _prompt_error(outcome.error, p, len(inputs))
                replies.append(outcome)
            if notify:
                for p, engine_id in enumerate(engine_ids):
                    error = await self.client.wait_accepted(engine_id)
                    if error is not None:
                        raise _prompt_error(error, p, len(inputs))
        except BaseException:  # refused, cancelled (client gone) or connection lost: none runs
            if running:
                self.abort_soon(running)
            raise
        parts = [
            _Part(engine_id, len(reply.prompt_token_ids),
                  self.metrics.timer(params.n, len(reply.prompt_token_ids), arrival), reply.prompt or "",
                  echo_only=isinstance(body, CompletionRequest) and body.echo_only)
            for engine_id, reply in zip(engine_ids, replies, strict=True)
        ]
        log.debug("request_submitted", request_id=request_id, num_prompts=len(parts),
                  num_prompt_tokens=sum(part.num_prompt_tokens for part in parts))
        cls = _ChatGeneration if chat else _CompletionGeneration
        return cls(request_id, self.model_info.name, body.include_usage, parts, params.n, body.continuous_usage,
                   body.wants_logprobs, bool(body.return_tokens_as_token_ids))

    async def _submit(self, engine_id: str, fields: dict[str, Any], params: SamplingParams,
                      body: AnyRequest, notify_accepted: bool) -> TokenizeReply:
        """Send one engine request to the tokenizer; its reply.

        Raises:
            APIError: no tokenizer (503), too large for NATS (413), no answer in time (504).
        """
        try:
            return await self.client.submit(engine_id, sampling_params=params, priority=body.priority,
                                            cache_salt=body.cache_salt, notify_accepted=notify_accepted, **fields)
        except nats.errors.NoRespondersError:
            raise APIError(
                503, f"no tokenizer is serving the model `{self.model_info.name}`", code="service_unavailable"
            ) from None
        except nats.errors.MaxPayloadError:  # refused before sending: nothing to abort
            raise APIError(413, f"the request is larger than the {self.client.bus.nc.max_payload} bytes a NATS "
                                "message may carry here (the NATS server's max_payload)",
                           code="request_too_large") from None
        except nats.errors.TimeoutError:  # it may have been accepted: the caller aborts it
            raise APIError(504, "the tokenizer did not answer in time", code="timeout") from None

    def finish(self, gen: _Generation) -> None:
        """The client is done with ``gen``: abort (and count aborted) what the engine has not ended."""
        unfinished = gen.unfinished_parts()
        for part in unfinished:
            part.timer.aborted()
        if unfinished:
            self.abort_soon([part.engine_id for part in unfinished])

    async def _deltas(self, gen: _Generation) -> AsyncIterator[RequestDelta]:
        """The deltas of every part of ``gen``, as they come (merged when several)."""
        if len(gen.parts) == 1:
            async with aclosing(self.client.stream(gen.parts[0].engine_id)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        merged: asyncio.Queue[RequestDelta | BaseException | None] = asyncio.Queue()

        async def pump(engine_id: str) -> None:
            try:
                async with aclosing(self.client.stream(engine_id)) as deltas:
                    async for delta in deltas:
                        merged.put_nowait(delta)
            except Exception as exc:  # raised to the consumer, as the one-prompt path would
                merged.put_nowait(exc)
            finally:
                merged.put_nowait(None)

        pumps = [asyncio.create_task(pump(part.engine_id)) for part in gen.parts]
        try:
            remaining = len(pumps)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def events(self, gen: _Generation) -> AsyncIterator[BaseModel]:
        """The request's streaming chunks, then its usage chunk if asked for.

        Raises:
            APIError: the engine reported an error mid-stream.
        """
        for chunk in gen.start_chunks():
            if gen.continuous_usage:
                chunk.usage = gen.choice_usage(chunk.choices[0].index)  # type: ignore[attr-defined]
            yield chunk
        async with aclosing(self._deltas(gen)) as deltas:
            async for delta in deltas:
                index = gen.update(delta)
                for chunk in gen.delta_chunks(delta, index):
                    if gen.continuous_usage:
                        chunk.usage = gen.choice_usage(index)  # type: ignore[attr-defined]
                    yield chunk
        if gen.include_usage:
            yield gen.usage_chunk()

    async def collect(self, gen: _Generation) -> BaseModel:
        """Wait for the request to finish; its full response."""
        async with aclosing(self._deltas(gen)) as deltas:
            async for delta in deltas:
                gen.update(delta)
        return gen.response()

    async def sse(self, gen: _Generation) -> AsyncIterator[str]:
        """Server-Sent Events: ``data: {chunk}`` lines, an error event if any, ``data: [DONE]``."""
        try:
            async for chunk in self.events(gen):
                yield f"data: {gen.dump_json(chunk)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception:
            log.exception("stream_failed", request_id=gen.request_id)
            yield f"data: {json.dumps(APIError(500, 'internal error while streaming').body())}\n\n"
        yield "data: [DONE]\n\n"

    async def handle_http(self, body: AnyRequest, request: Request) -> Response:
        """One HTTP request: JSON, or SSE when ``body.stream``; aborted if the client leaves."""
        gen = await self.begin(body)
        headers = {"X-Request-Id": gen.request_id}
        if body.stream:
            return _AbortingStreamingResponse(
                self.sse(gen),
                on_close=lambda: self.finish(gen),
                media_type="text/event-stream",
                headers={**SSE_HEADERS, **headers},
            )
        try:
            response = await _unless_disconnected(request, self.collect(gen))
        finally:
            self.finish(gen)
        if response is None:
            log.info("client_disconnected", request_id=gen.request_id)
            return Response(status_code=499)
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    async def handle_websocket(self, ws: WebSocket) -> None:
        """Serve one WebSocket connection (protocol in this module's docstring)."""
        await ws.accept()
        lock = asyncio.Lock()
        tasks: set[asyncio.Task[None]] = set()

        async def send(message: dict[str, Any]) -> None:
            try:
                async with lock:
                    await ws.send_text(json.dumps(message, ensure_ascii=False))
            except Exception as exc:
                raise _WebSocketClosed() from exc

        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                if data is None:
                    data = (message.get("bytes") or b"").decode("utf-8", errors="replace")
                try:
                    tag, body = _parse_ws_message(data)
                except _BadMessage as bad:
                    await send({"type": "error", "id": bad.tag, "error": bad.error.info.model_dump()})
                    continue
                task = asyncio.create_task(self._ws_request(tag, body, send))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except _WebSocketClosed:
            pass
        finally:
            for task in list(tasks):
                task.cancel()  # each task aborts its own unfinished request

    async def _ws_request(
        self, tag: Any, body: AnyRequest | APIError, send: Callable[[dict[str, Any]], Awaitable[None]]
    ) -> None:
        gen: _Generation | None = None
        try:
            if isinstance(body, APIError):
                raise body
            gen = await self.begin(body)
            async for chunk in self.events(gen):
                await send({"type": "chunk", "id": tag, "chunk": gen.dump(chunk)})
            await send({"type": "done", "id": tag, "response": gen.response().model_dump(mode="json")})
        except _WebSocketClosed:
            pass
        except APIError as exc:
            await _send_quietly(send, {"type": "error", "id": tag, "error": exc.info.model_dump()})
        except Exception:
            log.exception("websocket_request_failed", request_id=gen.request_id if gen else None)
            error = APIError(500, "internal error").info.model_dump()
            await _send_quietly(send, {"type": "error", "id": tag, "error": error})
        finally:
            if gen is not None:
                self.finish(gen)


class _BadMessage(Exception):
    def __init__(self, tag: Any, error: APIError) -> None:
        super().__init__(error.info.message)
        self.tag = tag
        self.error = error


def _parse_ws_message(data: str) -> tuple[Any, AnyRequest | APIError]:
    """(tag, validated request or its validation error) of one client message.

    Raises:
        _BadMessage: the envelope itself is unreadable.
    """
    try:
        envelope = json.loads(data)
    except ValueError as exc:
        raise _BadMessage(None, APIError(400, f"Invalid JSON message: {exc}")) from None
    if not isinstance(envelope, dict):
        raise _BadMessage(None, APIError(400, "a message must be a JSON object"))
    tag = envelope.get("id")
    kind = envelope.get("type")
    models: dict[Any, type[AnyRequest]] = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
    if kind not in models:
        raise _BadMessage(tag, APIError(400, "type must be 'completion' or 'chat'", param="type"))
    request = envelope.get("request")
    if not isinstance(request, dict):
        raise _BadMessage(tag, APIError(400, "request must be a JSON object", param="request"))
    try:  # a WebSocket always streams: its ``stream`` field is ignored
        return tag, models[kind].model_validate({**request, "stream": True})
    except ValidationError as exc:
        return tag, validation_error(exc.errors())


async def _send_quietly(send: Callable[[dict[str, Any]], Awaitable[None]], message: dict[str, Any]) -> None:
    try:
        await send(message)
    except _WebSocketClosed:
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, or None (work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    return None


# ---------------------------------------------------------------- the app


def create_app(settings: Settings, model_info: ModelInfo, client: EngineClient) -> FastAPI:
    """The FastAPI app of one gateway, serving ``model_info.name`` through ``client``."""
    app = FastAPI(title="pagedllm", description="OpenAI-compatible API of pagedllm", version="0.1.0")
    origins = [o.strip() for o in settings.allowed_origins.split(",") if o.strip()]
    if origins:  # browsers' preflight requests (OPTIONS) and CORS headers, as vLLM's defaults
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    serving = OpenAIServing(settings, model_info, client)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(
            exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
        )
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("request_failed", path=request.url.path, error=repr(exc))
        return _error_response(APIError(500, "internal server error"))

    @app.get("/health")
    async def health() -> Response:
        """200 when the engine can serve: NATS is up, every engine service answers a ping
        (each of the ``num_detokenizer_shards`` detokenizer shards) and the scheduler has an
        executor group; else 503 (also while the gateway drains before it stops)."""
        if serving.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if not client.connected:
            raise APIError(503, "the NATS connection is down", code="service_unavailable")
        if not await engine_ready(client.bus, model_info.name, settings.num_detokenizer_shards):
            raise APIError(503, "the engine is not ready (a service or executor group is missing)",
                           code="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (vLLM's names): engine state from the scheduler's statistics,
        request latencies and token counts measured by this gateway."""
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """The one served model."""
        return ModelList(data=[serving.model_card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard)
    async def retrieve_model(model: str) -> ModelCard:
        """The served model by name (404 for any other)."""
        serving.check_model(model)
        return serving.model_card()

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        """OpenAI ``POST /v1/completions`` (JSON, or SSE with ``stream``)."""
        return await serving.handle_http(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI ``POST /v1/chat/completions`` (JSON, or SSE with ``stream``)."""
        return await serving.handle_http(body, request)

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket) -> None:
        """Several streaming requests over one connection (see the module docstring)."""
        await serving.handle_websocket(ws)

    return app
