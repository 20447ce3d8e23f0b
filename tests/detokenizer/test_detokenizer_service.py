"""The detokenizer service on a real nats-server: a DetokStep in, one GatewayStep per gateway
out (exact streamed text, stop strings), AbortRequests and FailRequests to the scheduler, and
what a stopping, released or replaced detokenizer does; one scheduler and one detokenizer per
shard.

A fake scheduler and fake gateways subscribe to what the service sends; a marker request
published after the steps under test says when all of it has arrived.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import pytest
import pytest_asyncio

from services.detokenizer import DetokenizerService
from shared import subjects as subj
from shared.bus import Bus, decode
from shared.config import Settings
from shared.messages import (
    AbortRequests,
    DetokenizeParams,
    DetokNewRequest,
    DetokStep,
    FailRequests,
    GatewayStep,
    TokenUpdate,
)
from shared.model_source import ModelInfo

MAX_MODEL_LEN = 64
EOS = 2


@dataclass
class Env:
    bus: Bus
    info: ModelInfo
    subjects: subj.Subjects
    tokenizer: object


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env(nats_url, smollm2_served):
    settings, info = smollm2_served
    detokenizer_service = DetokenizerService(settings, info)
    await detokenizer_service.start()
    bus = await Bus.connect(nats_url, name="test-client")
    try:
        yield Env(bus, info, subj.Subjects(info.name), detokenizer_service.tokenizer)
    finally:
        await bus.close()
        await detokenizer_service.stop()


async def detok_steps(env: Env, steps: list[DetokStep], gateway_ids: list[str]
                      ) -> tuple[dict[str, list[GatewayStep]], list[AbortRequests], list[FailRequests]]:
    """Publish DetokSteps in order; every GatewayStep per gateway, and every AbortRequests and
    FailRequests the service sent for them."""
    marker = f"marker-{uuid.uuid4().hex[:6]}"
    marker_sub = await env.bus.nc.subscribe(subj.gateway(marker))
    subs = {g: await env.bus.nc.subscribe(subj.gateway(g)) for g in gateway_ids}
    abort_sub = await env.bus.nc.subscribe(env.subjects.abort)
    fail_sub = await env.bus.nc.subscribe(env.subjects.fail)
    try:
        for step in steps:
            await env.bus.publish(env.subjects.detok(0), step)
        # A marker request through the same service afterwards: once its output is here,
        # everything the service sent for ``steps`` is already in our subscriptions' queues.
        await env.bus.publish(env.subjects.detok(0), DetokStep(
            new_requests=[DetokNewRequest(request_id=marker, gateway_id=marker, prompt_tail_ids=[],
                                          num_prompt_tokens=1)],
            updates=[TokenUpdate(request_id=marker, new_token_ids=[28], finish_reason="length")],
        ))
        await marker_sub.next_msg(timeout=10)

        async def queued(sub, message_type):
            return [decode((await sub.next_msg(timeout=1)).data, message_type) for _ in range(sub.pending_msgs)]

        out = {g: await queued(sub, GatewayStep) for g, sub in subs.items()}
        return out, await queued(abort_sub, AbortRequests), await queued(fail_sub, FailRequests)
    finally:
        for sub in [*subs.values(), abort_sub, fail_sub, marker_sub]:
            await sub.unsubscribe()


async def detok_round(env: Env, step: DetokStep, gateway_ids: list[str], abort: bool = False):
    """Publish one DetokStep; return the one GatewayStep per gateway (and the abort if asked),
    then how many more each gateway and the abort subject got."""
    out, aborts, _ = await detok_steps(env, [step], gateway_ids)
    first = {g: steps[0] for g, steps in out.items()}  # IndexError: no output for g
    aborted = aborts[0] if abort else None
    return first, aborted, {g: len(steps) - 1 for g, steps in out.items()}, len(aborts) - abort


async def test_detokenizer_streams_exact_text_and_finishes_on_eos(env):
    tok = env.tokenizer
    text = "Bonjour! 中文 😀 ok"
    ids = tok(text)["input_ids"]
    gw = f"gw-{uuid.uuid4().hex[:6]}"
    new = DetokNewRequest(request_id="d1", gateway_id=gw, prompt_tail_ids=[1, 520, 9531, 198], num_prompt_tokens=20)
    streamed, token_ids = "", []
    for k, tid in enumerate(ids):
        step = DetokStep(new_requests=[new] if k == 0 else [],
                         updates=[TokenUpdate(request_id="d1", new_token_ids=[tid], num_cached_tokens=16)])
        out, _, _, _ = await detok_round(env, step, [gw])
        (delta,) = out[gw].outputs
        assert "\ufffd" not in delta.text and not delta.finished
        assert delta.num_output_tokens == k + 1 and delta.num_prompt_tokens == 20 and delta.num_cached_tokens == 16
        streamed += delta.text
        token_ids += delta.token_ids
    step = DetokStep(updates=[TokenUpdate(request_id="d1", new_token_ids=[EOS], finish_reason="stop")])
    out, _, _, abort_pending = await detok_round(env, step, [gw])
    (last,) = out[gw].outputs
    assert streamed + last.text == text
    assert last.finished and last.finish_reason == "stop" and last.stop_reason is None
    assert token_ids + last.token_ids == ids + [EOS] and last.num_output_tokens == len(ids) + 1
    assert abort_pending == 0  # the scheduler ended it: no abort


async def test_a_stopping_detokenizer_ends_its_live_requests(env, nats_url):
    """A detokenizer that stops takes its requests' text state with it: each live request
    fails at once at its gateway (503 request_lost, under the client's id and index for a
    sample of n > 1) and is aborted at the scheduler; finished ones are not mentioned."""
    info = dataclasses.replace(env.info, name=f"detok-stop-{uuid.uuid4().hex[:6]}")
    service = DetokenizerService(Settings(nats_url=nats_url, served_model_name=info.name), info, tokenizer=env.tokenizer)
    await service.start()
    subjects = subj.Subjects(info.name)
    gw = f"gw-{uuid.uuid4().hex[:6]}"
    gateway_sub = await env.bus.nc.subscribe(subj.gateway(gw))
    abort_sub = await env.bus.nc.subscribe(subjects.abort)
    await env.bus.flush()
    news = [DetokNewRequest(request_id=rid, gateway_id=gw, prompt_tail_ids=[1], num_prompt_tokens=3, **extra)
            for rid, extra in (("live", {}), ("done", {}),
                               ("p#1", {"parent_request_id": "p", "index": 1}))]
    await env.bus.publish(subjects.detok(0), DetokStep(new_requests=news, updates=[
        TokenUpdate(request_id="live", new_token_ids=[28]),
        TokenUpdate(request_id="done", new_token_ids=[28], finish_reason="length"),
        TokenUpdate(request_id="p#1", new_token_ids=[28]),
    ]))
    first = decode((await gateway_sub.next_msg(timeout=5)).data, GatewayStep)
    assert len(first.outputs) == 3 and sorted(service.requests) == ["live", "p#1"]
    await service.stop()
    aborted = decode((await abort_sub.next_msg(timeout=5)).data, AbortRequests)
    assert sorted(aborted.request_ids) == ["live", "p#1"]
    ended = decode((await gateway_sub.next_msg(timeout=5)).data, GatewayStep).outputs
    assert sorted((d.request_id, d.index) for d in ended) == [("live", 0), ("p", 1)]
    assert all(d.finished and d.finish_reason == "error" and d.error.code == "request_lost" for d in ended)
    await gateway_sub.unsubscribe()
    await abort_sub.unsubscribe()


async def test_detokenizer_one_message_per_gateway(env):
    tok = env.tokenizer
    a, b = f"gwa-{uuid.uuid4().hex[:6]}", f"gwb-{uuid.uuid4().hex[:6]}"
    texts = {"m1": "Hello world", "m2": "Second one", "m3": "Third"}
    gateways = {"m1": a, "m2": a, "m3": b}
    step = DetokStep(
        new_requests=[DetokNewRequest(request_id=r, gateway_id=g, prompt_tail_ids=[], num_prompt_tokens=1)
                      for r, g in gateways.items()],
        updates=[TokenUpdate(request_id=r, new_token_ids=tok(t)["input_ids"], finish_reason="length")
                 for r, t in texts.items()],
    )
    out, _, pending, _ = await detok_round(env, step, [a, b])
    assert pending == {a: 0, b: 0}
    assert {d.request_id: d.text for d in out[a].outputs} == {"m1": "Hello world", "m2": "Second one"}
    assert [(d.request_id, d.text, d.finish_reason) for d in out[b].outputs] == [("m3", "Third", "length")]


async def test_detokenizer_stop_string_finishes_and_aborts(env):
    tok = env.tokenizer
    ids = tok("The quick brown fox jumps over the lazy dog")["input_ids"]
    gw = f"gw-{uuid.uuid4().hex[:6]}"
    step = DetokStep(
        new_requests=[DetokNewRequest(request_id="s1", gateway_id=gw, prompt_tail_ids=[], num_prompt_tokens=3,
                                      params=DetokenizeParams(stop=["lazy", "own fo"])),
                      DetokNewRequest(request_id="s2", gateway_id=gw, prompt_tail_ids=[], num_prompt_tokens=3)],
        updates=[TokenUpdate(request_id="s1", new_token_ids=ids[:3]),
                 TokenUpdate(request_id="s2", new_token_ids=ids[:1])],
    )
    out, _, _, abort_pending = await detok_round(env, step, [gw])
    assert [d.text for d in out[gw].outputs] == ["The quick br", "The"]  # "own" held back
    assert abort_pending == 0
    step = DetokStep(updates=[TokenUpdate(request_id="s1", new_token_ids=ids[3:6])])
    out, aborted, _, _ = await detok_round(env, step, [gw], abort=True)
    (delta,) = out[gw].outputs
    assert delta.text == "" and delta.finished and delta.finish_reason == "stop" and delta.stop_reason == "own fo"
    assert delta.token_ids == ids[3:4] and delta.num_output_tokens == 4  # consumed up to " fox"
    assert aborted == AbortRequests(request_ids=["s1"], reason="stop")
    # the scheduler's late update for s1 is ignored; s2 goes on
    step = DetokStep(updates=[TokenUpdate(request_id="s1", new_token_ids=ids[6:7], finish_reason="abort"),
                              TokenUpdate(request_id="s2", new_token_ids=ids[1:2])])
    out, _, _, abort_pending = await detok_round(env, step, [gw])
    assert [(d.request_id, d.text) for d in out[gw].outputs] == [("s2", " quick")]
    assert abort_pending == 0


async def test_a_released_request_is_dropped_without_output(env):
    """A request the scheduler ended (aborted, failed) is released: its state goes, nothing is
    sent to its gateway, and a late update for it is not taken for a lost request."""
    gw = f"gw-{uuid.uuid4().hex[:6]}"
    step = DetokStep(
        new_requests=[DetokNewRequest(request_id="rel", gateway_id=gw, prompt_tail_ids=[], num_prompt_tokens=3)],
        updates=[TokenUpdate(request_id="rel", new_token_ids=[28])],
    )
    await detok_round(env, step, [gw])
    out, aborts, fails = await detok_steps(env, [DetokStep(released=["rel"]), DetokStep(updates=[
        TokenUpdate(request_id="rel", new_token_ids=[29])])], [gw])
    assert out == {gw: []} and aborts == [] and fails == []


async def test_an_update_for_a_request_never_registered_here_fails_it(env):
    """A detokenizer that replaced one that died never got the requests' first outputs: an
    update for such a request asks the scheduler to fail it (503 request_lost; the scheduler
    knows its gateway). A finished request's late update and an unknown request's last update
    are ignored."""
    gw = f"gw-{uuid.uuid4().hex[:6]}"
    step = DetokStep(
        new_requests=[DetokNewRequest(request_id="f1", gateway_id=gw, prompt_tail_ids=[], num_prompt_tokens=3)],
        updates=[TokenUpdate(request_id="f1", new_token_ids=[28], finish_reason="length")],
    )
    await detok_round(env, step, [gw])
    step = DetokStep(updates=[TokenUpdate(request_id="f1", new_token_ids=[28]),  # finished here
                              TokenUpdate(request_id="ghost", new_token_ids=[28, 29]),
                              TokenUpdate(request_id="ghost-last", new_token_ids=[28], finish_reason="length")])
    later = DetokStep(updates=[TokenUpdate(request_id="ghost", new_token_ids=[30])])  # reported once
    _, aborts, (lost, *more) = await detok_steps(env, [step, later], [])
    assert more == [] and aborts == []
    assert lost.request_ids == ["ghost"]
    assert lost.error.code == "request_lost" and lost.error.status == 503


async def test_a_second_scheduler_or_detokenizer_of_a_shard_is_refused(env, nats_url, tmp_path):
    """Two schedulers, or two detokenizers of one shard, on one NATS would both act on every
    message (doubled, garbled text): the second one refuses to start. Another shard starts."""
    from services.scheduler.service import SchedulerService
    from shared.pings import ServiceConflictError

    settings = Settings(model=str(env.info.path), served_model_name=env.info.name, nats_url=nats_url,
                        cache_dir=tmp_path, max_model_len=MAX_MODEL_LEN)
    duplicate = DetokenizerService(settings, env.info)
    duplicate.tokenizer = env.tokenizer
    with pytest.raises(ServiceConflictError, match="detokenizer of shard 0"):
        await duplicate.start()
    await duplicate.stop()
    other_shard = DetokenizerService(settings.model_copy(update={"detokenizer_shard": 1}), env.info)
    other_shard.tokenizer = env.tokenizer
    await other_shard.start()
    await other_shard.stop()

    first, second = SchedulerService(settings, env.info), SchedulerService(settings, env.info)
    await first.start()
    try:
        with pytest.raises(ServiceConflictError, match="another scheduler already serves"):
            await second.start()
    finally:
        await second.stop()
        await first.stop()
