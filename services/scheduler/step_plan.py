"""Building a group's ``StepPlan`` from what ``Scheduler.schedule`` chose (no I/O).

A plan carries vLLM V1-style diffs: a request the executor does not hold yet goes in full
(``NewRequestData``: every known token, its block table), a running one it holds only as its
appended block ids, ``num_computed_tokens`` and, after a copy-on-write, the one table entry
the copy replaced (a row of ``CachedRequests``). The plan's bytes are bounded ahead
(``Request.new_request_bytes`` / ``cached_request_bytes``) so that it fits one NATS message.
"""

from __future__ import annotations

from services.scheduler.group import GroupState, InFlightStep
from services.scheduler.request import Request
from shared.messages import BeamForks, NewRequestData, ServiceError, StepPlan


def plan_size_error(req: Request, max_plan_bytes: int | None) -> ServiceError | None:
    """Why ``req`` could never fit one plan of at most ``max_plan_bytes`` (its whole context
    resent as a ``NewRequestData`` after a preemption), or None if it could (or no limit)."""
    if max_plan_bytes is None or (size := req.new_request_bytes(req.max_total_tokens)) <= max_plan_bytes:
        return None
    return ServiceError(
        message=(f"The request, with up to {req.max_total_tokens} tokens, may need {size} bytes in a "
                 f"step plan, over the {max_plan_bytes} bytes a NATS message may carry here: raise the "
                 "NATS server's max_payload, or shorten the prompt or max_tokens."),
        param="prompt", code="request_too_large",
    )


def scheduled_bytes(group: GroupState, scheduled: dict[str, int], new_blocks: dict[str, list[int]]) -> int:
    """An upper bound of the bytes the group's plan takes so far: its running requests
    scheduled (``new_blocks`` appended to each) and the ids it tells the executor to forget."""
    size = sum(req.cached_request_bytes(len(new_blocks[req.request_id]))
               for req in group.running if req.request_id in scheduled)
    return size + sum(len(rid.encode()) + 5 for rid in group.to_forget)


def build_step_plan(
    step_id: int, group: GroupState, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
    copies: dict[str, tuple[int, int]],
) -> StepPlan:
    """The plan of step ``step_id`` for ``group``: ``scheduled[request id]`` tokens of each of
    its running requests, with ``new_blocks[request id]`` appended to its block table and
    ``copies[request id]`` the ``(src, dst)`` copy-on-write made for it, if any.

    Records the step in flight (``group.in_flight``) and counts its tokens as computed now
    (``num_computed_tokens``, as in vLLM V1): a request whose computed tokens reach its known
    ones (and placeholders) samples, and gets one more output placeholder; one whose prefill
    completes and needs n > 1 samples forks them (``StepPlan.forks``). A beam of a beam search
    gets no placeholder (its next token is not its own sample); the beams forked since the last
    plan go first (``StepPlan.beam_forks``).
    """
    plan = StepPlan(
        step_id=step_id,
        group_id=group.group_id,
        finished_request_ids=group.to_forget,
        block_copies=list(copies.values()),
        beam_forks=group.beam_forks,
    )
    group.to_forget, group.beam_forks = [], BeamForks()
    epochs: dict[str, int] = {}
    samplers: set[str] = set()
    for req in group.running:
        num = scheduled.get(req.request_id)
        if num is None:
            continue
        if req.request_id in group.known:
            copy = copies.get(req.request_id)  # (src, dst): the table entry that held src now holds dst
            plan.cached_requests.append(req.request_id, new_blocks[req.request_id], req.num_computed_tokens,
                                        None if copy is None else (req.block_ids.index(copy[1]), copy[1]))
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
        if req.is_beam:  # its next token is chosen when every beam of its search has reported
            continue
        if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:  # reaches its last token
            req.num_output_placeholders += 1
            samplers.add(req.request_id)
    plan.num_scheduled_tokens = scheduled
    group.in_flight.append(InFlightStep(plan, epochs, samplers))
    return plan

