"""The folding of engine deltas into OpenAI chunks and responses (``gateway/generation.py``,
``gateway/completion.py``, ``gateway/chat.py``) and into the offline ``LLM``'s
``RequestOutput``, with no NATS: requests are validated as the endpoints validate them, the
fake engine of ``gateway_fakes.py`` answers, and its deltas are folded directly (a batch's
streams merged one step of each prompt in turn)."""

from __future__ import annotations

import json
from itertools import zip_longest
from typing import Any

import msgspec
import pytest
from gateway_fakes import ANSWER, FULL, PROMPT, answer_steps, fake_logprobs, fake_tokenize

from gateway.completion import completion_logprobs
from gateway.errors import APIError
from gateway.generation import Generation, RequestState
from gateway.protocol.requests import ChatCompletionRequest, CompletionRequest
from gateway.serving import engine_requests, new_generation
from pagedllm.outputs import Logprob, request_output
from shared.messages import DecodedLogprobs, RequestDelta, SamplingParams, ServiceError, TokenLogprob

MODEL = "fake-model"


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """What the engine is asked for (the endpoint's mapping of ``body``)."""
    return _request(body).sampling_params()


def _request(body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    return (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)


def begin(body: dict[str, Any]) -> tuple[Generation, list[RequestDelta]]:
    """As ``OpenAIServing.begin`` in front of the fake engine: the request's generation and
    the deltas its engine requests send, in the order they come."""
    request = _request(body)
    params = request.sampling_params()
    request_id, engine_ids, inputs = engine_requests(request)
    prompts, steps = [], []
    for engine_id, fields in zip(engine_ids, inputs, strict=True):
        text, reply = fake_tokenize(fields.get("prompt"), fields.get("messages"),
                                    fields.get("return_prompt", False))
        prompts.append((engine_id, reply))
        steps.append(answer_steps(engine_id, text, len(reply.prompt_token_ids), params))
    gen = new_generation(request, request_id, MODEL, prompts)
    return gen, [d for row in zip_longest(*steps, fillvalue=[]) for step in row for d in step]


def stream_deltas(gen: Generation, deltas: list[RequestDelta]) -> list[dict[str, Any]]:
    """The chunks of a stream, as its SSE ``data:`` lines carry them."""
    chunks = gen.first_chunks()
    for delta in deltas:
        chunks += gen.chunks(delta)
    chunks += gen.last_chunks()
    return [json.loads(gen.dump_json(chunk)) for chunk in chunks]


def stream(body: dict[str, Any]) -> list[dict[str, Any]]:
    return stream_deltas(*begin({**body, "stream": True}))


def respond(body: dict[str, Any]) -> dict[str, Any]:
    """The whole response, as the JSON body carries it."""
    gen, deltas = begin(body)
    for delta in deltas:
        gen.update(delta)
    assert gen.finished
    return gen.response().model_dump(mode="json")


def test_completion_stream_equals_non_stream():
    full = respond({"prompt": PROMPT, "max_tokens": 20})
    chunks = stream({"prompt": PROMPT, "max_tokens": 20, "stream_options": {"include_usage": True}})
    text_chunks = [c for c in chunks if c["choices"]]
    assert len(text_chunks) == len(ANSWER)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == full["choices"][0]["text"] == FULL
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * 5 + ["stop"]
    assert all(c["usage"] is None for c in text_chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 12
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert full["object"] == "text_completion" and full["model"] == MODEL
    assert (full["usage"]["prompt_tokens"], full["usage"]["completion_tokens"]) == (6, 6)


def test_a_batch_of_prompts_gives_n_choices_per_prompt_with_echo():
    """A list of prompts is one engine request each: choice p * n + i is sample i of prompt
    p, usage sums the prompts, streamed and not; echo starts each choice with its prompt."""
    prompts = ["one two", "three four five", "six seven"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "echo": True}
    out = respond(body)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [p + "The capital of" for p in prompts for _ in range(2)]
    assert out["usage"] == {"prompt_tokens": 2 + 3 + 2, "completion_tokens": 3 * 6, "total_tokens": 25,
                            "prompt_tokens_details": None}
    events = stream({**body, "stream_options": {"include_usage": True}})
    texts = ["" for _ in range(6)]
    for event in events[:-1]:
        assert event["id"] == events[0]["id"] and len(event["choices"]) == 1
        texts[event["choices"][0]["index"]] += event["choices"][0]["text"]
    assert texts == [c["text"] for c in out["choices"]] and events[-1]["usage"] == out["usage"]
    ids = respond({"prompt": [[5, 6], [7]], "max_tokens": 1})
    assert [c["text"] for c in ids["choices"]] == ["The", "The"] and ids["usage"]["prompt_tokens"] == 3


def test_continuous_usage_stats_put_the_usage_in_every_chunk():
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far of
    its own choice (its prompt's tokens, its own output); the last chunk the whole usage."""
    events = stream({"prompt": ["one two", "three four five"], "n": 2, "max_tokens": 3,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    seen = [0, 0, 0, 0]
    for event in events[:-1]:
        index = event["choices"][0]["index"]
        seen[index] += 1
        assert event["usage"]["completion_tokens"] == seen[index]
        assert event["usage"]["prompt_tokens"] == (2 if index < 2 else 3)
    assert seen == [3, 3, 3, 3] and events[-1]["usage"]["completion_tokens"] == 12


def test_a_chat_stream_starts_with_the_role_and_ends_with_the_usage():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    out = respond({"messages": messages})
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": FULL, "refusal": None, "tool_calls": []}
    assert out["choices"][0]["finish_reason"] == "stop"
    assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"], out["usage"]["total_tokens"]) == (6, 6, 12)
    chunks = stream({"messages": messages, "stream_options": {"include_usage": True}})
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == FULL
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" not in c for c in stream({"messages": messages}))  # no include_usage: no usage key


def test_chat_logprobs_as_openai_shapes_them():
    """``logprobs`` with ``top_logprobs``: one entry per generated token (text, log probability,
    bytes, the most likely tokens), whole in the response and per token in the stream; the
    engine asked for ``top_logprobs`` alternatives; -inf is reported as -9999 (JSON has no
    infinity). Without ``logprobs`` the choice's logprobs is null."""
    messages = [{"role": "user", "content": PROMPT}]
    body = {"messages": messages, "logprobs": True, "top_logprobs": 2}
    assert sampling_params(body).logprobs == 2
    r = respond(body)
    content = r["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ANSWER and r["choices"][0]["message"]["content"] == FULL
    assert [t["logprob"] for t in content] == [-9999.0] + [-i / 10 for i in range(1, len(ANSWER))]
    assert [bytes(t["bytes"]) for t in content] == [a.encode() for a in ANSWER]
    assert all([(x["token"], x["logprob"]) for x in t["top_logprobs"]] == [("alt0", -1.0), ("alt1", -2.0)]
               for t in content)

    body = {"messages": messages, "logprobs": True, "max_tokens": 3}
    assert sampling_params(body).logprobs == 0
    content = respond(body)["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["top_logprobs"]) for t in content] == [(a, []) for a in ANSWER[:3]]

    chunks = stream({"messages": messages, "logprobs": True, "top_logprobs": 1})
    streamed = [t for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]
                for t in chunk["choices"][0]["logprobs"]["content"]]
    assert [(t["token"], [x["token"] for x in t["top_logprobs"]]) for t in streamed] == [(a, ["alt0"]) for a in ANSWER]

    r = respond({"messages": messages})
    assert r["choices"][0]["logprobs"] is None and sampling_params({"messages": messages}).logprobs is None


def test_completion_logprobs_as_openai_shapes_them():
    """Completions' legacy shape: tokens, token_logprobs, text_offset (cumulative over the
    token texts, continued across stream chunks) and, per token, the sampled and the
    ``logprobs`` most likely tokens by text."""
    offsets = [sum(len(a) for a in ANSWER[:i]) for i in range(len(ANSWER))]
    choice = respond({"prompt": PROMPT, "logprobs": 1})["choices"][0]
    assert choice["text"] == FULL
    assert choice["logprobs"] == {
        "tokens": ANSWER,
        "token_logprobs": [-9999.0] + [-i / 10 for i in range(1, len(ANSWER))],
        "text_offset": offsets,
        "top_logprobs": [{a: (-i / 10 if i else -9999.0), "alt0": -1.0} for i, a in enumerate(ANSWER)],
    }
    chunks = [c["choices"][0]["logprobs"] for c in stream({"prompt": PROMPT, "logprobs": 0})
              if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t for lp in chunks for t in lp["tokens"]] == ANSWER
    assert [o for lp in chunks for o in lp["text_offset"]] == offsets
    assert [d for lp in chunks for d in lp["top_logprobs"]] == [{a: (-i / 10 if i else -9999.0)}
                                                                for i, a in enumerate(ANSWER)]
    assert respond({"prompt": PROMPT})["choices"][0]["logprobs"] is None


def test_echo_with_logprobs_scores_the_prompt():
    """``echo`` with ``logprobs`` puts the prompt tokens' log probabilities first (the first
    token's null), then the completion's, with text offsets running over the echoed text; with
    ``max_tokens`` 0 the prompt alone comes back, no completion token counted (how
    lm-evaluation-harness scores a text). Streamed, the echo waits for the prompt's log
    probabilities and the completion's offsets go on after it."""
    words = [w if i == 0 else " " + w for i, w in enumerate(PROMPT.split())]
    offsets = [sum(len(t) for t in (words + ANSWER)[:i]) for i in range(len(words) + len(ANSWER))]
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1}
    sent = sampling_params(body)
    assert (sent.logprobs, sent.prompt_logprobs, sent.max_tokens) == (1, 1, 16)
    out = respond(body)
    lp = out["choices"][0]["logprobs"]
    assert out["choices"][0]["text"] == PROMPT + FULL
    assert lp["tokens"] == words + ANSWER and lp["text_offset"] == offsets
    assert lp["token_logprobs"][:len(words)] == [None] + [-float(i) for i in range(1, len(words))]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {" is": -1.0, "alt0": -10.0}

    body = {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    assert sampling_params(body).max_tokens == 1  # the engine generates one, unseen
    out = respond(body)
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"]) == (PROMPT, "length", 0)
    assert choice["logprobs"]["tokens"] == words and choice["logprobs"]["top_logprobs"][1] == {" is": -1.0}

    chunks = [c["choices"][0] for c in stream({"prompt": PROMPT, "echo": True, "logprobs": 0}) if c["choices"]]
    assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["tokens"] == words
    assert "".join(c["text"] for c in chunks) == PROMPT + FULL
    assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets


@pytest.mark.parametrize("held", [1, 2])
def test_streamed_echo_of_n_samples_waits_for_the_prompt_logprobs(held):
    """With n=2 the prompt's log probabilities come with sample 0's first delta; when sample 1's
    come first (another detokenizer shard; ``held`` of them), its echo waits for them: both
    choices stream the prompt with its log probabilities, then their text, offsets going on
    after the prompt (each delta its own offset, however many waited)."""
    prompt = "children first please"
    words = ["children", " first", " please"]
    gen, deltas = begin({"prompt": prompt, "echo": True, "logprobs": 0, "n": 2, "max_tokens": 2, "stream": True})
    assert [d.index for d in deltas] == [1, 0, 1, 0]  # "children first": the fake engine's order
    if held == 2:
        deltas = [deltas[0], deltas[2], deltas[1], deltas[3]]
    chunks = [c["choices"][0] for c in stream_deltas(gen, deltas) if c["choices"]]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["text"] == prompt and mine[0]["logprobs"]["tokens"] == words
        assert mine[0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
        assert "".join(c["text"] for c in mine) == prompt + "".join(ANSWER[:2])
        assert [o for c in mine for o in c["logprobs"]["text_offset"]] == [0, 8, 14, 21, 24]


def test_completion_top_logprobs_keep_the_likeliest_of_tokens_with_one_text():
    """Tokens holding parts of characters all read U+FFFD: in a completion's top_logprobs (keyed
    by text) the likeliest of them stays, so its maximum is the true one (a sampled byte token
    first used to hide a likelier one); return_tokens_as_token_ids keeps them apart."""

    def tok(token_id: int, logprob: float, rank: int) -> TokenLogprob:
        return TokenLogprob(token_id=token_id, token="\ufffd", bytes=bytes([0xE4 + rank]), logprob=logprob, rank=rank)

    items = [DecodedLogprobs(sampled=tok(7, -5.5, 3), top=[tok(8, -2.8, 1), tok(9, -3.0, 2)])]
    out = completion_logprobs(items, 0)
    assert out.tokens == ["\ufffd"] and out.token_logprobs == [-5.5] and out.top_logprobs == [{"\ufffd": -2.8}]
    out = completion_logprobs(items, 0, as_ids=True)
    assert out.tokens == ["token_id:7"]
    assert out.top_logprobs == [{"token_id:7": -5.5, "token_id:8": -2.8, "token_id:9": -3.0}]


def test_return_tokens_as_token_ids_names_tokens_by_id():
    body = {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 1,
            "max_tokens": 2, "return_tokens_as_token_ids": True}
    content = respond(body)["choices"][0]["logprobs"]["content"]
    assert [(t["token"], [x["token"] for x in t["top_logprobs"]]) for t in content] == [
        ("token_id:100", ["token_id:900"]), ("token_id:101", ["token_id:900"])]
    out = respond({"prompt": PROMPT, "logprobs": 0, "max_tokens": 2, "return_tokens_as_token_ids": True})
    assert out["choices"][0]["logprobs"]["tokens"] == ["token_id:100", "token_id:101"]


def test_an_engine_error_ends_its_prompt_and_names_it_in_a_batch():
    """An error delta raises the error with its status (naming the prompt of a batch) and
    ends that prompt's samples; a finish_reason "error" without one is a 500."""
    gen, deltas = begin({"prompt": ["one two", "three four"], "max_tokens": 2})
    gen.update(deltas[0])
    error = ServiceError(message="executor group g0 failed", type="internal_error", status=500)
    with pytest.raises(APIError) as exc:
        gen.update(RequestDelta(request_id=gen.engine_ids[1], finished=True, finish_reason="error",
                                error=error))
    assert exc.value.status == 500
    assert exc.value.body() == {"error": {"message": "prompt 1 of the batch: executor group g0 failed",
                                          "type": "internal_error", "param": None, "code": None}}
    assert gen.unfinished_ids() == [gen.engine_ids[0]] and not gen.finished
    gen, _ = begin({"prompt": "one two"})
    with pytest.raises(APIError) as exc:
        gen.update(RequestDelta(request_id=gen.request_id, finished=True, finish_reason="error"))
    assert exc.value.status == 500 and exc.value.info()["message"] == "the engine failed while generating this request"
    assert exc.value.info()["type"] == "server_error" and gen.finished


def test_the_offline_llm_folds_the_same_deltas_into_vllm_shapes():
    """``LLM.generate``'s ``RequestOutput``: per sample the text, token ids, one dict of
    ``Logprob``s per token (sampled first, then the likeliest; a sampled token among them is
    not repeated) and their sum; the prompt's with None first; the prompt's cached tokens."""
    params = SamplingParams(n=2, max_tokens=3, logprobs=1, prompt_logprobs=1)
    state = RequestState.new(params.n)
    for step in answer_steps("llm-1", PROMPT, 6, params):
        for delta in step:
            state.add(msgspec.structs.replace(delta, num_cached_tokens=4 if delta.index else 2))
    out = request_output("llm-1", state, PROMPT, list(range(6)), logprobs=True)
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == ("llm-1", PROMPT, list(range(6)), True)
    assert out.num_cached_tokens == 4
    for i, sample in enumerate(out.outputs):
        assert (sample.index, sample.text, sample.token_ids) == (i, "The capital of", [100, 101, 102])
        assert (sample.finish_reason, sample.stop_reason) == ("length", None)
        assert sample.logprobs[1] == {101: Logprob(-0.1, 1, " capital"), 900: Logprob(-1.0, 1, "alt0")}
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 6
    assert out.prompt_logprobs[1] == {1: Logprob(-1.0, 1, " is"), 900: Logprob(-10.0, 1, "alt0")}

    state = RequestState.new()
    state.add(RequestDelta(request_id="llm-2", text="Hi", token_ids=[5], logprobs=[fake_logprobs(1, "Hi", 0)]))
    state.add(RequestDelta(request_id="llm-2", text=" you", token_ids=[6], logprobs=[fake_logprobs(2, " you", 0)],
                           finished=True, finish_reason="stop", stop_reason="\n"))
    sample = request_output("llm-2", state, None, [1], logprobs=True).outputs[0]
    assert sample.cumulative_logprob == -0.1 + -0.2 and sample.logprobs[1] == {102: Logprob(-0.2, 1, " you")}
    out = request_output("llm-2", state, None, [1], logprobs=False)
    sample = out.outputs[0]
    assert (sample.text, sample.token_ids, sample.logprobs, sample.cumulative_logprob) == ("Hi you", [5, 6], None, None)
    assert (sample.finish_reason, sample.stop_reason) == ("stop", "\n")
    assert out.prompt is None and out.prompt_logprobs is None and out.num_cached_tokens == 0
