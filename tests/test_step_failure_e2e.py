"""A failed executor step with async scheduling: the scheduler drops the group (with no other
group its requests fail with the step's error), the executor drops the plan that was already
queued behind the failed one (instead of failing it too, which would drop the group again)
and registers again once; the engine then serves the same greedy tokens as before."""

from __future__ import annotations

import pytest

from services.executor import service as executor_service
from services.executor.model_runner import ModelRunner
from services.scheduler import service as scheduler_service


@pytest.mark.timeout(300)
def test_a_failed_step_fails_its_requests_and_drops_the_queued_plan(smollm2_path, monkeypatch):
    from pagedllm import LLM, SamplingParams

    registrations, dropped, stale_results = [], [], []
    original_register = executor_service.ExecutorService._register
    original_on_step = executor_service.ExecutorService._on_step
    original_on_result = scheduler_service.SchedulerService._on_result

    async def register(self):
        registrations.append(self.group_id)
        await original_register(self)

    async def on_step(self, plan):
        if self._recovering:
            dropped.append(plan.step_id)
        await original_on_step(self, plan)

    async def on_result(self, result):
        if not self.scheduler.is_in_flight(result.group_id, result.step_id):
            stale_results.append(result.step_id)
        await original_on_result(self, result)

    monkeypatch.setattr(executor_service.ExecutorService, "_register", register)
    monkeypatch.setattr(executor_service.ExecutorService, "_on_step", on_step)
    monkeypatch.setattr(scheduler_service.SchedulerService, "_on_result", on_result)

    llm = LLM(model=str(smollm2_path), dtype="float32", async_scheduling=True, max_num_seqs=8)
    try:
        prompts = [f"List {n} colours of the rainbow:" for n in ("two", "three", "four", "five")]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        calls = {"n": 0}
        original_execute = ModelRunner.execute

        def execute(self, plan):
            calls["n"] += 1
            if calls["n"] == 6:  # mid-decode, with the next plan already queued behind it
                raise RuntimeError("injected step failure")
            return original_execute(self, plan)

        monkeypatch.setattr(ModelRunner, "execute", execute)
        with pytest.raises(ValueError, match="injected step failure"):
            llm.generate(prompts, params, use_tqdm=False)
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert again == baseline
        assert calls["n"] > 6
        assert len(registrations) == 2  # the first, and one after the failure (not one per stale plan)
        assert len(dropped) <= 1 and not stale_results  # a stale plan is dropped, never answered
        stats = llm.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert all(g.num_free_blocks == g.num_blocks for g in stats.groups)
    finally:
        llm.close()
