"""``OpenAIServing``: the request logic behind the endpoints, shared by HTTP, SSE and
WebSocket: validate a request, submit it to the engine (one engine request per prompt),
feed its deltas to its ``Generation`` (``gateway/generation.py``), make its chunks or its
response, and abort what the client no longer waits for (``finish``). The transports send
what it makes: ``gateway/http_handler.py`` (JSON or SSE) and ``gateway/websocket.py``.

A streaming request is answered ``200`` only once the scheduler can no longer refuse it
(it is submitted with ``notify_accepted``), so a refusal is a plain 400. A client that
disconnects before its request finished has the request aborted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import nats.errors
from pydantic import BaseModel, ValidationError

from gateway.chat import ChatGeneration
from gateway.completion import CompletionGeneration
from gateway.errors import APIError, prompt_error, validation_error
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.protocol.requests import AnyRequest, ChatCompletionRequest
from gateway.protocol.responses import ModelCard
from gateway.protocol.structured import name_structured_error
from gateway.tools.choice import NO_TOOLS, ToolUse, tool_use
from shared.bus import RemoteError
from shared.config import Settings
from shared.engine_client import EngineClient, new_request_id
from shared.logging import get_logger
from shared.messages import RequestDelta, SamplingParams, TokenizeReply
from shared.model_source import ModelInfo

log = get_logger(__name__)


@dataclass
class ServedRequest:
    """One request this gateway serves: its output so far, and the metrics timer of each of
    its engine requests (by engine request id)."""

    gen: Generation
    timers: dict[str, RequestTimer]


def engine_requests(body: AnyRequest, tools: ToolUse = NO_TOOLS) -> tuple[str, list[str], list[dict[str, Any]]]:
    """How one OpenAI request maps to engine requests: the response's id, and per prompt (a
    completions batch has several) its engine request id and the tokenizer's inputs (the
    ``EngineClient.submit`` fields; a chat's tools for its template). One prompt: the engine
    request has the response's id; a batch: ``<id>-<p>`` for prompt ``p``."""
    chat = isinstance(body, ChatCompletionRequest)
    request_id = new_request_id("chatcmpl" if chat else "cmpl")
    inputs: list[dict[str, Any]]
    if isinstance(body, ChatCompletionRequest):
        inputs = [dict(messages=body.messages_input(), add_generation_prompt=body.add_generation_prompt,
                       tools=tools.template_tools)]
    else:
        inputs = [dict(prompt=prompt, return_prompt=body.echo) for prompt in body.prompt_inputs()]
    engine_ids = [request_id] if len(inputs) == 1 else [f"{request_id}-{p}" for p in range(len(inputs))]
    return request_id, engine_ids, inputs


def new_generation(body: AnyRequest, request_id: str, model: str,
                   prompts: list[tuple[str, TokenizeReply]], tools: ToolUse = NO_TOOLS) -> Generation:
    """The endpoint's ``Generation`` of ``body`` over its engine requests' ``(id, tokenizer
    reply)``; a chat's ``tools`` say how its calls are read."""
    if isinstance(body, ChatCompletionRequest):
        return ChatGeneration(request_id, model, body, prompts, tools)
    return CompletionGeneration(request_id, model, body, prompts)


class OpenAIServing:
    """The request logic behind the endpoints, shared by HTTP, SSE and WebSocket."""

    def __init__(self, settings: Settings, model_info: ModelInfo, client: EngineClient,
                 background: bool = False) -> None:
        self.settings = settings
        self.background = background  # the batch service's: its requests yield to interactive ones
        self.model_info = model_info
        self.client = client
        self.model_names = {model_info.name, "HuggingFaceTB/" + model_info.name}
        self._background: set[asyncio.Task[None]] = set()
        self.metrics = GatewayMetrics(model_info.name, resubmitted=lambda: client.num_resubmitted)
        self.draining = False  # set by GatewayService.stop: new requests get a 503

    def check_model(self, name: str | None) -> None:
        """Raises: APIError(404) for a model this gateway does not serve (None: the served one)."""
        if name is not None and name not in self.model_names:
            raise APIError.of(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

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

    async def begin(self, body: AnyRequest) -> ServedRequest:
        """Validate ``body`` and submit it: one engine request per prompt (a completions
        batch has several), all accepted or none (the others are aborted).

        Raises:
            APIError: unknown model (404), invalid parameters or a refused prompt (400; a
                streaming request also once the scheduler refused it), no tokenizer or the
                gateway shutting down (503), or no answer from the tokenizer (504).
        """
        arrival = time.perf_counter()
        if self.draining:
            raise APIError.of(503, "the server is shutting down; send the request to another replica",
                              code="server_shutting_down")
        self.check_model(body.model)
        tools = tool_use(body, self.settings) if isinstance(body, ChatCompletionRequest) else NO_TOOLS
        try:
            params = tools.sampling_params(body.sampling_params())
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        except ValueError as exc:  # SamplingParams' own check (a msgspec record, not pydantic)
            raise validation_error([{"msg": str(exc), "type": "value_error"}]) from None
        request_id, engine_ids, inputs = engine_requests(body, tools)
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
                    error = name_structured_error(outcome.error, "tools" if tools.schema is not None
                                                  else body.structured_outputs_path)
                    raise prompt_error(error, p, len(inputs))
                replies.append(outcome)
            if notify:
                for p, engine_id in enumerate(engine_ids):
                    error = await self.client.wait_accepted(engine_id)
                    if error is not None:
                        raise prompt_error(error, p, len(inputs))
        except BaseException:  # refused, cancelled (client gone) or connection lost: none runs
            if running:
                self.abort_soon(running)
            raise
        prompts = list(zip(engine_ids, replies, strict=True))
        gen = new_generation(body, request_id, self.model_info.name, prompts, tools)
        timers = {engine_id: self.metrics.timer(params.n, len(reply.prompt_token_ids), arrival)
                  for engine_id, reply in prompts}
        log.debug("request_submitted", request_id=request_id, num_prompts=len(prompts),
                  num_prompt_tokens=gen.num_prompt_tokens)
        return ServedRequest(gen, timers)

    async def _submit(self, engine_id: str, fields: dict[str, Any], params: SamplingParams,
                      body: AnyRequest, notify_accepted: bool) -> TokenizeReply:
        """Send one engine request to the tokenizer; its reply.

        Raises:
            APIError: no tokenizer (503), too large for NATS (413), no answer in time (504), the
                tokenizer failed on it (its error's status: 500, or 400 when it could not read it).
        """
        try:
            return await self.client.submit(engine_id, sampling_params=params, priority=body.priority,
                                            cache_salt=body.cache_salt, notify_accepted=notify_accepted,
                                            background=self.background, **fields)
        except nats.errors.NoRespondersError:
            raise APIError.of(
                503, f"no tokenizer is serving the model `{self.model_info.name}`", code="service_unavailable"
            ) from None
        except nats.errors.MaxPayloadError:  # refused before sending: nothing to abort
            raise APIError.of(413, f"the request is larger than the {self.client.bus.nc.max_payload} bytes a "
                                   "NATS message may carry here (the NATS server's max_payload)",
                              code="request_too_large") from None
        except nats.errors.TimeoutError:  # it may have been accepted: the caller aborts it
            raise APIError.of(504, "the tokenizer did not answer in time", code="timeout") from None
        except RemoteError as exc:  # its handler raised (maybe after submitting: the caller aborts it)
            raise APIError.of(exc.error.status, f"the tokenizer failed on this request: {exc.error.message}",
                              code="tokenizer_error") from None

    def finish(self, served: ServedRequest) -> None:
        """The client is done with ``served``: abort (and count aborted) what the engine has not ended."""
        unfinished = served.gen.unfinished_ids()
        for engine_id in unfinished:
            served.timers[engine_id].aborted()
        if unfinished:
            self.abort_soon(unfinished)

    async def _deltas(self, served: ServedRequest) -> AsyncIterator[RequestDelta]:
        """The deltas of every part of the request, as they come (merged when several), each
        observed by its timer."""
        engine_ids = served.gen.engine_ids
        if len(engine_ids) == 1:
            async with aclosing(self.client.stream(engine_ids[0])) as deltas:
                async for delta in deltas:
                    served.timers[delta.request_id].observe(delta)
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

        pumps = [asyncio.create_task(pump(engine_id)) for engine_id in engine_ids]
        try:
            remaining = len(pumps)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    served.timers[item.request_id].observe(item)
                    yield item
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def events(self, served: ServedRequest) -> AsyncIterator[BaseModel]:
        """The request's streaming chunks, then its usage chunk if asked for.

        Raises:
            APIError: the engine reported an error mid-stream.
        """
        gen = served.gen
        for chunk in gen.first_chunks():
            yield chunk
        async with aclosing(self._deltas(served)) as deltas:
            async for delta in deltas:
                for chunk in gen.chunks(delta):
                    yield chunk
        for chunk in gen.last_chunks():
            yield chunk

    async def collect(self, served: ServedRequest) -> BaseModel:
        """Wait for the request to finish; its full response."""
        async with aclosing(self._deltas(served)) as deltas:
            async for delta in deltas:
                served.gen.update(delta)
        return served.gen.response()
