"""A request's state as the scheduler owns it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from services.scheduler.beam import BeamSearch
from shared.messages import FinishReason, RequestSpec, SampleLogprobs, SamplingParams, SubmitRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED = "finished"


#: what a sample of an n > 1 request takes over from its parent as submitted (fork_child)
_INHERITED = ("prompt_token_ids", "max_model_len", "eos_token_ids")


@dataclass(eq=False)
class Request:
    """One request: its ``spec`` (as the edge built it: ids, sampling params, priority, ...),
    its tokens, how many are in the KV cache, and where its blocks are.

    The spec is held, not copied: ``request_id``, ``gateway_id``, ``sampling_params``,
    ``priority``, ``arrival_time`` and ``background`` read it. An n > 1 sample and a beam hold
    a spec derived from their parent's (their own id and params).

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache (vLLM V1); the
    request's next ``num_tokens - num_computed_tokens`` tokens are still to be computed.
    """

    spec: RequestSpec
    prompt_token_ids: list[int]
    max_model_len: int  # tokens
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    group_id: str | None = None
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    sent_to_detokenizer: bool = False
    # its gateway awaits the acceptance (notify_accepted), deferred while no group could refuse it
    acceptance_due: bool = False
    # tokens sampled in the last step but not yet published to the detokenizer
    pending_output_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[SampleLogprobs] = field(default_factory=list)  # theirs, if asked
    # prompt_logprobs: those of prompt tokens 1, 2, ... received so far (sent with its first output)
    prompt_logprobs: list[SampleLogprobs] = field(default_factory=list)
    # prefix caching: hashes of the full blocks of all_token_ids, and how many of the
    # request's blocks are registered in the cache
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)  # block size -> hashes
    num_cached_blocks: int = 0
    # n > 1 (parallel sampling): sample 0 is the parent request itself; samples 1..n-1 are
    # children forked from it when its prefill completes, sharing its blocks
    parent_request_id: str | None = None
    index: int = 0
    child_ids: list[str] = field(default_factory=list)
    fork_pending: bool = False  # the step in flight forks this request
    # beam search (services/scheduler/beam.py): the root request holds the search; each live
    # beam after the first step is a request "<id>@<k>" of its own pointing at the root
    beam: BeamSearch | None = None
    beam_root: Request | None = None
    cum_logprob: float = 0.0  # a beam's: the sum of its generated tokens' log probabilities
    beam_logprobs: list[SampleLogprobs] = field(default_factory=list)  # a beam's, one per generated token
    # async scheduling: tokens sampled by steps in flight whose results have not arrived
    num_output_placeholders: int = 0
    epoch: int = 0  # bumped when preempted or requeued: results of earlier steps are stale
    # failed steps (Scheduler.fail_step) that included this request
    num_failed_steps: int = 0  # batched
    num_failed_alone: int = 0  # as a suspect (Scheduler.suspects), alone in the step

    @classmethod
    def from_submit(cls, msg: SubmitRequest, max_model_len: int, eos_token_ids: tuple[int, ...],
                    now: float) -> Request:
        """A request as the tokenizer submitted it; ``now`` (unix seconds) is its arrival time
        if its spec has none. A resubmitted request's outputs (``spec.output_token_ids``) are
        recomputed like a preempted request's."""
        spec = msg.spec
        # the outputs a resubmitted request already has become its own state (not kept twice)
        output_token_ids = list(spec.output_token_ids)
        if output_token_ids or not spec.arrival_time:
            spec = spec.derive(arrival_time=spec.arrival_time or now, output_token_ids=[])
        params = spec.sampling_params
        beam = None
        if params.use_beam_search:
            beam = BeamSearch(width=params.n, length_penalty=params.length_penalty, ignore_eos=params.ignore_eos,
                              eos_token_ids=eos_token_ids, num_candidates=params.beam_candidates(len(eos_token_ids)),
                              rows=[spec.request_id])
        return cls(spec=spec, prompt_token_ids=msg.prompt_token_ids, max_model_len=max_model_len,
                   eos_token_ids=eos_token_ids, output_token_ids=output_token_ids, beam=beam)

    # ------------------------------------------------------------------ the spec's fields

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def gateway_id(self) -> str:
        return self.spec.gateway_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self.spec.sampling_params

    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def arrival_time(self) -> float:
        return self.spec.arrival_time

    @property
    def background(self) -> bool:
        """A batch line: after every interactive request, preempted first."""
        return self.spec.background

    @property
    def cache_extra_keys(self) -> tuple:
        """What its prefix-cache block hashes mix in besides the tokens (``(cache_salt,)``):
        requests with other keys never share cached blocks."""
        return (self.spec.cache_salt,) if self.spec.cache_salt else ()

    # ------------------------------------------------------------------ samples and beams

    def fork_child(self, index: int) -> Request:
        """Sample ``index`` of this n > 1 request, ``"<id>#<index>"``, forked when its prefill
        completes: running on the same group with its tokens so far (its blocks are shared by
        ``KVCacheManager.fork``) and the sampling params of that sample (``for_child``)."""
        return self._running_copy(f"{self.request_id}#{index}", self.sampling_params.for_child(index),
                                  list(self.output_token_ids), self.num_computed_tokens,
                                  parent_request_id=self.request_id, index=index)

    def fork_beam(self, parent: Request, token_id: int, logprobs: SampleLogprobs, cum_logprob: float) -> Request:
        """A new live beam of this root's search, ``"<id>@<k>"``: ``parent``'s tokens and
        ``token_id``, running on the same group; its blocks are shared by ``KVCacheManager.fork``."""
        assert self.beam is not None
        beam = self._running_copy(f"{self.request_id}@{self.beam.next_beam}", self.sampling_params,
                                  [*parent.output_token_ids, token_id], parent.num_computed_tokens,
                                  beam_root=self, cum_logprob=cum_logprob,
                                  beam_logprobs=[*parent.beam_logprobs, logprobs])
        self.beam.next_beam += 1
        return beam

    def _running_copy(self, request_id: str, sampling_params: SamplingParams, output_token_ids: list[int],
                      num_computed_tokens: int, **fields: Any) -> Request:
        """A request running on this one's group with a spec derived from its own (its id and
        params), its inherited fields (``_INHERITED``) and cached-token count: an n > 1 sample
        or a beam; ``fields`` name what makes it one."""
        return Request(spec=self.spec.derive(request_id=request_id, sampling_params=sampling_params),
                       **{name: getattr(self, name) for name in _INHERITED},
                       output_token_ids=output_token_ids, status=RequestStatus.RUNNING,
                       num_computed_tokens=num_computed_tokens, num_cached_tokens=self.num_cached_tokens,
                       group_id=self.group_id, **fields)

    @property
    def is_beam(self) -> bool:
        """It is a live beam of a beam search: the root while it is prefilled, or a beam."""
        return self.beam is not None or self.beam_root is not None

    def new_request_bytes(self, num_tokens: int | None = None) -> int:
        """An upper bound of the bytes its ``NewRequestData`` takes in a msgpack ``StepPlan``
        with ``num_tokens`` tokens (default: the tokens known now): at most 5 bytes per token
        id and per block id (block size >= 8), its sampling params (field names and the widest
        values: 512, plus 18 per ``logit_bias`` entry and the text of a structured-output
        constraint, at most twice its canonical form), its id in the plan's maps, the field
        names and counters (256), and the ids of the samples an n > 1 request forks."""
        tokens = self.num_tokens if num_tokens is None else num_tokens
        params = self.sampling_params
        params_bytes = (512 + sum(len(s.encode()) + 5 for s in params.stop) + 9 * len(params.stop_token_ids)
                        + 18 * len(params.logit_bias))
        if params.structured_outputs is not None:
            params_bytes += 64 + 2 * len(params.structured_outputs.spec().encode())
        forks = (params.n - 1) * (len(self.request_id.encode()) + 8)
        return 5 * (tokens + tokens // 8 + 1) + params_bytes + 3 * len(self.request_id.encode()) + 256 + forks

    def cached_request_bytes(self, num_new_blocks: int) -> int:
        """An upper bound of the bytes it takes in a msgpack ``StepPlan`` as a running request
        with ``num_new_blocks`` blocks appended, at most 5 bytes per integer and 5 per header:
        its row of ``CachedRequests`` (its id, the blocks' list, its computed tokens), a
        copy-on-write's ``replaced_blocks`` entry (its id, two integers) and ``block_copies``
        entry, and its ``num_scheduled_tokens`` entry (its id, an integer); and the ids of the
        samples an n > 1 request forks when its prefill completes, or a new beam's
        ``BeamForks`` row (its id, its parent's, a token)."""
        rid = len(self.request_id.encode())
        forks = (self.sampling_params.n - 1) * (rid + 8) + rid + 5 if self.needs_fork else 0
        if self.beam_root is not None:
            forks = 2 * rid + 48
        row = (rid + 5) + 5 + 5 * num_new_blocks + 5
        copy_on_write = (rid + 5) + 11 + 11
        return row + copy_on_write + (rid + 5) + 5 + forks

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for its prompt's log probabilities and has not had them all: it is not served
        from the prefix cache (those positions would not be computed), as in vLLM."""
        return (self.sampling_params.prompt_logprobs is not None and self.parent_request_id is None
                and not self.sent_to_detokenizer)

    @property
    def done_when_answered(self) -> bool:
        """The tokens sampled in flight (async scheduling) take the request to ``max_tokens``
        or ``max_model_len``: nothing more to schedule for it."""
        if self.num_output_placeholders == 0:
            return False
        max_tokens = self.sampling_params.max_tokens
        total = self.num_tokens + self.num_output_placeholders
        done_by_max_tokens = (max_tokens is not None
                              and len(self.output_token_ids) + self.num_output_placeholders >= max_tokens)
        return done_by_max_tokens or total >= self.max_model_len

    @property
    def needs_fork(self) -> bool:
        return (self.sampling_params.n > 1 and not self.child_ids and self.parent_request_id is None
                and not self.sampling_params.use_beam_search)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @cached_property
    def grammar_key(self) -> str | None:
        """The name of its structured-output grammar (``StructuredOutputsParams.digest``), or
        None when unconstrained: it is admitted on a group only once that group has it compiled."""
        params = self.sampling_params.structured_outputs
        return None if params is None else params.digest()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold: prompt + max_tokens, capped by max_model_len."""
        max_tokens = self.sampling_params.max_tokens
        limit = self.max_model_len if max_tokens is None else self.num_prompt_tokens + max_tokens
        return min(limit, self.max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[bool, int, float]:
        """Lower sorts first: interactive before background (batch lines), then higher
        priority (lower value), then older."""
        return (self.background, self.priority, self.arrival_time)

    def check_stop(self) -> bool:
        """After appending a token: decide whether the request is finished (sets the reason).

        Order as in vLLM: EOS (unless ``ignore_eos``), then ``stop_token_ids``, then
        ``max_tokens``, then ``max_model_len``. Before ``min_tokens`` outputs neither EOS nor a
        stop token ends it (the sampler forbids them there).
        """
        last = self.output_token_ids[-1]
        params = self.sampling_params
        stops = len(self.output_token_ids) >= params.min_tokens
        if stops and not params.ignore_eos and last in self.eos_token_ids:
            self.finish_reason, self.stop_reason = "stop", None
        elif stops and last in params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", last
        elif params.max_tokens is not None and len(self.output_token_ids) >= params.max_tokens:
            self.finish_reason = "length"
        elif self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
        else:
            return False
        return True
