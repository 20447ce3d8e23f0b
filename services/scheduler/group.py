"""One executor group as the scheduler sees it, and the routing of requests between groups
(no I/O).

``GroupState`` holds a group's ``KVCacheManager``, its running and waiting queues, the request
ids its executor holds state for and its steps in flight. ``pick_group`` chooses the group
where a request would start soonest: the least ``queued work + the request's uncached prompt
tokens``, where the uncached tokens come from an exact lookup of the request's block hashes in
that group's prefix cache (the scheduler owns every group's cache index, so this is exact).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.scheduler.block_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus
from shared.messages import (
    BeamForks,
    GroupStats,
    RegisterGroup,
    ServiceError,
    StepPlan,
    StructuredOutputsParams,
)
from shared.messages.structured_outputs import GRAMMAR_CACHE_SIZE

DECODE_COST_TOKENS = 16  # routing: one running request's per-step work, in prefill tokens


@dataclass
class InFlightStep:
    """A plan sent to a group and not yet answered."""

    plan: StepPlan
    epochs: dict[str, int]  # request id -> Request.epoch when planned (a later epoch: stale)
    samplers: set[str]  # requests that sample a token in this step (one placeholder each)


@dataclass
class GroupState:
    """One executor group: its block pool and the requests routed to it."""

    group_id: str
    kv: KVCacheManager
    running: list[Request] = field(default_factory=list)
    waiting: list[Request] = field(default_factory=list)
    known: set[str] = field(default_factory=set)  # request ids the executor holds state for
    to_forget: list[str] = field(default_factory=list)  # finished/preempted, not yet told
    in_flight: list[InFlightStep] = field(default_factory=list)  # oldest first
    beam_forks: BeamForks = field(default_factory=BeamForks)  # new beams, not yet told
    # structured outputs (vLLM V1's WAITING_FOR_FSM): the grammars (StructuredOutputsParams.digest)
    # compiled on this group's rank 0 (an LRU as long as its cache, least recently used first),
    # those asked and not yet answered, and those to ask
    grammars_ready: OrderedDict[str, None] = field(default_factory=OrderedDict)
    grammars_asked: dict[str, StructuredOutputsParams] = field(default_factory=dict)
    to_compile: list[str] = field(default_factory=list)

    def mark_grammar_ready(self, key: str) -> None:
        """The group compiled grammar ``key``: remembered as its most recently used, the least
        recently used forgotten past ``GRAMMAR_CACHE_SIZE`` (the executor's cache evicts it too:
        a request that needs it again asks again)."""
        self.grammars_ready[key] = None
        self.grammars_ready.move_to_end(key)
        while len(self.grammars_ready) > GRAMMAR_CACHE_SIZE:
            self.grammars_ready.popitem(last=False)

    def grammar_ready_for(self, req: Request) -> bool:
        """Whether ``req`` may be admitted here as far as its grammar goes (unconstrained, or
        its grammar compiled on this group: then marked used). A grammar forgotten (evicted)
        since it was asked for is asked for again (:meth:`ask_grammar`)."""
        key = req.grammar_key
        if key is None:
            return True
        if key in self.grammars_ready:
            self.grammars_ready.move_to_end(key)
            return True
        self.ask_grammar(req)
        return False

    def ask_grammar(self, req: Request) -> None:
        """Queue a ``CompileGrammar`` for ``req``'s grammar unless this group has it or was
        asked for it already."""
        key = req.grammar_key
        if key is not None and key not in self.grammars_ready and key not in self.grammars_asked:
            assert req.sampling_params.structured_outputs is not None
            self.grammars_asked[key] = req.sampling_params.structured_outputs
            self.to_compile.append(key)

    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def capacity_for(self, req: Request) -> int:
        """The most tokens ``req`` may hold here: the pool, or for a beam search of width n its
        n-th part in whole blocks (each beam may end up holding blocks of its own; a search
        that could not fit alone would preempt itself for ever)."""
        width = req.sampling_params.n if req.sampling_params.use_beam_search else 1
        return self.kv.num_blocks // width * self.kv.block_size

    def queued_work(self) -> int:
        """Tokens this group must compute before a newly routed request would start."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return waiting + DECODE_COST_TOKENS * len(self.running)

    def enqueue(self, req: Request, by_priority: bool, front: bool = False) -> None:
        """Add ``req`` to the waiting queue. ``by_priority``: the queue stays sorted by
        ``Request.sort_key``. Else FCFS: new requests join the back, but an interactive one
        ahead of every background one (batch lines wait for interactive requests); ``front``
        (preempted or requeued ones) go ahead of every request never started of their kind,
        in ``sort_key`` order among themselves. So the queue reads: preempted interactive,
        waiting interactive, preempted background, waiting background."""
        if by_priority:
            self.waiting.append(req)
            self.waiting.sort(key=Request.sort_key)
        elif front:  # a preempted background request goes behind every interactive one too
            i = 0
            while i < len(self.waiting) and (
                    (self.waiting[i].status is RequestStatus.PREEMPTED and self.waiting[i].sort_key() <= req.sort_key())
                    or (req.background and not self.waiting[i].background)):
                i += 1
            self.waiting.insert(i, req)
        elif not req.background:
            i = len(self.waiting)
            while i > 0 and self.waiting[i - 1].background:  # the background ones are the tail
                i -= 1
            self.waiting.insert(i, req)
        else:
            self.waiting.append(req)

    def admit(self, req: Request, budget: int) -> tuple[int, list[int]] | None:
        """Start the waiting ``req`` with up to ``budget`` tokens, from its longest cached prefix
        (none for a request that needs its prompt's log probabilities: those positions must be
        computed). Returns ``(tokens scheduled, blocks allocated)``, or None if its blocks do not
        fit (then nothing changes)."""
        computed, num_hit = ([], 0) if req.needs_prompt_logprobs else self.kv.get_computed_blocks(req)
        req.num_computed_tokens = num_hit
        num_new = min(req.num_tokens - num_hit, budget)
        blocks = self.kv.allocate_slots(req, num_new, computed)
        if blocks is None:
            req.num_computed_tokens = 0
            return None
        self.waiting.remove(req)
        self.kv.record_prefix_query(req.num_tokens, num_hit)
        if req.status is RequestStatus.WAITING:
            req.num_cached_tokens = num_hit
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return num_new, blocks

    def preempt(self, req: Request, by_priority: bool) -> None:
        """Preempt the running ``req`` (already out of ``running``) for recompute: free its
        blocks, tell the executor to forget it, and queue it again ahead of the requests never
        started (``enqueue``)."""
        self.kv.free(req)
        self.known.discard(req.request_id)
        self.to_forget.append(req.request_id)
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.epoch += 1  # results of its steps in flight are stale
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.enqueue(req, by_priority, front=True)

    def drop(self, req: Request) -> None:
        """Take a finishing ``req`` off this group: free its blocks, and tell the executor to
        forget it if it holds it."""
        if req in self.running:
            self.kv.free(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.request_id in self.known:
            self.known.discard(req.request_id)
            self.to_forget.append(req.request_id)

    def release_all(self) -> list[Request]:
        """The group is dropped: free every block and return its requests (running, then
        waiting), each reset to be routed again and recomputed from its first token."""
        moved = list(self.running) + list(self.waiting)
        for req in self.running:
            self.kv.free(req)
        for req in moved:
            req.num_computed_tokens = 0
            req.num_output_placeholders = 0
            req.epoch += 1  # results of its steps in flight are stale
            req.group_id = None
            req.block_hashes.clear()
            req.num_cached_blocks = 0
            if req.status is RequestStatus.RUNNING:
                req.status = RequestStatus.PREEMPTED
        return moved

    def stats(self) -> GroupStats:
        return GroupStats(
            group_id=self.group_id,
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            block_size=self.kv.block_size,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            prefix_cache_queries=self.kv.num_queries,
            prefix_cache_hits=self.kv.num_hits,
        )


def pick_group(groups: Iterable[GroupState], req: Request) -> GroupState | None:
    """The group where ``req`` would start soonest: the least queued work plus its own uncached
    prompt tokens (an exact prefix-cache hit saves those tokens), then the fewest running
    requests, then the group id; None if no group's pool can hold it."""
    best, best_cost = None, None
    for group in groups:
        if req.max_total_tokens > group.capacity_for(req):
            continue
        _, hit = group.kv.get_computed_blocks(req)
        cost = (group.queued_work() + req.num_tokens - hit, len(group.running), group.group_id)
        if best_cost is None or cost < best_cost:
            best, best_cost = group, cost
    return best


def fit_pools(groups: Iterable[GroupState], req: Request) -> ServiceError | None:
    """None if the largest KV cache pool of ``groups`` (at least one) can hold ``req`` alone,
    else why not.

    A request without ``max_tokens`` (generate up to the context length, as a chat request
    does by default) whose context would outgrow the largest pool gets that pool's capacity as
    its context length instead: it stops there with finish_reason "length", rather than being
    refused.
    """
    largest = max(g.capacity_for(req) for g in groups)
    if req.sampling_params.max_tokens is None and req.num_prompt_tokens < largest < req.max_model_len:
        req.max_model_len = largest
    if req.max_total_tokens <= largest:
        return None
    return ServiceError(
        message=(
            f"The request needs up to {req.max_total_tokens} tokens of KV cache "
            f"(prompt {req.num_prompt_tokens} + max_tokens), but the largest KV cache "
            f"pool holds {largest} tokens{' per beam' if req.sampling_params.use_beam_search else ''}. "
            "Reduce max_tokens or the prompt."
        ),
        param="max_tokens",
        code="kv_cache_too_small",
    )


def registration_error(msg: RegisterGroup, model: str, max_model_len: int) -> ServiceError | None:
    """Why a group may not join a scheduler of ``model`` and ``max_model_len``: an empty pool,
    or another model or context length (the requests are validated and sized for those)."""
    if msg.block_size < 1 or msg.num_blocks < 1:
        return ServiceError(message="empty KV cache pool")
    if msg.model != model or msg.max_model_len != max_model_len:
        return ServiceError(
            message=(f"executor group {msg.group_id!r} serves model {msg.model!r} with max_model_len "
                     f"{msg.max_model_len}, but this scheduler serves {model!r} with max_model_len "
                     f"{max_model_len}: start them with the same --model, --served-model-name and "
                     "--max-model-len"),
            type="server_error", code="group_mismatch", status=500)
    return None
