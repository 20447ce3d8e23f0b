"""Folding the engine's ``RequestDelta``s into a request's output, with no I/O.

- ``SampleState`` and ``RequestState``: one engine request's output so far (text, token ids,
  log probabilities, counts, why each sample ended), folded from its deltas. The offline
  ``LLM`` turns them into vLLM's ``RequestOutput``; the gateway into OpenAI objects.
- ``Generation``: one OpenAI request in flight (one engine request per prompt, ``n`` samples
  each) and the chunks and response it makes; ``gateway/completion.py`` and
  ``gateway/chat.py`` give each endpoint's shapes (as vLLM's ``serving_completion`` and
  ``serving_chat``). ``gateway/serving.py`` feeds it the deltas and sends what it makes.

A stream is ``first_chunks()``, then ``chunks(delta)`` for each delta as it comes, then
``last_chunks()``; a plain request is ``update(delta)`` for each, then ``response()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Self

from pydantic import BaseModel

from gateway.errors import APIError, prompt_error
from gateway.protocol.requests import AnyRequest
from gateway.protocol.responses import PromptTokensDetails, UsageInfo
from shared.messages import DecodedLogprobs, RequestDelta, TokenizeReply, TokenLogprob


@dataclass
class SampleState:
    """One sample's output so far (one ``delta.index`` of an engine request)."""

    pieces: list[str] = field(default_factory=list)  # its texts, one per delta
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[DecodedLogprobs] = field(default_factory=list)  # one per token, if asked
    tokens_text_len: int = 0  # characters in the texts of the tokens of ``logprobs``
    cumulative_logprob: float = 0.0  # the sum of the sampled tokens' log probabilities (vLLM)
    num_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, delta: RequestDelta) -> None:
        """Fold in one delta of this sample (an error is the caller's to handle first)."""
        self.pieces.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
            self.tokens_text_len += tokens_text_len(delta.logprobs)
            self.cumulative_logprob += sum(lp.sampled.logprob or 0.0 for lp in delta.logprobs)
        self.num_tokens = max(delta.num_output_tokens, self.num_tokens + len(delta.token_ids))
        if delta.finished:
            self.finish(delta.finish_reason or "stop", delta.stop_reason)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finished = True
        self.finish_reason, self.stop_reason = reason, stop_reason


@dataclass
class RequestState:
    """One engine request's output so far: its prompt's counts and log probabilities, and its
    ``n`` samples (``delta.index``). Its owner knows which request it is (``Generation``'s
    ``engine_ids``, the offline ``LLM``'s ids)."""

    samples: list[SampleState]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with prompt_logprobs: one per prompt token (the first's logprob None), from sample 0's
    # first delta; None while that has not come
    prompt_logprobs: list[DecodedLogprobs] | None = None
    prompt_text_len: int = 0  # characters of their tokens' texts: where a text_offset goes on

    @classmethod
    def new(cls, n: int = 1, **fields: Any) -> Self:
        return cls([SampleState() for _ in range(n)], **fields)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def add(self, delta: RequestDelta) -> SampleState:
        """Fold in one delta (not an error: the caller's to handle first); its sample."""
        self.add_prompt_info(delta)
        sample = self.samples[delta.index]
        sample.add(delta)
        return sample

    def add_prompt_info(self, delta: RequestDelta) -> None:
        """Keep what a delta says of the prompt: its token counts and, in sample 0's first
        delta, its log probabilities (or that there are none)."""
        if self.prompt_logprobs is None and (delta.prompt_logprobs or delta.index == 0):
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_text_len = tokens_text_len(delta.prompt_logprobs)
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)


@dataclass
class Part(RequestState):
    """One prompt of an OpenAI request: the engine request that serves it."""

    echo: str = ""  # the prompt text, echoed before each of its samples (completions' echo)


class Generation:
    """One OpenAI request in flight: folds the ``RequestDelta``s of its engine requests (one
    per prompt, ``parts``; ``n`` samples each) into OpenAI chunks and the response. Choice
    ``p * n + i`` is sample ``i`` of prompt ``p``, as in vLLM.

    Args:
        request_id: the response's id.
        model: the served model's name.
        body: the validated request.
        prompts: per prompt, its engine request id and the tokenizer's reply (the reply's
            ``prompt`` is echoed, when there).
    """

    def __init__(self, request_id: str, model: str, body: AnyRequest,
                 prompts: list[tuple[str, TokenizeReply]]) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.n = body.n
        self.include_usage = body.include_usage
        self.continuous_usage = body.continuous_usage  # every chunk carries the usage so far
        self.logprobs = body.wants_logprobs  # choices carry log probabilities
        self.tokens_as_ids = bool(body.return_tokens_as_token_ids)  # tokens named token_id:<id>
        self.echo_only = False  # the prompt alone: what the engine generates is not shown
        self.engine_ids = [engine_id for engine_id, _ in prompts]  # of the parts, in order
        self.parts = [Part.new(self.n, num_prompt_tokens=len(reply.prompt_token_ids), echo=reply.prompt or "")
                      for _, reply in prompts]
        self._part_of = {engine_id: p for p, engine_id in enumerate(self.engine_ids)}
        self.choices = [sample for part in self.parts for sample in part.samples]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(part.num_prompt_tokens for part in self.parts)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def unfinished_ids(self) -> list[str]:
        """The engine ids of the parts the engine has not ended yet (a sample not finished)."""
        return [engine_id for engine_id, part in zip(self.engine_ids, self.parts, strict=True) if not part.finished]

    def update(self, delta: RequestDelta) -> int:
        """Fold in one delta of one of the parts; its choice index.

        Raises:
            APIError: the engine reported an error for this request (that part has ended).
        """
        p = self._part_of[delta.request_id]
        part = self.parts[p]
        if delta.error is not None or delta.finish_reason == "error":
            for sample in part.samples:
                sample.finished = True
            if delta.error is not None:
                raise prompt_error(delta.error, p, len(self.parts))
            raise APIError.of(500, "the engine failed while generating this request")
        if self.echo_only:  # the token the engine had to generate is not shown
            part.add_prompt_info(delta)
            sample = part.samples[delta.index]
            sample.finished = sample.finished or delta.finished
            if delta.finished:
                sample.finish("length")
        else:
            part.add(delta)
        return p * self.n + delta.index

    # ------------------------------------------------------------------ a stream

    def first_chunks(self) -> list[BaseModel]:
        """The chunks a stream starts with, before any delta."""
        chunks = self.start_chunks()
        if self.continuous_usage:
            for chunk in chunks:
                chunk.usage = self.choice_usage(chunk.choices[0].index)  # type: ignore[attr-defined]
        return chunks

    def chunks(self, delta: RequestDelta) -> list[BaseModel]:
        """Fold in one delta (``update``); the chunks it makes.

        Raises:
            APIError: as ``update``.
        """
        index = self.update(delta)
        chunks = self.delta_chunks(delta, index)
        if self.continuous_usage:
            for chunk in chunks:
                chunk.usage = self.choice_usage(index)  # type: ignore[attr-defined]
        return chunks

    def last_chunks(self) -> list[BaseModel]:
        """The chunks a finished stream ends with: the usage chunk, if asked for."""
        if not self.include_usage:
            return []
        chunk = self.chunk([])
        chunk.usage = self.usage()  # type: ignore[attr-defined]
        return [chunk]

    def dump(self, chunk: BaseModel) -> dict[str, Any]:
        """A chunk as JSON-able dict (``usage`` only with ``include_usage``, as OpenAI does)."""
        return chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"})

    def dump_json(self, chunk: BaseModel) -> str:
        return chunk.model_dump_json(exclude=None if self.include_usage else {"usage"})

    # ------------------------------------------------------------------ usage

    def usage(self) -> UsageInfo:
        cached = sum(part.num_cached_tokens for part in self.parts)
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            total_tokens=self.num_prompt_tokens + self.num_output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None,
        )

    def choice_usage(self, index: int) -> UsageInfo:
        """The usage so far of choice ``index`` alone: its prompt's tokens and its own output
        (vLLM's ``continuous_usage_stats`` chunks)."""
        part, completion = self.parts[index // self.n], self.choices[index].num_tokens
        return UsageInfo(
            prompt_tokens=part.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=part.num_prompt_tokens + completion,
            prompt_tokens_details=(PromptTokensDetails(cached_tokens=part.num_cached_tokens)
                                   if part.num_cached_tokens else None),
        )

    # ------------------------------------------------------------------ each endpoint's shapes

    def chunk(self, choices: list[Any]) -> BaseModel:
        """A streaming chunk of ``choices``."""
        raise NotImplementedError

    def start_chunks(self) -> list[BaseModel]:
        return []

    def delta_chunks(self, delta: RequestDelta, index: int) -> list[BaseModel]:
        """The chunks of one delta folded in as choice ``index``."""
        raise NotImplementedError

    def response(self) -> BaseModel:
        """The whole response (once every delta is folded in)."""
        raise NotImplementedError

    def has_news(self, delta: RequestDelta) -> bool:
        """Whether a delta makes a chunk: text, an end, or tokens whose log probabilities
        were asked for (their text may still be held back)."""
        return bool(delta.text or delta.finished or (self.logprobs and delta.logprobs))


def tokens_text_len(items: list[DecodedLogprobs]) -> int:
    """Characters in the texts of the tokens of ``items`` (what a text_offset goes on by)."""
    return sum(len(lp.sampled.token) for lp in items)


def token_str(t: TokenLogprob, as_ids: bool) -> str:
    """A token as the response names it: its text, or ``token_id:<id>`` with vLLM's
    ``return_tokens_as_token_ids`` (tokens with the same text, parts of one character, stay
    apart)."""
    return f"token_id:{t.token_id}" if as_ids else t.token
