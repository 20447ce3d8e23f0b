"""``SamplingParams``: how to sample one request (vLLM's names), checked where it is built."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from shared.messages.common import GREEDY_TEMPERATURE, INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N, Message
from shared.messages.structured_outputs import StructuredOutputsParams

_VLLM_ONLY_SAMPLING_PARAMS = frozenset({
    "best_of", "logits_processors", "bad_words", "allowed_token_ids",
    "truncate_prompt_tokens", "output_kind", "detokenize",
    "spaces_between_special_tokens", "extra_args",
})


#: fields beam search does not combine with, and their defaults (a request that changes one is refused)
_NOT_WITH_BEAM_SEARCH: dict[str, Any] = {
    "top_p": 1.0, "top_k": 0, "seed": None, "stop": [], "stop_token_ids": [], "logprobs": None,
    "prompt_logprobs": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "min_tokens": 0, "logit_bias": {}, "structured_outputs": None,
}


class SamplingParams(Message):
    """How to sample one request (a subset of vLLM's ``SamplingParams``, same names).

    ``temperature`` below 1e-5 (``GREEDY_TEMPERATURE``, as vLLM) means greedy. ``top_k`` 0 or
    -1 disables top-k. A per-request ``seed`` makes the request's samples independent of
    whatever else is in the batch. ``logprobs`` N returns, with each sampled token, its log
    probability, its rank and the N most likely tokens' (0: the sampled token's only; None:
    nothing), over the model's raw distribution (before temperature, top-k and top-p; vLLM's
    default ``raw_logprobs``). ``prompt_logprobs`` N does the same for every prompt token but
    the first (a request asking for them is not served from the prefix cache, as in vLLM).
    Every integer must fit a signed 64-bit integer.

    Logits processing, as vLLM (and OpenAI for ``presence_penalty``, ``frequency_penalty``,
    ``logit_bias``), in this order: ``logit_bias`` adds to a token's logit; ``min_tokens``
    forbids EOS and ``stop_token_ids`` until that many tokens are generated (stop strings are
    not matched before either); ``repetition_penalty`` (CTRL, Keskar et al. 2019) divides the
    positive logits and multiplies the negative ones of every token in the prompt or the output;
    ``frequency_penalty`` subtracts per occurrence in the output, ``presence_penalty`` once per
    token present there. Greedy requests take the argmax after these. Then the temperature;
    ``min_p`` drops tokens less likely than ``min_p`` times the most likely one; then top-k and
    top-p.

    Beam search (``use_beam_search``, vLLM's OpenAI field; the offline API builds it from
    ``BeamSearchParams``): ``n`` is the beam width, ``length_penalty`` the exponent of the
    length normalisation; the engine keeps ``n`` beams per step and returns the ``n`` best
    finished ones (``services/scheduler/beam.py``). Only ``max_tokens``, ``ignore_eos``,
    ``temperature`` (as in vLLM it does not change the raw log probabilities the beams are
    scored by), ``skip_special_tokens`` and ``include_stop_str_in_output`` combine with it;
    any other sampling or logits-processing field is refused by name.

    ``structured_outputs`` constrains the output to a JSON schema, a regex, a list of choices,
    a grammar or any JSON object (``StructuredOutputsParams``): a token bitmask applied after
    the logits processing above, before the temperature; once the constraint is complete only
    EOS is allowed. ``guided_decoding`` (vLLM's older name) is taken as ``structured_outputs``.

    Raises:
        pydantic.ValidationError: a value is out of range, also when assigned later, or a
            vLLM parameter this engine does not implement is given; the message names the
            parameter.
    """

    n: int = 1
    max_tokens: int | None = Field(16, description="Max generated tokens; None = up to max_model_len")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # alternatives per sampled token, 0..MAX_LOGPROBS
    prompt_logprobs: int | None = None  # alternatives per prompt token, 0..MAX_LOGPROBS
    presence_penalty: float = 0.0  # -2..2
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # > 0; 1 = none
    min_p: float = 0.0  # 0..1
    min_tokens: int = 0  # <= max_tokens
    logit_bias: dict[int, float] = Field(default_factory=dict)  # token id -> bias in -100..100
    use_beam_search: bool = False  # n is the beam width
    length_penalty: float = 1.0  # beam search: score = cum_logprob / generated_len ** length_penalty
    structured_outputs: StructuredOutputsParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and "guided_decoding" in data:
            data = dict(data)
            guided = data.pop("guided_decoding")
            if guided is not None:
                if data.get("structured_outputs") is not None:
                    raise ValueError("guided_decoding and structured_outputs are the same parameter: give one")
                data["structured_outputs"] = guided
        if isinstance(data, dict):
            given = sorted(k for k in data if k in _VLLM_ONLY_SAMPLING_PARAMS)
            if given:
                raise ValueError(f"{', '.join(given)}: vLLM sampling parameter(s) that this engine does not "
                                 f"support; supported: {', '.join(cls.model_fields)}")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v: Any) -> Any:
        return [] if v is None else v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if not (1 <= self.n <= MAX_N):
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.max_tokens is not None and not (1 <= self.max_tokens <= INT64_MAX):
            raise ValueError(f"max_tokens must be between 1 and {INT64_MAX}, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (-1 <= self.top_k <= INT64_MAX):
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive (at most {INT64_MAX}), got {self.top_k}")
        if self.seed is not None and not (INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be between {INT64_MIN} and {INT64_MAX}, got {self.seed}")
        if bad := [t for t in self.stop_token_ids if not (0 <= t <= INT64_MAX)]:
            raise ValueError(f"stop_token_ids must be token ids >= 0 (at most {INT64_MAX}), got {bad[0]}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0 <= self.min_tokens <= INT64_MAX):
            raise ValueError(f"min_tokens must be between 0 and {INT64_MAX}, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        if bad_ids := [t for t in self.logit_bias if not (0 <= t <= INT64_MAX)]:
            raise ValueError(f"logit_bias: token ids must be between 0 and {INT64_MAX}, got {bad_ids[0]}")
        if bad := [v for v in self.logit_bias.values() if not (-100.0 <= v <= 100.0)]:
            raise ValueError(f"logit_bias: biases must be in [-100, 100], got {bad[0]}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.use_beam_search:
            changed = [name for name, default in _NOT_WITH_BEAM_SEARCH.items()
                       if getattr(self, name) != default and not (name == "top_k" and self.top_k == -1)]
            if changed:
                raise ValueError(f"{changed[0]}: not supported with beam search (use_beam_search); only "
                                 "max_tokens, ignore_eos, temperature, length_penalty, skip_special_tokens and "
                                 "include_stop_str_in_output apply to it")
        elif self.length_penalty != 1.0:
            raise ValueError(f"length_penalty={self.length_penalty} applies only to beam search (use_beam_search)")
        return self

    def beam_candidates(self, num_eos_tokens: int) -> int:
        """How many continuations of each live beam a beam-search step looks at: Hugging Face's
        ``max(2, 1 + number of EOS tokens) * beam width``, enough to keep ``n`` beams alive
        after every EOS candidate has finished."""
        return max(2, 1 + num_eos_tokens) * self.n

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition, frequency or presence penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def __setattr__(self, name: str, value: Any) -> None:
        """An assigned field is checked as at construction (pydantic's ``validate_assignment``
        would keep a value that the model check then refuses)."""
        if name in type(self).model_fields:
            value = getattr(type(self).model_validate({**self.__dict__, name: value}), name)
        super().__setattr__(name, value)

    @property
    def greedy(self) -> bool:
        """Whether the request samples greedily (temperature below ``GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an ``n > 1`` request (vLLM's rule: a seeded
        request's sample i uses ``seed + i``, so the n samples differ yet are reproducible).
        The sum wraps around in 64 bits (two's complement), so a child seed always fits."""
        seed = None
        if self.seed is not None:
            seed = self.seed + index
            if seed > INT64_MAX:
                seed -= 2**64
        return self.model_copy(update={"n": 1, "seed": seed})
