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

The parts: ``request.py`` (a request's state), ``block_manager.py`` (its blocks;
``block_hash.py``: their prefix-cache keys),
``group.py`` (one group's queues and the routing), ``blame.py`` (who fails with a failed
step), ``admission.py`` (waiting requests admitted into a step), ``step_plan.py`` (the plan
sent for a step), ``results.py`` (a step's result applied to its requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.scheduler import beam_group
from services.scheduler.admission import admit_one, admit_waiting
from services.scheduler.blame import blame, find_suspect
from services.scheduler.block_manager import KVCacheManager
from services.scheduler.group import GroupState, fit_pools, pick_group
from services.scheduler.request import Request, RequestStatus
from services.scheduler.results import StepOutcome, apply_result
from services.scheduler.step_plan import build_step_plan, plan_size_error
from shared.messages import SchedulerStats, ServiceError, StepPlan, StepResult

__all__ = ["Scheduler", "SchedulerConfig", "StepOutcome"]


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


class Scheduler:
    """Owns every request's state and one ``KVCacheManager`` per executor group."""

    def __init__(self, config: SchedulerConfig, first_step_id: int = 1) -> None:
        self.config = config
        self.groups: dict[str, GroupState] = {}
        self.requests: dict[str, Request] = {}
        self.unrouted: list[Request] = []  # no group can hold them yet
        self._step_id = first_step_id - 1
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
            error = fit_pools(self.groups.values(), req)
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
        moved = group.release_all()
        roots = {}  # a beam search starts again from its prompt, as its root
        for req in moved:
            root = req.beam_root or (req if req.beam is not None else None)
            if root is not None:
                roots[root.request_id] = root
        for root in roots.values():
            beam_group.restart(None, root, self.requests)
            root.num_computed_tokens, root.block_ids, root.num_cached_blocks = 0, [], 0
            root.epoch += 1
            root.group_id = None
            root.block_hashes.clear()
            root.status = RequestStatus.PREEMPTED
        moved = [r for r in moved if r.beam_root is None and r.beam is None] + list(roots.values())
        for req in sorted(moved, key=Request.sort_key):
            self.route(req)
        return moved

    # ------------------------------------------------------------------ requests

    def fail_step(self, group_id: str) -> tuple[list[Request], list[Request]]:
        """The group's oldest step in flight failed (an error result, or a timeout). Returns
        ``(failed, requeued)``: the requests to fail now (``blame``; finish_reason "error",
        blocks freed) and the group's other requests, routed again for recompute; the group is
        removed."""
        group = self.groups.get(group_id)
        if group is None:
            return [], []
        failed: list[Request] = []
        if group.in_flight:
            failed = blame([self.requests[rid] for rid in group.in_flight[0].epochs if rid in self.requests],
                           self.suspects)
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
        if self.groups and (error := fit_pools(self.groups.values(), req)) is not None:
            return error
        if (error := plan_size_error(req, self.config.max_plan_bytes)) is not None:
            return error
        self.requests[req.request_id] = req
        self.route(req)
        return None

    def route(self, req: Request) -> GroupState | None:
        """Queue ``req`` on the group where it would start soonest (``pick_group``), or keep it
        unrouted while no group can hold it."""
        best = pick_group(self.groups.values(), req)
        if best is None:
            self.unrouted.append(req)
            return None
        req.group_id = best.group_id
        best.enqueue(req, self.config.policy == "priority", front=req.status is RequestStatus.PREEMPTED)
        best.ask_grammar(req)  # a constrained request is admitted once the group has its grammar
        return best

    def grammar_ready(self, group_id: str, key: str, error: ServiceError | None = None) -> list[Request]:
        """The group's rank 0 answered ``CompileGrammar(key)``: its requests waiting for that
        grammar may be admitted now; with ``error`` (it does not compile) they cannot, and are
        returned, still held, for the caller to fail. An answer nobody asked for (an unknown or
        re-registered group's, or a repeat) changes nothing."""
        group = self.groups.get(group_id)
        if group is None or group.grammars_asked.pop(key, None) is None:
            return []
        if error is None:
            group.mark_grammar_ready(key)
            return []
        return [r for r in group.waiting if r.grammar_key == key]

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[Request]:
        """Finish these requests now and free their blocks. Unknown ids are ignored."""
        done: list[Request] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.beam_root is not None:  # a beam: its whole search ends
                req = req.beam_root
                if req in done:
                    continue
            if req is not None and req.beam is not None:
                beam_group.drop_beams(self.groups.get(req.group_id or ""), req, self.requests)
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
        suspect, waiting_suspect = find_suspect(group, self.suspects)
        if (waiting_suspect is not None and len(group.running) < self.config.max_num_seqs
                and group.grammar_ready_for(waiting_suspect)):
            if admit_one(group, waiting_suspect, budget, scheduled, new_blocks):
                return self._make_plan(group, scheduled, new_blocks, copies)
        gone: set[str] = set()  # preempted by this step
        for req in [suspect] if suspect is not None else list(group.running):
            if budget <= 0:
                break
            if req.request_id in gone:
                continue
            # tokens known or sampled in flight, not yet computed (0: waiting for a result)
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
            if num_new <= 0 or req.done_when_answered:
                continue
            while True:
                allocated = group.kv.allocate_running(req, num_new)
                if allocated is not None:
                    break
                victim = group.running.pop()  # lowest priority, then newest
                gone.update(r.request_id for r in self._preempt(victim, group))
                preempted = True
                if req.request_id in gone:
                    break
            if allocated is None:  # the request preempted itself
                break
            new_blocks[req.request_id], copy = allocated
            if copy is not None:
                copies[req.request_id] = copy
            scheduled[req.request_id] = num_new
            budget -= num_new

        for rid in gone:  # a preempted beam search's beams may have been scheduled before (no
            scheduled.pop(rid, None)  # admission follows a preemption: the budget is not reused)
            copies.pop(rid, None)
            new_blocks.pop(rid, None)
        if not preempted and suspect is None and waiting_suspect is None:
            admit_waiting(group, budget, scheduled, new_blocks, self.config.max_num_seqs,
                          self.config.max_plan_bytes)
        if not scheduled:
            return None
        return self._make_plan(group, scheduled, new_blocks, copies)

    def _make_plan(self, group: GroupState, scheduled: dict[str, int], new_blocks: dict,
                   copies: dict[str, tuple[int, int]]) -> StepPlan:
        self._step_id += 1
        return build_step_plan(self._step_id, group, scheduled, new_blocks, copies)

    def update_from_output(self, result: StepResult) -> StepOutcome:
        """Apply a group's ``StepResult`` to the oldest step it has in flight (anything else is
        stale and ignored): append the sampled tokens, check stops, finish (``apply_result``)."""
        if not self.is_in_flight(result.group_id, result.step_id):
            return StepOutcome()
        group = self.groups[result.group_id]
        return apply_result(group, group.in_flight.pop(0), result, self.requests, self.suspects, self._finish)

    # ------------------------------------------------------------------ internals

    def _preempt(self, req: Request, group: GroupState) -> list[Request]:
        """Preempt the running ``req`` (already out of ``running``) for recompute; a beam of a
        beam search preempts its whole search, which starts again from its prompt. Returns
        every request taken off the group."""
        root = req.beam_root or (req if req.beam is not None else None)
        dropped = [] if root is None else beam_group.restart(group, root, self.requests)
        group.preempt(root or req, self.config.policy == "priority")
        self.num_preemptions += 1
        return [root or req, *dropped]

    def _finish(self, req: Request) -> None:
        group = self.groups.get(req.group_id) if req.group_id else None
        if group is not None:
            group.drop(req)
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
            groups=[g.stats() for g in self.groups.values()],
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            time=time.time(),
        )
