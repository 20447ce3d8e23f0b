"""Answering one HTTP request to ``POST /v1/completions`` or ``/v1/chat/completions``:
``handle_http(serving, body, request)``, the HTTP counterpart of ``gateway/websocket.py``.

The request logic (validate, submit, the deltas and what they make) is ``OpenAIServing``'s
(``gateway/serving.py``); this module sends its result as one JSON response, or with
``"stream": true`` as Server-Sent Events (``data: {chunk}`` lines, an error event if any,
then ``data: [DONE]``). A client that disconnects first has its request aborted: a JSON
request's client is watched while it runs (then answered 499), a stream's ends the stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import APIError
from gateway.protocol.requests import AnyRequest
from gateway.serving import OpenAIServing, ServedRequest
from shared.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def handle_http(serving: OpenAIServing, body: AnyRequest, request: Request) -> Response:
    """One HTTP request: JSON, or SSE when ``body.stream``; aborted if the client leaves."""
    served = await serving.begin(body)
    headers = {"X-Request-Id": served.gen.request_id}
    if body.stream:
        return _AbortingStreamingResponse(
            sse(serving, served),
            on_close=lambda: serving.finish(served),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    try:
        response = await _unless_disconnected(request, serving.collect(served))
    finally:
        serving.finish(served)
    if response is None:
        log.info("client_disconnected", request_id=served.gen.request_id)
        return Response(status_code=499)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


async def sse(serving: OpenAIServing, served: ServedRequest) -> AsyncIterator[str]:
    """Server-Sent Events: ``data: {chunk}`` lines, an error event if any, ``data: [DONE]``."""
    try:
        async for chunk in serving.events(served):
            yield f"data: {served.gen.dump_json(chunk)}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception:
        log.exception("stream_failed", request_id=served.gen.request_id)
        yield f"data: {json.dumps(APIError.of(500, 'internal error while streaming').body())}\n\n"
    yield "data: [DONE]\n\n"


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
