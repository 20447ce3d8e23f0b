"""What every message shares: the pydantic base of the control messages, the typed error
that travels between services, and the limits the messages are checked against."""

from __future__ import annotations

from typing import Literal

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
