"""The tokenizer service on a real nats-server (the detokenizer service's tests are in
tests/detokenizer/test_detokenizer_service.py).

A fake scheduler and a fake gateway listen on the model's subjects; messages are read from
ONE wildcard subscription, so the order in which the service published them is what the
test sees (NATS keeps one publisher's order within a subscription).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass

import pytest
import pytest_asyncio

from services.tokenizer import TokenizerService
from shared import subjects as subj
from shared.bus import Bus, decode, encode
from shared.messages import (
    RequestSpec,
    SamplingParams,
    StructuredOutputsParams,
    SubmitRequest,
    TokenizeReply,
    TokenizeRequest,
)
from shared.model_source import ModelInfo
from shared.structured_output import StructuredOutputError

MAX_MODEL_LEN = 64


@dataclass
class Env:
    bus: Bus
    info: ModelInfo
    subjects: subj.Subjects
    tokenizer: object
    tokenizer_service: TokenizerService


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env(nats_url, smollm2_served):
    settings, info = smollm2_served
    tokenizer_service = TokenizerService(settings, info)
    await tokenizer_service.start()
    bus = await Bus.connect(nats_url, name="test-client")
    try:
        yield Env(bus, info, subj.Subjects(info.name), tokenizer_service.tokenizer, tokenizer_service)
    finally:
        await bus.close()
        await tokenizer_service.stop()


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, **kw})


async def tokenize(env: Env, **fields) -> tuple[list[str], SubmitRequest | None, TokenizeReply]:
    """Send a TokenizeRequest; return the subjects seen up to the reply, the submit, the reply."""
    rid = fields.pop("request_id", f"r-{uuid.uuid4().hex[:8]}")
    spec = {name: fields.pop(name) for name in RequestSpec.__struct_fields__ if name in fields}
    req = TokenizeRequest(spec=RequestSpec(request_id=rid, gateway_id="gw", **{"sampling_params": params(), **spec}),
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
                assert submit is None or submit.spec.request_id == rid
                return [("inbox" if s == inbox else s) for s in seen], submit, reply
    finally:
        await sub.unsubscribe()


def chat_ids(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)



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
    assert submit == SubmitRequest(spec=RequestSpec(request_id="chat-1", gateway_id="gw", sampling_params=sp,
                                                    priority=3, arrival_time=123.0), prompt_token_ids=expected)


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
    assert reply.error is None and submit is not None and submit.spec.sampling_params.max_tokens is None
    assert submit.spec.sampling_params == params(max_tokens=None)
    _, submit, _ = await tokenize(env, prompt=[7] * 59, sampling_params=params(max_tokens=5),
                                  cap_at_max_model_len=True)
    assert submit is not None and submit.spec.sampling_params.max_tokens == 5
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
    ("schema that does not compile",
     {"prompt": [7], "sampling_params": params(structured_outputs=StructuredOutputsParams(json={"type": "strin"}))},
     "structured_outputs.json"),
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


async def test_a_slow_structured_output_compile_holds_up_no_other_request(env, monkeypatch):
    """A constraint still compiling (its own thread) while another request is tokenized and
    submitted; then the constrained request gets its answer."""
    release = threading.Event()

    class SlowBackend:
        def compile(self, spec):
            assert release.wait(30)
            raise StructuredOutputError("structured_outputs.regex: refused by the test", "structured_outputs.regex")

    monkeypatch.setattr(env.tokenizer_service, "_structured", SlowBackend())
    constrained = TokenizeRequest(spec=RequestSpec(request_id="slow", gateway_id="gw", sampling_params=params(
        structured_outputs=StructuredOutputsParams(regex="a+"))), prompt=[7])
    slow = asyncio.ensure_future(env.tokenizer_service.handle(constrained))
    try:
        seen, submit, reply = await tokenize(env, prompt="The capital of France is")
        assert reply.error is None and submit is not None and not slow.done()
    finally:
        release.set()
    reply = await slow
    assert reply.error is not None and reply.error.param == "structured_outputs.regex"
