"""A failed executor step with async scheduling: the scheduler blames and drops the group,
the executor drops the plan that was already queued behind the failed one (instead of failing
it too, which would drop the group again) but never a plan of its new registration, and
registers again once. A transient failure loses no request: they are retried and give the
same greedy tokens. A request that fails every step it is in fails alone, with the error."""

from __future__ import annotations

import pytest

from services.executor import service as executor_service
from services.executor.model_runner import ModelRunner
from services.scheduler import service as scheduler_service


def assert_idle(llm) -> None:
    """Nothing running or waiting, and every KV block free again."""
    stats = llm.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert all(g.num_free_blocks == g.num_blocks for g in stats.groups)


@pytest.mark.timeout(300)
def test_a_failed_step_is_retried_and_drops_the_queued_plan(smollm2_path, monkeypatch):
    from pagedllm import LLM, SamplingParams

    registrations, executed, stale_results = [], [], []
    original_register = executor_service.ExecutorService._register
    original_execute_step = executor_service.ExecutorService._execute
    original_on_result = scheduler_service.SchedulerService._on_result

    async def register(self):
        await original_register(self)
        registrations.append(self._first_step_id)

    async def execute_step(self, plan):
        executed.append(plan.step_id)
        await original_execute_step(self, plan)

    async def on_result(self, result):
        if not self.scheduler.is_in_flight(result.group_id, result.step_id):
            stale_results.append(result.step_id)
        await original_on_result(self, result)

    monkeypatch.setattr(executor_service.ExecutorService, "_register", register)
    monkeypatch.setattr(executor_service.ExecutorService, "_execute", execute_step)
    monkeypatch.setattr(scheduler_service.SchedulerService, "_on_result", on_result)

    llm = LLM(model=str(smollm2_path), dtype="float32", async_scheduling=True, max_num_seqs=8)
    try:
        prompts = [f"List {n} colours of the rainbow:" for n in ("two", "three", "four", "five")]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        calls = {"n": 0, "fail_at": -1}
        failed_steps: list[int] = []
        original_execute = ModelRunner.execute

        def execute(self, plan):
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:  # mid-decode, with the next plan already queued behind it
                failed_steps.append(plan.step_id)
                raise RuntimeError("injected step failure")
            return original_execute(self, plan)

        monkeypatch.setattr(ModelRunner, "execute", execute)
        for _ in range(3):  # each retry races the executor's new registration
            calls["fail_at"] = calls["n"] + 5
            num_registrations = len(registrations)
            again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert again == baseline  # retried after the failure: nothing lost
            assert len(registrations) == num_registrations + 1
            after = executed[executed.index(failed_steps[-1]) + 1:]
            assert after and min(after) >= registrations[-1]  # nothing of the old registration ran
        assert len(registrations) == 4  # the first, and one per failure (not one per stale plan)
        assert not stale_results  # a stale plan is dropped, never answered
        assert_idle(llm)
    finally:
        llm.close()


@pytest.mark.timeout(300)
def test_a_request_that_fails_every_step_fails_alone(smollm2_path, monkeypatch):
    """A poisoned request (every step holding it fails) fails with the step's error, whether
    alone or batched; the requests batched with it give their usual tokens; the engine then
    serves the same tokens as before."""
    import asyncio

    from pagedllm import LLM, SamplingParams

    original_execute = ModelRunner.execute
    poisoned: set[str] = set()
    marker: list[int] = []
    failed_step_sizes: list[int] = []

    def execute(self, plan):
        for new in plan.new_requests:
            if marker and new.prompt_token_ids[: len(marker)] == marker:
                poisoned.add(new.request_id)
        if poisoned & set(plan.num_scheduled_tokens):
            failed_step_sizes.append(len(plan.num_scheduled_tokens))
            raise RuntimeError("injected poison")
        return original_execute(self, plan)

    async def batch(client, prompts: dict[str, str], params) -> dict[str, tuple[list[int], str | None]]:
        """Submit together, then (token ids, error message) per request id."""
        for rid, prompt in prompts.items():
            assert (await client.submit(rid, prompt=prompt, sampling_params=params)).error is None

        async def collect(rid: str) -> tuple[list[int], str | None]:
            tokens, error = [], None
            async for delta in client.stream(rid):
                tokens += delta.token_ids
                error = error or (delta.error.message if delta.error else None)
            return tokens, error

        return dict(zip(prompts, await asyncio.gather(*map(collect, prompts)), strict=True))

    llm = LLM(model=str(smollm2_path), dtype="float32", async_scheduling=True, max_num_seqs=8)
    try:
        prompts = [f"List {n} colours of the rainbow:" for n in ("two", "three", "four")]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        marker += llm.generate(["Poison pill:"], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
        monkeypatch.setattr(ModelRunner, "execute", execute)
        with pytest.raises(ValueError, match="injected poison"):
            llm.generate(["Poison pill: alone"], params, use_tqdm=False)
        out = llm._services.run(batch(llm._client, {"a": prompts[0], "p": "Poison pill: batched", "b": prompts[1]},
                                      params), timeout=120)
        assert max(failed_step_sizes) > 1  # the poison did share a step with the others
        assert out["a"] == (baseline[0], None) and out["b"] == (baseline[1], None)
        assert out["p"][1] is not None and "injected poison" in out["p"][1]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert again == baseline and len(poisoned) >= 2
        assert_idle(llm)
    finally:
        llm.close()


@pytest.mark.timeout(300)
def test_requests_fail_when_no_group_registers_again(smollm2_path, monkeypatch):
    """When the last group fails a step and does not register again within
    executor_wait_timeout_s, its requeued requests fail with its error instead of hanging."""
    import asyncio
    import time

    from pagedllm import LLM, SamplingParams

    original_register = executor_service.ExecutorService._register
    registered = {"n": 0}

    async def register_once(self):
        if registered["n"]:
            await asyncio.Event().wait()  # the executor never comes back
        registered["n"] += 1
        await original_register(self)

    monkeypatch.setattr(executor_service.ExecutorService, "_register", register_once)
    llm = LLM(model=str(smollm2_path), dtype="float32", heartbeat_timeout_s=1.0, executor_wait_timeout_s=1.0)
    try:
        original_execute = ModelRunner.execute
        calls = {"n": 0}

        def execute(self, plan):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected step failure")
            return original_execute(self, plan)

        monkeypatch.setattr(ModelRunner, "execute", execute)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="no executor group is available .*injected step failure"):
            llm.generate(["One, two,", "Three, four,"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert 1.0 <= time.monotonic() - t0 < 30
    finally:
        llm.close()


@pytest.mark.timeout(300)
def test_a_poisoned_sample_of_an_n3_request_reaches_the_client(smollm2_path, monkeypatch):
    """When the blamed request is a sample of an n > 1 request, its error reaches the client
    under the client's request id (it used to be dropped there, and generate hung)."""
    from pagedllm import LLM, SamplingParams

    original_execute = ModelRunner.execute

    def execute(self, plan):
        if any(rid.endswith("#1") for rid in plan.num_scheduled_tokens):
            raise RuntimeError("injected poison in sample 1")
        return original_execute(self, plan)

    llm = LLM(model=str(smollm2_path), dtype="float32", async_scheduling=True)
    try:
        monkeypatch.setattr(ModelRunner, "execute", execute)
        with pytest.raises(ValueError, match="injected poison in sample 1"):
            llm.generate(["Name a colour:"], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=6),
                         use_tqdm=False)
        assert_idle(llm)
    finally:
        llm.close()


@pytest.mark.timeout(300)
def test_an_executor_dropped_after_a_step_timeout_registers_again(smollm2_path, monkeypatch):
    """A step that outlasts step_timeout_s gets its group dropped while the executor is still
    busy with it; the executor's next heartbeat learns that the group is unknown and it
    registers again after the step, so the requests are retried and later ones are served
    (the executor used to stay orphaned, and every later request hung)."""
    import time

    from pagedllm import LLM, SamplingParams

    original_execute = ModelRunner.execute
    calls = {"n": 0}

    def execute(self, plan):
        calls["n"] += 1
        if calls["n"] == 3:
            time.sleep(3.0)  # past step_timeout_s
        return original_execute(self, plan)

    llm = LLM(model=str(smollm2_path), dtype="float32", step_timeout_s=1.0, heartbeat_interval_s=0.5)
    try:
        prompts = ["One, two,", "Three, four,"]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        monkeypatch.setattr(ModelRunner, "execute", execute)
        calls["n"] = 0
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == baseline
        assert calls["n"] > 3  # the slow step was retried after the executor registered again
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == baseline
        assert_idle(llm)
    finally:
        llm.close()


@pytest.mark.timeout(300)
def test_a_request_whose_outputs_or_detokenizer_state_are_lost_goes_again_and_gives_its_tokens(
        smollm2_path, monkeypatch):
    """No client waits forever on a detokenizer that died, and none loses its request:
    - its outputs lost (or the scheduler restarted and forgot the request): a request with no
      output that the scheduler no longer holds is resubmitted by its client;
    - its state lost mid-generation (a detokenizer that replaced one that died gets updates
      for requests it never registered): each fails at once at the scheduler (freeing its
      blocks) with a 503 request_lost, which its client turns into a resubmission with the
      tokens it has: generation continues after them, with the undisturbed greedy tokens;
    - lost for good (every attempt's outputs dropped): after MAX_RESUBMITS, a 503.
    The engine then serves as before, every block free."""
    from pagedllm import LLM, SamplingParams
    from services.detokenizer.service import DetokenizerService
    from shared import inflight
    from shared.request_recovery import RequestTable

    monkeypatch.setattr(RequestTable, "liveness_idle_s", 0.5)
    monkeypatch.setattr(RequestTable, "liveness_check_s", 0.25)
    monkeypatch.setattr(inflight, "MAX_RESUBMITS", 2)
    original_handle, original_process = DetokenizerService.handle, DetokenizerService.process
    original_resubmit = RequestTable._resubmit
    dropping = {"on": False, "until_resubmitted": False}
    steps = {"n": 0, "lose_at": -1}

    async def handle(self, step):
        if not dropping["on"]:
            await original_handle(self, step)

    def process(self, step):
        steps["n"] += 1
        if steps["n"] == steps["lose_at"]:
            self.requests.clear()  # as if a new detokenizer had taken the shard over
        return original_process(self, step)

    async def resubmit(self, pending):
        if dropping["until_resubmitted"]:
            dropping["on"] = False
        await original_resubmit(self, pending)

    monkeypatch.setattr(DetokenizerService, "handle", handle)
    monkeypatch.setattr(DetokenizerService, "process", process)
    monkeypatch.setattr(RequestTable, "_resubmit", resubmit)
    llm = LLM(model=str(smollm2_path), dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        baseline = llm.generate(["One, two,"], params, use_tqdm=False)[0].outputs[0].token_ids
        dropping.update(on=True, until_resubmitted=True)
        assert llm.generate(["One, two,"], params, use_tqdm=False)[0].outputs[0].token_ids == baseline
        assert llm._client.num_resubmitted == 1

        long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        long_baseline = llm.generate(["One, two,"], long, use_tqdm=False)[0].outputs[0].token_ids
        steps["lose_at"] = steps["n"] + 8  # mid-decode: the client has tokens by then
        assert llm.generate(["One, two,"], long, use_tqdm=False)[0].outputs[0].token_ids == long_baseline
        assert llm._client.num_resubmitted == 2
        assert_idle(llm)  # the lost attempt was freed at the scheduler

        dropping.update(on=True, until_resubmitted=False)
        with pytest.raises(ValueError, match="the engine lost this request"):
            llm.generate(["One, two,"], params, use_tqdm=False)
        assert llm._client.num_resubmitted == 4
        dropping["on"] = False
        assert llm.generate(["One, two,"], params, use_tqdm=False)[0].outputs[0].token_ids == baseline
        assert_idle(llm)
    finally:
        llm.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lost", ["plan", "result"])
def test_a_lost_plan_or_result_is_noticed_by_heartbeat(smollm2_path, monkeypatch, lost):
    """NATS drops messages in transit when a connection or the server restarts. A lost step
    plan (or its lost result) used to freeze the group until step_timeout_s (600 s); now the
    executor's idle heartbeats tell the scheduler, which drops the group without blaming
    anyone; the executor registers again and the requests give their exact tokens."""
    from pagedllm import LLM, SamplingParams

    # the executor's plan handler, or the scheduler's result handler, drops one message
    owner, handler = ((executor_service.ExecutorService, "_on_step") if lost == "plan"
                      else (scheduler_service.SchedulerService, "_on_result"))
    original = getattr(owner, handler)
    lose = {"at": -1, "n": 0, "lost": []}

    async def dropping(self, msg):
        lose["n"] += 1
        if lose["n"] == lose["at"]:
            lose["lost"].append(msg.step_id)
            return
        await original(self, msg)

    monkeypatch.setattr(owner, handler, dropping)
    llm = LLM(model=str(smollm2_path), dtype="float32", heartbeat_interval_s=0.2, heartbeat_timeout_s=3,
              step_timeout_s=600)
    try:
        prompts = ["One, two,", "Three, four, five,"]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        lose["at"] = lose["n"] + 4  # mid-decode
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert len(lose["lost"]) == 1 and again == baseline
        assert_idle(llm)
    finally:
        llm.close()
