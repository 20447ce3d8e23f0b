"""Structured output request fields -> ``StructuredOutputsParams`` (no server): OpenAI's
``response_format``, vLLM's ``structured_outputs`` and ``guided_*``, and the errors naming them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.protocol.requests import ChatCompletionRequest, CompletionRequest
from gateway.protocol.structured import name_structured_error
from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.sampling_params import GuidedDecodingParams
from pagedllm.sampling_params import StructuredOutputsParams as FromModule
from shared.bus import decode, encode
from shared.messages import NewRequestData, ServiceError

CHAT = {"messages": [{"role": "user", "content": "x"}]}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(("fields", "expected", "path"), [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA), "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+"), "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True), "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA), "guided_json"),
    ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+"), "guided_regex"),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"]), "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"'), "guided_grammar"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_fields_become_params(endpoint, fields, expected, path):
    body = (ChatCompletionRequest(**CHAT, **fields) if endpoint == "chat"
            else CompletionRequest(prompt="x", **fields))
    assert body.sampling_params().structured_outputs == expected
    assert body.structured_outputs_path == path


@pytest.mark.parametrize(("fields", "starts"), [
    ({"response_format": {"type": "xml"}}, "response_format: type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs: exactly one of"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs: jsn: Unexpected keyword"),
    ({"guided_choice": []}, "guided_choice: choice must hold"),
    ({"guided_json": "{not json"}, "guided_json: json is not valid JSON"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex: give one"),
])
def test_malformed_fields_are_named(fields, starts):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(**CHAT, **fields)
    message = info.value.errors()[0]["msg"].removeprefix("Value error, ")
    assert message.startswith(starts), message


def test_compile_error_renamed_after_the_request_field():
    error = ServiceError(message="structured_outputs.json: invalid (Unsupported type)", param="structured_outputs.json")
    renamed = name_structured_error(error, "response_format.json_schema.schema")
    assert renamed.param == "response_format"
    assert renamed.message == "response_format.json_schema.schema: invalid (Unsupported type)"
    assert name_structured_error(error, "structured_outputs.json").param == "structured_outputs"
    other = ServiceError(message="prompt is empty", param="prompt")
    assert name_structured_error(other, "guided_json") is other


def test_params_exactly_one_and_importable_as_vllm():
    assert FromModule is StructuredOutputsParams and GuidedDecodingParams is StructuredOutputsParams
    for bad in ({}, {"regex": "a", "grammar": "b"}, {"choice": ["a"], "json_object": True}):
        with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object"):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="structured_outputs.json_object must be true"):
        StructuredOutputsParams(json_object=False)
    # vLLM's older name; a dict is taken as the params
    assert SamplingParams(guided_decoding=GuidedDecodingParams(regex="a")).structured_outputs.regex == "a"
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]
    with pytest.raises(ValueError, match="guided_decoding and structured_outputs"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


def test_params_travel_in_a_step_plan():
    """The schema (a dict, its key order kept: properties are generated in that order) and a
    JSON string spec survive msgpack."""
    for so in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json='{"type": "string"}')):
        params = SamplingParams(structured_outputs=so)
        new = NewRequestData(request_id="r", prompt_token_ids=[1], sampling_params=params, block_ids=[0],
                             num_computed_tokens=0)
        back = decode(encode(new), NewRequestData).sampling_params.structured_outputs
        assert back == so and back.spec() == so.spec()
    assert list(decode(encode(NewRequestData(
        request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(structured_outputs=StructuredOutputsParams(
            json=SCHEMA)), block_ids=[0], num_computed_tokens=0)), NewRequestData)
        .sampling_params.structured_outputs.json["properties"]) == ["b", "a"]


def test_a_constraint_given_as_a_dict_is_checked_as_when_built():
    """A ``structured_outputs`` dict (or ``guided_decoding``) is built as ``StructuredOutputsParams``
    and checked, at construction and on assignment; a field of the wrong type is named."""
    for bad, message in (({"json": "{}", "regex": "x"}, "exactly one of"), ({}, "exactly one of"),
                         ({"json_object": False}, "json_object must be true"), ({"jsn": {}}, "jsn")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(structured_outputs=bad)
        with pytest.raises(ValueError, match=message):
            SamplingParams(guided_decoding=bad)
    params = SamplingParams(structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match="choice must hold"):
        params.structured_outputs = {"choice": []}
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="^temperature: Expected `float`"):
        SamplingParams(temperature="hot")
    with pytest.raises(ValueError, match="^regex: Expected `str | null`"):
        StructuredOutputsParams(regex=5)
