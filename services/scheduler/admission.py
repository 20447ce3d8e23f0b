"""Admitting a group's waiting requests into a step (no I/O).

``admit_waiting`` is the second half of ``Scheduler.schedule``: after the running requests got
their tokens, it starts waiting requests in queue order while the token budget, the
sequence limit (``max_num_seqs``), the free blocks and the plan's bytes (``max_plan_bytes``)
last. ``admit_one`` starts a single one (also used for a waiting suspect of a failed step).
"""

from __future__ import annotations

from services.scheduler.group import GroupState
from services.scheduler.request import Request
from services.scheduler.step_plan import scheduled_bytes


def admit_waiting(
    group: GroupState, budget: int, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
    max_num_seqs: int, max_plan_bytes: int | None,
) -> None:
    """Start waiting requests of ``group`` in queue order while ``budget`` (tokens),
    ``max_num_seqs``, blocks and the plan's bytes (``max_plan_bytes``: each new request carries
    its whole prompt; None: no limit) last. Each admitted request is added to ``scheduled``
    (request id -> tokens this step) and ``new_blocks`` (request id -> block ids allocated).

    A constrained request whose grammar this group has not compiled yet is skipped, and the
    requests behind it are admitted (as vLLM V1 does with ``WAITING_FOR_FSM``): a compile
    never holds up the others; it keeps its place in the queue, so once ready it goes
    first again. A request whose blocks do not fit stops admission (queue order)."""
    plan_bytes = 0
    if max_plan_bytes is not None and group.waiting:  # what the running requests scheduled take
        plan_bytes = scheduled_bytes(group, scheduled, new_blocks)
    for req in list(group.waiting):
        if budget <= 0 or len(group.running) >= max_num_seqs:
            break
        if not group.grammar_ready_for(req):
            continue  # waits for its grammar (CompileGrammar); the requests behind it go first
        if max_plan_bytes is not None:
            plan_bytes += req.new_request_bytes()
            if plan_bytes > max_plan_bytes and scheduled:
                break  # the next step takes it
        if not admit_one(group, req, budget, scheduled, new_blocks):
            break  # wait for blocks; keep the queue order
        budget -= scheduled[req.request_id]


def admit_one(group: GroupState, req: Request, budget: int, scheduled: dict[str, int],
              new_blocks: dict[str, list[int]]) -> bool:
    """Start the waiting ``req`` with up to ``budget`` tokens (``GroupState.admit``), recording
    it in ``scheduled`` and ``new_blocks``; False (nothing changed) if its blocks do not fit."""
    admitted = group.admit(req, budget)
    if admitted is not None:
        scheduled[req.request_id], new_blocks[req.request_id] = admitted
    return admitted is not None
