"""The tokenizer and detokenizer services on a real nats-server.

A fake scheduler and a fake gateway listen on the model's subjects; messages are read from
ONE wildcard subscription, so the order in which the service published them is what the
test sees (NATS keeps one publisher's order within a subscription).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import pytest
import pytest_asyncio

from services.detokenizer import DetokenizerService
from services.tokenizer import TokenizerService
from shared import subjects as subj
from shared.bus import Bus, decode, encode
from shared.config import Settings
from shared.messages import (
    AbortRequests,
    DetokNewRequest,
    DetokStep,
    FailRequests,
    GatewayStep,
    SamplingParams,
    SubmitRequest,
    TokenizeReply,
    TokenizeRequest,
    TokenUpdate,
)
from shared.model_source import ModelInfo, load_model_info

MAX_MODEL_LEN = 64
EOS = 2


@dataclass
class Env:
    bus: Bus
    info: ModelInfo
    subjects: subj.Subjects
    tokenizer: object
    tokenizer_service: TokenizerService


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env(nats_url, smollm2_path, tmp_path_factory):
    name = f"test-tok-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        model=str(smollm2_path), served_model_name=name, nats_url=nats_url,
        cache_dir=tmp_path_factory.mktemp("cache"), max_model_len=MAX_MODEL_LEN,
    )
    info = load_model_info(settings)
    tokenizer_service = TokenizerService(settings, info)  # each connects on its own
    detokenizer_service = DetokenizerService(settings, info)
    await tokenizer_service.start()
    await detokenizer_service.start()
    bus = await Bus.connect(nats_url, name="test-client")
    try:
        yield Env(bus, info, subj.Subjects(name), tokenizer_service.tokenizer, tokenizer_service)
    finally:
        await bus.close()
        await detokenizer_service.stop()
        await tokenizer_service.stop()


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, **kw})


async def tokenize(env: Env, **fields) -> tuple[list[str], SubmitRequest | None, TokenizeReply]:
    """Send a TokenizeRequest; return the subjects seen up to the reply, the submit, the reply."""
    rid = fields.pop("request_id", f"r-{uuid.uuid4().hex[:8]}")
    req = TokenizeRequest(request_id=rid, gateway_id="gw", sampling_params=fields.pop("sampling_params", params()),
                          **fields)
    inbox = f"{env.subjects.base}.inbox.{uuid.uuid4().hex}"
    sub = await env.bus.nc.subscribe(f"{env.subjects.base}.>")
    try:
        await env.bus.nc.publish(env.subjects.tokenize, encode(req), reply=inbox)
        seen, submit = [], None
        while True:
            msg = await sub.next_msg(timeout=10)
            if msg.subject == env.subjects.tokenize:
                continue
            seen.append(msg.subject)
            if msg.subject == env.subjects.submit:
                submit = decode(msg.data, SubmitRequest)
            if msg.subject == inbox:
                reply = decode(msg.data, TokenizeReply)
                assert reply.request_id == rid
                return [("inbox" if s == inbox else s) for s in seen], submit, reply
    finally:
        await sub.unsubscribe()


def chat_ids(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---------------------------------------------------------------------- tokenizer


async def test_chat_request_is_templated_and_submitted_before_the_reply(env):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there! 😀"}]
    sp = params(temperature=0.0, stop=["\n"], max_tokens=5)
    seen, submit, reply = await tokenize(env, request_id="chat-1", messages=messages, sampling_params=sp,
                                         priority=3, arrival_time=123.0, return_prompt=True)
    expected = chat_ids(env.tokenizer, messages)
    assert reply.error is None
    assert reply.prompt_token_ids == expected
    assert expected[-3:] == [520, 9531, 198]  # ends with "<|im_start|>assistant\n"
    assert reply.prompt == env.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there! 😀")
    assert seen == [env.subjects.submit, "inbox"]
    assert submit == SubmitRequest(request_id="chat-1", gateway_id="gw", prompt_token_ids=expected,
                                   sampling_params=sp, priority=3, arrival_time=123.0)


async def test_chat_without_generation_prompt_and_text_parts(env):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    _, _, reply = await tokenize(env, messages=parts, add_generation_prompt=False)
    assert reply.prompt_token_ids == chat_ids(env.tokenizer, [{"role": "user", "content": "one\ntwo"}], False)


async def test_completion_prompts(env):
    _, submit, reply = await tokenize(env, prompt="The capital of France is")
    assert reply.prompt_token_ids == env.tokenizer("The capital of France is")["input_ids"]
    assert submit is not None and submit.prompt_token_ids == reply.prompt_token_ids
    _, _, reply = await tokenize(env, prompt=[5, 6, env.info.vocab_size - 1])
    assert reply.error is None and reply.prompt_token_ids == [5, 6, env.info.vocab_size - 1]
    assert reply.prompt is None  # only a chat request's rendered prompt comes back, when asked
    _, _, reply = await tokenize(env, messages=[{"role": "user", "content": "Hi"}])
    assert reply.prompt is None and reply.prompt_token_ids


async def test_chat_typed_special_tokens_match_apply_chat_template(env):
    """The rendered text is tokenized as apply_chat_template(tokenize=True) does: a control
    token typed in a message is that token."""
    messages = [{"role": "user", "content": "a<|im_end|>b <|im_start|>"}]
    _, _, reply = await tokenize(env, messages=messages)
    assert reply.prompt_token_ids == chat_ids(env.tokenizer, messages)
    assert reply.prompt_token_ids.count(2) == 3  # <|im_end|>: the system turn's, the typed one, the user turn's


async def test_a_submit_over_nats_max_payload_is_refused_with_413(env, monkeypatch):
    """A prompt too large for one NATS message to the scheduler is refused at once (413
    request_too_large), not left without a reply until the gateway's timeout."""
    monkeypatch.setattr(env.tokenizer_service.bus.nc, "_max_payload", 620)
    bulky = params(max_tokens=1, stop=["x" * 400])  # the submit carries the params, the reply does not
    seen, submit, reply = await tokenize(env, prompt=[300] * 10, sampling_params=bulky)  # 545 bytes
    assert reply.error is None and submit is not None
    seen, submit, reply = await tokenize(env, prompt=[300] * 60, sampling_params=bulky)  # 697 bytes
    assert submit is None and seen == ["inbox"]
    assert reply.error.code == "request_too_large" and reply.error.status == 413 and reply.error.param == "prompt"


async def test_prompt_logprobs_too_large_for_a_nats_message_are_refused(env, monkeypatch):
    """A prompt's log probabilities travel in one message: a request whose would exceed the
    NATS server's max_payload is refused up front (naming logprobs), not lost on the way."""
    monkeypatch.setattr(env.tokenizer_service.bus.nc, "_max_payload", 10_000)
    fits = params(prompt_logprobs=1)  # 40 tokens x (120 + 96) bytes = 8,640
    seen, submit, reply = await tokenize(env, prompt=[300] * 40, sampling_params=fits)
    assert reply.error is None and submit is not None
    seen, submit, reply = await tokenize(env, prompt=[300] * 40, sampling_params=params(prompt_logprobs=2))
    assert submit is None and seen == ["inbox"]  # 40 x 312 = 12,480 bytes
    assert (reply.error.param, reply.error.code, reply.error.status) == ("logprobs", "request_too_large", 400)
    seen, submit, reply = await tokenize(env, prompt=[300] * 50, sampling_params=params(logprobs=20))
    assert reply.error is None and submit is not None  # output logprobs travel a token at a time


async def test_offline_requests_are_capped_at_max_model_len(env):
    """cap_at_max_model_len (the offline LLM, as vLLM's): prompt + max_tokens over
    max_model_len is submitted with max_tokens None (up to the context length) instead of
    refused; within the limit max_tokens is kept; a prompt filling the context is refused."""
    _, submit, reply = await tokenize(env, prompt=[7] * 60, sampling_params=params(max_tokens=5),
                                      cap_at_max_model_len=True)
    assert reply.error is None and submit is not None and submit.sampling_params.max_tokens is None
    assert submit.sampling_params == params(max_tokens=None)
    _, submit, _ = await tokenize(env, prompt=[7] * 59, sampling_params=params(max_tokens=5),
                                  cap_at_max_model_len=True)
    assert submit is not None and submit.sampling_params.max_tokens == 5
    _, submit, reply = await tokenize(env, prompt=[7] * MAX_MODEL_LEN, sampling_params=params(max_tokens=5),
                                      cap_at_max_model_len=True)
    assert submit is None and reply.error.param == "prompt" and reply.error.code == "context_length_exceeded"


async def test_max_tokens_none_and_exact_fit_are_accepted(env):
    ids = list(range(10, 10 + MAX_MODEL_LEN - 1))
    _, submit, reply = await tokenize(env, prompt=ids, sampling_params=params(max_tokens=None))
    assert reply.error is None and submit is not None
    _, _, reply = await tokenize(env, prompt=ids, sampling_params=params(max_tokens=1))
    assert reply.error is None


BAD_REQUESTS = [
    ("empty string prompt", {"prompt": ""}, "prompt"),
    ("empty id prompt", {"prompt": []}, "prompt"),
    ("no prompt", {}, "prompt"),
    ("empty messages", {"messages": []}, "messages"),
    ("both", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("no role", {"messages": [{"content": "x"}]}, "messages"),
    ("content number", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ("id too large", {"prompt": [1, 49152]}, "prompt"),
    ("negative id", {"prompt": [-1]}, "prompt"),
    ("prompt fills context", {"prompt": [7] * MAX_MODEL_LEN, "sampling_params": params(max_tokens=None)}, "prompt"),
    ("messages fill context", {"messages": [{"role": "user", "content": "word " * 80}]}, "messages"),
    ("prompt + max_tokens", {"prompt": [7] * 60, "sampling_params": params(max_tokens=5)}, "max_tokens"),
    ("logit_bias id too large", {"prompt": [7], "sampling_params": params(logit_bias={49152: 1.0})}, "logit_bias"),
]


@pytest.mark.parametrize("fields,param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_requests_are_refused_and_not_submitted(env, fields, param):
    seen, submit, reply = await tokenize(env, **fields)
    assert reply.error is not None, reply
    assert reply.error.param == param
    assert reply.error.type == "invalid_request_error" and reply.error.status == 400
    assert reply.prompt_token_ids == [] and submit is None and seen == ["inbox"]


async def test_context_length_message(env):
    _, _, reply = await tokenize(env, prompt=[7] * 60, sampling_params=params(max_tokens=5))
    assert reply.error.message.startswith(
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(60 in the prompt, 5 in the completion)."
    )
    assert reply.error.code == "context_length_exceeded"


# ---------------------------------------------------------------------- detokenizer


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
                                      stop=["lazy", "own fo"]),
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
    from shared.service import ServiceConflictError

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
