"""The executor service's state machine (``ExecutorState``) on a real nats-server, with a stub
runner (no model) and a fake scheduler on the bus: the first registration, rejoining after the
scheduler dropped the group (a heartbeat answered unknown, a failed step), the plans of a
previous registration dropped by step id, the heartbeat's fields, and stopping."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from polling import until

from services.executor.service import ExecutorService, ExecutorState
from shared import subjects
from shared.bus import Bus, decode, encode
from shared.config import Settings
from shared.messages import (
    Heartbeat,
    HeartbeatAck,
    Ping,
    Pong,
    RegisterAck,
    RegisterGroup,
    ServiceError,
    StepPlan,
    StepResult,
)
from shared.model_source import ModelInfo

GROUP = "g"


class StubRunner:
    """A ModelRunner stand-in, run on the executor's torch thread. A step id in ``gates`` waits
    for its event (at most 5 s) before it ends; one in ``failing`` then raises. ``started``:
    the step ids begun; ``calls``: "ran <step id>" (a step that ended) and "reset", in order."""

    num_blocks, block_size = 8, 16

    def __init__(self) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.failing: set[int] = set()
        self.started: list[int] = []
        self.calls: list[str] = []
        self.structured_closed = threading.Event()  # the grammar threads' close() at stop
        self.structured = SimpleNamespace(close=self.structured_closed.set)

    def execute(self, plan: StepPlan) -> StepResult:
        self.started.append(plan.step_id)
        if (gate := self.gates.get(plan.step_id)) is not None:
            gate.wait(5)
        self.calls.append(f"ran {plan.step_id}")
        if plan.step_id in self.failing:
            raise RuntimeError(f"boom at {plan.step_id}")
        return StepResult(step_id=plan.step_id, group_id=plan.group_id, sampled_token_ids={"r": plan.step_id})

    def reset(self) -> None:
        self.calls.append("reset")


class FakeScheduler:
    """Records every RegisterGroup (on receipt), Heartbeat and StepResult; answers a
    registration once ``open`` is set (a RegisterAck with ``next_step_id``; the group is then
    known) and a heartbeat with a HeartbeatAck saying ``known``. Keep ``open`` clear for less
    than the executor's 2 s registration timeout."""

    def __init__(self, bus: Bus, model: str) -> None:
        self.bus, self.subjects = bus, subjects.Subjects(model)
        self.registrations: list[RegisterGroup] = []
        self.heartbeats: list[Heartbeat] = []
        self.results: list[StepResult] = []
        self.known, self.next_step_id = True, 0
        self.open = asyncio.Event()
        self.open.set()

    async def serve(self) -> None:
        await self.bus.subscribe(self.subjects.register, RegisterGroup, self._on_register)
        await self.bus.subscribe(self.subjects.heartbeat, Heartbeat, self._on_heartbeat)
        await self.bus.subscribe(self.subjects.result, StepResult, self._on_result)
        await self.bus.flush()

    async def _on_register(self, msg: RegisterGroup) -> RegisterAck:
        self.registrations.append(msg)
        await self.open.wait()
        self.known = True
        return RegisterAck(group_id=msg.group_id, accepted=True, next_step_id=self.next_step_id)

    async def _on_result(self, result: StepResult) -> None:
        self.results.append(result)

    async def _on_heartbeat(self, msg: Heartbeat) -> HeartbeatAck:
        self.heartbeats.append(msg)
        return HeartbeatAck(group_id=msg.group_id, known=self.known)

    async def plan(self, *step_ids: int) -> None:
        for step_id in step_ids:
            await self.bus.publish(self.subjects.step(GROUP), StepPlan(step_id=step_id, group_id=GROUP))

    async def beats(self, n: int = 2) -> list[Heartbeat]:
        """Wait for ``n`` more heartbeats; all of them so far."""
        seen = len(self.heartbeats)
        await until(lambda: len(self.heartbeats) >= seen + n)
        return self.heartbeats


async def pongs(env, name: str) -> list[str]:
    """The services that answered one Ping on ``ping(model, name)`` within 0.2 s (one each
    expected: a name answered twice would be two subscriptions)."""
    nc = env.sched.bus.nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subjects.ping(env.info.name, name), encode(Ping()), reply=inbox)
    await asyncio.sleep(0.2)
    msgs = [await sub.next_msg(timeout=1) for _ in range(sub.pending_msgs)]
    # nobody listening: NATS answers with an empty "503 no responders" status message
    answers = [decode(msg.data, Pong).service for msg in msgs if msg.data]
    await sub.unsubscribe()
    return answers


@pytest.fixture
async def env(nats_url):
    """An ExecutorService of group ``GROUP`` with a StubRunner (not started; heartbeats every
    50 ms once registered) and a FakeScheduler serving its model on the session's NATS."""
    name = f"exec-{uuid.uuid4().hex[:8]}"
    info = ModelInfo(path=Path("/models") / name, name=name, max_model_len=64, eos_token_ids=(2,), vocab_size=100)
    bus = await Bus.connect(nats_url, name="fake-scheduler")
    sched = FakeScheduler(bus, name)
    await sched.serve()
    executor = ExecutorService(Settings(nats_url=nats_url, group_id=GROUP, heartbeat_interval_s=0.05), info)
    runner = StubRunner()
    executor.runner = runner

    async def load() -> None:  # the stub runner is there already
        pass

    executor.load = load
    try:
        yield SimpleNamespace(executor=executor, runner=runner, sched=sched, info=info)
    finally:
        sched.open.set()
        for gate in runner.gates.values():
            gate.set()
        await executor.stop()
        await bus.close()


@pytest.fixture
async def serving(env):
    """``env`` with the executor started and registered (``next_step_id`` 0)."""
    await env.executor.start()
    await asyncio.wait_for(env.executor.wait_registered(), 3)
    return env


async def test_registers_then_serves_and_answers_executor_pings_only_once_registered(env):
    env.sched.open.clear()
    await env.executor.start()
    await until(lambda: env.sched.registrations)
    await env.sched.plan(1)  # waits for the registration
    assert env.executor.state is ExecutorState.REGISTERING
    assert await pongs(env, f"executor.{GROUP}") == ["executor.g"]  # a second executor of g is refused
    assert await pongs(env, "executor") == []
    assert env.runner.started == []
    env.sched.open.set()
    await asyncio.wait_for(env.executor.wait_registered(), 3)
    assert env.executor.state is ExecutorState.SERVING
    assert env.sched.registrations == [RegisterGroup(group_id=GROUP, model=env.info.name, num_blocks=8,
                                                     block_size=16, max_model_len=64)]
    assert await pongs(env, "executor") == ["executor"]
    assert await pongs(env, f"executor.{GROUP}") == ["executor.g"]
    await until(lambda: env.sched.results)
    assert env.sched.results == [StepResult(step_id=1, group_id=GROUP, sampled_token_ids={"r": 1})]


async def test_unknown_to_the_scheduler_while_idle_resets_and_registers_again(serving):
    env = serving
    env.sched.open.clear()
    env.sched.known = False
    await until(lambda: len(env.sched.registrations) == 2)
    assert env.executor.state is ExecutorState.REJOINING and env.runner.calls == ["reset"]
    await env.sched.beats()  # answered unknown again while rejoining: one rejoin only
    assert env.runner.calls == ["reset"] and len(env.sched.registrations) == 2
    env.sched.open.set()
    await asyncio.wait_for(env.executor.wait_registered(), 3)
    assert env.executor.state is ExecutorState.SERVING and env.sched.registrations[0] == env.sched.registrations[1]
    assert await pongs(env, "executor") == ["executor"]  # answered once, as before
    await env.sched.plan(1)
    await until(lambda: env.sched.results)
    assert env.sched.results == [StepResult(step_id=1, group_id=GROUP, sampled_token_ids={"r": 1})]


async def test_unknown_to_the_scheduler_while_a_plan_runs_rejoins_after_its_step(serving):
    env = serving
    env.runner.gates[1] = threading.Event()
    await env.sched.plan(1)
    await until(lambda: env.runner.started == [1])
    env.sched.known = False
    await until(lambda: env.executor.state is ExecutorState.REJOIN_PENDING)
    await env.sched.beats()
    assert env.executor.state is ExecutorState.REJOIN_PENDING
    assert env.runner.calls == [] and len(env.sched.registrations) == 1
    env.runner.gates[1].set()
    await until(lambda: len(env.sched.registrations) == 2 and env.executor.state is ExecutorState.SERVING)
    await until(lambda: env.sched.results)
    assert env.sched.results == [StepResult(step_id=1, group_id=GROUP, sampled_token_ids={"r": 1})]
    assert env.runner.calls == ["ran 1", "reset"]


async def test_a_failed_step_answers_an_error_result_and_rejoins(serving):
    env = serving
    env.runner.failing.add(1)
    await env.sched.plan(1)
    await until(lambda: len(env.sched.registrations) == 2 and env.executor.state is ExecutorState.SERVING)
    await until(lambda: env.sched.results)
    (result,) = env.sched.results
    assert (result.step_id, result.group_id, result.sampled_token_ids) == (1, GROUP, {})
    assert result.error == ServiceError(message="executor step failed: boom at 1", type="server_error", status=500)
    assert env.runner.calls == ["ran 1", "reset"]


async def test_after_a_rejoin_plans_below_next_step_id_are_dropped_and_the_rest_run_in_order(serving):
    env = serving
    env.runner.gates[1] = threading.Event()
    env.runner.failing.add(1)
    await env.sched.plan(1)
    await until(lambda: env.runner.started == [1])
    await env.sched.plan(2, 3, 4)  # planned for this registration: queued behind 1
    env.sched.open.clear()
    env.sched.next_step_id = 5
    env.runner.gates[1].set()  # 1 fails: the group registers again
    await until(lambda: len(env.sched.registrations) == 2)
    await env.sched.plan(5, 6)  # the new registration's, here before its answer
    await until(lambda: env.sched.heartbeats and env.sched.heartbeats[-1].last_step_id == 6)
    assert env.executor.state is ExecutorState.REJOINING and env.runner.started == [1]  # plans wait
    env.sched.open.set()
    await until(lambda: len(env.sched.results) == 3)
    assert [(r.step_id, r.error is None) for r in env.sched.results] == [(1, False), (5, True), (6, True)]
    assert env.runner.started == [1, 5, 6] and env.runner.calls == ["ran 1", "reset", "ran 5", "ran 6"]
    await env.sched.beats()
    assert len(env.sched.results) == 3


async def test_heartbeats_say_idle_only_with_no_plan_queued_or_running(serving):
    env = serving
    assert (await env.sched.beats())[-1] == Heartbeat(group_id=GROUP, idle=True, last_step_id=0)
    env.runner.gates[3] = threading.Event()
    await env.sched.plan(3)
    await until(lambda: env.runner.started == [3])
    assert (await env.sched.beats())[-1] == Heartbeat(group_id=GROUP, idle=False, last_step_id=3)  # running
    await env.sched.plan(4)  # queued behind 3
    await until(lambda: env.sched.heartbeats[-1].last_step_id == 4)
    assert (await env.sched.beats())[-1] == Heartbeat(group_id=GROUP, idle=False, last_step_id=4)
    env.runner.gates[3].set()
    await until(lambda: len(env.sched.results) == 2)
    assert (await env.sched.beats())[-1] == Heartbeat(group_id=GROUP, idle=True, last_step_id=4)


async def test_a_plan_queued_but_not_yet_taken_is_not_idle(env, nats_url):
    """``_heartbeat`` on an executor not started (no step loop takes the queued plan)."""
    executor = env.executor
    executor.bus = await Bus.connect(nats_url, name="test-executor")
    await executor._on_step(StepPlan(step_id=7, group_id=GROUP))
    await executor._heartbeat()  # queued
    executor._plans.get_nowait()
    await executor._heartbeat()  # taken, not held
    executor._held_step_id = 7
    await executor._heartbeat()  # held
    assert env.sched.heartbeats == [Heartbeat(group_id=GROUP, idle=idle, last_step_id=7) for idle in (False, True, False)]


async def test_stop_sends_a_last_heartbeat_saying_stopping(serving):
    env = serving
    await env.sched.beats(1)
    await env.executor.stop()
    assert env.executor.state is ExecutorState.STOPPING
    assert env.sched.heartbeats[-1] == Heartbeat(group_id=GROUP, stopping=True)
    assert [h for h in env.sched.heartbeats if h.stopping] == [env.sched.heartbeats[-1]]
    assert env.runner.structured_closed.is_set()


async def test_stop_while_rejoining_ends_cleanly(serving):
    """The scheduler already dropped the group: no stopping heartbeat; the registration under
    way is cancelled, and no task of the executor is left or failed."""
    env = serving
    env.sched.open.clear()
    env.sched.known = False
    await until(lambda: len(env.sched.registrations) == 2)
    assert env.executor.state is ExecutorState.REJOINING
    await asyncio.wait_for(env.executor.stop(), 3)
    env.sched.open.set()
    await asyncio.sleep(0.1)
    assert env.executor.state is ExecutorState.STOPPING and env.executor.bus is None
    assert not any(h.stopping for h in env.sched.heartbeats) and len(env.sched.registrations) == 2
    left = [t for t in asyncio.all_tasks() if not t.done() and "ExecutorService" in t.get_coro().__qualname__]
    assert left == []
    assert all(t.cancelled() or t.exception() is None for t in env.executor._tasks)
