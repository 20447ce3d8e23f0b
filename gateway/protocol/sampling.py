"""The fields ``POST /v1/completions`` and ``POST /v1/chat/completions`` share (OpenAI names
plus vLLM extensions, vLLM's defaults), their checks, and the ``SamplingParams`` they become
(``SamplingFields._sampling_params``; each request passes its own token limit and log
probabilities)."""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationInfo, field_validator, model_validator

from gateway.protocol.base import OpenAIRequest
from gateway.protocol.structured import structured_outputs_of
from shared.messages import SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage; with it,
    ``continuous_usage_stats`` (vLLM) puts the usage so far in every chunk."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIRequest):
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
    def _structured_outputs(self) -> SamplingFields:
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
    def _min_tokens_within_the_limit(self) -> SamplingFields:
        """``min_tokens`` above the request's token limit, named as the request sets it (or
        its default), rather than as the engine's ``max_tokens``."""
        name = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"
        limit = getattr(self, name)
        if limit is not None and self.min_tokens > limit:
            default = "" if name in self.model_fields_set else " (its default when not given)"
            raise ValueError(f"min_tokens={self.min_tokens} is more than {name}={limit}{default}")
        return self

    @model_validator(mode="after")
    def _beam_search_is_not_streamed(self) -> SamplingFields:
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
        """The engine's params: every field both share that the body gives (a field the body
        leaves None takes the engine's default), ``logit_bias``'s keys as token ids, the
        structured output constraint, and the request's own token limit and log probabilities.

        Raises:
            ValueError: a value ``SamplingParams`` refuses (the message names it).
        """
        given = {name: value for name in _SAME_NAMES if (value := getattr(self, name)) is not None}
        return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
                              structured_outputs=self._structured)


#: the fields a body and ``SamplingParams`` share under one name and meaning (taken as given)
_SAME_NAMES = tuple(name for name in SamplingParams.__struct_fields__ if name in SamplingFields.model_fields
                    and name not in ("max_tokens", "logprobs", "prompt_logprobs", "logit_bias", "structured_outputs"))
