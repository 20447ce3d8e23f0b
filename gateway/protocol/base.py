"""``OpenAIRequest``: the base of request bodies.

Unknown request fields are ignored and logged, as vLLM does. A field that is known (to
OpenAI or vLLM) but whose value this engine cannot honour (``prompt_logprobs``, ``best_of``,
``guided_whitespace_pattern``, a chat's ``echo``, ...) fails validation with a message that starts with the
field's name, so the error's ``param`` names it: ignoring it would change what the output
means. Every integer that reaches the engine must fit a signed 64-bit integer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from shared.logging import get_logger
from shared.messages import INT64_MAX, INT64_MIN

log = get_logger(__name__)

#: (field, accepts(value), what is supported) for known fields with unsupported values
Unsupported = tuple[tuple[str, Callable[[Any], bool], str], ...]


def _int_out_of_range(value: Any) -> int | None:
    """The first integer in ``value``, at any depth of lists and dicts, outside int64; else None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not (INT64_MIN <= item <= INT64_MAX):
                return item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


#: the fields that travel to the services (msgpack and torch take int64 at most); a chat
#: message's extra keys and the tools go to the chat template with it
_ENGINE_INT_FIELDS = ("prompt", "messages", "tools", "n", "max_tokens", "max_completion_tokens", "seed", "top_k",
                      "priority", "stop_token_ids")


class OpenAIRequest(BaseModel):
    """Base of request bodies: unknown fields are ignored (as in vLLM). Every integer that
    reaches the engine must fit a signed 64-bit integer (the services' messages carry int64)."""

    model_config = ConfigDict(extra="ignore")

    unsupported_values: ClassVar[Unsupported] = ()

    @model_validator(mode="before")
    @classmethod
    def _ints_fit_int64(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in _ENGINE_INT_FIELDS:
                if name in data and (bad := _int_out_of_range(data[name])) is not None:
                    raise ValueError(f"{name}: {bad} is out of range; integers must be between {INT64_MIN} "
                                     f"and {INT64_MAX}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved_fields(cls, data: Any) -> Any:
        """Refuse the OpenAI / vLLM fields this server does not implement when they ask for
        something (``_UNSERVED_FIELDS``); log the unknown ones it ignores, as vLLM does."""
        if not isinstance(data, dict):
            return data
        for name, is_noop, what in _UNSERVED_FIELDS:
            if name in data and not is_noop(data[name]):
                raise ValueError(f"{name} is not supported by this server ({what})")
        ignored = sorted(k for k in data if k not in cls.model_fields and k not in UNSERVED_NAMES)
        if ignored:
            log.warning("request_fields_ignored", fields=ignored)
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> OpenAIRequest:
        for name, accepts, supported in self.unsupported_values:
            value = getattr(self, name)
            if not accepts(value):
                raise ValueError(f"{name}={json.dumps(value, default=str)} is not supported; {supported}")
        return self


def is_none(v: Any) -> bool:
    return v is None


def is_false(v: Any) -> bool:
    return not v


def one_or_none(v: Any) -> bool:
    return v is None or v == 1


def _is_empty(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def _is_true_or_none(v: Any) -> bool:
    return v is None or v is True


#: (field, is_noop(value), what it does) of OpenAI and vLLM request fields not implemented
#: here: refused when present with a value other than their no-op one
_UNSERVED_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("guided_decoding_backend", _is_empty, "the structured output backend is chosen by the server"),
    ("guided_whitespace_pattern", _is_empty, "a JSON whitespace pattern (structured_outputs."
                                            "disable_any_whitespace is supported)"),
    ("bad_words", _is_empty, "banned words"),
    ("allowed_token_ids", _is_empty, "restricting the vocabulary"),
    ("prompt_logprobs", _is_empty, "log probabilities of the prompt"),
    ("truncate_prompt_tokens", _is_empty, "prompt truncation"),
    ("chat_template_kwargs", _is_empty, "the model's chat template is rendered with its defaults"),
    ("mm_processor_kwargs", _is_empty, "multimodal inputs"),
    ("documents", _is_empty, "documents for the chat template"),
    ("logits_processors", _is_empty, "custom logits processors"),
    ("prompt_embeds", _is_empty, "prompt embeddings"),
    ("functions", _is_empty, "the legacy functions API; use tools"),
    ("function_call", lambda v: _is_empty(v) or v == "none", "the legacy functions API; use tool_choice"),
    ("audio", _is_empty, "audio output"),
    ("modalities", lambda v: _is_empty(v) or v == ["text"], "only text output"),
    ("spaces_between_special_tokens", _is_true_or_none, "special tokens are always decoded with spaces"),
)
UNSERVED_NAMES = frozenset(name for name, _, _ in _UNSERVED_FIELDS)

