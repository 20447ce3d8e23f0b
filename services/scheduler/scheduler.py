"""Continuous batching over many executor groups (no I/O: unit-tested on the CPU).

A new request is routed to one group by a score that weighs its exact prefix-cache hit in
each group against that group's queued work (``route``). Each group steps independently:
``schedule(group_id)`` builds that group's next ``StepPlan`` and ``update_from_output``
applies its ``StepResult``. Per step, as in vLLM V1:
1. running requests of the group get their next tokens (decode = 1 token, or the next
   chunk of a chunked prefill), preempting the lowest-priority/newest running request
   (recompute) when a block cannot be allocated;
2. the group's waiting requests are admitted while ``max_num_seqs``, the token budget
   (``max_num_batched_tokens``) and free blocks allow, reusing their longest cached prefix;
   a prompt longer than the budget left is prefilled in chunks.
Prefills and decodes share the step.

With ``async_scheduling`` (vLLM's async scheduling) a group may have two steps in flight: step
N + 1 is planned while the executor runs step N. A request that samples in a step in flight
holds an output placeholder; its next decode is scheduled on it (the executor feeds back the
token it sampled itself), and its stop checks happen when the result arrives, so a request
that stops on EOS may compute one token that is dropped. ``num_computed_tokens`` advances
when a step is planned (as in vLLM V1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.scheduler.block_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus
from shared.messages import (
    CachedRequestData,
    GroupStats,
    NewRequestData,
    SchedulerStats,
    ServiceError,
    StepPlan,
    StepResult,
)

DECODE_COST_TOKENS = 16  # routing: one running request's per-step work, in prefill tokens
MAX_FAILED_STEPS = 3  # a request in this many failed batched steps fails with the error (fail_step)
MAX_FAILED_ALONE = 2  # a suspect that fails this many steps alone fails with the error (fail_step)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # tokens per step
    policy: str = "fcfs"  # "fcfs" or "priority"
    enable_prefix_caching: bool = True
    async_scheduling: bool = True  # plan step N + 1 while step N runs (two steps in flight)
    # the largest StepPlan the bus carries (NATS max_payload); None: no limit. A step admits
    # waiting requests only while their NewRequestData (whole prompts) fit
    max_plan_bytes: int | None = None

    @property
    def max_steps_in_flight(self) -> int:
        return 2 if self.async_scheduling else 1


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
    last_heartbeat: float = field(default_factory=time.monotonic)

    @property
    def capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def queued_work(self) -> int:
        """Tokens this group must compute before a newly routed request would start."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return waiting + DECODE_COST_TOKENS * len(self.running)


@dataclass
class StepOutcome:
    """What one ``StepResult`` changed: requests with new tokens (``pending_output_ids``) and
    the ones that finished."""

    updated: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    """Owns every request's state and one ``KVCacheManager`` per executor group."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.groups: dict[str, GroupState] = {}
        self.requests: dict[str, Request] = {}
        self.unrouted: list[Request] = []  # no group can hold them yet
        self._step_id = 0
        # requests of failed steps that run alone until they sample (fail_step); empty almost
        # always, so the step loop pays one truth test for them
        self.suspects: set[str] = set()
        self.num_preemptions = 0
        self.num_finished = 0

    @property
    def waiting(self) -> list[Request]:
        """Every waiting request, over all groups."""
        return [r for g in self.groups.values() for r in g.waiting] + self.unrouted

    # ------------------------------------------------------------------ groups

    def add_group(self, group_id: str, num_blocks: int, block_size: int) -> list[tuple[Request, ServiceError]]:
        """Register an executor group (a re-registration replaces the old one) and route the
        requests that waited for one. Returns those that no group can ever hold, finished
        (as ``add_request`` refuses them when groups exist), each with its error."""
        if group_id in self.groups:
            self.remove_group(group_id)
        self.groups[group_id] = GroupState(
            group_id, KVCacheManager(num_blocks, block_size, self.config.enable_prefix_caching)
        )
        pending, self.unrouted = self.unrouted, []
        refused = []
        for req in pending:
            error = self._fit_pools(req)
            if error is None:
                self.route(req)
            else:
                refused.append((req, error))
                req.finish_reason = "error"
                self._finish(req)
        return refused

    def remove_group(self, group_id: str) -> list[Request]:
        """Drop a group; its requests are routed again (recomputed elsewhere). Returns them."""
        group = self.groups.pop(group_id, None)
        if group is None:
            return []
        moved = list(group.running) + list(group.waiting)
        for req in group.running:
            group.kv.free(req)
        for req in moved:
            req.num_computed_tokens = 0
            req.num_output_placeholders = 0
            req.epoch += 1  # results of its steps in flight are stale
            req.group_id = None
            req.block_hashes.clear()
            req.num_cached_blocks = 0
            if req.status is RequestStatus.RUNNING:
                req.status = RequestStatus.PREEMPTED
        for req in sorted(moved, key=Request.sort_key):
            self.route(req)
        return moved

    # ------------------------------------------------------------------ requests

    def fail_step(self, group_id: str) -> tuple[list[Request], list[Request]]:
        """The group's oldest step in flight failed (an error result, or a timeout). Returns
        ``(failed, requeued)``: the requests to fail now (finish_reason "error", blocks freed)
        and the group's other requests, routed again for recompute; the group is removed.

        Blame, so that one poisoned request (an input that crashes the model or the sampler)
        does not fail every request batched with it, as a single failed step does in vLLM:
        - a suspect runs alone (``schedule``) until a step in which it samples succeeds; a
          suspect that fails ``MAX_FAILED_ALONE`` steps alone fails (twice: a transient failure
          of one of its steps alone harms nobody);
        - any other failed step makes each of its requests a suspect, and fails a request that
          has now been in ``MAX_FAILED_STEPS`` such steps (one that crashes only in a batch).
        A request counts as in the step whatever happened to it since (preempted meanwhile).
        """
        group = self.groups.get(group_id)
        if group is None:
            return [], []
        failed: list[Request] = []
        if group.in_flight:
            reqs = [self.requests[rid] for rid in group.in_flight[0].epochs if rid in self.requests]
            if len(reqs) == 1 and reqs[0].request_id in self.suspects:
                reqs[0].num_failed_alone += 1
                if reqs[0].num_failed_alone >= MAX_FAILED_ALONE:
                    failed.append(reqs[0])
            else:
                for req in reqs:
                    req.num_failed_steps += 1
                    if req.num_failed_steps >= MAX_FAILED_STEPS:
                        failed.append(req)
                    else:
                        self.suspects.add(req.request_id)
        done = self.abort([r.request_id for r in failed], "error") if failed else []
        return done, self.remove_group(group_id)

    def add_request(self, req: Request) -> ServiceError | None:
        """Queue a request, or refuse it at once if it could never fit a pool even alone
        (with no group yet, it waits for one: ``add_group`` checks it then)."""
        if req.request_id in self.requests:
            return ServiceError(message=f"duplicate request id {req.request_id}", param="request_id")
        if req.priority != 0 and self.config.policy != "priority":  # as vLLM: not silently ignored
            return ServiceError(message=f"priority={req.priority} needs --scheduling-policy priority "
                                        f"(this engine schedules {self.config.policy})", param="priority")
        if self.groups and (error := self._fit_pools(req)) is not None:
            return error
        limit = self.config.max_plan_bytes
        if limit is not None and (size := req.new_request_bytes(req.max_total_tokens)) > limit:
            return ServiceError(
                message=(f"The request, with up to {req.max_total_tokens} tokens, may need {size} bytes in a "
                         f"step plan, over the {limit} bytes a NATS message may carry here: raise the "
                         "NATS server's max_payload, or shorten the prompt or max_tokens."),
                param="prompt", code="request_too_large",
            )
        self.requests[req.request_id] = req
        self.route(req)
        return None

    def _fit_pools(self, req: Request) -> ServiceError | None:
        """None if the largest KV cache pool can hold ``req`` alone, else why not.

        A request without ``max_tokens`` (generate up to the context length, as a chat request
        does by default) whose context would outgrow the largest pool gets that pool's
        capacity as its context length instead: it stops there with finish_reason "length",
        rather than being refused.
        """
        largest = max(g.capacity_tokens for g in self.groups.values())
        if req.sampling_params.max_tokens is None and req.num_prompt_tokens < largest < req.max_model_len:
            req.max_model_len = largest
        if req.max_total_tokens <= largest:
            return None
        return ServiceError(
            message=(
                f"The request needs up to {req.max_total_tokens} tokens of KV cache "
                f"(prompt {req.num_prompt_tokens} + max_tokens), but the largest KV cache "
                f"pool holds {largest} tokens. Reduce max_tokens or the prompt."
            ),
            param="max_tokens",
            code="kv_cache_too_small",
        )

    def route(self, req: Request) -> GroupState | None:
        """Queue ``req`` on the group where it would start soonest: the least queued work plus
        its own uncached prompt tokens (an exact prefix-cache hit saves those tokens)."""
        best, best_cost = None, None
        for group in self.groups.values():
            if req.max_total_tokens > group.capacity_tokens:
                continue
            _, hit = group.kv.get_computed_blocks(req)
            cost = (group.queued_work() + req.num_tokens - hit, len(group.running), group.group_id)
            if best_cost is None or cost < best_cost:
                best, best_cost = group, cost
        if best is None:
            self.unrouted.append(req)
            return None
        req.group_id = best.group_id
        self._enqueue(best, req, front=req.status is RequestStatus.PREEMPTED)
        return best

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[Request]:
        """Finish these requests now and free their blocks. Unknown ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            family = [req] if req is not None else []
            if req is not None and req.parent_request_id is None and reason != "stop":
                family += [self.requests[c] for c in req.child_ids if c in self.requests]
            elif req is None and "#" not in rid:  # the parent finished; its samples may run on
                family = [r for r in self.requests.values() if r.parent_request_id == rid]
            for r in family:
                r.finish_reason = reason  # type: ignore[assignment]
                self._finish(r)
                done.append(r)
        return done

    def has_work(self, group_id: str) -> bool:
        group = self.groups.get(group_id)
        return group is not None and bool(group.running or group.waiting)

    @property
    def next_step_id(self) -> int:
        """The id the next plan will get (step ids are global and only increase)."""
        return self._step_id + 1

    def can_schedule(self, group_id: str) -> bool:
        """Whether the group may get another plan now: it has work and fewer steps in flight
        than ``max_steps_in_flight`` (none past a step that forks n > 1 samples, whose
        children join once it is answered)."""
        group = self.groups.get(group_id)
        if group is None or not (group.running or group.waiting):
            return False
        if len(group.in_flight) >= self.config.max_steps_in_flight:
            return False
        return not any(step.plan.forks for step in group.in_flight)

    def is_in_flight(self, group_id: str, step_id: int) -> bool:
        """Whether ``step_id`` is the oldest unanswered step of the group (the one a result
        must answer; anything else is stale: a dropped or re-registered group's)."""
        group = self.groups.get(group_id)
        return group is not None and bool(group.in_flight) and group.in_flight[0].plan.step_id == step_id

    # ------------------------------------------------------------------ step

    def schedule(self, group_id: str) -> StepPlan | None:
        """The group's next step, or ``None`` if it has nothing to compute now.

        A suspect of a failed step (``fail_step``) runs alone: while one runs, the group's
        other requests keep their blocks but are not scheduled; a waiting suspect is admitted
        alone when it fits, and until then nobody else is admitted, so that it is not starved.
        """
        group = self.groups[group_id]
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        copies: dict[str, tuple[int, int]] = {}  # request id -> (src, dst) copy-on-write
        preempted = False

        group.running.sort(key=Request.sort_key)
        suspect = waiting_suspect = None
        if self.suspects:
            suspect = next((r for r in group.running if r.request_id in self.suspects), None)
            if suspect is None:
                waiting_suspect = next((r for r in group.waiting if r.request_id in self.suspects), None)
        if waiting_suspect is not None and len(group.running) < self.config.max_num_seqs:
            if self._admit_one(group, waiting_suspect, budget, scheduled, new_blocks):
                return self._make_plan(group, scheduled, new_blocks, copies)
        gone: set[str] = set()  # preempted by this step
        for req in [suspect] if suspect is not None else list(group.running):
            if budget <= 0:
                break
            if req.request_id in gone:
                continue
            # tokens known or sampled in flight, not yet computed (0: waiting for a result)
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
            if num_new <= 0 or self._done_when_answered(req):
                continue
            while True:
                allocated = group.kv.allocate_running(req, num_new)
                if allocated is not None:
                    break
                victim = group.running.pop()  # lowest priority, then newest
                self._preempt(victim, group)
                gone.add(victim.request_id)
                preempted = True
                if victim is req:
                    break
            if allocated is None:  # the request preempted itself
                break
            new_blocks[req.request_id], copy = allocated
            if copy is not None:
                copies[req.request_id] = copy
            scheduled[req.request_id] = num_new
            budget -= num_new

        if not preempted and suspect is None and waiting_suspect is None:
            self._admit(group, budget, scheduled, new_blocks)
        if not scheduled:
            return None
        return self._make_plan(group, scheduled, new_blocks, copies)

    @staticmethod
    def _done_when_answered(req: Request) -> bool:
        """The tokens in flight take the request to max_tokens or max_model_len: nothing more
        to schedule for it."""
        if req.num_output_placeholders == 0:
            return False
        max_tokens = req.sampling_params.max_tokens
        total = req.num_tokens + req.num_output_placeholders
        done_by_max_tokens = max_tokens is not None and len(req.output_token_ids) + req.num_output_placeholders >= max_tokens
        return done_by_max_tokens or total >= req.max_model_len

    def _admit(self, group: GroupState, budget: int, scheduled: dict[str, int], new_blocks: dict) -> None:
        """Start waiting requests in queue order while budget, sequences, blocks and the plan's
        bytes (``max_plan_bytes``: each new request carries its whole prompt) last."""
        limit = self.config.max_plan_bytes
        plan_bytes = 0
        if limit is not None and group.waiting:  # what the running requests scheduled take
            plan_bytes = sum(req.cached_request_bytes(len(new_blocks[req.request_id]))
                             for req in group.running if req.request_id in scheduled)
            plan_bytes += sum(len(rid.encode()) + 5 for rid in group.to_forget)
        while group.waiting and budget > 0 and len(group.running) < self.config.max_num_seqs:
            req = group.waiting[0]
            if limit is not None:
                plan_bytes += req.new_request_bytes()
                if plan_bytes > limit and scheduled:
                    break  # the next step takes it
            if not self._admit_one(group, req, budget, scheduled, new_blocks):
                break  # wait for blocks; keep the queue order
            budget -= scheduled[req.request_id]

    def _admit_one(self, group: GroupState, req: Request, budget: int, scheduled: dict[str, int],
                   new_blocks: dict) -> bool:
        """Start the waiting ``req`` with up to ``budget`` tokens; False if its blocks do not fit."""
        computed, num_hit = ([], 0) if req.needs_prompt_logprobs else group.kv.get_computed_blocks(req)
        req.num_computed_tokens = num_hit
        num_new = min(req.num_tokens - num_hit, budget)
        blocks = group.kv.allocate_slots(req, num_new, computed)
        if blocks is None:
            req.num_computed_tokens = 0
            return False
        group.waiting.remove(req)
        group.kv.record_prefix_query(req.num_tokens, num_hit)
        if req.status is RequestStatus.WAITING:
            req.num_cached_tokens = num_hit
        req.status = RequestStatus.RUNNING
        group.running.append(req)
        scheduled[req.request_id] = num_new
        new_blocks[req.request_id] = blocks
        return True

    def _make_plan(
        self, group: GroupState, scheduled: dict[str, int], new_blocks: dict, copies: dict[str, tuple[int, int]]
    ) -> StepPlan:
        copied = copies
        self._step_id += 1
        plan = StepPlan(
            step_id=self._step_id,
            group_id=group.group_id,
            finished_request_ids=group.to_forget,
            block_copies=list(copies.values()),
        )
        group.to_forget = []
        epochs: dict[str, int] = {}
        samplers: set[str] = set()
        for req in group.running:
            num = scheduled.get(req.request_id)
            if num is None:
                continue
            if req.request_id in group.known:
                copy = copied.get(req.request_id)
                plan.cached_requests.append(
                    CachedRequestData(
                        request_id=req.request_id,
                        new_block_ids=new_blocks[req.request_id],
                        num_computed_tokens=req.num_computed_tokens,
                        replaced_block=None if copy is None else (req.block_ids.index(copy[1]), copy[1]),
                    )
                )
            else:
                group.known.add(req.request_id)
                plan.new_requests.append(
                    NewRequestData(
                        request_id=req.request_id,
                        prompt_token_ids=req.all_token_ids,
                        sampling_params=req.sampling_params,
                        block_ids=list(req.block_ids),
                        num_computed_tokens=req.num_computed_tokens,
                        num_output_tokens=len(req.output_token_ids),
                    )
                )
            if req.needs_fork and req.num_computed_tokens + num == req.num_tokens:
                req.fork_pending = True  # the prefill completes this step: fork the n - 1 others
                plan.forks[req.request_id] = [f"{req.request_id}#{i}" for i in range(1, req.sampling_params.n)]
            # the plan carries the step's start; the scheduler counts the step as computed now
            req.num_computed_tokens += num
            epochs[req.request_id] = req.epoch
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:  # reaches its last token
                req.num_output_placeholders += 1
                samplers.add(req.request_id)
        plan.num_scheduled_tokens = scheduled
        group.in_flight.append(InFlightStep(plan, epochs, samplers))
        return plan

    def update_from_output(self, result: StepResult) -> StepOutcome:
        """Apply a group's ``StepResult`` to the oldest step it has in flight (anything else is
        stale and ignored): append the sampled tokens, check stops, finish."""
        outcome = StepOutcome()
        if not self.is_in_flight(result.group_id, result.step_id):
            return outcome
        group = self.groups[result.group_id]
        step = group.in_flight.pop(0)
        plan = step.plan
        group.last_heartbeat = time.monotonic()
        for rid in plan.num_scheduled_tokens:
            req = self.requests.get(rid)
            if (req is None or req.epoch != step.epochs[rid] or req.status is not RequestStatus.RUNNING
                    or req.group_id != group.group_id):
                continue  # finished, aborted or preempted meanwhile
            if rid in step.samplers:
                req.num_output_placeholders -= 1
            if (chunk := result.prompt_logprobs.get(rid)) is not None and req.needs_prompt_logprobs:
                have = 1 + len(req.prompt_logprobs)  # the next prompt position it needs (a recompute repeats some)
                if chunk.start <= have < chunk.start + len(chunk.logprobs):
                    req.prompt_logprobs.extend(chunk.logprobs[have - chunk.start:])
            token = result.sampled_token_ids.get(rid)
            if token is None:
                continue
            self.suspects.discard(rid)  # a step that sampled for it succeeded (fail_step)
            samples = [(req, token)]
            if req.fork_pending:
                req.fork_pending = False
                samples += [(self._fork(group, req, cid), result.sampled_token_ids[cid]) for cid in plan.forks[rid]]
            for sample, tok in samples:
                sample.output_token_ids.append(tok)
                sample.pending_output_ids.append(tok)
                if (lp := result.logprobs.get(sample.request_id)) is not None:
                    sample.pending_logprobs.append(lp)
                outcome.updated.append(sample)
                if sample.check_stop():
                    self._finish(sample)
                    outcome.finished.append(sample)
        return outcome

    def _fork(self, group: GroupState, parent: Request, child_id: str) -> Request:
        """Sample ``index`` of an n > 1 request: the parent's tokens and blocks (shared)."""
        index = int(child_id.rsplit("#", 1)[1])
        child = Request(
            request_id=child_id,
            gateway_id=parent.gateway_id,
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params.for_child(index),
            max_model_len=parent.max_model_len,
            eos_token_ids=parent.eos_token_ids,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            output_token_ids=list(parent.output_token_ids),
            status=RequestStatus.RUNNING,
            num_computed_tokens=parent.num_computed_tokens,
            num_cached_tokens=parent.num_cached_tokens,
            group_id=group.group_id,
            parent_request_id=parent.request_id,
            index=index,
            cache_extra_keys=parent.cache_extra_keys,
        )
        group.kv.fork(parent, child)
        group.running.append(child)
        group.known.add(child_id)
        parent.child_ids.append(child_id)
        self.requests[child_id] = child
        return child

    # ------------------------------------------------------------------ internals

    def _enqueue(self, group: GroupState, req: Request, front: bool = False) -> None:
        """FCFS: new requests join the back; ``front`` (preempted or requeued ones) go ahead
        of every request never started, in arrival order among themselves."""
        if self.config.policy == "priority":
            group.waiting.append(req)
            group.waiting.sort(key=Request.sort_key)
        elif front:
            i = 0
            while (i < len(group.waiting) and group.waiting[i].status is RequestStatus.PREEMPTED
                   and group.waiting[i].sort_key() <= req.sort_key()):
                i += 1
            group.waiting.insert(i, req)
        else:
            group.waiting.append(req)

    def _preempt(self, req: Request, group: GroupState) -> None:
        group.kv.free(req)
        group.known.discard(req.request_id)
        group.to_forget.append(req.request_id)
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.epoch += 1  # results of its steps in flight are stale
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(group, req, front=True)

    def _finish(self, req: Request) -> None:
        group = self.groups.get(req.group_id) if req.group_id else None
        if group is not None:
            if req in group.running:
                group.kv.free(req)
                group.running.remove(req)
            elif req in group.waiting:
                group.waiting.remove(req)
            if req.request_id in group.known:
                group.known.discard(req.request_id)
                group.to_forget.append(req.request_id)
        elif req in self.unrouted:
            self.unrouted.remove(req)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self.suspects.discard(req.request_id)
        self.num_finished += 1

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=sum(len(g.running) for g in self.groups.values()),
            num_waiting=len(self.waiting),
            groups=[
                GroupStats(
                    group_id=g.group_id,
                    num_blocks=g.kv.num_blocks,
                    num_free_blocks=g.kv.num_free_blocks,
                    block_size=g.kv.block_size,
                    num_running=len(g.running),
                    num_waiting=len(g.waiting),
                    prefix_cache_queries=g.kv.num_queries,
                    prefix_cache_hits=g.kv.num_hits,
                )
                for g in self.groups.values()
            ],
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            time=time.time(),
        )
