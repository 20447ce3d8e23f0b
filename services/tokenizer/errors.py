"""``TokenizeError``: a request the tokenizer refuses, with the typed error sent back."""

from __future__ import annotations

from shared.messages import ServiceError


class TokenizeError(Exception):
    """A request the tokenizer refuses; ``error`` is the typed error sent back (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.error = ServiceError(message=message, type="invalid_request_error", param=param, code=code)
