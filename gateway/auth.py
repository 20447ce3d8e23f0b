"""API keys, as vLLM's ``--api-key``: every ``/v1`` route and the ``/v1/stream`` WebSocket need
``Authorization: Bearer <key>`` with one of ``Settings.api_key``'s keys (comma-separated;
``PAGEDLLM_API_KEY``). Without it an HTTP request gets a 401 with an OpenAI-shaped body (as
OpenAI's ``invalid_api_key``) and a WebSocket handshake is refused (close code 1008, policy
violation). ``/health`` and ``/metrics`` stay open; so do CORS preflights (``OPTIONS``), which
browsers send without credentials. Keys are compared in constant time (``hmac.compare_digest``,
every key tried).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

PROTECTED_PREFIX = "/v1"


def parse_api_keys(value: str | None) -> list[str]:
    """The keys of ``Settings.api_key`` (comma-separated, blanks dropped); [] = no authentication."""
    return [key.strip() for key in (value or "").split(",") if key.strip()]


def key_matches(presented: str, keys: list[str]) -> bool:
    """Whether ``presented`` is one of ``keys``, in time independent of where they differ."""
    found = False
    for key in keys:  # no early exit: the time does not say which key came close
        found |= hmac.compare_digest(presented.encode(), key.encode())
    return found


class APIKeyMiddleware:
    """ASGI middleware refusing ``/v1`` requests without a valid bearer key."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] not in ("http", "websocket") or not scope["path"].startswith(PROTECTED_PREFIX)
                or (scope["type"] == "http" and scope["method"] == "OPTIONS") or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
            return
        body = json.dumps({"error": {
            "message": "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and key_matches(token.strip(), self.keys)
        return False
