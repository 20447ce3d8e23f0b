"""Structured outputs end to end on SmolLM2-135M at temperature 1: offline through ``LLM`` and
over HTTP with the openai SDK, on one engine (a gateway in front of the ``LLM``'s services on
the session's NATS). The pool is small enough that the batches below preempt, so every
output here also went through recompute (the matchers replayed)."""

from __future__ import annotations

import json
import re
import threading
import uuid

import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio

from gateway.service import GatewayService
from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from services.executor.structured_output import StructuredOutputManager
from services.scheduler.scheduler import Scheduler
from shared.config import Settings
from shared.model_source import load_model_info

ASK = [{"role": "user", "content": "Describe a user of our shop as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "address"], "additionalProperties": False,
}
SCHEMAS = [
    PERSON,  # nested objects, a string pattern
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green"]},
                                               "minItems": 2, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},  # array bounds, enum
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}},
     "required": ["v"], "additionalProperties": False},  # anyOf
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"], "additionalProperties": False},  # $ref
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {"enum": ["alpha", "beta", 3]},
]


@pytest.fixture(scope="module")
def engine(nats_url, smollm2_path):
    """``(LLM, Settings)``: the engine on the session's NATS server, 20 blocks of 16 tokens."""
    name = f"so-{uuid.uuid4().hex[:8]}"
    with LLM(model=str(smollm2_path), dtype="float32", nats_url=nats_url, served_model_name=name,
             num_gpu_blocks_override=20, max_model_len=1024, seed=0) as llm:
        yield llm, Settings(model=str(smollm2_path), served_model_name=name, nats_url=nats_url, host="127.0.0.1",
                            port=0, max_model_len=1024)


@pytest_asyncio.fixture(scope="module")
async def client(engine):
    """An openai SDK client of a gateway in front of ``engine``."""
    _, settings = engine
    service = GatewayService(settings, load_model_info(settings))
    await service.start()
    oai = openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key="x", max_retries=0, timeout=120)
    yield oai, settings.served_model_name
    await oai.close()
    await service.stop()


def test_json_schemas_validate_with_n_and_preemption(engine):
    llm, _ = engine
    before = llm.stats().num_preemptions
    params = [SamplingParams(temperature=1.0, seed=10 + i, n=2 if i < 3 else 1, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i, schema in enumerate(SCHEMAS)]
    outs = llm.chat([ASK] * len(SCHEMAS), params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
    assert llm.stats().num_preemptions > before  # 9 samples in 320 slots


def test_regex_choice_grammars_json_object(engine):
    llm, _ = engine
    choices = ["yes", "no", "it depends"]
    kinds = [
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),  # EBNF: xgrammar
        StructuredOutputsParams(grammar='start: "ok" | "not " WORD\nWORD: /[a-z]{1,6}/'),  # Lark: llguidance
        StructuredOutputsParams(json_object=True),
    ]
    params = [SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=120, structured_outputs=k) for k in kinds]
    outs = llm.generate(["The answer is"] * len(kinds), params, use_tqdm=False)
    texts = [[c.text for c in o.outputs] for o in outs]
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs), texts
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in texts[0]), texts[0]
    assert all(t in choices for t in texts[1]), texts[1]
    assert all(re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t) for t in texts[2]), texts[2]
    assert all(re.fullmatch(r"ok|not [a-z]{1,6}", t) for t in texts[3]), texts[3]
    assert all(isinstance(json.loads(t), dict) for t in texts[4]), texts[4]


def test_a_slow_grammar_compile_does_not_hold_up_other_requests(engine, monkeypatch):
    """Issue 21 (vLLM V1's WAITING_FOR_FSM): the executor compiles a new grammar off the step
    loop and the scheduler admits its request only once it is compiled; an unconstrained
    request sent with it runs meanwhile. Here the executor's compile is held until that request
    has finished: were the compile on the step loop, it never would (the hold gives up after
    30 s and the test fails)."""
    llm, _ = engine
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], free, use_tqdm=False)[0].outputs[0]
    free_done, events = threading.Event(), []
    finish, compile_ = Scheduler._finish, StructuredOutputManager._compile

    def finishing(self, req):
        finish(self, req)
        if req.sampling_params.structured_outputs is None:
            events.append("free finished")
            free_done.set()

    def slow_compile(self, params):
        events.append(("compiled", free_done.wait(30)))
        return compile_(self, params)

    monkeypatch.setattr(Scheduler, "_finish", finishing)
    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    regex = r"[0-9]{4}-[a-f]{3}"  # a spec no other test uses
    outs = llm.generate(["Serial number:", "Once upon a time"],
                        [SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                        structured_outputs=StructuredOutputsParams(regex=regex)), free],
                        use_tqdm=False)
    assert re.fullmatch(regex, outs[0].outputs[0].text), outs[0].outputs[0].text
    assert outs[1].outputs[0].token_ids == alone.token_ids and len(alone.token_ids) == 8
    assert events[0] == "free finished" and events[1] == ("compiled", True), events


def test_logprobs_stay_raw(engine):
    """A choice the model would never pick: its token is forced, its log probability is the
    raw distribution's (rank > 1), not the masked one's (0)."""
    llm, _ = engine
    out = llm.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=8, logprobs=1, structured_outputs=StructuredOutputsParams(choice=["zebra"])),
        use_tqdm=False)[0].outputs[0]
    assert out.text == "zebra"
    first = out.logprobs[0][out.token_ids[0]]
    assert first.rank > 1 and first.logprob < -1


def test_bad_spec_offline_names_field(engine):
    llm, _ = engine
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")), use_tqdm=False)


class Town(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int
    coastal: bool


async def test_sdk_parse_with_pydantic_model(client):
    oai, model = client
    parse = oai.beta.chat.completions.parse if hasattr(oai.beta, "chat") else oai.chat.completions.parse
    completion = await parse(model=model, messages=[{"role": "user", "content": "Describe a town."}],
                             response_format=Town, temperature=1.0, seed=3, max_tokens=120)
    town = completion.choices[0].message.parsed
    assert isinstance(town, Town), completion.choices[0].message.content


async def test_http_fields_stream_and_n(client):
    oai, model = client
    schema = SCHEMAS[1]
    stream = await oai.chat.completions.create(
        model=model, messages=ASK, stream=True, n=2, temperature=1.0, seed=5, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": schema, "strict": True}})
    texts = ["", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    done = await oai.completions.create(model=model, prompt="Numbers:", temperature=1.0, seed=2, max_tokens=20,
                                        extra_body={"guided_regex": r"[0-9]{2}(,[0-9]{2}){2}"})
    assert re.fullmatch(r"[0-9]{2}(,[0-9]{2}){2}", done.choices[0].text)
    done = await oai.completions.create(model=model, prompt="Pick:", temperature=1.0, seed=2, max_tokens=20,
                                        extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert done.choices[0].text in ("left", "right")
    done = await oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Reply with an empty JSON object."}], temperature=1.0,
        seed=2, max_tokens=200, response_format={"type": "json_object"})
    assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
    assert isinstance(json.loads(done.choices[0].message.content), dict)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_regex": "a(?=b)"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
async def test_bad_specs_are_400_naming_the_field(client, extra, param):
    oai, model = client
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
