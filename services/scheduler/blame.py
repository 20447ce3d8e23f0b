"""Blame for a failed step, so that one poisoned request (an input that crashes the model or
the sampler) does not fail every request batched with it, as a single failed step does in
vLLM (no I/O).

- Each request of a failed batched step becomes a suspect. A request in
  ``MAX_FAILED_STEPS`` failed batched steps fails with the error (one that crashes only in a
  batch, or only late in its generation).
- A suspect runs alone (``find_suspect``: the group's other requests keep their blocks but
  are not scheduled, and nobody else is admitted while it waits) until a step in which it
  samples succeeds. A suspect that fails ``MAX_FAILED_ALONE`` steps alone fails with the
  error: one failure alone may be transient, and it harmed nobody else.

A request counts as in the step whatever happened to it since (preempted meanwhile). A single
transient failure therefore loses no request; it costs a recompute of the failed batch, one
suspect at a time.
"""

from __future__ import annotations

from services.scheduler.group import GroupState
from services.scheduler.request import Request

MAX_FAILED_STEPS = 3  # a request in this many failed batched steps fails with the error
MAX_FAILED_ALONE = 2  # a suspect that fails this many steps alone fails with the error


def blame(step_requests: list[Request], suspects: set[str]) -> list[Request]:
    """Count a failed step against the requests it held (those still held: ``step_requests``);
    returns those that now fail. Updates each request's failure counts and ``suspects``."""
    failed: list[Request] = []
    if len(step_requests) == 1 and step_requests[0].request_id in suspects:
        alone = step_requests[0]
        alone.num_failed_alone += 1
        if alone.num_failed_alone >= MAX_FAILED_ALONE:
            failed.append(alone)
        return failed
    for req in step_requests:
        req.num_failed_steps += 1
        if req.num_failed_steps >= MAX_FAILED_STEPS:
            failed.append(req)
        else:
            suspects.add(req.request_id)
    return failed


def find_suspect(group: GroupState, suspects: set[str]) -> tuple[Request | None, Request | None]:
    """``(running suspect, waiting suspect)`` of the group: its first running suspect, which
    then runs alone; else its first waiting suspect, admitted alone when it fits (nobody else
    is admitted until then, so that it is not starved). Both None almost always."""
    if not suspects:
        return None, None
    running = next((r for r in group.running if r.request_id in suspects), None)
    if running is not None:
        return running, None
    return None, next((r for r in group.waiting if r.request_id in suspects), None)
