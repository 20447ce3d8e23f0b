"""The gateway's errors: ``APIError`` (a ``ServiceError`` raised, with its HTTP status) and the
validation errors of request bodies, answered as OpenAI error bodies::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

An engine error keeps its status (``ServiceError.status``) from the service that raised it
to the HTTP answer. Invalid bodies are 400 (never FastAPI's 422), with ``param`` naming the
first bad field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gateway.protocol.requests import KNOWN_PARAMS
from shared.messages import ServiceError


class APIError(Exception):
    """An error answered with an OpenAI-shaped body and an HTTP status: ``error`` raised.

    Args:
        error: its status and the body's fields (from a service, or made here by ``of``).
    """

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error

    @classmethod
    def of(
        cls,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> APIError:
        """A gateway's own error; ``type`` defaults to ``invalid_request_error`` below 500,
        else ``server_error``."""
        return cls(ServiceError(
            message=message,
            type=type or ("invalid_request_error" if status < 500 else "server_error"),
            param=param,
            code=code,
            status=status,
        ))

    @property
    def status(self) -> int:
        return self.error.status

    def info(self) -> dict[str, Any]:
        """The inner object of the error body: ``{"message", "type", "param", "code"}``."""
        return self.error.model_dump(exclude={"status"})

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": info}``."""
        return {"error": self.info()}


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
    return APIError.of(400, "; ".join(parts[:4]) or "invalid request", param=param)


def prompt_error(error: ServiceError, p: int, num_prompts: int) -> APIError:
    """The error of prompt ``p`` of a request, naming the prompt when the request is a batch."""
    if num_prompts > 1:
        error = error.model_copy(update={"message": f"prompt {p} of the batch: {error.message}"})
    return APIError(error)
