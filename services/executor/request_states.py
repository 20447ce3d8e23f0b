"""The executor's per-request state between steps (no model, no KV cache tensors).

The runner keeps each running request's tokens and block table, so that a ``StepPlan`` carries
only what changed (vLLM V1's cached request states). ``update_states`` applies a plan's diffs
before the step runs: the beams a beam search forked, the finished ids to forget, the new
requests sent in full and the running ones' appended blocks; ``fork_states`` starts the
n > 1 samples of a prompt on its first sampled token. A request holds a row of the
executor's ``SamplingColumns`` from the step it joins to the step it leaves, where its
sampling parameters and seeded generator are written once.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.executor.sampler import Sampler
from services.executor.sampling_columns import SamplingColumns
from services.executor.structured_output import StructuredOutputManager
from shared.messages import SamplingParams, StepPlan


@dataclass
class CachedRequestState:
    """What the executor remembers of a running request."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    sampling_row: int  # its row in the SamplingColumns: its parameters and seeded generator
    num_prompt_tokens: int = 0  # of token_ids, the prompt's (the rest are outputs)
    wants_prompt_logprobs: bool = False  # its prompt's log probabilities are computed as it is prefilled


def _forget(requests: dict[str, CachedRequestState], columns: SamplingColumns, request_id: str) -> None:
    """Drop a request's state, if any, and free its row (finished, or sent again to be recomputed)."""
    state = requests.pop(request_id, None)
    if state is not None:
        columns.free(state.sampling_row)


def update_states(
    requests: dict[str, CachedRequestState], columns: SamplingColumns, plan: StepPlan, sampler: Sampler,
    structured: StructuredOutputManager, vocab_size: int, is_first_rank: bool,
) -> None:
    """Apply ``plan``'s diffs to ``requests`` (request id -> state) and their rows in
    ``columns`` before its step runs.

    ``sampler`` makes a new request's seeded generator (advanced past the outputs it already
    has, ``vocab_size`` draws each); ``structured`` gets the grammar matchers of new constrained
    requests (only on the first rank, ``is_first_rank``, which samples) and forgets those of
    finished or recomputed ones.

    Raises:
        KeyError: a beam fork or a cached request names a request never received.
    """
    # the beams first: finished_request_ids may drop their parents
    for beam_id, parent_id, token_id in plan.beam_forks.rows():
        parent = requests[parent_id]
        computed = parent.num_computed_tokens  # the parent's tokens as planned, not its own sample
        _forget(requests, columns, beam_id)
        requests[beam_id] = CachedRequestState(
            request_id=beam_id,
            token_ids=parent.token_ids[:computed] + [token_id],
            block_ids=list(parent.block_ids),
            num_computed_tokens=computed,
            sampling_params=parent.sampling_params,
            sampling_row=columns.add(parent.sampling_params, None),
            num_prompt_tokens=parent.num_prompt_tokens,
        )
    for rid in plan.finished_request_ids:
        _forget(requests, columns, rid)
        structured.remove(rid)
    for new in plan.new_requests:
        structured.remove(new.request_id)  # recomputed: its matcher starts again
        if new.sampling_params.structured_outputs is not None and is_first_rank:
            outputs = new.prompt_token_ids[len(new.prompt_token_ids) - new.num_output_tokens:]
            structured.add(new.request_id, new.sampling_params.structured_outputs, outputs)
        _forget(requests, columns, new.request_id)
        generator = sampler.new_request_generator(new.sampling_params.seed, new.num_output_tokens, vocab_size)
        requests[new.request_id] = CachedRequestState(
            request_id=new.request_id,
            token_ids=list(new.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=new.sampling_params,
            sampling_row=columns.add(new.sampling_params, generator),
            num_prompt_tokens=len(new.prompt_token_ids) - new.num_output_tokens,
            # a resumed request (outputs already) sent them the first time
            wants_prompt_logprobs=new.sampling_params.prompt_logprobs is not None and not new.num_output_tokens,
        )
    for rid, new_block_ids, num_computed_tokens, replaced in plan.cached_requests.rows():
        state = requests[rid]
        if replaced is not None:  # a copy-on-write gave it its own block
            position, block_id = replaced
            state.block_ids[position] = block_id
        state.block_ids.extend(new_block_ids)
        state.num_computed_tokens = num_computed_tokens


def fork_states(
    requests: dict[str, CachedRequestState], columns: SamplingColumns, forks: dict[str, list[str]],
    sample_states: list[CachedRequestState], logits_rows: list[int], sampler: Sampler,
    structured: StructuredOutputManager, vocab_size: int, is_first_rank: bool,
) -> None:
    """n > 1: each child of ``forks`` (parent id -> child ids ``"<parent>#<index>"``) starts as
    a copy of its parent (tokens, shared blocks) and samples its first token from the parent's
    logits row with its own params (``SamplingParams.for_child``): it is added to ``requests``
    (with a row of ``columns``) and appended to ``sample_states``, with its parent's logits row
    appended to ``logits_rows``. A constrained parent's grammar matcher is forked on the first
    rank (``is_first_rank``)."""
    for state, row in list(zip(sample_states, logits_rows, strict=True)):
        for child_id in forks.get(state.request_id, ()):
            index = int(child_id.rsplit("#", 1)[1])
            params = state.sampling_params.for_child(index)
            _forget(requests, columns, child_id)
            child = CachedRequestState(
                request_id=child_id,
                token_ids=list(state.token_ids),
                block_ids=list(state.block_ids),
                num_computed_tokens=state.num_computed_tokens,
                sampling_params=params,
                sampling_row=columns.add(params, sampler.new_request_generator(params.seed, 0, vocab_size)),
                num_prompt_tokens=state.num_prompt_tokens,
            )
            requests[child_id] = child
            if is_first_rank and state.request_id in structured:
                structured.fork(state.request_id, child_id)
            sample_states.append(child)
            logits_rows.append(row)
