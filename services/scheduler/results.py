"""Applying a group's ``StepResult`` to the requests of the step it answers (no I/O).

``apply_result`` is the body of ``Scheduler.update_from_output``: for each request planned in
the answered step that is still the same request (same ``Request.epoch``, still running in
this group), it releases the output placeholder the step held, takes the step's prompt
logprobs, appends the sampled token (forking the n > 1 samples of a prompt on its first
token, ``fork_sample``), checks the stops, and hands the finished ones to ``finish``. A beam
search advances once every live beam of it reported (``beam_group.advance``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler import beam_group
from services.scheduler.group import GroupState, InFlightStep
from services.scheduler.request import Request, RequestStatus
from shared.messages import StepResult


@dataclass
class StepOutcome:
    """What one ``StepResult`` changed: requests with new tokens (``pending_output_ids``) and
    the ones that finished."""

    updated: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


def apply_result(
    group: GroupState, step: InFlightStep, result: StepResult, requests: dict[str, Request],
    suspects: set[str], finish: Callable[[Request], None],
) -> StepOutcome:
    """Apply ``result``, the answer to ``step`` (already taken off ``group.in_flight``).

    ``requests`` (request id -> Request) gains the forked samples; ``suspects`` loses every
    request the step sampled for (its step succeeded, see ``blame.py``); ``finish`` is called
    on each request that stopped (it frees the request's blocks and forgets it). Requests
    finished, aborted or preempted since the step was planned are skipped."""
    outcome = StepOutcome()
    plan = step.plan
    searches: dict[str, Request] = {}  # beam searches whose every live beam reported
    for rid in plan.num_scheduled_tokens:
        req = requests.get(rid)
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
        suspects.discard(rid)  # a step that sampled for it succeeded (Scheduler.fail_step)
        if req.is_beam:
            root = req.beam_root or req
            assert root.beam is not None
            if root.beam.report(rid, result.logprobs[rid]):
                searches[root.request_id] = root
            continue
        samples = [(req, token)]
        if req.fork_pending:
            req.fork_pending = False
            samples += [(fork_sample(group, req, cid, requests), result.sampled_token_ids[cid])
                        for cid in plan.forks[rid]]
        for sample, tok in samples:
            sample.output_token_ids.append(tok)
            sample.pending_output_ids.append(tok)
            if (lp := result.logprobs.get(sample.request_id)) is not None:
                sample.pending_logprobs.append(lp)
            outcome.updated.append(sample)
            if sample.check_stop():
                finish(sample)
                outcome.finished.append(sample)
    for root in searches.values():
        if (samples := beam_group.advance(group, root, requests)) is not None:
            finish(root)
            outcome.updated += samples
            outcome.finished += samples
    return outcome


def fork_sample(group: GroupState, parent: Request, child_id: str, requests: dict[str, Request]) -> Request:
    """Start sample ``child_id`` (``"<parent id>#<index>"``) of an n > 1 request: the parent's
    tokens and blocks (shared, by reference count), running in ``group`` and registered in
    ``requests``. Returns the child."""
    child = parent.fork_child(int(child_id.rsplit("#", 1)[1]))
    group.kv.fork(parent, child)
    group.running.append(child)
    group.known.add(child_id)
    parent.child_ids.append(child_id)
    requests[child_id] = child
    return child
