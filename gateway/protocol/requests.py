"""The request bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``: what
each adds to the fields both share (``sampling.py``'s ``SamplingFields``, which builds the
``SamplingParams``), and the checks of its own fields."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.protocol.base import UNSERVED_NAMES, Unsupported, is_false, is_none, one_or_none
from gateway.protocol.sampling import SamplingFields
from gateway.protocol.tools import ChatTool, NamedToolChoice, ToolCallParam, ToolChoice
from shared.messages import MAX_LOGPROBS, SamplingParams

#: the most prompts one /v1/completions request may batch (each is an engine request)
MAX_BATCH_PROMPTS = 1024


class CompletionRequest(SamplingFields):
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
            ValueError: a value is out of range (the message names it).
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


class ChatCompletionRequest(SamplingFields):
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
            ValueError: a value is out of range (the message names it).
        """
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)


#: Every request field name (for naming the ``param`` of an error from its message).
KNOWN_PARAMS: frozenset[str] = frozenset(
    {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, *SamplingParams.__struct_fields__,
     *UNSERVED_NAMES}
)

AnyRequest = CompletionRequest | ChatCompletionRequest
