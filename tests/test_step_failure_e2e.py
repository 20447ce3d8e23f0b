"""A failed executor step with async scheduling: the scheduler drops the group (with no other
group its requests fail with the step's error), the executor drops the plan that was already
queued behind the failed one (instead of failing it too, which would drop the group again)
but never a plan of its new registration, and registers again once; the engine then serves
the same greedy tokens as before."""

from __future__ import annotations

import pytest

from services.executor import service as executor_service
from services.executor.model_runner import ModelRunner
from services.scheduler import service as scheduler_service


@pytest.mark.timeout(300)
def test_a_failed_step_fails_its_requests_and_drops_the_queued_plan(smollm2_path, monkeypatch):
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
        original_execute = ModelRunner.execute

        def execute(self, plan):
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:  # mid-decode, with the next plan already queued behind it
                raise RuntimeError("injected step failure")
            return original_execute(self, plan)

        monkeypatch.setattr(ModelRunner, "execute", execute)
        for _ in range(3):  # each time the next generate() races the executor's new registration
            calls["fail_at"] = calls["n"] + 5
            with pytest.raises(ValueError, match="injected step failure"):
                llm.generate(prompts, params, use_tqdm=False)
            failed_step = executed[-1]
            again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert again == baseline
            after = executed[executed.index(failed_step) + 1:]
            assert after and min(after) >= registrations[-1]  # nothing of the old registration ran
        assert len(registrations) == 4  # the first, and one per failure (not one per stale plan)
        assert not stale_results  # a stale plan is dropped, never answered
        stats = llm.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert all(g.num_free_blocks == g.num_blocks for g in stats.groups)
    finally:
        llm.close()
