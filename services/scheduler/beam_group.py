"""A beam search's beams on one executor group (no I/O): forking the survivors of a step,
dropping the beams that die, restarting a search, and its results as n samples.

The beams share blocks through their block tables: a survivor takes every block of its parent
by refcount (``KVCacheManager.fork``), so the prompt and the common prefix of the beams are
held once; the last, partially filled block is copied only when a beam is about to write into
it while another beam still holds it (``allocate_running``'s copy-on-write, executed by the
executor from ``StepPlan.block_copies``). The search's selection is ``beam.py``.
"""

from __future__ import annotations

from services.scheduler.group import GroupState
from services.scheduler.request import Request, RequestStatus


def live_beams(root: Request, requests: dict[str, Request]) -> list[Request]:
    """The search's live beams, in its ``rows`` order (the root itself before its first step)."""
    assert root.beam is not None
    return [root if rid == root.request_id else requests[rid] for rid in root.beam.rows if
            rid == root.request_id or rid in requests]


def advance(group: GroupState, root: Request, requests: dict[str, Request]) -> list[Request] | None:
    """Every live beam of ``root``'s search has reported: keep the best continuations.

    Survivors become new beams (``"<id>@<k>"``, added to ``requests`` and the group's running
    queue, their forks queued for the executor); the old beams are dropped (their blocks freed
    after the survivors took their references). Returns the search's results
    (:func:`final_samples`) when it is over, else None.
    """
    assert root.beam is not None
    beams = live_beams(root, requests)
    survivors, done = root.beam.select(beams, root.max_total_tokens - root.num_prompt_tokens)
    new_rows = []
    for cand in survivors:
        beam = root.fork_beam(cand.parent, cand.token_id, cand.entry, cand.cum_logprob)
        group.kv.fork(cand.parent, beam)
        group.running.append(beam)
        group.known.add(beam.request_id)
        group.beam_forks.append(beam.request_id, cand.parent.request_id, cand.token_id)
        requests[beam.request_id] = beam
        new_rows.append(beam.request_id)
    for beam in beams:
        drop_beam(group, beam, requests)
    root.beam.rows = new_rows
    return final_samples(root) if done else None


def drop_beam(group: GroupState, beam: Request, requests: dict[str, Request]) -> None:
    """Take one live beam off the group: blocks freed, the executor told to forget it. The root
    stays the client's request (in ``requests``); a beam of its own is finished. A beam
    already taken off the running queue (a preemption's victim) is freed all the same."""
    if beam not in group.running and beam.block_ids:
        group.kv.free(beam)
    group.drop(beam)
    if beam.beam_root is not None:
        requests.pop(beam.request_id, None)
        beam.status = RequestStatus.FINISHED
        beam.epoch += 1  # a result of a step in flight for it is stale


def drop_beams(group: GroupState | None, root: Request, requests: dict[str, Request]) -> list[Request]:
    """Drop every live beam of the search other than the root (abort, preemption); returns them."""
    assert root.beam is not None
    dropped = [b for b in live_beams(root, requests) if b is not root]
    for beam in dropped:
        if group is not None:
            drop_beam(group, beam, requests)
        else:
            requests.pop(beam.request_id, None)
            beam.status = RequestStatus.FINISHED
    root.beam.rows = [rid for rid in root.beam.rows if rid == root.request_id]
    return dropped


def restart(group: GroupState | None, root: Request, requests: dict[str, Request]) -> list[Request]:
    """Start ``root``'s search again from its prompt (preempted, or its group lost): its beams
    are dropped and the caller queues the root for recompute. Beam search is deterministic, so
    the search finds the same beams again. Returns the dropped beams."""
    assert root.beam is not None
    dropped = drop_beams(group, root, requests)
    root.beam.reset(root.request_id)
    root.output_token_ids, root.cum_logprob, root.beam_logprobs = [], 0.0, []
    return dropped


def final_samples(root: Request) -> list[Request]:
    """The search's finished hypotheses, best first, as the n samples of an n > 1 request:
    sample 0 is the root, sample i ``"<id>#<i>"``. Each is finished, with every generated
    token (EOS included) and its log probabilities pending for the detokenizer."""
    assert root.beam is not None
    samples = []
    for i, hyp in enumerate(root.beam.finished):
        sample = root if i == 0 else root.fork_child(i)
        sample.output_token_ids = list(hyp.output_token_ids)
        sample.pending_output_ids = list(hyp.output_token_ids)
        sample.pending_logprobs = list(hyp.logprobs)
        sample.cum_logprob = hyp.cum_logprob
        sample.finish_reason, sample.stop_reason = hyp.finish_reason, None
        if i:
            sample.status = RequestStatus.FINISHED
        samples.append(sample)
    return samples
