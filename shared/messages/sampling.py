"""``SamplingParams``: how to sample one request (vLLM's names), a msgspec record checked once
where it is built and carried whole to the sampler; ``DetokenizeParams``: the part of it the
detokenizer reads, one sub-record the scheduler hands on by reference."""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec import StructMeta, field

from shared.messages.common import (
    GREEDY_TEMPERATURE,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    Record,
    decoding,
    is_decoding,
)
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


class DetokenizeParams(Record):
    """What the detokenizer does with a request's text (``SamplingParams.detokenize_params``):
    stop strings, whether a matched one stays in the text, whether special tokens are shown,
    and how many output tokens come before a stop string may match. Built once per request and
    only read after (its ``stop`` is the params' own list)."""

    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0


class _Constructor(StructMeta):
    """Names, when ``SamplingParams(...)`` is called in code, the vLLM parameters this engine
    does not implement, and takes vLLM's older ``guided_decoding`` as ``structured_outputs``
    (a decoder never calls it)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "guided_decoding" in kwargs:
            guided = kwargs.pop("guided_decoding")
            if guided is not None:
                if kwargs.get("structured_outputs") is not None:
                    raise ValueError("guided_decoding and structured_outputs are the same parameter: give one")
                kwargs["structured_outputs"] = guided
        if given := sorted(k for k in kwargs if k in _VLLM_ONLY_SAMPLING_PARAMS):
            raise ValueError(f"{', '.join(given)}: vLLM sampling parameter(s) that this engine does not "
                             f"support; supported: {', '.join(cls.__struct_fields__)}")
        return super().__call__(*args, **kwargs)


class SamplingParams(Record, metaclass=_Constructor):
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
    a grammar or any JSON object (``StructuredOutputsParams``, or its fields as a dict): a
    token bitmask applied after the logits processing above, before the temperature; once the
    constraint is complete only EOS is allowed. ``guided_decoding`` (vLLM's older name) is
    taken as ``structured_outputs``.

    A msgspec struct (as vLLM's): built in code it is checked once, by :meth:`validate`
    (types coerced as msgspec's lax conversion does, ``stop`` given as one string made a
    list), and an assigned field is checked the same way; a decoder checks the types only
    (``shared.messages.common.decoding``), so a request's params are checked where they are
    made (the gateway, ``LLM``) and nowhere after.

    Raises:
        ValueError: a value is out of range or of the wrong type, also when assigned later
            (the field then keeps its value), or a vLLM parameter this engine does not
            implement is given; the message names the parameter.
        TypeError: an unknown parameter.
    """

    n: int = 1
    max_tokens: int | None = 16  # max generated tokens; None = up to max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
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
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in -100..100
    use_beam_search: bool = False  # n is the beam width
    length_penalty: float = 1.0  # beam search: score = cum_logprob / generated_len ** length_penalty
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not is_decoding():
            self._coerce()
            self.validate()

    def _coerce(self) -> None:
        """``stop`` given as a string or None and ``stop_token_ids`` as None made lists; a
        ``structured_outputs`` given as a dict built (and checked) as ``StructuredOutputsParams``."""
        stop, constraint = self.stop, self.structured_outputs
        if isinstance(constraint, dict):
            try:
                constraint = StructuredOutputsParams(**constraint)
            except TypeError as exc:  # an unknown field
                raise ValueError(f"structured_outputs: {exc}") from None
        super()._coerce(stop=[] if stop is None else [stop] if isinstance(stop, str) else stop,
                        stop_token_ids=[] if self.stop_token_ids is None else self.stop_token_ids,
                        structured_outputs=constraint)

    def validate(self) -> SamplingParams:
        """Check every value (types are :meth:`_coerce`'s); ``self``.

        Raises:
            ValueError: the first value out of range, named.
        """
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
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

    def __setattr__(self, name: str, value: Any) -> None:
        """An assigned field is checked as at construction, and left as it was when refused."""
        if name in self.__struct_fields__ and not is_decoding():
            value = getattr(msgspec.structs.replace(self, **{name: value}), name)
        super().__setattr__(name, value)

    def beam_candidates(self, num_eos_tokens: int) -> int:
        """How many continuations of each live beam a beam-search step looks at: Hugging Face's
        ``max(2, 1 + number of EOS tokens) * beam width``, enough to keep ``n`` beams alive
        after every EOS candidate has finished."""
        return max(2, 1 + num_eos_tokens) * self.n

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition, frequency or presence penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """Whether the request samples greedily (temperature below ``GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE

    def detokenize_params(self) -> DetokenizeParams:
        """The detokenizer's part of these params (built once per request, by the scheduler)."""
        return DetokenizeParams(stop=self.stop, include_stop_str_in_output=self.include_stop_str_in_output,
                                skip_special_tokens=self.skip_special_tokens, min_tokens=self.min_tokens)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes``, checked as at construction.

        Raises:
            ValueError: as at construction.
        """
        return msgspec.structs.replace(self, **changes)

    def derive(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` that the caller vouches for (not checked again)."""
        with decoding():
            return msgspec.structs.replace(self, **changes)

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``SamplingParams.clone``)."""
        with decoding():
            return msgspec.structs.replace(self)

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an ``n > 1`` request (vLLM's rule: a seeded
        request's sample i uses ``seed + i``, so the n samples differ yet are reproducible).
        The sum wraps around in 64 bits (two's complement), so a child seed always fits."""
        seed = None
        if self.seed is not None:
            seed = self.seed + index
            if seed > INT64_MAX:
                seed -= 2**64
        with decoding():  # derived from checked params: n 1 and a seed in range
            return msgspec.structs.replace(self, n=1, seed=seed)
