"""One request in flight as the ``EngineClient`` holds it, and what is needed to resubmit it
when the engine loses it (no I/O here).

The engine can lose a request: its scheduler dies (the request state goes with it), its
detokenizer dies (the text state), or a NATS outage drops an update. The client still
holds everything the request was submitted with and every output token its client has
received, so it resubmits the request under a new engine id (``<id>~<attempt>``) with those
tokens (``RequestSpec.output_token_ids``): the scheduler recomputes them as it does a
preempted request's, and generation continues after them. Greedy output is the same as an
undisturbed run's; a seeded sample's random stream starts again, so it may differ.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import msgspec

from shared.messages import RequestDelta, ServiceError, TokenizeRequest

#: resubmissions of one request before its client gets the 503 ``request_lost`` error
MAX_RESUBMITS = 5


class Received(enum.Enum):
    """What a delta from the engine means for its request."""

    OUTPUT = "output"  # in order: deliver it
    LOST = "lost"  # the engine lost the request (a ``request_lost`` error, or skipped tokens)


@dataclass
class InFlight:
    """One request submitted and not ended.

    ``engine_id`` is the id the engine knows it by now (the client's id, then
    ``<id>~1``, ... after resubmissions); ``outputs[i]`` the token ids sample ``i``'s
    client has received.
    """

    message: TokenizeRequest  # as first submitted
    queue: asyncio.Queue[RequestDelta]  # its deltas, for ``EngineClient.stream``
    last_output: float  # time.monotonic() of its last delta (of its (re)submission before any)
    engine_id: str = ""
    # the scheduler's verdict (None: accepted), for submit(notify_accepted=True); None when
    # not asked for, or once ``wait_accepted`` has it
    verdict: asyncio.Future[ServiceError | None] | None = None
    outputs: list[list[int]] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)  # sample indexes
    got_prompt_logprobs: bool = False
    submitted: bool = False  # the tokenizer took the current engine id (False while one is being sent)
    attempts: int = 0  # resubmissions so far

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or self.request_id
        self.outputs = [[] for _ in range(self.num_samples)]

    @property
    def request_id(self) -> str:
        """The client's id (its first submission's)."""
        return self.message.spec.request_id

    @property
    def num_samples(self) -> int:
        return self.message.spec.sampling_params.n

    def receive(self, delta: RequestDelta) -> Received:
        """Note a delta from the engine (its tokens, whether its sample finished).

        A ``request_lost`` error, or a delta whose ``num_output_tokens`` says tokens came
        before it that the client never got, is ``LOST`` (nothing is noted).
        """
        if delta.error is not None:
            if delta.error.code == "request_lost":
                return Received.LOST
        elif len(self.outputs[delta.index]) + len(delta.token_ids) != delta.num_output_tokens:
            return Received.LOST
        self.outputs[delta.index].extend(delta.token_ids)
        self.got_prompt_logprobs = self.got_prompt_logprobs or bool(delta.prompt_logprobs)
        if delta.finished:
            self.finished.add(delta.index)
        return Received.OUTPUT

    @property
    def recoverable(self) -> bool:
        """Whether a resubmission can continue it: attempts left, and one sample (or none has
        output yet: the samples of an n > 1 request are forked together, so they cannot each
        continue where they stopped)."""
        started = self.finished or any(self.outputs)
        return self.attempts < MAX_RESUBMITS and (self.num_samples == 1 or not started)

    def resubmission(self) -> TokenizeRequest:
        """The next attempt's message under a new engine id (``engine_id`` moves to it): the
        client's tokens so far as ``output_token_ids``; without ``prompt_logprobs`` once they
        were delivered; asking for the scheduler's acceptance while the client still awaits it."""
        self.attempts += 1
        self.engine_id = f"{self.request_id}~{self.attempts}"
        spec = self.message.spec
        params = spec.sampling_params.replace(prompt_logprobs=None) if self.got_prompt_logprobs else spec.sampling_params
        return msgspec.structs.replace(self.message, spec=spec.derive(
            request_id=self.engine_id, sampling_params=params, output_token_ids=list(self.outputs[0]),
            notify_accepted=self.verdict is not None and not self.verdict.done()))
