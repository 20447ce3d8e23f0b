"""Sampler: exact masks for top-k/top-p, greedy rows, empirical distribution, seeds."""

from __future__ import annotations

import torch

from services.executor.sampler import Sampler, apply_top_k_top_p
from shared.messages import SamplingParams


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5]]))
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.8]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False, False], [False, False, True, True, True]]
    assert torch.equal(out[kept], logits[kept])  # kept logits are unchanged


def test_greedy_rows_and_distribution():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).expand(4000, 4).clone()
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = torch.tensor(sampler.sample(logits, params, [None] * 4000))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03) and freq[3] == 0
    mixed = sampler.sample(logits[:2], [SamplingParams(temperature=0), SamplingParams(temperature=1.0)], [None, None])
    assert mixed[0] == 0


def test_seeded_rows_are_independent_of_the_batch():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.8, seed=7)
    alone = sampler.sample(logits[1:2], [p], [sampler.new_request_generator(7, 0, 100)])
    batch = sampler.sample(
        logits, [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.5)],
        [None, sampler.new_request_generator(7, 0, 100), None],
    )
    assert batch[1] == alone[0]
    # a generator advanced past n draws continues the same stream (resumed after preemption)
    g = sampler.new_request_generator(7, 0, 100)
    seq = [sampler.sample(logits[1:2], [p], [g])[0] for _ in range(5)]
    g3 = sampler.new_request_generator(7, 3, 100)
    assert [sampler.sample(logits[1:2], [p], [g3])[0] for _ in range(2)] == seq[3:]
