"""The scheduler's ``Watchdog`` without NATS: it acts on the ``Scheduler`` and ``Liveness`` it
is given and asks only its ``WatchdogActions`` (here a recorder) to send; ``watchdog.py``
imports nothing of the service, and the service implements every action as declared."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest

from services.scheduler import watchdog as watchdog_module
from services.scheduler.blame import MAX_FAILED_STEPS
from services.scheduler.liveness import Liveness, Verdict
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.service import SchedulerService
from services.scheduler.watchdog import Watchdog, WatchdogActions
from shared.messages import FinishReason, RequestSpec, SamplingParams, ServiceError

ACTIONS = [name for name, value in vars(WatchdogActions).items() if inspect.iscoroutinefunction(value)]


class Recorder:
    """``WatchdogActions`` that record each call as ``(action, argument...)``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def kick(self) -> None:
        self.calls.append(("kick",))

    async def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        self.calls.append(("finish_requests", request_ids, reason))
        return []

    async def fail_requests(self, request_ids: list[str], error: ServiceError) -> None:
        self.calls.append(("fail_requests", request_ids, error.code))

    async def send_error(self, req: Request, error: ServiceError) -> None:
        self.calls.append(("send_error", req.request_id, error.message))

    async def release_detokenizer(self, reqs: list[Request]) -> None:
        self.calls.append(("release_detokenizer", [r.request_id for r in reqs]))


def request(rid: str) -> Request:
    return Request(spec=RequestSpec(request_id=rid, gateway_id="gw", sampling_params=SamplingParams(max_tokens=8)),
                   prompt_token_ids=[7] * 20, max_model_len=4096)


@pytest.fixture
def setup() -> tuple[Watchdog, Recorder, Scheduler, Liveness]:
    """A watchdog over one group "g" running "r0" and "r1" (one step in flight)."""
    scheduler = Scheduler(SchedulerConfig(async_scheduling=False))
    liveness = Liveness(heartbeat_timeout_s=10.0, step_timeout_s=60.0, executor_wait_timeout_s=0.0)
    scheduler.add_group("g", num_blocks=64, block_size=16)
    liveness.group_registered("g", now=0.0)
    for rid in ("r0", "r1"):
        assert scheduler.add_request(request(rid)) is None
    assert scheduler.schedule("g") is not None
    actions = Recorder()
    dog = Watchdog(actions, scheduler, liveness, shard_of=lambda req: 0, model="m", heartbeat_interval_s=0.01)
    return dog, actions, scheduler, liveness


async def test_a_lost_group_is_dropped_with_no_blame(setup):
    dog, actions, scheduler, liveness = setup
    await dog.drop_group("g", Verdict.HEARTBEAT_LOST)
    assert not scheduler.groups and "g" not in liveness.groups
    assert [r.request_id for r in scheduler.unrouted] == ["r0", "r1"]  # requeued, nobody failed
    assert actions.calls == [("kick",)]
    assert liveness.groups_lost is not None and liveness.groups_lost[1] is Verdict.HEARTBEAT_LOST.error


async def test_a_timed_out_step_fails_its_culprit_and_requeues_the_others(setup):
    dog, actions, scheduler, _ = setup
    scheduler.requests["r0"].num_failed_steps = MAX_FAILED_STEPS - 1  # this failure is its last
    await dog.drop_group("g", Verdict.STEP_TIMED_OUT)
    assert actions.calls == [("send_error", "r0", "executor step timed out"), ("release_detokenizer", ["r0"]),
                             ("kick",)]
    assert [r.request_id for r in scheduler.unrouted] == ["r1"] and "r0" not in scheduler.requests


async def test_the_waiting_requests_fail_once_no_group_came_back(setup):
    dog, actions, scheduler, _ = setup
    dog.remove_group("g")
    dog.note_group_dropped(Verdict.HEARTBEAT_LOST.error)  # executor_wait_timeout_s 0: due at once
    task = asyncio.ensure_future(dog.watch_groups())
    try:
        while not actions.calls:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert actions.calls[0] == ("fail_requests", ["r0", "r1"], "no_executor")


def test_the_watchdog_imports_nothing_of_the_service():
    tree = ast.parse(Path(watchdog_module.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "services.scheduler.service" not in imported


@pytest.mark.parametrize("action", ACTIONS)
def test_the_service_implements_each_action_as_declared(action):
    assert inspect.signature(getattr(SchedulerService, action)) == inspect.signature(getattr(WatchdogActions, action))
    assert inspect.signature(getattr(Recorder, action)) == inspect.signature(getattr(WatchdogActions, action))
