"""Sampler: exact masks for top-k/top-p, greedy rows, empirical distribution, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from services.executor.sampler import (
    Sampler,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs,
    generator_seed,
)
from shared.bus import decode, encode
from shared.messages import MAX_LOGPROBS, NewRequestData, SamplingParams


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


def test_near_zero_temperature_is_greedy():
    """Below 1e-5 (vLLM's epsilon) a temperature samples greedily: 1e-39 underflows float32,
    and dividing the logits by it gave NaN probabilities and end-of-text tokens."""
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=t) for t in (1e-39, 1e-30, 9.9e-6, 0.0)]
    assert all(p.greedy for p in params) and not SamplingParams(temperature=1e-5).greedy
    assert sampler.sample(logits, params, [None] * 4) == logits.argmax(dim=-1).tolist()


def test_out_of_range_integers_are_refused():
    """Integers that would overflow int64 (msgpack, torch.tensor) fail validation, naming the
    parameter, before a request reaches the executor's batch."""
    for kwargs, name in [
        (dict(top_k=2**63), "top_k"), (dict(top_k=-2), "top_k"), (dict(seed=2**63), "seed"),
        (dict(seed=-(2**63) - 1), "seed"), (dict(max_tokens=2**63), "max_tokens"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature=float("inf")), "temperature"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    ok = SamplingParams(top_k=2**63 - 1, seed=-(2**63), max_tokens=2**63 - 1, stop_token_ids=[2**63 - 1])
    assert ok.top_k == 2**63 - 1


def test_assignments_are_checked_and_vllm_only_parameters_named():
    """A field assigned after construction is checked as at construction and, when refused,
    left as it was; a vLLM parameter this engine lacks is refused by its name."""
    params = SamplingParams(temperature=0.5)
    with pytest.raises(ValueError, match="temperature must be"):
        params.temperature = -3
    assert params.temperature == 0.5
    params.stop = "x"  # coerced as at construction
    params.max_tokens = None
    assert params.stop == ["x"] and params.max_tokens is None
    with pytest.raises(ValueError, match="bad_words, best_of: vLLM sampling"):
        SamplingParams(best_of=2, bad_words=["x"])


def test_child_seeds_wrap_in_64_bits_and_travel():
    """seed + i of an n > 1 request wraps around (two's complement), so every child's params
    still validate after the trip through msgpack."""
    parent = SamplingParams(n=3, seed=2**63 - 2, temperature=0.7)
    seeds = [parent.for_child(i).seed for i in range(3)]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)]
    for i in range(3):
        child = parent.for_child(i)
        back = decode(encode(NewRequestData(request_id="r", prompt_token_ids=[1], sampling_params=child, block_ids=[],
                                            num_computed_tokens=0)), NewRequestData).sampling_params
        assert back == child and back.validate() is back


def test_generator_seed_uses_all_64_bits_on_cpu():
    """The CPU generator (mt19937) keeps 32 bits of its seed: seeds past 2**32 are mixed down,
    so 0 and 2**32 draw different streams; seeds below 2**32 are used unchanged."""
    cpu = torch.device("cpu")
    assert [generator_seed(s, cpu) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    mixed = {generator_seed(s, cpu) for s in (2**32, 2**33, 2**63 - 1, -1, -(2**63))}
    assert len(mixed) == 5 and all(0 <= s < 2**32 for s in mixed) and not mixed & {0, 2**32 - 1}
    assert generator_seed(2**40, torch.device("cuda")) == 2**40  # Philox takes all 64 bits
    sampler = Sampler(seed=0, device=cpu)
    logits = torch.zeros(1, 1000)
    draws = {s: sampler.sample(logits, [SamplingParams(seed=s)], [sampler.new_request_generator(s, 0, 1000)])[0]
             for s in (0, 2**32)}
    assert draws[0] != draws[2**32]


def test_compute_logprobs_matches_log_softmax_with_ranks_and_top_tokens():
    """Rows that ask get the float32 log-softmax of their raw logits at the sampled token, its
    rank (tokens at least as likely, as vLLM: 5 in a row of 5 equal ones) and their N most
    likely tokens; others get None."""
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05],
                                     [0.1, 0.4, 0.1, 0.3, 0.1],
                                     [0.2, 0.2, 0.2, 0.2, 0.2]])) + 3.0  # shifted: not normalised
    out = compute_logprobs(logits, [2, 3, 4], [2, None, 0])
    assert out[1] is None
    first, last = out[0], out[2]
    assert first.rank == 3 and first.logprob == pytest.approx(math.log(0.15), abs=1e-6)
    assert first.top_token_ids == [0, 1]
    assert first.top_logprobs == pytest.approx([math.log(0.5), math.log(0.2)], abs=1e-6)
    assert last.rank == 5 and last.top_token_ids == [] and last.logprob == pytest.approx(math.log(0.2), abs=1e-6)
    assert compute_logprobs(logits, [0, 0, 0], [None] * 3) == [None] * 3


def test_logprobs_parameter_is_checked():
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=MAX_LOGPROBS).logprobs == 20
    for bad in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(ValueError, match="logprobs must be between 0 and 20"):
            SamplingParams(logprobs=bad)


def test_penalties_follow_vllm_formulas():
    """Repetition (CTRL): positive logits of tokens seen in the prompt or output divided, others
    multiplied; frequency per output occurrence and presence once per output token subtracted
    (prompt tokens get neither). Worked by hand."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    out = apply_penalties(logits, prompt_ids=[[0], [2]], output_ids=[[1, 1, 2], [3, 3]],
                          presence=[0.5, 0.0], frequency=[0.25, 1.0], repetition=[2.0, 1.0])
    assert out.tolist() == [[1.0, -1.0 * 2 - 0.5 - 0.5, 0.5 / 2 - 0.25 - 0.5, 3.0], [1.0, 1.0, 1.0, -1.0]]


def test_logit_bias_min_tokens_and_penalties_steer_greedy_rows_but_not_logprobs():
    """Greedy rows take the argmax of the processed logits: a logit_bias moves it; min_tokens
    forbids EOS and the stop token ids (not EOS with ignore_eos) while the output is shorter;
    a presence penalty pushes away from a generated token. The logits passed in are unchanged
    (log probabilities are of the raw logits)."""
    sampler = Sampler(seed=0, device=torch.device("cpu"), eos_token_ids=(3,))
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0]] * 6)
    raw = logits.clone()
    params = [
        SamplingParams(temperature=0, logit_bias={0: 10.0, 99: 5.0}),  # 99: outside the vocabulary, ignored
        SamplingParams(temperature=0, min_tokens=2),  # 1 output so far: EOS forbidden
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]),  # and stop token 2
        SamplingParams(temperature=0, min_tokens=1),  # 1 output: EOS allowed again
        SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0),  # 3 generated twice
    ]
    token_ids = [[7, 1], [7, 1], [7, 1], [7, 1], [7, 1], [7, 3, 3]]
    got = sampler.sample(logits, params, [None] * 6, token_ids, [1, 1, 1, 1, 1, 1])
    assert got == [0, 2, 1, 3, 3, 2]
    assert torch.equal(logits, raw)
    with pytest.raises(ValueError, match="need each row's token_ids"):
        sampler.sample(logits[:1], [SamplingParams(temperature=0, min_tokens=1)], [None])


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    """min_p 0.3 after temperature 1: of probabilities 0.5, 0.2, 0.15, 0.1, 0.05 only those
    >= 0.15 remain, renormalised (vLLM's MinPLogitsProcessor)."""
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = torch.log(probs).expand(6000, 5).clone()
    tokens = torch.tensor(sampler.sample(logits, [SamplingParams(min_p=0.3)] * 6000, [None] * 6000))
    freq = torch.bincount(tokens, minlength=5).float() / 6000
    assert freq[3] == 0 and freq[4] == 0
    assert torch.allclose(freq[:3], probs[:3] / probs[:3].sum(), atol=0.03)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("presence_penalty", 2.5, "presence_penalty must be in \\[-2, 2\\]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be in"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("min_p", 1.5, "min_p must be in \\[0, 1\\]"),
    ("min_tokens", 17, "min_tokens must be at most max_tokens=16"),
    ("logit_bias", {5: 101.0}, "logit_bias: biases must be in"),
    ("logit_bias", {-1: 1.0}, "logit_bias: token ids must be between 0 and"),
])
def test_logits_processing_parameters_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
