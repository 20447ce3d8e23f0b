"""Every message between services (subjects in shared/subjects.py; encoding in shared/bus.py).

Flow of one request (its ``RequestSpec``, built at the edge, travels whole to the scheduler):
  gateway/LLM --TokenizeRequest{spec}--> tokenizer --SubmitRequest{spec}--> scheduler
  scheduler --CompileGrammar--> executor group --GrammarReady--> scheduler (structured outputs)
  scheduler --StepPlan--> executor group --StepResult--> scheduler
  scheduler --DetokStep--> detokenizer shard --GatewayStep--> gateway/LLM
  gateway/detokenizer --AbortRequests--> scheduler
  detokenizer --FailRequests--> scheduler
A prompt's token ids cross each hop once; per step only changes travel (vLLM V1's
``SchedulerOutput`` style: new requests in full, then appended block ids and counts).

Modules: ``common`` (the pydantic base ``Message``, the msgspec base ``Record``,
``ServiceError``, limits, ``decoding``), ``request`` (``RequestSpec``), ``sampling``
(``SamplingParams``, ``DetokenizeParams``), ``structured_outputs``, ``control`` (request/reply
and control messages) and ``steps`` (the four per-step messages and their parts, msgspec
structs). Import from here.
"""

from shared.messages.common import (
    GREEDY_TEMPERATURE,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    FinishReason,
    Message,
    Record,
    ServiceError,
    decoding,
)
from shared.messages.control import (
    AbortRequests,
    CompileGrammar,
    FailRequests,
    GrammarReady,
    GroupStats,
    Heartbeat,
    HeartbeatAck,
    Ping,
    Pong,
    RegisterAck,
    RegisterGroup,
    RequestsKnown,
    RequestsQuery,
    SchedulerStarted,
    SchedulerStats,
    StatsQuery,
    SubmitRequest,
    TokenizeReply,
    TokenizeRequest,
)
from shared.messages.request import RequestSpec
from shared.messages.sampling import DetokenizeParams, SamplingParams
from shared.messages.steps import (
    BeamForks,
    CachedRequests,
    DecodedLogprobs,
    DetokNewRequest,
    DetokStep,
    GatewayStep,
    NewRequestData,
    PromptLogprobs,
    RequestDelta,
    SampleLogprobs,
    StepMessage,
    StepPlan,
    StepResult,
    TokenLogprob,
    TokenUpdate,
)
from shared.messages.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "GREEDY_TEMPERATURE", "INT64_MAX", "INT64_MIN", "MAX_LOGPROBS", "MAX_N", "AbortRequests", "BeamForks",
    "CachedRequests", "CompileGrammar", "DecodedLogprobs", "DetokNewRequest", "DetokenizeParams", "DetokStep", "FailRequests", "FinishReason",
    "GatewayStep", "GrammarReady", "GuidedDecodingParams", "GroupStats", "Heartbeat", "HeartbeatAck", "Message", "NewRequestData", "Ping", "Pong",
    "PromptLogprobs", "Record", "RegisterAck", "RegisterGroup", "RequestDelta", "RequestSpec", "RequestsKnown", "RequestsQuery",
    "SampleLogprobs", "SamplingParams", "SchedulerStarted", "SchedulerStats", "ServiceError", "StatsQuery", "StepMessage",
    "StepPlan", "StructuredOutputsParams", "StepResult", "SubmitRequest", "TokenLogprob", "TokenUpdate", "TokenizeReply",
    "TokenizeRequest", "decoding",
]
