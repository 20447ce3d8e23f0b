"""Beam search in the scheduler, against a fake executor that keeps the runner's state (beam
forks included) and checks that every K/V slot a step reads holds the prefix it should: the
beams' shared blocks and copy-on-writes are right, the selection equals a plain reference
search, and a width-4 search holds fewer blocks than four independent sequences."""

from __future__ import annotations

import math
import random

import pytest

from services.scheduler.beam import BeamSearch
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import RequestSpec, SampleLogprobs, SamplingParams, StepPlan, StepResult, SubmitRequest

VOCAB = 40
EOS = 7


def log_probs(prefix: tuple[int, ...]) -> list[float]:
    """A deterministic next-token distribution (natural log) for a token prefix."""
    rng = random.Random(hash(prefix))
    logits = [rng.gauss(0, 2) for _ in range(VOCAB)]
    lse = math.log(sum(math.exp(x) for x in logits))
    return [x - lse for x in logits]


class FakeExecutor:
    """The runner's per-request state machine, with beam forks; checks every K/V read."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.state: dict[str, dict] = {}
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for beam_id, parent_id, token_id in plan.beam_forks.rows():  # before the finished ids, as the runner
            parent = self.state[parent_id]
            self.state[beam_id] = dict(tokens=parent["tokens"][: parent["computed"]] + [token_id],
                                               blocks=list(parent["blocks"]), computed=parent["computed"],
                                               k=parent["k"])
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for new in plan.new_requests:
            self.state[new.request_id] = dict(tokens=list(new.prompt_token_ids), blocks=list(new.block_ids),
                                              computed=new.num_computed_tokens,
                                              k=new.sampling_params.beam_candidates(1))
        for src, dst in plan.block_copies:
            for off in range(self.bs):
                if (prefix := self.slots.get(src * self.bs + off)) is not None:
                    self.slots[dst * self.bs + off] = prefix
        for rid, new_block_ids, num_computed_tokens, replaced in plan.cached_requests.rows():
            st = self.state[rid]
            if replaced is not None:
                st["blocks"][replaced[0]] = replaced[1]
            st["blocks"].extend(new_block_ids)
            assert st["computed"] == num_computed_tokens
        writes = {}
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.state[rid]
            for pos in range(st["computed"], st["computed"] + n):
                slot = st["blocks"][pos // self.bs] * self.bs + pos % self.bs
                assert writes.setdefault(slot, tuple(st["tokens"][: pos + 1])) == tuple(st["tokens"][: pos + 1])
        self.slots.update(writes)
        result = StepResult(step_id=plan.step_id, group_id=plan.group_id)
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.state[rid]
            st["computed"] += n
            for pos in range(st["computed"]):
                slot = st["blocks"][pos // self.bs] * self.bs + pos % self.bs
                assert self.slots[slot] == tuple(st["tokens"][: pos + 1]), f"{rid}: wrong K/V at {pos}"
            if st["computed"] == len(st["tokens"]):
                lps = log_probs(tuple(st["tokens"]))
                top = sorted(range(VOCAB), key=lambda t: -lps[t])[: st["k"]]
                result.sampled_token_ids[rid] = top[0]
                result.logprobs[rid] = SampleLogprobs(logprob=lps[top[0]], rank=1, top_token_ids=top,
                                                      top_logprobs=[lps[t] for t in top])
                st["tokens"].append(top[0])
        return result


def reference(prompt: list[int], width: int, max_tokens: int, ignore_eos: bool) -> list[list[int]]:
    """Hugging Face's beam search (early_stopping="never", length_penalty=0) written plainly."""
    live = [([], 0.0)]
    finished: list[tuple[float, list[int]]] = []
    for length in range(1, max_tokens + 1):
        cands = sorted(((cum + lp, out + [t]) for out, cum in live
                        for t, lp in enumerate(log_probs(tuple(prompt + out)))), key=lambda c: -c[0])[: 2 * width]
        live = []
        for rank, (cum, out) in enumerate(cands):
            if (out[-1] == EOS and not ignore_eos) or length == max_tokens:
                if rank < width:
                    finished = sorted(finished + [(cum, out)], key=lambda f: -f[0])[:width]
            elif len(live) < width:
                live.append((out, cum))
        if length == max_tokens or (len(finished) == width and live[0][1] <= finished[-1][0]):
            break
    return [out for _, out in finished]


def beam_request(rid: str, prompt: list[int], width: int, max_tokens: int, ignore_eos: bool = False) -> Request:
    params = SamplingParams(n=width, use_beam_search=True, temperature=0, max_tokens=max_tokens,
                            length_penalty=0.0, ignore_eos=ignore_eos)
    msg = SubmitRequest(spec=RequestSpec(request_id=rid, gateway_id="gw", sampling_params=params),
                        prompt_token_ids=prompt)
    return Request.from_submit(msg, max_model_len=4096, eos_token_ids=(EOS,), now=0.0)


def run(sched: Scheduler, ex: FakeExecutor, on_step=None) -> dict[str, list[list[int]]]:
    """Plan (two steps in flight where allowed), execute the oldest, apply; until done."""
    results: dict[str, list[list[int]]] = {}
    queue: list[StepPlan] = []
    for _ in range(2000):
        while sched.can_schedule("g0") and (plan := sched.schedule("g0")) is not None:
            queue.append(plan)
            if on_step:
                on_step(sched)
        if not queue:
            break
        outcome = sched.update_from_output(ex.execute(queue.pop(0)))
        for req in outcome.finished:
            results.setdefault(req.parent_request_id or req.request_id, []).append(req)
    return {rid: [r.output_token_ids for r in sorted(reqs, key=lambda r: r.index)] for rid, reqs in results.items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beams_equal_the_reference_search_and_every_block_is_freed(async_scheduling, ignore_eos):
    sched = Scheduler(SchedulerConfig(async_scheduling=async_scheduling, max_num_batched_tokens=16))
    sched.add_group("g0", num_blocks=64, block_size=4)
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(9 + 4 * i)] for i in range(3)}
    other = Request(spec=RequestSpec(request_id="plain", gateway_id="gw",
                                     sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
                    prompt_token_ids=[1, 2, 3], max_model_len=4096, eos_token_ids=(EOS,))
    for rid, prompt in prompts.items():
        assert sched.add_request(beam_request(rid, prompt, 3 + int(rid[1]) % 2, 12, ignore_eos)) is None
    assert sched.add_request(other) is None
    results = run(sched, FakeExecutor(4))
    for rid, prompt in prompts.items():
        assert results[rid] == reference(prompt, 3 + int(rid[1]) % 2, 12, ignore_eos)
    assert len(results["plain"]) == 1
    assert sched.groups["g0"].kv.num_free_blocks == 64 and not sched.requests


def test_a_width_4_search_shares_its_blocks():
    """Prompt of 10 tokens, blocks of 4: two full blocks and a partial one. Four independent
    sequences (no prefix caching) hold 3 blocks each at their first decode: 12. The four beams
    hold the two full blocks once, and the partial block once each after copy-on-write: 6."""
    prompt = list(range(10, 20))

    def blocks_at_first_decode(reqs: list[Request]) -> int:
        sched = Scheduler(SchedulerConfig(async_scheduling=False, enable_prefix_caching=False))
        sched.add_group("g0", num_blocks=64, block_size=4)
        for req in reqs:
            sched.add_request(req)
        ex, used = FakeExecutor(4), []
        kv = sched.groups["g0"].kv

        def record(s: Scheduler) -> None:
            if all(len(r.output_token_ids) == 1 for r in s.groups["g0"].running):
                used.append(kv.num_blocks - kv.num_free_blocks)
        run(sched, ex, on_step=record)
        assert kv.num_free_blocks == 64
        return used[0]

    plain = [Request(spec=RequestSpec(request_id=f"s{i}", gateway_id="gw",
                                      sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
                     prompt_token_ids=prompt, max_model_len=4096, eos_token_ids=(EOS,)) for i in range(4)]
    assert blocks_at_first_decode(plain) == 12
    assert blocks_at_first_decode([beam_request("b", prompt, 4, 4, ignore_eos=True)]) == 6


def test_a_preempted_search_starts_again_and_finds_the_same_beams():
    prompt = list(range(3, 12))
    expected = reference(prompt, 4, 10, True)
    sched = Scheduler(SchedulerConfig(async_scheduling=True, max_num_batched_tokens=32))
    sched.add_group("g0", num_blocks=20, block_size=4)  # 4 beams of 19 tokens: 5 blocks each at most
    assert sched.add_request(beam_request("b", prompt, 4, 10, ignore_eos=True)) is None
    for i in range(3):  # plain requests that fill the pool while the search runs
        sched.add_request(Request(spec=RequestSpec(request_id=f"p{i}", gateway_id="gw", arrival_time=-1.0,
                                                   sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True)),
                                  prompt_token_ids=[i + 1] * 9, max_model_len=4096, eos_token_ids=(EOS,)))
    results = run(sched, FakeExecutor(4))
    assert sched.num_preemptions > 0
    assert results["b"] == expected
    assert sched.groups["g0"].kv.num_free_blocks == 20


def test_aborting_a_search_mid_way_frees_every_beam():
    sched = Scheduler(SchedulerConfig(async_scheduling=False))
    sched.add_group("g0", num_blocks=32, block_size=4)
    sched.add_request(beam_request("b", list(range(9)), 4, 10, ignore_eos=True))
    ex = FakeExecutor(4)
    for _ in range(4):
        sched.update_from_output(ex.execute(sched.schedule("g0")))
    beams = [r.request_id for r in sched.groups["g0"].running]
    assert len(beams) == 4 and all(b.startswith("b@") for b in beams)
    done = sched.abort([beams[1]])  # a beam's id ends its whole search
    assert [r.request_id for r in done] == ["b"]
    assert sched.groups["g0"].kv.num_free_blocks == 32 and not sched.requests


def test_search_state_stops_once_no_live_beam_can_win():
    search = BeamSearch(width=1, length_penalty=0.0, ignore_eos=False, eos_token_ids=(EOS,), num_candidates=2,
                        rows=["r"])
    root = Request(spec=RequestSpec(request_id="r", gateway_id="gw", sampling_params=SamplingParams()),
                   prompt_token_ids=[1], max_model_len=64)
    search.report("r", SampleLogprobs(logprob=-0.1, rank=1, top_token_ids=[EOS, 3], top_logprobs=[-0.1, -2.5]))
    survivors, done = search.select([root], max_new_tokens=10)
    assert done and survivors == [] and search.finished[0].output_token_ids == [EOS]
