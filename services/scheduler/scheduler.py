"""Continuous batching over many executor groups (no I/O: unit-tested on the CPU).

Each executor group steps independently; ``schedule(group_id)`` builds that group's next
``StepPlan`` and ``update_from_output`` applies its ``StepResult``. Per step, as in vLLM V1:
1. running requests of the group get their next tokens (decode = 1 token, or the next
   chunk of a chunked prefill), preempting the lowest-priority/newest running request
   (recompute) when a block cannot be allocated;
2. waiting requests are admitted while ``max_num_seqs``, the token budget
   (``max_num_batched_tokens``) and free blocks allow; a prompt longer than the budget
   left is prefilled in chunks.
Prefills and decodes share the step.
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


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # tokens per step
    policy: str = "fcfs"  # "fcfs" or "priority"


@dataclass
class GroupState:
    """One executor group: its block pool and the requests placed on it."""

    group_id: str
    kv: KVCacheManager
    running: list[Request] = field(default_factory=list)
    known: set[str] = field(default_factory=set)  # request ids the executor holds state for
    to_forget: list[str] = field(default_factory=list)  # finished/preempted, not yet told
    in_flight: StepPlan | None = None
    last_heartbeat: float = field(default_factory=time.monotonic)


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
        self.waiting: list[Request] = []
        self._step_id = 0
        self.num_preemptions = 0
        self.num_finished = 0

    # ------------------------------------------------------------------ groups

    def add_group(self, group_id: str, num_blocks: int, block_size: int) -> None:
        """Register an executor group (a re-registration replaces the old one)."""
        if group_id in self.groups:
            self.remove_group(group_id)
        self.groups[group_id] = GroupState(group_id, KVCacheManager(num_blocks, block_size))

    def remove_group(self, group_id: str) -> list[Request]:
        """Drop a group; its requests are requeued (recomputed elsewhere). Returns them."""
        group = self.groups.pop(group_id, None)
        if group is None:
            return []
        moved = list(group.running)
        for req in moved:
            self._reset_for_recompute(req, group)
            self._enqueue(req, front=True)
        return moved

    # ------------------------------------------------------------------ requests

    def add_request(self, req: Request) -> ServiceError | None:
        """Queue a request, or refuse it at once if it could never fit a pool even alone."""
        if req.request_id in self.requests:
            return ServiceError(message=f"duplicate request id {req.request_id}", param="request_id")
        if self.groups:
            largest = max(g.kv.num_blocks * g.kv.block_size for g in self.groups.values())
            if req.max_total_tokens > largest:
                return ServiceError(
                    message=(
                        f"The request needs up to {req.max_total_tokens} tokens of KV cache "
                        f"(prompt {req.num_prompt_tokens} + max_tokens), but the largest KV cache "
                        f"pool holds {largest} tokens. Reduce max_tokens or the prompt."
                    ),
                    param="max_tokens",
                    code="kv_cache_too_small",
                )
        self.requests[req.request_id] = req
        self._enqueue(req)
        return None

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[Request]:
        """Finish these requests now and free their blocks. Unknown ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(req)
            req.finish_reason = reason  # type: ignore[assignment]
            self._finish(req)
            done.append(req)
        return done

    def has_work(self, group_id: str) -> bool:
        group = self.groups.get(group_id)
        return group is not None and bool(group.running or self.waiting)

    # ------------------------------------------------------------------ step

    def schedule(self, group_id: str) -> StepPlan | None:
        """The group's next step, or ``None`` if it has nothing to compute now."""
        group = self.groups[group_id]
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []

        group.running.sort(key=Request.sort_key)
        i = 0
        while i < len(group.running) and budget > 0:
            req = group.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                blocks = group.kv.allocate_slots(req, num_new)
                if blocks is not None:
                    break
                victim = group.running.pop()  # lowest priority, then newest
                self._preempt(victim, group)
                preempted.append(victim)
                if victim is req:
                    break
            if blocks is None:  # the request preempted itself
                break
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new
            i += 1

        if not preempted:
            self._admit(group, budget, scheduled, new_blocks)

        if not scheduled:
            return None
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, group_id=group_id, finished_request_ids=group.to_forget)
        group.to_forget = []
        for req in group.running:
            if req.request_id not in scheduled:
                continue
            if req.request_id in group.known:
                plan.cached_requests.append(
                    CachedRequestData(
                        request_id=req.request_id,
                        new_block_ids=new_blocks[req.request_id],
                        num_computed_tokens=req.num_computed_tokens,
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
        plan.num_scheduled_tokens = scheduled
        group.in_flight = plan
        return plan

    def _admit(self, group: GroupState, budget: int, scheduled: dict[str, int], new_blocks: dict) -> None:
        while self.waiting and budget > 0 and len(group.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.max_total_tokens > group.kv.num_blocks * group.kv.block_size:
                break  # fits another group only
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            blocks = group.kv.allocate_slots(req, num_new)
            if blocks is None:
                break  # wait for blocks; keep the queue order
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            req.group_id = group.group_id
            group.running.append(req)
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new

    def update_from_output(self, result: StepResult) -> StepOutcome:
        """Apply a group's ``StepResult``: advance computed tokens, append samples, finish."""
        outcome = StepOutcome()
        group = self.groups.get(result.group_id)
        if group is None or group.in_flight is None or group.in_flight.step_id != result.step_id:
            return outcome
        plan, group.in_flight = group.in_flight, None
        group.last_heartbeat = time.monotonic()
        for rid, num in plan.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING or req.group_id != group.group_id:
                continue  # aborted or preempted meanwhile
            req.num_computed_tokens += num
            token = result.sampled_token_ids.get(rid)
            if token is None:
                continue
            req.output_token_ids.append(token)
            req.pending_output_ids.append(token)
            outcome.updated.append(req)
            if req.check_stop():
                self._finish(req)
                outcome.finished.append(req)
        return outcome

    # ------------------------------------------------------------------ internals

    def _enqueue(self, req: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            self.waiting.append(req)
            self.waiting.sort(key=Request.sort_key)
        elif front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)

    def _reset_for_recompute(self, req: Request, group: GroupState) -> None:
        group.kv.free(req)
        group.known.discard(req.request_id)
        req.num_computed_tokens = 0
        req.group_id = None
        req.status = RequestStatus.PREEMPTED

    def _preempt(self, req: Request, group: GroupState) -> None:
        self._reset_for_recompute(req, group)
        group.to_forget.append(req.request_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def _finish(self, req: Request) -> None:
        group = self.groups.get(req.group_id) if req.group_id else None
        if group is not None:
            group.kv.free(req)
            if req in group.running:
                group.running.remove(req)
            if req.request_id in group.known:
                group.known.discard(req.request_id)
                group.to_forget.append(req.request_id)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
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
                )
                for g in self.groups.values()
            ],
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            time=time.time(),
        )
