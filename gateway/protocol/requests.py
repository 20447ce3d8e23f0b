"""The request bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``, and
the ``SamplingParams`` each becomes (OpenAI names plus vLLM extensions, vLLM's defaults)."""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.protocol.base import (
    UNSERVED_NAMES,
    OpenAIRequest,
    Unsupported,
    is_false,
    is_none,
    one_or_none,
)
from gateway.protocol.structured import structured_outputs_of
from gateway.protocol.tools import ChatTool, NamedToolChoice, ToolCallParam, ToolChoice
from shared.messages import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


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
    use_beam_search: bool = False  # vLLM extension: n is the beam width; the n best beams are the choices
    length_penalty: float = 1.0  # vLLM extension, beam search: score = cum_logprob / length ** length_penalty
    # structured outputs (gateway/protocol/structured.py): OpenAI's, vLLM's, vLLM's older fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _structured: StructuredOutputsParams | None = PrivateAttr(default=None)
    _structured_path: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _structured_outputs(self) -> _SamplingFields:
        """The structured output constraint, from whichever field asks for it (one at most)."""
        self._structured, self._structured_path = structured_outputs_of(
            {name: getattr(self, name) for name in ("response_format", "structured_outputs", "guided_json",
                                                     "guided_regex", "guided_choice", "guided_grammar")})
        return self

    @property
    def structured_outputs_path(self) -> str | None:
        """The path of the field that asked for a constraint (``response_format.json_schema.schema``,
        ``guided_regex``, ...), to name it in an error; None without one."""
        return self._structured_path

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

    @model_validator(mode="after")
    def _beam_search_is_not_streamed(self) -> _SamplingFields:
        if self.use_beam_search and self.stream:  # as vLLM: the beams are known only at the end
            raise ValueError("use_beam_search: beam search results cannot be streamed; set stream to false")
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
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            structured_outputs=self._structured,
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
    add_special_tokens: bool = True  # vLLM extension

    echo_takes_zero_max_tokens: ClassVar[bool] = True
    unsupported_values: ClassVar[Unsupported] = (
        ("add_special_tokens", bool, "the tokenizer's special tokens are always added to a prompt"),
        ("best_of", one_or_none, "only best_of=1 is supported"),
        ("suffix", is_none, "suffix is not supported"),
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
    tool_calls: list[ToolCallParam] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"messages: a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"messages: only assistant messages have tool_calls, not {self.role} ones")
        return self

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
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # False: "required" forces one call (auto: not enforced)
    chat_template: str | None = None
    add_special_tokens: bool = False  # vLLM extension: the chat template adds them

    unsupported_values: ClassVar[Unsupported] = (
        ("add_special_tokens", is_false, "the chat template's text is tokenized without adding special tokens"),
        ("echo", is_false, "only echo=false is supported"),
        ("continue_final_message", is_false, "only continue_final_message=false is supported"),
        ("chat_template", is_none, "the server's chat template (--chat-template, else the model's) is always used"),
    )

    @model_validator(mode="after")
    def _tools_and_choice(self) -> ChatCompletionRequest:
        """As vLLM: ``tools`` is not empty; ``tool_choice`` other than "none" needs ``tools``;
        a named function is one of them."""
        if self.tools is not None and not self.tools:
            raise ValueError("tools must not be an empty array; give at least one tool or leave it out")
        if self.tool_choice not in (None, "none") and self.tools is None:
            raise ValueError("tool_choice: when using `tool_choice`, `tools` must be set")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice: the function {name!r} is not one of `tools`")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """``tool_choice`` as it applies: not given, "auto" when there are tools (as OpenAI
        and vLLM), else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

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
     *UNSERVED_NAMES}
)

AnyRequest = CompletionRequest | ChatCompletionRequest
