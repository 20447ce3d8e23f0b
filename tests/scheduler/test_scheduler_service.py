"""The scheduler service's handling of its groups and requests over a real NATS server, with
no model: a group whose step was lost (idle heartbeats) or that stops is dropped at once and
its requests requeued; a plan that cannot be sent drops its group; plans stay under NATS's
max_payload; a stopping scheduler fails the requests it holds at once; the requests of a gateway
or detokenizer shard gone are aborted or failed."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from pathlib import Path
from types import SimpleNamespace

import nats.errors
import pytest
from polling import until

from services.scheduler.service import SchedulerService
from shared import subjects
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    AbortRequests,
    CompileGrammar,
    DetokStep,
    FailRequests,
    GatewayStep,
    GrammarReady,
    Heartbeat,
    Ping,
    Pong,
    RegisterGroup,
    RequestDelta,
    RequestSpec,
    SamplingParams,
    ServiceError,
    StepPlan,
    StructuredOutputsParams,
    SubmitRequest,
)
from shared.model_source import ModelInfo
from shared.pings import answer_pings
from shared.service import FatalServiceError


@pytest.fixture
async def env(nats_url, monkeypatch):
    """A started SchedulerService on the session's NATS server; ``plans`` and ``errors``
    collect the step plans and the request errors it sends (taken at its publish calls)."""
    name = f"sched-{uuid.uuid4().hex[:8]}"
    info = ModelInfo(path=Path("/models") / name, name=name, max_model_len=4096, eos_token_ids=(2,), vocab_size=50000)
    svc = SchedulerService(Settings(nats_url=nats_url, served_model_name=name), info)
    await svc.start()
    plans: list[StepPlan] = []
    errors: list[RequestDelta] = []  # sent to gateways
    publish = svc.bus.publish

    async def recording(subject, message):
        await publish(subject, message)
        if isinstance(message, StepPlan):
            plans.append(message)
        elif isinstance(message, GatewayStep):
            errors.extend(d for d in message.outputs if d.error is not None)

    monkeypatch.setattr(svc.bus, "publish", recording)
    try:
        yield SimpleNamespace(svc=svc, plans=plans, errors=errors)
    finally:
        await svc.stop()


async def register(svc: SchedulerService, num_blocks: int = 256) -> None:
    ack = await svc._on_register(RegisterGroup(group_id="g", model=svc.model_info.name, num_blocks=num_blocks,
                                               block_size=16, max_model_len=svc.model_info.max_model_len))
    assert ack.accepted


async def submit(svc: SchedulerService, rid: str, num_prompt: int = 20, gateway: str = "gw") -> None:
    await svc._on_submit(SubmitRequest(spec=RequestSpec(request_id=rid, gateway_id=gateway,
                                                        sampling_params=SamplingParams(max_tokens=8)),
                                       prompt_token_ids=[7] * num_prompt))


def accepted_spec(rid: str) -> RequestSpec:
    """A request whose gateway awaits its acceptance (``notify_accepted``)."""
    return RequestSpec(request_id=rid, gateway_id="gw", sampling_params=SamplingParams(max_tokens=8),
                       notify_accepted=True)


def heartbeat(idle: bool = False, stopping: bool = False, last_step_id: int = 0) -> Heartbeat:
    return Heartbeat(group_id="g", idle=idle, stopping=stopping, last_step_id=last_step_id)


async def test_two_idle_heartbeats_with_a_step_in_flight_drop_the_group(env):
    service, plans = env.svc, env.plans
    await register(service)
    await submit(service, "r0")
    await until(lambda: len(plans) == 2)  # async scheduling: two plans in flight
    assert (await service._on_heartbeat(heartbeat(idle=False))).known
    assert (await service._on_heartbeat(heartbeat(idle=True))).known  # the plan may still be on its way
    assert (await service._on_heartbeat(heartbeat(idle=False))).known  # it was: busy
    assert (await service._on_heartbeat(heartbeat(idle=True))).known
    ack = await service._on_heartbeat(heartbeat(idle=True))  # idle twice, the step sent before both: lost
    assert not ack.known and "g" not in service.scheduler.groups
    req = service.scheduler.requests["r0"]
    assert req.num_failed_steps == 0 and service.scheduler.unrouted == [req]  # requeued, not blamed
    await register(service)  # the executor registers again: the request runs anew
    await until(lambda: len(plans) >= 3)
    assert [n.request_id for n in plans[2].new_requests] == ["r0"]
    assert plans[2].new_requests[0].num_computed_tokens == 0


async def test_a_result_missing_for_heartbeat_timeout_s_drops_the_group(env):
    """The executor received the oldest step (last_step_id) and is idle: its result was lost,
    unless it is still in the scheduler's backlog, so the group is dropped only after
    heartbeat_timeout_s of idle heartbeats saying so."""
    service, plans = env.svc, env.plans
    service.liveness.heartbeat_timeout_s = 0.5  # the policy reads it (Settings.heartbeat_timeout_s)
    await register(service)
    await submit(service, "r0")
    await until(lambda: len(plans) == 2)
    answered = plans[0].step_id
    for _ in range(3):
        assert (await service._on_heartbeat(heartbeat(idle=True, last_step_id=answered))).known
    await asyncio.sleep(0.6)
    ack = await service._on_heartbeat(heartbeat(idle=True, last_step_id=answered))
    assert not ack.known and service.scheduler.unrouted[0].request_id == "r0"


async def test_idle_heartbeats_without_a_step_in_flight_keep_the_group(env):
    service = env.svc
    await register(service)
    for _ in range(3):
        assert (await service._on_heartbeat(heartbeat(idle=True))).known
    assert "g" in service.scheduler.groups


async def test_a_stopping_executor_hands_its_requests_back_at_once(env):
    service, plans = env.svc, env.plans
    await register(service)
    await submit(service, "r0")
    await until(lambda: len(plans) == 2)
    ack = await service._on_heartbeat(heartbeat(stopping=True))
    assert not ack.known and not service.scheduler.groups
    assert [r.request_id for r in service.scheduler.unrouted] == ["r0"]


async def test_a_plan_that_cannot_be_sent_drops_the_group(env, monkeypatch):
    service, plans = env.svc, env.plans
    await register(service)
    recording = service.bus.publish

    async def failing(subject, message):
        if isinstance(message, StepPlan):
            raise nats.errors.MaxPayloadError()
        await recording(subject, message)

    monkeypatch.setattr(service.bus, "publish", failing)
    await submit(service, "r0")
    assert not service.scheduler.groups and [r.request_id for r in service.scheduler.unrouted] == ["r0"]
    assert (await service._on_heartbeat(heartbeat())).known is False  # the executor registers again
    monkeypatch.setattr(service.bus, "publish", recording)
    await register(service)
    await until(lambda: len(plans) == 2)
    assert [n.request_id for n in plans[0].new_requests] == ["r0"]


async def test_plans_stay_under_max_payload(env):
    """max_plan_bytes comes from the server's max_payload; a step admits waiting requests
    while their prompts fit (the rest start in the next steps); one that never could is
    refused with request_too_large."""
    service, plans = env.svc, env.plans
    limit = service.scheduler.config.max_plan_bytes
    assert limit == service.bus.nc.max_payload - (64 << 10)
    service.scheduler.config = type(service.scheduler.config)(max_plan_bytes=40_000)
    for i in range(4):  # no group yet: they wait, then start together
        await submit(service, f"r{i}", num_prompt=2000)  # at most 11,773 bytes each
    await register(service, num_blocks=4096)
    await until(lambda: len(plans) >= 2)
    assert [n.request_id for n in plans[0].new_requests] == ["r0", "r1", "r2"]
    assert [n.request_id for n in plans[1].new_requests] == ["r3"]
    await submit(service, "big", num_prompt=4000)  # max_tokens 8 -> 4,008 tokens: 23,068 bytes, fits
    assert "big" in service.scheduler.requests
    service.scheduler.config = type(service.scheduler.config)(max_plan_bytes=20_000)
    await submit(service, "too-big", num_prompt=4000)
    [delta] = env.errors
    assert delta.request_id == "too-big" and delta.error.code == "request_too_large"
    assert "max_payload" in delta.error.message and "too-big" not in service.scheduler.requests


async def test_a_stopping_scheduler_fails_its_requests_at_once(env):
    await submit(env.svc, "r0")  # no group: it waits
    await env.svc.stop()
    [delta] = env.errors
    assert delta.request_id == "r0" and delta.finished and delta.finish_reason == "error"
    assert delta.error.code == "request_lost" and delta.error.status == 503


async def test_requests_of_a_gateway_gone_are_aborted(nats_url):
    """A gateway that died without aborting its requests (no responder on its ping subject,
    twice in a row) has them aborted; those of a live gateway (an EngineClient) run on, and so
    do those of one that missed one ping (reconnecting after a NATS blip)."""
    from shared.engine_client import EngineClient

    name = f"sched-{uuid.uuid4().hex[:8]}"
    info = ModelInfo(path=Path("/models") / name, name=name, max_model_len=4096, eos_token_ids=(2,), vocab_size=50000)
    svc = SchedulerService(Settings(nats_url=nats_url, served_model_name=name, heartbeat_timeout_s=1.0), info)
    await svc.start()
    bus = await Bus.connect(nats_url, name="test-gateway")
    client = EngineClient(bus, name, gateway_id="gw-alive")
    await client.start()
    late = EngineClient(bus, name, gateway_id="gw-late")
    await answer_pings(bus, name, "detokenizer.0")
    try:
        await submit(svc, "mine", gateway="gw-alive")  # no group: they wait
        await submit(svc, "orphan", gateway="gw-dead")
        await submit(svc, "late", gateway="gw-late")
        await until(lambda: svc.liveness.peers.misses(("gateway", "gw-late")) == 1)  # the first round missed it
        await late.start()
        await until(lambda: "orphan" not in svc.scheduler.requests)
        await asyncio.sleep(1.2)  # one more round
        assert sorted(svc.scheduler.requests) == ["late", "mine"]
    finally:
        await late.stop()
        await client.stop()
        await bus.close()
        await svc.stop()


async def test_failed_requests_report_their_error_to_the_gateway(env):
    """A detokenizer that lost requests' state sends them back with an error (FailRequests): the
    scheduler sends it to each held request's gateway and frees it; unknown ids are ignored."""
    await submit(env.svc, "r0")
    await submit(env.svc, "r1")
    lost = ServiceError(message="lost", type="server_error", code="request_lost", status=503)
    await env.svc._on_fail(FailRequests(request_ids=["r0", "gone"], error=lost))
    assert [(d.request_id, d.finish_reason, d.error) for d in env.errors] == [("r0", "error", lost)]
    assert list(env.svc.scheduler.requests) == ["r1"]


async def test_requests_of_a_detokenizer_shard_gone_fail(nats_url):
    """With no detokenizer answering for a shard twice in a row, the scheduler fails that
    shard's requests with a 503 request_lost (their outputs would go nowhere); the other
    shard's requests run on."""
    name = f"sched-{uuid.uuid4().hex[:8]}"
    info = ModelInfo(path=Path("/models") / name, name=name, max_model_len=4096, eos_token_ids=(2,), vocab_size=50000)
    svc = SchedulerService(Settings(nats_url=nats_url, served_model_name=name, heartbeat_timeout_s=1.0,
                                    num_detokenizer_shards=2), info)
    await svc.start()
    bus = await Bus.connect(nats_url, name="test-peers")
    failed: list[RequestDelta] = []

    async def on_step(step: GatewayStep) -> None:
        failed.extend(step.outputs)

    async def pong(_: Ping) -> Pong:
        return Pong(service="gateway")

    try:
        await bus.subscribe(subjects.gateway("gw"), GatewayStep, on_step)
        await bus.subscribe(subjects.gateway_ping("gw"), Ping, pong)
        await answer_pings(bus, name, "detokenizer.1")  # shard 0 has none
        ids = [f"r{i}" for i in range(6)]
        shard0 = sorted(r for r in ids if subjects.detok_shard(r, 2) == 0)
        assert shard0 and len(shard0) < len(ids)
        for rid in ids:
            await submit(svc, rid)  # no group: they wait
        await until(lambda: len(svc.scheduler.requests) < len(ids), timeout=10)
        await until(lambda: len(failed) == len(shard0))
        assert sorted(d.request_id for d in failed) == shard0
        assert all(d.finish_reason == "error" and d.error.code == "request_lost" for d in failed)
        assert sorted(svc.scheduler.requests) == sorted(set(ids) - set(shard0))
    finally:
        await bus.close()
        await svc.stop()


async def test_acceptance_waits_for_a_group_that_may_refuse(env):
    """A notify_accepted request queued with no group registered is acknowledged only once a
    group registers and keeps it: one larger than that group's pool is refused instead, so a
    streaming client never sees a 200 followed by a 400."""
    accepted: list[str] = []
    publish = env.svc.bus.publish

    async def recording(subject, message):
        await publish(subject, message)
        if isinstance(message, GatewayStep):
            accepted.extend(message.accepted)

    env.svc.bus.publish = recording
    for rid, num_prompt in (("fits", 20), ("too-big", 900)):
        await env.svc._on_submit(SubmitRequest(spec=accepted_spec(rid), prompt_token_ids=[7] * num_prompt))
    assert accepted == [] and env.errors == []
    await register(env.svc, num_blocks=16)  # 256 tokens
    assert accepted == ["fits"]
    [refused] = env.errors
    assert refused.request_id == "too-big" and refused.error.status == 400
    await submit(env.svc, "later")  # without notify_accepted: nothing
    await env.svc._on_submit(SubmitRequest(spec=accepted_spec("now"), prompt_token_ids=[7] * 20))
    assert accepted == ["fits", "now"]  # a group is there: at once


async def test_requests_finished_here_release_their_detokenizer_state(env):
    """A request aborted or failed by the scheduler after its first output had reached the
    detokenizer is named in a DetokStep's ``released`` there, so that the detokenizer drops its
    text state (it stayed there for good before)."""
    steps: list[DetokStep] = []
    publish = env.svc.bus.publish

    async def recording(subject, message):
        await publish(subject, message)
        if isinstance(message, DetokStep):
            steps.append(message)

    env.svc.bus.publish = recording
    for rid in ("sent", "unsent", "failed"):
        await submit(env.svc, rid)
    for rid in ("sent", "failed"):
        env.svc.scheduler.requests[rid].sent_to_detokenizer = True
    await env.svc._on_abort(AbortRequests(request_ids=["sent", "unsent"]))
    lost = ServiceError(message="lost", type="server_error", code="request_lost", status=503)
    await env.svc._on_fail(FailRequests(request_ids=["failed"], error=lost))
    assert [rid for s in steps for rid in s.released] == ["sent", "failed"]
    assert not [u for s in steps for u in s.updates]
    assert not env.svc.scheduler.requests


async def test_the_peer_watch_survives_a_failed_round(nats_url, monkeypatch):
    """An exception in one round of the gateway/detokenizer watch (NATS failing while a shard
    is lost) is logged and the watch goes on; the requests are finished all the same."""
    name = f"sched-{uuid.uuid4().hex[:8]}"
    info = ModelInfo(path=Path("/models") / name, name=name, max_model_len=4096, eos_token_ids=(2,), vocab_size=50000)
    svc = SchedulerService(Settings(nats_url=nats_url, served_model_name=name, heartbeat_timeout_s=0.5), info)
    await svc.start()
    bus = await Bus.connect(nats_url, name="test-peers")

    async def pong(_: Ping) -> Pong:
        return Pong(service="gateway")

    async def broken_send_error(req, error):
        raise nats.errors.ConnectionClosedError

    try:
        await bus.subscribe(subjects.gateway_ping("gw"), Ping, pong)
        await bus.flush()
        monkeypatch.setattr(svc, "send_error", broken_send_error)
        monkeypatch.setattr(svc, "release_detokenizer", None)  # a bug in the round: TypeError
        await submit(svc, "r0")  # no detokenizer at all
        await until(lambda: "r0" not in svc.scheduler.requests, timeout=10)
        monkeypatch.undo()
        await submit(svc, "r1")
        await until(lambda: "r1" not in svc.scheduler.requests, timeout=10)  # a later round ran
        assert not [t for t in svc._tasks if t.done()]
    finally:
        await bus.close()
        await svc.stop()


async def test_a_group_of_another_model_or_context_length_is_refused(env, nats_url, monkeypatch):
    """The scheduler refuses a group that serves another model or max_model_len than its own
    (its requests are validated and sized for those), naming both values; the executor's
    registration task fails with it, which ends the service (``failed``) instead of serving."""
    from services.executor import service as executor_service

    svc = env.svc
    name = svc.model_info.name
    for model, max_model_len in ((name, 2048), ("other-model", 4096)):
        ack = await svc._on_register(RegisterGroup(group_id="g", model=model, num_blocks=256, block_size=16,
                                                   max_model_len=max_model_len))
        assert not ack.accepted and ack.error.code == "group_mismatch" and ack.error.status == 500
        assert (f"executor group 'g' serves model {model!r} with max_model_len {max_model_len}, but this "
                f"scheduler serves {name!r} with max_model_len 4096") in ack.error.message
    assert not svc.scheduler.groups

    class StubRunner:
        num_blocks, block_size = 64, 16
        structured = SimpleNamespace(close=lambda: None)

    executor = executor_service.ExecutorService(Settings(nats_url=nats_url, group_id="g-short"),
                                                dataclasses.replace(svc.model_info, max_model_len=2048))
    executor.runner = StubRunner()
    executor.bus = await Bus.connect(nats_url, name="test-executor")
    try:
        executor.spawn(executor._register_and_heartbeat())
        error = await asyncio.wait_for(executor.failed(), 5)
        assert isinstance(error, FatalServiceError)
        assert re.fullmatch("scheduler refused group g-short: executor group 'g-short' serves model .* with "
                            "max_model_len 2048, but this scheduler serves .* with max_model_len 4096: start them "
                            "with the same --model, --served-model-name and --max-model-len", str(error))
        assert executor.state is executor_service.ExecutorState.REGISTERING and not svc.scheduler.groups
    finally:
        await executor.stop()


async def test_a_stopping_scheduler_handles_what_is_pending_but_plans_nothing(env, nats_url, monkeypatch):
    """A submit whose handling is under way when the scheduler stops is finished while its
    subscriptions drain, but no plan goes out for it (its requests are about to fail): it
    fails at once with a 503 request_lost, like every request held."""
    svc = env.svc
    await register(svc)
    entered, release = asyncio.Event(), asyncio.Event()
    publish = svc.bus.publish

    async def held(subject, message):  # the submit's acceptance waits until stop() has begun
        if isinstance(message, GatewayStep) and message.accepted:
            entered.set()
            await release.wait()
        await publish(subject, message)

    monkeypatch.setattr(svc.bus, "publish", held)
    client = await Bus.connect(nats_url, name="test-submitter")
    try:
        await client.publish(svc.subjects.submit, SubmitRequest(spec=accepted_spec("late"),
                                                                prompt_token_ids=[7] * 20))
        await asyncio.wait_for(entered.wait(), 5)  # queued; its plan would be sent next
        stopping = asyncio.create_task(svc.stop())
        await until(lambda: svc.stopping)
        release.set()
        await asyncio.wait_for(stopping, 10)
    finally:
        await client.close()
    assert env.plans == []
    [late] = env.errors
    assert (late.request_id, late.error.code, late.error.status) == ("late", "request_lost", 503)


async def test_a_constrained_request_waits_for_grammar_ready_and_fails_with_its_error(env, nats_url):
    """The scheduler asks the group to compile (CompileGrammar on its compile subject, again at
    a heartbeat while unanswered); the request is planned once the group answers GrammarReady;
    a compile error fails the requests waiting for it."""
    svc = env.svc
    asks: list[CompileGrammar] = []
    bus = await Bus.connect(nats_url)

    async def on_ask(msg: CompileGrammar) -> None:
        asks.append(msg)

    await bus.subscribe(subjects.Subjects(svc.model_info.name).compile("g"), CompileGrammar, on_ask)
    await bus.flush()
    try:
        await register(svc)
        for rid, regex in (("ok", "[a-z]+"), ("bad", "(x")):
            params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=regex))
            await svc._on_submit(SubmitRequest(spec=RequestSpec(request_id=rid, gateway_id="gw", sampling_params=params),
                                               prompt_token_ids=[7] * 20))
        await until(lambda: len(asks) == 2)
        assert not env.plans  # both wait for their grammar
        assert await svc._on_heartbeat(heartbeat()) is not None
        await until(lambda: len(asks) == 4)  # asked again while unanswered
        by_regex = {a.structured_outputs.regex: a.key for a in asks}
        await svc._on_grammar_ready(GrammarReady(group_id="g", key=by_regex["[a-z]+"]))
        assert [n.request_id for n in env.plans[0].new_requests] == ["ok"]
        error = ServiceError(message="structured_outputs.regex: invalid", param="structured_outputs.regex")
        await svc._on_grammar_ready(GrammarReady(group_id="g", key=by_regex["(x"], error=error))
        await until(lambda: [e.request_id for e in env.errors] == ["bad"])
        assert env.errors[0].error == error and "bad" not in svc.scheduler.requests
    finally:
        await bus.close()
