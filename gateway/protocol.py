"""OpenAI-compatible request and response shapes: the subset pagedllm serves.

Field names and defaults follow the OpenAI API reference and vLLM's OpenAI server
(``top_k``, ``priority``, ``stop_token_ids``, ``ignore_eos`` ... are vLLM extensions).
Unknown request fields are ignored and logged, as vLLM does. A field that is known (to
OpenAI or vLLM) but whose value this engine cannot honour (``prompt_logprobs``, ``best_of``,
guided decoding, a chat's ``echo``, ...) fails validation with a message that starts with the
field's name, so the error's ``param`` names it: ignoring it would change what the output
means.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from shared.logging import get_logger
from shared.messages import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams

log = get_logger(__name__)

# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    """The inner object of an OpenAI error body."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------- requests


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
#: message's extra keys go to the chat template with it
_ENGINE_INT_FIELDS = ("prompt", "messages", "n", "max_tokens", "max_completion_tokens", "seed", "top_k",
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
        ignored = sorted(k for k in data if k not in cls.model_fields and k not in _UNSERVED_NAMES)
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


def _is_none(v: Any) -> bool:
    return v is None


def _is_false(v: Any) -> bool:
    return not v


def _one_or_none(v: Any) -> bool:
    return v is None or v == 1


def _is_empty(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def _is_true_or_none(v: Any) -> bool:
    return v is None or v is True


#: (field, is_noop(value), what it does) of OpenAI and vLLM request fields not implemented
#: here: refused when present with a value other than their no-op one
_UNSERVED_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    *((name, _is_empty, "guided decoding") for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern", "structured_outputs")),
    ("bad_words", _is_empty, "banned words"),
    ("allowed_token_ids", _is_empty, "restricting the vocabulary"),
    ("prompt_logprobs", _is_empty, "log probabilities of the prompt"),
    ("use_beam_search", _is_empty, "beam search"),
    ("length_penalty", lambda v: v is None or v == 1, "beam search"),
    ("truncate_prompt_tokens", _is_empty, "prompt truncation"),
    ("chat_template_kwargs", _is_empty, "the model's chat template is rendered with its defaults"),
    ("mm_processor_kwargs", _is_empty, "multimodal inputs"),
    ("documents", _is_empty, "documents for the chat template"),
    ("logits_processors", _is_empty, "custom logits processors"),
    ("prompt_embeds", _is_empty, "prompt embeddings"),
    ("functions", _is_empty, "tools and function calling"),
    ("function_call", lambda v: _is_empty(v) or v == "none", "tools and function calling"),
    ("audio", _is_empty, "audio output"),
    ("modalities", lambda v: _is_empty(v) or v == ["text"], "only text output"),
    ("spaces_between_special_tokens", _is_true_or_none, "special tokens are always decoded with spaces"),
)
_UNSERVED_NAMES = frozenset(name for name, _, _ in _UNSERVED_FIELDS)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage; with it,
    ``continuous_usage_stats`` (vLLM) puts the usage so far in every chunk."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIRequest):
    """The fields both endpoints share (OpenAI names plus vLLM extensions)."""

    echo_takes_zero_max_tokens: ClassVar[bool] = False  # completions: max_tokens 0 with echo

    model: str | None = None  # None = the served model (as vLLM; OpenAI requires it)
    temperature: float | None = None  # None = 1.0
    top_p: float | None = None  # None = 1.0
    top_k: int | None = None  # vLLM extension; None, 0 or -1 = disabled
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # vLLM extension: lower is served earlier
    cache_salt: str | None = None  # vLLM extension: only requests with the same salt share cached blocks
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    return_tokens_as_token_ids: bool | None = None  # vLLM extension: logprobs name tokens token_id:<id>

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """Keys must be token ids in ASCII digits; biases are clamped to [-100, 100] (vLLM)."""
        if v is None:
            return None
        for key in v:
            if not re.fullmatch(r"\s*[0-9]+\s*", key, re.ASCII):
                raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {key!r}")
            if not math.isfinite(v[key]):
                raise ValueError(f"logit_bias: biases must be finite numbers, got {v[key]} for {key!r}")
        return {key: min(100.0, max(-100.0, bias)) for key, bias in v.items()}

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _positive_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v < 1 and not (v == 0 and cls.echo_takes_zero_max_tokens):
            raise ValueError(f"{info.field_name} must be at least 1, got {v}")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string if provided")  # as vLLM
        return v

    @model_validator(mode="after")
    def _min_tokens_within_the_limit(self) -> _SamplingFields:
        """``min_tokens`` above the request's token limit, named as the request sets it (or
        its default), rather than as the engine's ``max_tokens``."""
        name = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"
        limit = getattr(self, name)
        if limit is not None and self.min_tokens > limit:
            default = "" if name in self.model_fields_set else " (its default when not given)"
            raise ValueError(f"min_tokens={self.min_tokens} is more than {name}={limit}{default}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):  # as vLLM
            raise ValueError("stream_options can only be set when stream is true")
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens,
            logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


#: the most prompts one /v1/completions request may batch (each is an engine request)
MAX_BATCH_PROMPTS = 1024


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt (a string or token ids) or a batch of them (a list
    of strings or of token-id lists; each is its own engine request, as in vLLM).
    ``echo`` starts each choice's text with its prompt (with ``logprobs``, the prompt tokens'
    log probabilities start its logprobs; with ``max_tokens`` 0, nothing is generated)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # vLLM extension
    add_special_tokens: bool = True  # vLLM extension

    echo_takes_zero_max_tokens: ClassVar[bool] = True
    unsupported_values: ClassVar[Unsupported] = (
        ("add_special_tokens", bool, "the tokenizer's special tokens are always added to a prompt"),
        ("response_format", lambda v: v is None or v.get("type") == "text", "only type 'text' is supported"),
        ("best_of", _one_or_none, "only best_of=1 is supported"),
        ("suffix", _is_none, "suffix is not supported"),
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        ok = isinstance(v, str) or (
            isinstance(v, list)
            and (
                all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                or all(isinstance(x, str) for x in v)
                or all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                       for x in v)
            )
        )
        if not ok:
            raise ValueError("prompt must be a string, a list of token ids, or a list of either (a batch)")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and len(v) > MAX_BATCH_PROMPTS and not isinstance(v[0], int):
            raise ValueError(f"prompt: a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _zero_max_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1, got 0 (0 is only accepted with echo=true)")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt (and its log probabilities) without a
        completion (OpenAI's legacy way to score a text, as lm-evaluation-harness does)."""
        return self.echo and self.max_tokens == 0

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts, each as text or token ids (one unless a batch)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        """The request as ``SamplingParams``.

        Raises:
            pydantic.ValidationError: a value is out of range (the message names it).
        """
        # the echoed prompt's tokens get their log probabilities too (logprobs is range-checked there)
        return self._sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs,
                                     self.logprobs if self.echo else None)


class ChatMessage(BaseModel):
    """One chat message. Content is a string or a list of ``text`` parts (joined by newlines)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages: content part type {kind!r} is not supported; only 'text'")
        return v

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (content as one string)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part["text"] for part in self.content)
        return out


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI; None = up to the context length
    max_completion_tokens: int | None = None  # wins over max_tokens
    add_generation_prompt: bool = True  # vLLM extension
    continue_final_message: bool = False
    echo: bool = False
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    add_special_tokens: bool = False  # vLLM extension: the chat template adds them

    unsupported_values: ClassVar[Unsupported] = (
        ("add_special_tokens", _is_false, "the chat template's text is tokenized without adding special tokens"),
        ("echo", _is_false, "only echo=false is supported"),
        ("continue_final_message", _is_false, "only continue_final_message=false is supported"),
        ("chat_template", _is_none, "the model's own chat template is always used"),
        ("response_format", lambda v: v is None or v.get("type") == "text", "only type 'text' is supported"),
    )

    @model_validator(mode="after")
    def _no_tools(self) -> ChatCompletionRequest:
        if self.tools and self.tool_choice != "none":
            raise ValueError("tools are not supported (tool_choice='none' is accepted)")
        if self.tool_choice not in (None, "none") and self.tools is None:  # as vLLM
            raise ValueError("tool_choice: when using `tool_choice`, `tools` must be set")
        return self

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None:
            if not (0 <= self.top_logprobs <= MAX_LOGPROBS):
                raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}")
            if self.top_logprobs > 0 and not self.logprobs:  # as OpenAI and vLLM
                raise ValueError("top_logprobs: when using `top_logprobs`, `logprobs` must be set to true")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def messages_input(self) -> list[dict[str, Any]]:
        """The messages for the tokenizer's chat template."""
        return [m.to_template_dict() for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        """The request as ``SamplingParams`` (``max_completion_tokens`` wins over ``max_tokens``).

        Raises:
            pydantic.ValidationError: a value is out of range (the message names it).
        """
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)


#: Every request field name (for naming the ``param`` of an error from its message).
KNOWN_PARAMS: frozenset[str] = frozenset(
    {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, *SamplingParams.model_fields,
     *_UNSERVED_NAMES}
)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


#: the floor of a reported log probability: JSON has no -inf (vLLM's value)
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """``value`` as a JSON-safe log probability: -inf, and NaN (from a broken logits row),
    become ``MIN_LOGPROB``."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class CompletionLogprobs(BaseModel):
    """A completion choice's ``logprobs`` (OpenAI's legacy shape): per token its text, its
    offset in the choice's text, its log probability and the most likely tokens' (the
    sampled one included, so up to ``logprobs`` + 1 entries)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    """A non-streaming ``text_completion``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streaming completion (``usage`` only with ``include_usage``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position (chat ``top_logprobs``)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at one position of a chat choice, and the most likely tokens there."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A non-streaming ``chat.completion``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """The ``delta`` of a chat chunk; unset (None) keys are left out."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streaming chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
