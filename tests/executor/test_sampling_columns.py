"""SamplingColumns: rows taken when a request joins and reused after it leaves, parameters
written once, gathered per step in logits order; the runner's path samples as the list path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.executor import sampling_columns as col
from services.executor.request_states import fork_states, update_states
from services.executor.sampler import Sampler, apply_penalties, apply_top_k_top_p
from services.executor.sampling_columns import SamplingColumns
from services.executor.structured_output import StructuredOutputManager
from shared.messages import BeamForks, NewRequestData, SamplingParams, StepPlan

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0)


def columns(capacity: int = 4) -> SamplingColumns:
    return SamplingColumns(vocab_size=100, eos_token_ids=(2,), device=CPU, capacity=capacity)


def test_rows_are_taken_lowest_first_reused_after_free_and_grow_when_full():
    store = columns(capacity=2)
    assert [store.add(GREEDY, None) for _ in range(3)] == [0, 1, 2]  # the third doubled the tables
    assert len(store) == 3 and store.ints.shape == (10, 4) and store.floats.shape == (6, 4)
    store.free(1)
    assert store.add(SamplingParams(temperature=0.5), None) == 1  # the freed row, before row 3
    assert store.floats[col.TEMPERATURE, 1] == np.float32(0.5)
    store.free(1)
    with pytest.raises(ValueError, match="sampling row 1 is not in use"):
        store.free(1)
    store.clear()
    assert len(store) == 0 and store.counts == [0] * 8


def test_parameters_are_written_once_as_float32_columns_flags_and_row_objects():
    store = columns()
    seeded = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={5: 1.5, 100: 3.0}, min_tokens=2,
                            stop_token_ids=[7, 500], logprobs=3, seed=9)
    row = store.add(params, seeded)
    assert store.floats[:, row].tolist() == np.array([0.7, 0.9, 0.1, 0.5, 0.0, 1.2], dtype=np.float32).tolist()
    assert store.ints[:, row].tolist() == [0, 3, 1, 1, 1, 1, 1, 1, 1, 1]  # top_k -1 is off
    assert store.generators[row] is seeded
    ids, bias = store.bias[row]  # token 100 is past the vocabulary
    assert ids.tolist() == [5] and bias.tolist() == [1.5]
    minimum, forbidden = store.min_tokens[row]
    assert minimum == 2 and forbidden.tolist() == [2, 7]  # EOS and the stop id inside the vocabulary
    # top_p just below 1 rounds to 1 in float32: no top-k/top-p stage, as the float32 tensor said before
    near_one = store.add(SamplingParams(temperature=0, top_p=1 - 1e-9), None)
    assert store.ints[col.TOP_K_P, near_one] == 0 and store.ints[col.RANDOM, near_one] == 0
    search = store.add(SamplingParams(use_beam_search=True, n=3), None)
    assert store.ints[col.NUM_TOP, search] == 6  # max(2, 1 + one EOS) * 3 candidates per beam
    store.free(row)
    assert store.generators[row] is None and store.bias[row] is None and store.min_tokens[row] is None
    assert store.counts == [1, 0, 0, 0, 0, 0, 0, 1]  # the beam search: random, logprobs


def test_gather_takes_the_step_rows_in_logits_order_and_says_which_stages_apply():
    store = columns()
    greedy = store.add(GREEDY, None)
    assert store.gather([greedy]).ints is None  # nothing set by any running request: no gather
    warm = store.add(SamplingParams(temperature=0.5, top_k=4), None)
    logprobs = store.add(SamplingParams(temperature=0, logprobs=2), None)
    step = store.gather([logprobs, greedy, warm])
    assert step.floats[col.TEMPERATURE].tolist() == [0.0, 0.0, 0.5]
    assert step.ints[col.TOP_K].tolist() == [0, 0, 4]
    assert step.where(col.RANDOM).tolist() == [2] and step.where(col.PENALISED).tolist() == []
    assert step.need(col.TOP_K_P) and not step.need(col.SEEDED)
    assert step.num_top() == [2, None, None]
    assert store.gather([greedy, warm]).num_top() is None


def test_requests_join_and_leave_between_steps():
    """update_states gives a new request a row and frees a finished one's, which the next new
    request takes; a request sent again (recomputed) frees its old row; n > 1 children and beams
    take rows of their own."""
    store, requests = columns(), {}
    structured = StructuredOutputManager(Path("unused"), 100, (2,))
    sampler = Sampler(0, CPU, (2,))

    def new(rid: str, params: SamplingParams) -> NewRequestData:
        return NewRequestData(request_id=rid, prompt_token_ids=[5, 6, 7], sampling_params=params,
                              block_ids=[0], num_computed_tokens=0)

    def step(**plan) -> None:
        update_states(requests, store, StepPlan(step_id=0, group_id="g", **plan), sampler, structured, 100, True)

    step(new_requests=[new("a", GREEDY), new("b", SamplingParams(temperature=0.8, seed=1, n=2))])
    assert (requests["a"].sampling_row, requests["b"].sampling_row) == (0, 1)
    assert store.generators[1] is not None and store.counts[col.SEEDED - col.RANDOM] == 1
    step(finished_request_ids=["a"], new_requests=[new("c", SamplingParams(presence_penalty=1.0))])
    assert requests["c"].sampling_row == 0 and store.ints[col.PENALISED, 0] == 1 and len(store) == 2
    step(new_requests=[new("c", GREEDY)])  # recomputed: its old row goes, it takes one again
    assert requests["c"].sampling_row == 0 and store.ints[col.PENALISED, 0] == 0 and len(store) == 2
    states, rows = [requests["b"]], [0]
    fork_states(requests, store, {"b": ["b#1"]}, states, rows, sampler, structured, 100, True)
    assert requests["b#1"].sampling_row == 2 and store.generators[2] is not store.generators[1]
    step(beam_forks=BeamForks(req_ids=["c.1"], parent_ids=["c"], token_ids=[9]), finished_request_ids=["c"])
    assert requests["c.1"].sampling_row == 3 and len(store) == 3  # c's row 0 freed after the fork
    assert store.gather([r.sampling_row for r in states]).where(col.SEEDED).tolist() == [0, 1]


def reference_sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None], token_ids: list[list[int]],
                     num_prompt: list[int]) -> list[int]:
    """The per-step lists of every row's params, stage by stage (the sampler before columns)."""
    logits, vocab = logits.clone(), logits.shape[1]
    for i, p in enumerate(params):
        for t, b in p.logit_bias.items():
            if t < vocab:
                logits[i, t] += b
        if p.min_tokens and len(token_ids[i]) - num_prompt[i] < p.min_tokens:
            stops = [t for t in {*p.stop_token_ids, *(() if p.ignore_eos else sampler.eos_token_ids)} if t < vocab]
            logits[i, stops] = float("-inf")
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    if pen:
        sub = logits[pen]
        apply_penalties(sub, [token_ids[i][: num_prompt[i]] for i in pen], [token_ids[i][num_prompt[i]:] for i in pen],
                        [params[i].presence_penalty for i in pen], [params[i].frequency_penalty for i in pen],
                        [params[i].repetition_penalty for i in pen])
        logits[pen] = sub
    out = logits.argmax(dim=-1)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        sub = logits[rand] / torch.tensor([params[i].temperature for i in rand]).unsqueeze(1)
        min_p = torch.tensor([params[i].min_p for i in rand])
        if bool(min_p.any()):
            probs = sub.softmax(dim=-1)
            sub = sub.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1), float("-inf"))
        top_k = torch.tensor([max(params[i].top_k, 0) for i in rand])
        top_p = torch.tensor([params[i].top_p for i in rand])
        if bool((top_k > 0).any() or (top_p < 1).any()):
            sub = apply_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=sampler.generator)
        for j, i in enumerate(rand):
            if generators[i] is not None:
                q[j].exponential_(generator=generators[i])
        out[rand] = (probs / q).argmax(dim=-1)
    return out.tolist()


def test_sampling_from_columns_matches_per_step_lists():
    """Rows written once and gathered over steps, requests joining and leaving between them,
    sample the tokens of the per-step lists (same seeded streams, same batch draws)."""
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)) * 2
    logits[:, 2] = logits.amax(dim=1) + 1  # EOS first, unless min_tokens holds it back
    params = [SamplingParams(temperature=0.9, seed=4), GREEDY, SamplingParams(temperature=1.5, top_p=0.9, min_p=0.5),
              SamplingParams(temperature=1.2, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={3: 3.0}),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]), SamplingParams(top_k=5, seed=-2)]
    reference, by_rows = Sampler(1, CPU, (2,)), Sampler(1, CPU, (2,))
    store = columns(capacity=1)
    running: dict[int, tuple[int, torch.Generator | None, list[int]]] = {}  # param index -> row, generator, tokens
    joins, leaves = {0: [0, 1, 2], 1: [3, 4], 3: [5]}, {2: [1], 9: [0, 3]}
    for step in range(12):
        for i in leaves.get(step, []):
            store.free(running.pop(i)[0])
        for i in joins.get(step, []):
            running[i] = (store.add(params[i], by_rows.new_request_generator(params[i].seed, 0, 100)),
                          reference.new_request_generator(params[i].seed, 0, 100), [7, 8])
        ids = list(running)
        rows = logits[: len(ids)]
        tokens = [running[i][2] for i in ids]
        want = reference_sample(reference, rows, [params[i] for i in ids], [running[i][1] for i in ids],
                                tokens, [1] * len(ids))
        assert by_rows.sample_rows(rows, store.gather([running[i][0] for i in ids]), tokens, [1] * len(ids)) == want
        for t, tok in zip(tokens, want, strict=True):
            t.append(tok)
