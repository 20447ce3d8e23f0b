"""The WebSocket protocol (``/v1/stream``): several streaming requests over one connection.

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
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import WebSocket
from pydantic import ValidationError

from gateway.errors import APIError, validation_error
from gateway.protocol.requests import AnyRequest, ChatCompletionRequest, CompletionRequest
from gateway.serving import OpenAIServing, ServedRequest
from shared.logging import get_logger

log = get_logger(__name__)
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def handle_websocket(serving: OpenAIServing, ws: WebSocket) -> None:
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
                await send({"type": "error", "id": bad.tag, "error": bad.api_error.info()})
                continue
            task = asyncio.create_task(_ws_request(serving, tag, body, send))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    except _WebSocketClosed:
        pass
    finally:
        for task in list(tasks):
            task.cancel()  # each task aborts its own unfinished request


async def _ws_request(serving: OpenAIServing, tag: Any, body: AnyRequest | APIError, send: Send) -> None:
    """Serve one request of a connection: its chunks, then ``done`` or an ``error``."""
    served: ServedRequest | None = None
    try:
        if isinstance(body, APIError):
            raise body
        served = await serving.begin(body)
        async for chunk in serving.events(served):
            await send({"type": "chunk", "id": tag, "chunk": served.gen.dump(chunk)})
        await send({"type": "done", "id": tag, "response": served.gen.response().model_dump(mode="json")})
    except _WebSocketClosed:
        pass
    except APIError as exc:
        await _send_quietly(send, {"type": "error", "id": tag, "error": exc.info()})
    except Exception:
        log.exception("websocket_request_failed", request_id=served.gen.request_id if served else None)
        error = APIError.of(500, "internal error").info()
        await _send_quietly(send, {"type": "error", "id": tag, "error": error})
    finally:
        if served is not None:
            serving.finish(served)


class _WebSocketClosed(Exception):
    pass


class _BadMessage(Exception):
    def __init__(self, tag: Any, api_error: APIError) -> None:
        super().__init__(api_error.error.message)
        self.tag = tag
        self.api_error = api_error


def _parse_ws_message(data: str) -> tuple[Any, AnyRequest | APIError]:
    """(tag, validated request or its validation error) of one client message.

    Raises:
        _BadMessage: the envelope itself is unreadable.
    """
    try:
        envelope = json.loads(data)
    except ValueError as exc:
        raise _BadMessage(None, APIError.of(400, f"Invalid JSON message: {exc}")) from None
    if not isinstance(envelope, dict):
        raise _BadMessage(None, APIError.of(400, "a message must be a JSON object"))
    tag = envelope.get("id")
    kind = envelope.get("type")
    models: dict[Any, type[AnyRequest]] = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
    if kind not in models:
        raise _BadMessage(tag, APIError.of(400, "type must be 'completion' or 'chat'", param="type"))
    request = envelope.get("request")
    if not isinstance(request, dict):
        raise _BadMessage(tag, APIError.of(400, "request must be a JSON object", param="request"))
    try:  # a WebSocket always streams: its ``stream`` field is ignored
        return tag, models[kind].model_validate({**request, "stream": True})
    except ValidationError as exc:
        return tag, validation_error(exc.errors())


async def _send_quietly(send: Send, message: dict[str, Any]) -> None:
    try:
        await send(message)
    except _WebSocketClosed:
        pass
