"""What every message shares: the pydantic base of the control messages, the msgspec base of
the records that travel whole (``Record``), the typed error that travels between services, the
limits the messages are checked against, and ``decoding``: the context in which a decoded
record is not checked again (its values were checked where it was built)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import msgspec
from msgspec import Struct
from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_N = 64  # most samples of one prompt (``n``)
MAX_LOGPROBS = 20  # most alternatives per sampled token (``logprobs``; vLLM's default max_logprobs)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the range every integer of a message must fit (msgpack, torch)
#: temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
#: float32-underflowing temperature would give inf / NaN probabilities
GREEDY_TEMPERATURE = 1e-5


class Message(BaseModel):
    """Base of every pydantic wire message: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class ServiceError(Message):
    """A typed error that travels between services and becomes an OpenAI-shaped error body."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    status: int = 400


class Record(Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """Base of the msgspec records built once at the edge and carried whole between services
    (``RequestSpec``, ``SamplingParams``, ...): defaults stay off the wire, unknown fields are
    refused on decode. Unlike a pydantic model a struct checks nothing when built in code: a
    record with values to check does it in ``__post_init__`` unless it is being decoded
    (:func:`decoding`), so that it is checked once, where it is made."""

    def _coerce(self, **given: Any) -> None:
        """Give every field its declared type, as msgspec's lax conversion does (``1`` for a
        float, a dict for a nested record), from its value or from ``given``.

        Raises:
            ValueError: a value of the wrong type; the message names the field.
        """
        raw = {**msgspec.structs.asdict(self), **given}
        try:
            with decoding():
                typed = msgspec.convert(raw, type(self), strict=False)
        except msgspec.ValidationError as exc:
            message, _, where = str(exc).partition(" - at `$.")
            name = where.rstrip("`").split(".")[0].split("[")[0] or type(self).__name__
            raise ValueError(f"{name}: {message}") from None
        for name in self.__struct_fields__:
            Struct.__setattr__(self, name, getattr(typed, name))


class _Decoding(threading.local):
    active = False


_decoding = _Decoding()


@contextmanager
def decoding() -> Iterator[None]:
    """Within it, records built (by a msgspec decoder, ``msgspec.structs.replace`` or code that
    derives one checked record from another) skip their value checks: msgspec still checks
    every field's type on decode. Per thread."""
    outer = _decoding.active
    _decoding.active = True
    try:
        yield
    finally:
        _decoding.active = outer


def is_decoding() -> bool:
    """Whether a record being built now skips its value checks (:func:`decoding`)."""
    return _decoding.active
