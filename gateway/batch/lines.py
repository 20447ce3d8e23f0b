"""One batch line through the gateway's ``OpenAIServing``, and output files: what the ``batch``
service and the offline ``pagedllm run-batch`` share."""

from __future__ import annotations

from pydantic import ValidationError

from gateway.batch.objects import BatchLineError, BatchRequestOutput, BatchResponse, new_id
from gateway.errors import APIError, validation_error
from gateway.protocol.requests import ChatCompletionRequest, CompletionRequest
from gateway.serving import OpenAIServing


async def run_line(serving: OpenAIServing, endpoint: str, custom_id: str, body: dict) -> tuple[BatchRequestOutput, bool]:
    """One batch line through ``serving`` as a non-streaming request: its output line and
    whether it succeeded (status 200). An invalid body or a refused request is the error
    body the endpoint would answer, with its status."""
    model = ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest
    request_id = new_id("batch_req")
    try:
        try:
            request = model.model_validate({**body, "stream": False})
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        served = await serving.begin(request)
        try:
            response = await serving.collect(served)
        finally:
            serving.finish(served)
    except APIError as exc:
        out = BatchRequestOutput(id=request_id, custom_id=custom_id,
                                 response=BatchResponse(status_code=exc.status, request_id=request_id, body=exc.body()),
                                 error=BatchLineError(code=exc.error.code or exc.error.type, message=exc.error.message))
        return out, False
    body_json = response.model_dump(mode="json")
    return BatchRequestOutput(id=request_id, custom_id=custom_id,
                              response=BatchResponse(status_code=200, request_id=body_json["id"], body=body_json)), True


def jsonl(outputs: list[BatchRequestOutput]) -> bytes:
    return "".join(o.model_dump_json() + "\n" for o in outputs).encode()
