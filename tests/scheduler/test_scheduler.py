"""Scheduler unit tests with a fake executor that keeps executor-side state from the plans
exactly as the real ModelRunner does, and 'samples' a deterministic function of the tokens."""

from __future__ import annotations

import functools
import random
import sys

import pytest

from services.scheduler import blame
from services.scheduler import scheduler as scheduler_module
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import (
    PromptLogprobs,
    RequestSpec,
    SampleLogprobs,
    SamplingParams,
    ServiceError,
    StepPlan,
    StepResult,
    StructuredOutputsParams,
)
from shared.messages.structured_outputs import GRAMMAR_CACHE_SIZE


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def async_scheduling(request, monkeypatch) -> bool:
    """Every test runs with one step in flight and with async scheduling (two in flight:
    ``run`` plans step N + 1 before it executes step N)."""
    monkeypatch.setattr(sys.modules[__name__], "SchedulerConfig",
                        functools.partial(scheduler_module.SchedulerConfig, async_scheduling=request.param))
    return request.param

VOCAB = 1000
EOS = 999


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 7919 + len(tokens)) % (VOCAB - 1)


class FakeExecutor:
    """Mirrors the runner's state machine: tokens, block table, computed count per request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.state: dict[str, dict] = {}
        self.slots: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose K/V it holds
        self.queue: list[StepPlan] = []  # plans received, not yet executed (see run)
        self.prompt_logprob_chunks: list[tuple[str, int, int]] = []  # (request, first, end) prompt positions

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for new in plan.new_requests:
            self.state[new.request_id] = dict(
                tokens=list(new.prompt_token_ids), blocks=list(new.block_ids), computed=new.num_computed_tokens,
                # prompt_logprobs: as the runner, for a request without outputs yet
                prompt_len=(len(new.prompt_token_ids) if new.sampling_params.prompt_logprobs is not None
                            and not new.num_output_tokens else 0),
            )
        for src, dst in plan.block_copies:
            for off in range(self.block_size):
                if src * self.block_size + off in self.slots:
                    self.slots[dst * self.block_size + off] = self.slots[src * self.block_size + off]
        for rid, new_block_ids, num_computed_tokens, replaced in plan.cached_requests.rows():
            st = self.state[rid]
            if replaced is not None:
                position, block_id = replaced
                st["blocks"][position] = block_id
            st["blocks"].extend(new_block_ids)
            assert st["computed"] == num_computed_tokens
        sampled = {}
        self.written: list[tuple[int, tuple[int, ...]]] = []
        reads = []
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.state[rid]
            start = st["computed"]
            assert n >= 1 and start + n <= len(st["tokens"])
            for pos in range(start, start + n):
                block = st["blocks"][pos // self.block_size]
                assert 0 <= block < self.num_blocks
                self.written.append((block * self.block_size + pos % self.block_size, tuple(st["tokens"][: pos + 1])))
            reads.append((rid, start + n))
        # like a forward pass: every K/V write of the step lands before any attention read
        step_writes: dict[int, tuple[int, ...]] = {}
        for slot, prefix in self.written:
            assert step_writes.setdefault(slot, prefix) == prefix, f"slot {slot} written twice in one step"
            self.slots[slot] = prefix
        for rid, upto in reads:
            st = self.state[rid]
            for pos in range(upto):
                slot = st["blocks"][pos // self.block_size] * self.block_size + pos % self.block_size
                assert self.slots.get(slot) == tuple(st["tokens"][: pos + 1]), f"{rid}: wrong KV at {pos}"
        prompt_logprobs = {}
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.state[rid]
            first, end = st["computed"], min(st["computed"] + n, st.get("prompt_len", 0) - 1)
            if end > first:  # row of position p -> prompt token p + 1, "log probability" -(p + 1)
                self.prompt_logprob_chunks.append((rid, first + 1, end + 1))
                prompt_logprobs[rid] = PromptLogprobs(
                    start=first + 1, token_ids=st["tokens"][first + 1 : end + 1],
                    logprobs=[SampleLogprobs(logprob=-(p + 1.0), rank=1) for p in range(first, end)])
            st["computed"] += n
            if st["computed"] == len(st["tokens"]):
                for cid in plan.forks.get(rid, ()):  # n > 1: children sample from the same logits
                    index = int(cid.rsplit("#", 1)[1])
                    child = dict(tokens=list(st["tokens"]), blocks=list(st["blocks"]), computed=st["computed"])
                    self.state[cid] = child
                    tok = (next_token(child["tokens"]) + index) % (VOCAB - 1)
                    child["tokens"].append(tok)
                    sampled[cid] = tok
                tok = next_token(st["tokens"])
                st["tokens"].append(tok)
                sampled[rid] = tok
        return StepResult(step_id=plan.step_id, group_id=plan.group_id, sampled_token_ids=sampled,
                          prompt_logprobs=prompt_logprobs)


def make_request(
    rid: str, prompt_len: int, max_tokens: int, seed: int = 0, priority: int = 0, prefix: list[int] | None = None
) -> Request:
    rng = random.Random(seed)
    return Request(
        spec=RequestSpec(request_id=rid, gateway_id="gw",
                         sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                         priority=priority, arrival_time=float(seed)),
        prompt_token_ids=(prefix or []) + [rng.randrange(VOCAB - 1) for _ in range(prompt_len)],
        max_model_len=4096,
        eos_token_ids=(EOS,),
    )


def respec(req: Request, **changes) -> None:
    """Change what ``req`` was submitted with (its spec's fields)."""
    req.spec = req.spec.derive(**changes)


def plan_ahead(sched: Scheduler, group: str, queue: list[StepPlan]) -> list[StepPlan]:
    """Plan as the scheduler service does, while the group has room in flight; the plans
    join ``queue`` (the executor's, executed in order)."""
    planned = []
    while sched.can_schedule(group):
        plan = sched.schedule(group)
        if plan is None:
            break
        planned.append(plan)
    queue.extend(planned)
    return planned


def run(sched: Scheduler, ex: FakeExecutor, group: str = "g0", max_steps: int = 10_000, on_step=None):
    """Plan, execute the oldest plan in flight, apply its result; until nothing is left."""
    outputs: dict[str, list[int]] = {}
    plans: list[StepPlan] = []
    queue = ex.queue  # plans in flight outlive one call (run(..., max_steps=2), then run again)
    for _ in range(max_steps):
        plans += plan_ahead(sched, group, queue)
        if not queue:
            break
        plan = queue.pop(0)
        outcome = sched.update_from_output(ex.execute(plan))
        for req in outcome.finished:
            outputs[req.request_id] = list(req.output_token_ids)
        if on_step:
            on_step(plan)
    return outputs, plans


def expected(req: Request) -> list[int]:
    toks = list(req.prompt_token_ids)
    out = []
    for _ in range(req.sampling_params.max_tokens):
        t = next_token(toks)
        toks.append(t)
        out.append(t)
    return out


def test_budgets_respected_and_all_blocks_freed():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    sched.add_group("g0", num_blocks=64, block_size=16)
    ex = FakeExecutor(64, 16)
    reqs = [make_request(f"r{i}", prompt_len=10 + 13 * i, max_tokens=5 + i, seed=i) for i in range(10)]
    for r in reqs:
        assert sched.add_request(r) is None

    def check(plan: StepPlan):
        assert sum(plan.num_scheduled_tokens.values()) <= 64
        assert len(sched.groups["g0"].running) <= 4

    outputs, plans = run(sched, ex, on_step=check)
    assert {r.request_id: expected(r) for r in reqs} == outputs
    assert sched.groups["g0"].kv.num_free_blocks == 64
    assert sched.stats().num_running == 0 and sched.stats().num_waiting == 0


def test_decodes_progress_while_long_prompt_prefills_in_chunks():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32))
    sched.add_group("g0", num_blocks=128, block_size=16)
    ex = FakeExecutor(128, 16)
    short = make_request("short", prompt_len=8, max_tokens=20, seed=1)
    sched.add_request(short)
    run(sched, ex, max_steps=2)  # short is decoding now
    long = make_request("long", prompt_len=200, max_tokens=3, seed=2)
    sched.add_request(long)
    chunks = []

    def check(plan: StepPlan):
        if "long" in plan.num_scheduled_tokens and sched.requests.get("long") is not None:
            chunks.append(plan.num_scheduled_tokens["long"])
            assert plan.num_scheduled_tokens.get("short") == 1  # the decode is never starved

    outputs, _ = run(sched, ex, on_step=check)
    assert chunks[:6] == [31, 31, 31, 31, 31, 31]  # 32-token budget minus the decode
    assert sum(chunks[:7]) == 200
    assert outputs == {"short": expected(short), "long": expected(long)}


def test_request_without_max_tokens_runs_to_the_pool_capacity():
    """No max_tokens means "up to the context length" (a chat request's default). Where the
    largest pool holds fewer tokens than max_model_len (4096 here), the request runs until it
    fills the pool (8 blocks x 16 = 128 tokens) and finishes with "length"; it used to be
    refused for needing 4096 tokens. An explicit max_tokens that cannot fit is still refused."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    sched.add_group("g0", num_blocks=8, block_size=16)
    ex = FakeExecutor(8, 16)
    req = make_request("open", prompt_len=20, max_tokens=1, seed=3)
    respec(req, sampling_params=req.sampling_params.replace(max_tokens=None))
    assert sched.add_request(req) is None and req.max_model_len == 128
    too_big = make_request("big", prompt_len=20, max_tokens=200, seed=4)
    error = sched.add_request(too_big)
    assert error is not None and error.code == "kv_cache_too_small" and error.param == "max_tokens"

    outputs, _ = run(sched, ex)

    toks, out = list(req.prompt_token_ids), []
    for _ in range(128 - 20):
        out.append(next_token(toks))
        toks.append(out[-1])
    assert outputs == {"open": out} and req.finish_reason == "length"
    assert sched.groups["g0"].kv.num_free_blocks == 8


def run_with_failures(sched: Scheduler, fails, num_blocks: int = 64, block_size: int = 16, max_steps: int = 2000):
    """``run``, where a plan for which ``fails(plan, sched)`` is true fails instead: the
    scheduler blames (``fail_step``) and drops the group, whose executor registers again
    with a fresh state (as the executor service does). Returns (outputs, failed ids, number
    of failed steps)."""
    ex = FakeExecutor(num_blocks, block_size)
    outputs: dict[str, list[int]] = {}
    failed_ids: list[str] = []
    num_failures = 0
    for _ in range(max_steps):
        plan_ahead(sched, "g0", ex.queue)
        if not ex.queue:
            break
        plan = ex.queue.pop(0)
        if fails(plan, sched):
            num_failures += 1
            failed, _ = sched.fail_step("g0")
            failed_ids += [r.request_id for r in failed]
            assert all(r.finish_reason == "error" for r in failed)
            sched.add_group("g0", num_blocks=num_blocks, block_size=block_size)
            ex = FakeExecutor(num_blocks, block_size)  # the plan queued behind it is dropped too
            continue
        for req in sched.update_from_output(ex.execute(plan)).finished:
            outputs[req.request_id] = list(req.output_token_ids)
    return outputs, failed_ids, num_failures


def _poison_outputs(sched: Scheduler) -> int:
    req = sched.requests.get("poison")
    return -1 if req is None else len(req.output_token_ids)


@pytest.mark.parametrize(
    "kind, fails, num_failures",
    [  # the poison's first step fails (a prompt or sampling value that crashes the step)
        ("early", lambda plan, sched: "poison" in plan.num_scheduled_tokens, 3),
        # it fails once it has 5 output tokens, mid-decode, batched with the others
        ("late", lambda plan, sched: "poison" in plan.num_scheduled_tokens and _poison_outputs(sched) >= 5, 3),
    ],
)
def test_a_poisoned_request_fails_alone(kind, fails, num_failures):
    """One request that crashes every step it is in fails with the error (after the batch and
    two steps alone); the requests batched with it are retried (each suspect alone until it
    samples) and give their exact outputs."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=64, block_size=16)
    reqs = [make_request(f"r{i}", prompt_len=10 + 9 * i, max_tokens=12, seed=i) for i in range(5)]
    reqs.insert(2, make_request("poison", prompt_len=17, max_tokens=12, seed=9))
    for r in reqs:
        assert sched.add_request(r) is None

    outputs, failed_ids, failures = run_with_failures(sched, fails)

    assert failed_ids == ["poison"] and failures == num_failures
    assert outputs == {r.request_id: expected(r) for r in reqs if r.request_id != "poison"}
    assert sched.groups["g0"].kv.num_free_blocks == 64 and not sched.requests


def test_a_transient_step_failure_loses_no_request():
    """A step that fails once (not because of a request) fails nobody: every request is
    retried and gives its exact output."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=64, block_size=16)
    reqs = [make_request(f"r{i}", prompt_len=10 + 9 * i, max_tokens=12, seed=i) for i in range(6)]
    for r in reqs:
        assert sched.add_request(r) is None
    seen = {"n": 0}

    def fails(plan, sched):
        seen["n"] += 1
        return seen["n"] == 4  # mid-decode

    outputs, failed_ids, failures = run_with_failures(sched, fails)

    assert failed_ids == [] and failures == 1
    assert outputs == {r.request_id: expected(r) for r in reqs}
    assert not sched.suspects and [r.num_failed_steps for r in reqs] == [1] * 6


def test_two_poisons_and_a_poison_preempted_in_flight_fail_alone():
    """Two poisoned requests in one batch both fail, and nobody else; so does a poison that was
    preempted (a tiny pool, async planning) while its failing step was in flight."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=64, block_size=16)
    reqs = [make_request(f"r{i}", prompt_len=10 + 9 * i, max_tokens=12, seed=i) for i in range(4)]
    reqs[1:1] = [make_request("p1", prompt_len=15, max_tokens=12, seed=8)]
    reqs[4:4] = [make_request("p2", prompt_len=19, max_tokens=12, seed=9)]
    for r in reqs:
        sched.add_request(r)
    outputs, failed_ids, failures = run_with_failures(
        sched, lambda plan, sched: bool({"p1", "p2"} & set(plan.num_scheduled_tokens)))
    assert sorted(failed_ids) == ["p1", "p2"] and failures == 5  # the batch, then each alone twice
    assert outputs == {r.request_id: expected(r) for r in reqs if r.request_id not in ("p1", "p2")}

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=8, block_size=16)
    r0 = make_request("r0", prompt_len=64, max_tokens=30, seed=1)
    poison = make_request("poison", prompt_len=64, max_tokens=30, seed=2)
    for r in (r0, poison):
        sched.add_request(r)
    outputs, failed_ids, _ = run_with_failures(
        sched, lambda plan, sched: "poison" in plan.num_scheduled_tokens and _poison_outputs(sched) >= 3,
        num_blocks=8)
    assert failed_ids == ["poison"] and outputs == {"r0": expected(r0)}


def test_a_suspect_runs_alone_until_it_samples():
    """After a failed step every request of it is a suspect. A suspect is admitted and
    scheduled alone (other running requests keep their blocks but wait) until it samples;
    nobody else is admitted while a suspect waits. A suspect that fails two steps alone
    fails; a step failing with several requests makes them suspects, and a request in
    MAX_FAILED_STEPS failed steps fails."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=64, block_size=16)
    reqs = [make_request(f"r{i}", prompt_len=12, max_tokens=6, seed=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    assert set(sched.schedule("g0").num_scheduled_tokens) == {"r0", "r1", "r2"}
    failed, moved = sched.fail_step("g0")
    assert failed == [] and len(moved) == 3 and sched.suspects == {"r0", "r1", "r2"}
    assert all(r.num_failed_steps == 1 for r in reqs)
    sched.add_group("g0", num_blocks=64, block_size=16)
    sched.add_request(make_request("fresh", prompt_len=12, max_tokens=6, seed=7))
    assert list(sched.schedule("g0").num_scheduled_tokens) == ["r0"]  # alone, in arrival order
    ex = FakeExecutor(64, 16)
    queue: list[StepPlan] = []
    plan_ahead(sched, "g0", queue)  # async: only the suspect's next decode is planned behind it
    assert all(list(p.num_scheduled_tokens) == ["r0"] for p in queue)
    failed, _ = sched.fail_step("g0")  # r0 failed alone once (transient?): it runs alone again
    assert failed == [] and "r0" in sched.suspects and reqs[0].num_failed_alone == 1
    sched.add_group("g0", num_blocks=64, block_size=16)
    assert list(sched.schedule("g0").num_scheduled_tokens) == ["r0"]
    failed, _ = sched.fail_step("g0")  # twice alone: it fails
    assert [r.request_id for r in failed] == ["r0"] and reqs[1].num_failed_steps == 1
    sched.add_group("g0", num_blocks=64, block_size=16)
    plan = sched.schedule("g0")
    assert list(plan.num_scheduled_tokens) == ["r1"]
    sched.update_from_output(ex.execute(plan))  # r1 sampled: no longer a suspect
    assert "r1" not in sched.suspects
    plan = sched.schedule("g0")
    assert list(plan.num_scheduled_tokens) == ["r2"]  # r1 waits while the next suspect runs
    sched.update_from_output(ex.execute(plan))
    plan = sched.schedule("g0")
    assert set(plan.num_scheduled_tokens) == {"r1", "r2", "fresh"}  # a normal batch again
    reqs[1].num_failed_steps = blame.MAX_FAILED_STEPS - 1
    failed, _ = sched.fail_step("g0")
    assert [r.request_id for r in failed] == ["r1"]
    assert sched.suspects == {"r2", "fresh"} and sched.requests["fresh"].num_failed_steps == 1


def test_requests_that_waited_for_a_group_are_checked_when_one_registers():
    """With no group (at startup, or while the executor registers again after a failure) a
    request waits; when a group registers, one too big for it fails with kv_cache_too_small
    and one without max_tokens gets the pool's capacity as its context."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    big = make_request("big", prompt_len=20, max_tokens=200, seed=1)
    open_ended = make_request("open", prompt_len=20, max_tokens=1, seed=2)
    respec(open_ended, sampling_params=open_ended.sampling_params.replace(max_tokens=None))
    assert sched.add_request(big) is None and sched.add_request(open_ended) is None
    refused = sched.add_group("g0", num_blocks=8, block_size=16)
    assert [(r.request_id, e.code) for r, e in refused] == [("big", "kv_cache_too_small")]
    assert big.finish_reason == "error" and "big" not in sched.requests
    assert open_ended.max_model_len == 128 and sched.groups["g0"].waiting == [open_ended]


def test_preemption_under_tiny_pool_gives_same_outputs():
    reqs = lambda: [make_request(f"r{i}", prompt_len=20 + 7 * i, max_tokens=30, seed=i) for i in range(6)]  # noqa: E731
    big = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    big.add_group("g0", num_blocks=256, block_size=16)
    for r in reqs():
        big.add_request(r)
    ref, _ = run(big, FakeExecutor(256, 16))

    small = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    small.add_group("g0", num_blocks=12, block_size=16)
    for r in reqs():
        assert small.add_request(r) is None
    out, _ = run(small, FakeExecutor(12, 16))
    assert small.num_preemptions > 0
    assert out == ref
    assert small.groups["g0"].kv.num_free_blocks == 12


def test_request_that_never_fits_is_rejected_at_once():
    sched = Scheduler(SchedulerConfig())
    sched.add_group("g0", num_blocks=4, block_size=16)
    err = sched.add_request(make_request("big", prompt_len=60, max_tokens=10))
    assert err is not None and err.param == "max_tokens"
    assert sched.add_request(make_request("ok", prompt_len=50, max_tokens=14)) is None


@pytest.mark.parametrize("seed", range(5))
def test_aborts_at_any_moment_free_every_block(seed):
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48))
    sched.add_group("g0", num_blocks=20, block_size=16)
    ex = FakeExecutor(20, 16)
    ids = []
    for i in range(12):
        r = make_request(f"r{i}", prompt_len=rng.randrange(1, 60), max_tokens=rng.randrange(1, 40), seed=i)
        sched.add_request(r)
        ids.append(r.request_id)
    queue: list[StepPlan] = []
    for _ in range(200):
        plan_ahead(sched, "g0", queue)
        if not queue:
            break
        if rng.random() < 0.3:  # between planning and the result: with steps in flight
            sched.abort([rng.choice(ids)])
        sched.update_from_output(ex.execute(queue.pop(0)))
    sched.abort(ids)
    assert sched.groups["g0"].kv.num_free_blocks == 20
    assert not sched.requests and not sched.waiting and not sched.groups["g0"].running


def test_priority_is_refused_under_fcfs():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    sched.add_group("g0", num_blocks=8, block_size=16)
    error = sched.add_request(make_request("p", prompt_len=5, max_tokens=2, priority=-1))
    assert error is not None and error.param == "priority" and "scheduling-policy priority" in error.message
    assert sched.add_request(make_request("q", prompt_len=5, max_tokens=2, priority=0)) is None


def test_priority_policy_runs_lower_value_first():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512, policy="priority"))
    sched.add_group("g0", num_blocks=64, block_size=16)
    for i, prio in enumerate([5, 1, 3]):
        sched.add_request(make_request(f"p{prio}", prompt_len=5, max_tokens=2, seed=i, priority=prio))
    order = []
    _, plans = run(sched, FakeExecutor(64, 16))
    for plan in plans:
        for new in plan.new_requests:
            order.append(new.request_id)
    assert order == ["p1", "p3", "p5"]


def test_background_requests_wait_for_interactive_ones_and_are_preempted_first():
    """Batch lines (``background``) are admitted after every interactive request waiting, even
    one that arrived later, and a pool that runs out preempts a batch line, though under FCFS
    the newest request (here the interactive one) would go; all complete with their outputs."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512))
    sched.add_group("g0", num_blocks=6, block_size=16)
    reqs = [make_request(rid, prompt_len=20, max_tokens=30, seed=seed) for rid, seed in (("b0", 1), ("b1", 2), ("i0", 3))]
    for r in reqs:
        respec(r, background=r.request_id.startswith("b"))
        assert sched.add_request(r) is None
    order: list[str] = []

    def on_step(plan):
        order.extend(new.request_id for new in plan.new_requests if new.request_id not in order)

    out, _ = run(sched, FakeExecutor(6, 16), on_step=on_step)
    assert order[:2] == ["i0", "b0"]  # the interactive one first, though the batch lines came first
    assert out == {r.request_id: expected(r) for r in reqs}
    by_id = {r.request_id: r for r in reqs}
    assert by_id["i0"].num_preemptions == 0 and by_id["b0"].num_preemptions > 0


def test_fcfs_queue_puts_interactive_requests_ahead_of_background_ones():
    """The waiting queue's order under FCFS: preempted interactive, waiting interactive,
    preempted background, waiting background (each in arrival order)."""
    from services.scheduler.group import GroupState
    from services.scheduler.request import RequestStatus

    group = GroupState.__new__(GroupState)  # only the queue is used
    group.waiting = []
    made = {}
    for rid, seed, background, preempted in (("bw", 1, True, False), ("iw", 2, False, False),
                                             ("bp", 3, True, True), ("ip", 4, False, True), ("iw2", 5, False, False)):
        req = made[rid] = make_request(rid, prompt_len=4, max_tokens=2, seed=seed)
        respec(req, background=background)
        if preempted:
            req.status = RequestStatus.PREEMPTED
        group.enqueue(req, by_priority=False, front=preempted)
    assert [r.request_id for r in group.waiting] == ["ip", "iw", "iw2", "bp", "bw"]


def test_group_removal_requeues_requests_to_another_group():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("a", num_blocks=32, block_size=16)
    reqs = [make_request(f"r{i}", prompt_len=12, max_tokens=6, seed=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    ex_a = FakeExecutor(32, 16)
    plan = sched.schedule("a")
    sched.update_from_output(ex_a.execute(plan))
    moved = sched.remove_group("a")
    assert {r.request_id for r in moved} == {"r0", "r1", "r2"}
    sched.add_group("b", num_blocks=32, block_size=16)
    out, _ = run(sched, FakeExecutor(32, 16), group="b")
    assert out == {r.request_id: expected(r) for r in reqs}


def run_workload(reqs, enable_prefix_caching: bool, num_blocks: int = 64, budget: int = 128):
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                      enable_prefix_caching=enable_prefix_caching))
    sched.add_group("g0", num_blocks=num_blocks, block_size=16)
    ex = FakeExecutor(num_blocks, 16)
    cached = {}
    outputs = {}
    for wave in reqs:  # later waves arrive after earlier ones finished (warm cache)
        for r in wave:
            assert sched.add_request(r) is None
        out, _ = run(sched, ex)
        outputs.update(out)
        cached.update({r.request_id: r.num_cached_tokens for r in wave})
    assert sched.groups["g0"].kv.num_free_blocks == num_blocks
    return outputs, cached, sched


def shared_prefix_waves():
    prefix = [random.Random(42).randrange(VOCAB - 1) for _ in range(64)]  # 4 full blocks
    warm = [make_request("warm", 0, 5, seed=1, prefix=prefix)]
    return [
        warm,
        [
            make_request("same", 0, 5, seed=2, prefix=prefix),  # exactly on a block boundary
            make_request("plus1", 1, 5, seed=3, prefix=prefix),  # one token past it
            make_request("plus20", 20, 5, seed=4, prefix=prefix),
            make_request("other", 30, 5, seed=5),
        ],
    ]


def test_prefix_caching_hits_and_keeps_outputs():
    on, cached, sched = run_workload(shared_prefix_waves(), True)
    off, cached_off, _ = run_workload(shared_prefix_waves(), False)
    assert on == off
    # the last block holding the final prompt token is always recomputed
    assert cached == {"warm": 0, "same": 48, "plus1": 64, "plus20": 64, "other": 0}
    assert set(cached_off.values()) == {0}
    kv = sched.groups["g0"].kv
    assert kv.num_hits == 48 + 64 + 64
    assert kv.num_queries == 64 + 64 + 65 + 84 + 30


def test_prefix_cache_eviction_is_lru_and_content_stays_correct():
    # a pool so small that cached blocks are evicted and reused while requests run
    def waves():
        busy = [[make_request(f"w{i}-{j}", 40, 10, seed=100 * i + j) for j in range(3)] for i in range(4)]
        return busy + shared_prefix_waves()

    on, _, sched = run_workload(waves(), True, num_blocks=14, budget=64)
    off, _, _ = run_workload(waves(), False, num_blocks=14, budget=64)
    assert on == off
    assert sched.groups["g0"].kv.pool.num_evictions > 0


def test_eviction_order_is_least_recently_freed_first():
    from services.scheduler.block_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", 9, 1, seed=1)  # 2 full blocks cached + 1 partial
    assert kv.allocate_slots(a, 9) == [0, 1, 2]
    kv.free(a)  # freed tail first: free queue is 3, 2, 1, 0
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]
    assert sorted(kv.pool.cached.values()) == [0, 1]
    b = make_request("b", 5, 1, seed=2)
    assert kv.allocate_slots(b, 5) == [3, 2]  # the uncached blocks go first; a's prefix survives
    assert kv.get_computed_blocks(a) == ([0, 1], 8)
    kv.free(b)  # free queue: 1, 0, 2, 3 (a's prefix is now the least recently freed)
    assert list(kv.pool.free_queue) == [1, 0, 2, 3]
    c = make_request("c", 5, 1, seed=3)
    assert kv.allocate_slots(c, 5) == [1, 0]  # evicts a's prefix, its tail block first
    assert kv.pool.num_evictions == 2 and kv.get_computed_blocks(a) == ([], 0)
    assert sorted(kv.pool.cached.values()) == [1, 3]  # c's first block, and b's (free, still cached)


def test_copy_on_write_of_a_shared_partial_block():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=16, block_size=16)
    ex = FakeExecutor(16, 16)
    parent = make_request("parent", 20, 6, seed=9)
    sched.add_request(parent)
    plan = sched.schedule("g0")
    sched.update_from_output(ex.execute(plan))  # prefill: 20 prompt tokens + 1 sampled
    group = sched.groups["g0"]
    child = make_request("child", 0, 6, seed=9)
    child.prompt_token_ids = list(parent.prompt_token_ids)
    child.output_token_ids = list(parent.output_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    child.status = parent.status
    child.group_id = "g0"
    group.kv.fork(parent, child)
    sched.requests["child"] = child
    group.running.append(child)
    ex.state["child"] = {k: list(v) if isinstance(v, list) else v for k, v in ex.state["parent"].items()}
    group.known.add("child")
    shared = parent.block_ids[1]
    assert group.kv.pool.ref_counts[shared] == 2
    plan = sched.schedule("g0")
    assert len(plan.block_copies) == 1 and plan.block_copies[0][0] == shared
    assert parent.block_ids[1] != child.block_ids[1]
    sched.update_from_output(ex.execute(plan))
    out, _ = run(sched, ex)
    assert out["parent"] == out["child"] == expected(parent)  # same greedy stream, own blocks
    assert group.kv.num_free_blocks == 16


def test_parallel_sampling_forks_share_the_prompt_and_copy_on_write():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=16, block_size=16)
    ex = FakeExecutor(16, 16)
    req = make_request("p", 20, 6, seed=3)  # 20 prompt tokens: the second block is partial
    respec(req, sampling_params=req.sampling_params.replace(n=3))
    sched.add_request(req)
    plan = sched.schedule("g0")
    assert plan.forks == {"p": ["p#1", "p#2"]}
    outcome = sched.update_from_output(ex.execute(plan))
    assert sorted(r.request_id for r in outcome.updated) == ["p", "p#1", "p#2"]
    group = sched.groups["g0"]
    assert group.kv.pool.ref_counts[req.block_ids[0]] == 3 and group.kv.num_free_blocks == 14
    plan = sched.schedule("g0")
    assert len(plan.block_copies) == 2  # two of the three writers of the shared partial block copy it
    sched.update_from_output(ex.execute(plan))
    out, _ = run(sched, ex)
    toks = list(req.prompt_token_ids)
    for rid, index in (("p", 0), ("p#1", 1), ("p#2", 2)):
        seq = toks + [(next_token(toks) + index) % (VOCAB - 1)]
        while len(seq) < len(toks) + 6:
            seq.append(next_token(seq))
        assert out[rid] == seq[len(toks):]
    assert len({tuple(v) for v in out.values()}) == 3
    assert group.kv.num_free_blocks == 16
    # aborting the parent id aborts every sample
    req2 = make_request("q", 5, 50, seed=4)
    respec(req2, sampling_params=req2.sampling_params.replace(n=2))
    sched.add_request(req2)
    sched.update_from_output(ex.execute(sched.schedule("g0")))
    assert set(sched.requests) == {"q", "q#1"}
    sched.abort(["q"])
    assert not sched.requests and group.kv.num_free_blocks == 16


def test_cache_salt_separates_prefix_caches():
    prefix = [random.Random(7).randrange(VOCAB - 1) for _ in range(48)]
    waves = [[make_request("a", 4, 2, seed=1, prefix=prefix)],
             [make_request("same-salt", 4, 2, seed=2, prefix=prefix), make_request("salted", 4, 2, seed=3, prefix=prefix)]]
    respec(waves[0][0], cache_salt="s1")
    respec(waves[1][0], cache_salt="s1")
    respec(waves[1][1], cache_salt="s2")
    _, cached, _ = run_workload(waves, True)
    assert cached == {"a": 0, "same-salt": 48, "salted": 0}


def test_async_scheduling_keeps_two_steps_in_flight_and_drops_the_token_after_a_stop(async_scheduling):
    """Decodes are planned on output placeholders (step N + 1 before N's result); a request
    that stops on a stop token computes at most one token more, which is dropped, and one at
    max_tokens is not planned past it."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=32, block_size=16)
    ex = FakeExecutor(32, 16)
    stopper = make_request("stop", prompt_len=10, max_tokens=50, seed=1)
    stop_at = expected(make_request("stop", prompt_len=10, max_tokens=50, seed=1))[3]
    respec(stopper, sampling_params=SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, stop_token_ids=[stop_at]))
    capped = make_request("cap", prompt_len=7, max_tokens=6, seed=2)
    for r in (stopper, capped):
        assert sched.add_request(r) is None
    depth = []
    outputs, plans = run(sched, ex, on_step=lambda plan: depth.append(len(sched.groups["g0"].in_flight)))
    full = expected(make_request("stop", prompt_len=10, max_tokens=50, seed=1))
    assert outputs == {"stop": full[: full.index(stop_at) + 1], "cap": expected(capped)}
    computed = [p.num_scheduled_tokens.get("stop", 0) for p in plans]
    sampled_steps = sum(1 for n in computed[1:] if n)  # decodes after the prefill
    assert sampled_steps == full.index(stop_at) + (1 if async_scheduling else 0)  # one wasted in flight
    assert sum(p.num_scheduled_tokens.get("cap", 0) for p in plans) == 7 + 6 - 1  # never past max_tokens
    assert max(depth) == (1 if async_scheduling else 0)  # one more plan waits while a step runs
    assert sched.groups["g0"].kv.num_free_blocks == 32 and not sched.requests


def _plans_of_a_forking_workload(max_plan_bytes: int | None) -> tuple[dict[str, list[int]], list[StepPlan], list]:
    """24 requests with long non-ASCII ids and 300–1,000-token prompts, every fourth with
    n = 3 (forks, then copies-on-write of the shared partial block), some in chunked prefills."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096, max_plan_bytes=max_plan_bytes))
    sched.add_group("g0", num_blocks=2048, block_size=16)
    ex = FakeExecutor(2048, 16)
    reqs = []
    for i in range(24):
        req = make_request(f"chatcmpl-{i:032x}-ünï", 300 + 31 * i, 8, seed=i)
        if i % 4 == 0:
            respec(req, sampling_params=req.sampling_params.replace(n=3))
        assert sched.add_request(req) is None
        reqs.append(req)
    outputs, plans = run(sched, ex)
    return outputs, plans, reqs


def test_plans_stay_within_max_plan_bytes():
    """Admission keeps every plan within ``max_plan_bytes`` (plus the plan's own header)
    with long request ids, n > 1 forks and their copies-on-write, finished ids and chunked
    prefills. A copy-on-write sends the one table entry it changed, not the whole table."""
    from shared.bus import encode

    limit = 12_000
    header = len(encode(StepPlan(step_id=10**9, group_id="g0")))
    unbounded = max(len(encode(p)) for p in _plans_of_a_forking_workload(None)[1])
    assert unbounded > limit + header  # the bound is what keeps the plans small
    outputs, plans, reqs = _plans_of_a_forking_workload(limit)
    sizes = [len(encode(p)) for p in plans]
    assert max(sizes) <= limit + header, sorted(sizes)[-5:]
    for req in reqs:
        if req.sampling_params.n == 1:
            assert outputs[req.request_id] == expected(req)
        else:
            assert {f"{req.request_id}#1", f"{req.request_id}#2"} <= set(outputs)
    replaced = [r for p in plans for *_, r in p.cached_requests.rows() if r is not None]
    assert len(replaced) == sum(len(p.block_copies) for p in plans) > 0
    assert all(dst == copy[1] for p in plans for (_, dst), copy in zip(
        [r for *_, r in p.cached_requests.rows() if r], p.block_copies, strict=True))


@pytest.mark.parametrize("rid", ["r", "chatcmpl-" + "f" * 32 + "#127", "ü" * 60])
def test_plan_byte_bounds_hold_for_the_widest_values(rid):
    """``Request.new_request_bytes`` and ``Request.cached_request_bytes`` bound what a request
    adds to an encoded ``StepPlan``, with integers too big for 3 msgpack bytes, multi-byte
    ids, stop strings and an n > 1 fork; a running request's copy-on-write included."""
    from shared.bus import encode
    from shared.messages import CachedRequests, NewRequestData

    req = make_request(rid, 500, 8)
    req.prompt_token_ids = [70_000 + i for i in range(500)]
    respec(req, sampling_params=SamplingParams(n=4, max_tokens=2**31 - 1, temperature=1.5, top_p=0.5, top_k=40,
                                         seed=2**40, stop=["éé", "stop"], stop_token_ids=[2**20, 7],
                                         ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True,
                                         logprobs=20, presence_penalty=-1.5, frequency_penalty=1.25,
                                         repetition_penalty=1.3, min_p=0.05, min_tokens=2**30,
                                         logit_bias={2**20: -100.0, 7: 0.1, 2**31: 99.5}))
    blocks = [100_000 + i for i in range(req.num_tokens // 16 + 1)]

    def new_plan(*rids: str) -> StepPlan:
        return StepPlan(step_id=2**40, group_id="g0", num_scheduled_tokens={r: 2**20 for r in rids},
                        forks={r: [f"{r}#{i}" for i in range(1, 4)] for r in rids}, new_requests=[NewRequestData(
                            request_id=r, prompt_token_ids=req.all_token_ids, sampling_params=req.sampling_params,
                            block_ids=blocks, num_computed_tokens=2**20, num_output_tokens=2**20) for r in rids])

    def cached_plan(*rids: str) -> StepPlan:  # the step that completes a chunked prefill: it forks
        return StepPlan(step_id=2**40, group_id="g0", num_scheduled_tokens={r: 2**20 for r in rids},
                        forks={r: [f"{r}#{i}" for i in range(1, 4)] for r in rids},
                        block_copies=[(2**20, 2**20 + 1) for _ in rids], cached_requests=CachedRequests(
                            req_ids=list(rids), new_block_ids=[blocks[:3] for _ in rids],
                            num_computed_tokens=[2**20 for _ in rids],
                            replaced_blocks={r: (2**20, 2**20 + 1) for r in rids}))

    # what the request adds to a plan that has the fields already (another request "x")
    added = len(encode(new_plan("x", rid))) - len(encode(new_plan("x")))
    assert 0.5 * req.new_request_bytes() < added <= req.new_request_bytes()
    added = len(encode(cached_plan("x", rid))) - len(encode(cached_plan("x")))
    assert 0.5 * req.cached_request_bytes(3) < added <= req.cached_request_bytes(3)


def test_prompt_logprobs_bypass_the_prefix_cache_and_survive_a_preemption_mid_prefill(async_scheduling):
    """A request with prompt_logprobs is prefilled from its first token although its prompt is
    cached (those positions' logits are needed), in chunks; preempted mid-prefill, it is
    prefilled again and the chunks it already had are not taken twice: it holds exactly one
    log probability per prompt token after the first. Its first output token is unchanged."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    sched.add_group("g0", num_blocks=32, block_size=8)
    ex = FakeExecutor(32, 8)
    warm = make_request("warm", 40, 1, seed=4)
    sched.add_request(warm)
    run(sched, ex)
    req = make_request("scored", 40, 2, seed=4)  # the same 40-token prompt: 5 full blocks cached
    respec(req, sampling_params=req.sampling_params.replace(prompt_logprobs=1))
    sched.add_request(req)
    for _ in range(2):  # two chunks of 16 prompt tokens (async: the third is planned, in flight)
        plan_ahead(sched, "g0", ex.queue)
        sched.update_from_output(ex.execute(ex.queue.pop(0)))
    assert req.num_cached_tokens == 0 and len(req.prompt_logprobs) == 32  # tokens 1..32 so far
    group = sched.groups["g0"]
    group.running.remove(req)  # as schedule() preempts a victim
    sched._preempt(req, group)
    assert req.needs_prompt_logprobs and req.num_computed_tokens == 0
    out, _ = run(sched, ex)  # async: the step in flight runs first; its result is stale
    assert out["scored"] == expected(req)
    assert [lp.logprob for lp in req.prompt_logprobs] == [-(p + 1.0) for p in range(39)]  # positions 0..38
    firsts = [first for rid, first, _ in ex.prompt_logprob_chunks if rid == "scored"]
    assert firsts == [1, 17, *([33] if async_scheduling else []), 1, 17, 33]  # recomputed from the start
    assert group.kv.num_free_blocks == 32


# ---------------------------------------------------------------- structured outputs: waiting for the grammar


def constrained(rid: str, seed: int, regex: str = "[a-z]+") -> Request:
    req = make_request(rid, prompt_len=12, max_tokens=4, seed=seed)
    respec(req, sampling_params=req.sampling_params.replace(structured_outputs=StructuredOutputsParams(regex=regex)))
    return req


def test_a_constrained_request_waits_for_its_grammar_while_others_run():
    """vLLM V1's WAITING_FOR_FSM: the group is asked once per grammar; admission skips the
    constrained requests until the group reports it compiled, the others behind them start
    at once; once ready they start, first in the queue, with the outputs they would have had."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=64, block_size=16)
    group = sched.groups["g0"]
    reqs = [constrained("c1", 1), make_request("free", 12, 4, seed=2), constrained("c2", 3)]
    for r in reqs:
        assert sched.add_request(r) is None
    key = reqs[0].grammar_key
    assert key is not None and reqs[1].grammar_key is None and reqs[2].grammar_key == key
    assert group.to_compile == [key] and list(group.grammars_asked) == [key]  # one ask for both
    plan = sched.schedule("g0")
    assert [n.request_id for n in plan.new_requests] == ["free"]
    ex = FakeExecutor(64, 16)
    ex.queue.append(plan)
    outputs, plans = run(sched, ex)  # the compile is pending all along
    assert outputs == {"free": expected(reqs[1])}
    assert not any(p.new_requests for p in plans)
    assert [r.request_id for r in group.waiting] == ["c1", "c2"]
    assert sched.grammar_ready("g0", "unasked") == [] and sched.grammar_ready("other", key) == []
    assert not group.grammars_ready
    assert sched.grammar_ready("g0", key) == []
    assert list(group.grammars_ready) == [key] and not group.grammars_asked
    outputs, plans = run(sched, ex)
    assert [n.request_id for n in plans[0].new_requests] == ["c1", "c2"]
    assert outputs == {r.request_id: expected(r) for r in (reqs[0], reqs[2])}
    assert group.kv.num_free_blocks == 64


def test_ready_grammars_are_an_lru_as_long_as_the_executor_cache():
    """The group remembers GRAMMAR_CACHE_SIZE compiled grammars, the least recently used
    forgotten first (as the executor's cache evicts it); a request whose grammar was forgotten
    asks for it again and waits for the answer."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=64, block_size=16)
    group = sched.groups["g0"]
    req = constrained("c", 1)
    sched.add_request(req)
    key = req.grammar_key
    group.to_compile.clear()
    assert sched.grammar_ready("g0", key) == []
    for i in range(GRAMMAR_CACHE_SIZE - 1):
        group.mark_grammar_ready(f"other{i}")
    assert len(group.grammars_ready) == GRAMMAR_CACHE_SIZE
    assert group.grammar_ready_for(req)  # used: now the most recent
    group.mark_grammar_ready("newest")
    assert "other0" not in group.grammars_ready and key in group.grammars_ready
    for i in range(GRAMMAR_CACHE_SIZE):
        group.mark_grammar_ready(f"more{i}")
    assert key not in group.grammars_ready and len(group.grammars_ready) == GRAMMAR_CACHE_SIZE
    assert sched.schedule("g0") is None  # waits: the grammar is asked for again, once
    assert group.to_compile == [key] and key in group.grammars_asked
    assert sched.schedule("g0") is None and group.to_compile == [key]
    sched.grammar_ready("g0", key)
    out, _ = run(sched, FakeExecutor(64, 16))
    assert out == {"c": expected(req)}


def test_a_grammar_that_does_not_compile_returns_the_requests_waiting_for_it():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("g0", num_blocks=64, block_size=16)
    bad, other = constrained("bad", 1, regex="(x"), constrained("ok", 2)
    for r in (bad, other):
        sched.add_request(r)
    error = ServiceError(message="invalid regex", param="structured_outputs.regex")
    assert sched.grammar_ready("g0", bad.grammar_key, error) == [bad]  # still held: the caller fails it
    assert bad.grammar_key not in sched.groups["g0"].grammars_ready
    assert sched.grammar_ready("g0", bad.grammar_key, error) == []  # answered already


def test_a_constrained_request_rerouted_asks_its_new_group():
    """A group lost: its requests go to another group, which is asked for their grammar and
    admits them only once it has it; a group that registers again knows no grammar."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    sched.add_group("a", num_blocks=32, block_size=16)
    req = constrained("c", 1)
    sched.add_request(req)
    key = req.grammar_key
    sched.grammar_ready("a", key)
    plan = sched.schedule("a")
    assert [n.request_id for n in plan.new_requests] == ["c"]
    sched.add_group("b", num_blocks=32, block_size=16)
    assert sched.groups["b"].to_compile == []
    sched.remove_group("a")
    group_b = sched.groups["b"]
    assert req.group_id == "b" and group_b.to_compile == [key] and key in group_b.grammars_asked
    assert sched.schedule("b") is None  # waits for b's compile
    sched.add_group("a", num_blocks=32, block_size=16)  # registers again: an empty ready set
    assert not sched.groups["a"].grammars_ready and not sched.groups["a"].grammars_asked
    sched.grammar_ready("b", key)
    out, _ = run(sched, FakeExecutor(32, 16), group="b")
    assert out == {"c": expected(req)}
