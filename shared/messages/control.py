"""The control messages: requests, registrations, heartbeats, statistics and pings (none of
them is sent per step). Most are pydantic models, validated on decode; those that carry a
request's records (``TokenizeRequest``, ``SubmitRequest``, ``CompileGrammar``) are msgspec
records, checked where they are built and decoded with their types checked only."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shared.messages.common import FinishReason, Message, Record, ServiceError
from shared.messages.request import RequestSpec
from shared.messages.structured_outputs import StructuredOutputsParams

# ---------------------------------------------------------------- gateway -> tokenizer -> scheduler


class TokenizeRequest(Record):
    """A completion (``prompt``) or chat (``messages``) request, before tokenization: its
    ``spec``, forwarded to the scheduler as it is, and what the tokenizer needs to make its
    prompt token ids."""

    spec: RequestSpec
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    # chat: the tools the chat template gets (OpenAI's {"type": "function", "function": {...}})
    tools: list[dict[str, Any]] | None = None
    # chat: a Jinja chat template (its text) used instead of the server's (offline LLM.chat)
    chat_template: str | None = None
    # prompt + max_tokens may exceed max_model_len: the request then stops at max_model_len with
    # finish_reason "length" (vLLM's offline LLM); False: refused, as the OpenAI server does
    cap_at_max_model_len: bool = False
    return_prompt: bool = False  # reply with the prompt text (chat: as rendered; token ids: decoded)


class TokenizeReply(Message):
    """The tokenizer's answer to a ``TokenizeRequest``: accepted (and submitted to the
    scheduler) or an error."""

    error: ServiceError | None = None
    prompt_token_ids: list[int] = Field(default_factory=list)
    prompt: str | None = None  # the prompt text, when asked (return_prompt)


class SubmitRequest(Record):
    """A tokenized request, to the scheduler: its spec as the edge built it, and its prompt."""

    spec: RequestSpec
    prompt_token_ids: list[int]


class AbortRequests(Message):
    """Stop these requests and free their blocks (client gone, or stop string matched)."""

    request_ids: list[str]
    reason: FinishReason = "abort"


class FailRequests(Message):
    """End these requests with ``error`` (a detokenizer lost their state): the scheduler frees
    their blocks and sends the error to the gateway of each one it still holds (the sender does
    not know the gateways)."""

    request_ids: list[str]
    error: ServiceError


# ---------------------------------------------------------------- scheduler <-> executor


class RegisterGroup(Message):
    """An executor group announces itself (request/reply; answered by ``RegisterAck``). The
    scheduler refuses a group whose served ``model`` or ``max_model_len`` differs from its own."""

    group_id: str
    model: str  # the served model name
    num_blocks: int
    block_size: int  # tokens
    max_model_len: int


class RegisterAck(Message):
    group_id: str
    accepted: bool
    error: ServiceError | None = None
    # the first step id planned for this registration: a re-registering executor drops the
    # plans of its previous registration still queued (async scheduling keeps two in flight)
    next_step_id: int = 0


class Heartbeat(Message):
    """An executor group is alive (request/reply: answered by ``HeartbeatAck``).

    ``idle``: no plan is queued or running on the executor; ``last_step_id``: the newest plan
    it has received. An idle executor that never received the scheduler's oldest step in
    flight, in two heartbeats in a row with the step sent before the first, lost its plan; one
    that received it lost its result if the scheduler has not had it for
    ``heartbeat_timeout_s`` (a NATS reconnect drops messages in transit). The scheduler then
    drops the group, which registers again. ``stopping``: the executor is shutting down; its
    requests go elsewhere now.
    """

    group_id: str
    idle: bool = False
    last_step_id: int = 0
    stopping: bool = False


class HeartbeatAck(Message):
    """``known`` False: the scheduler has dropped the group (a step timed out, or the
    scheduler restarted); the executor registers again."""

    group_id: str
    known: bool


class CompileGrammar(Record):
    """Compile this structured-output constraint now (scheduler -> the group's rank 0, on
    ``Subjects.compile(group_id)``): a request routed to the group waits for it before it is
    admitted (vLLM V1's ``WAITING_FOR_FSM``). Answered by ``GrammarReady`` once compiled; asked
    again (each heartbeat) while unanswered, so a lost message only delays."""

    group_id: str
    key: str  # StructuredOutputsParams.digest()
    structured_outputs: StructuredOutputsParams


class GrammarReady(Message):
    """The group's rank 0 has compiled the grammar ``key`` (``error``: it does not compile; the
    requests waiting for it fail with that error)."""

    group_id: str
    key: str
    error: ServiceError | None = None


# ---------------------------------------------------------------- statistics


class GroupStats(Message):
    group_id: str
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int
    num_waiting: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of them, served from the cache


class SchedulerStats(Message):
    """Published every second and answered on request (``stats_get`` subject)."""

    num_running: int
    num_waiting: int
    groups: list[GroupStats]
    num_preemptions: int = 0
    num_finished: int = 0
    time: float = 0.0


class StatsQuery(Message):
    pass


class RequestsQuery(Message):
    """Which of these client request ids does the scheduler still hold? (request/reply)"""

    request_ids: list[str]


class RequestsKnown(Message):
    """The ids of a ``RequestsQuery`` that the scheduler holds (a request, or samples of it)."""

    known: list[str] = Field(default_factory=list)


class SchedulerStarted(Message):
    """A scheduler has started (published once it serves): the gateways resubmit the requests
    in flight that it does not hold (a scheduler that died took them with it)."""

    instance_id: str


class Ping(Message):
    """Liveness probe of a service (request/reply on ``Subjects.ping(service)``)."""


class Pong(Message):
    service: str
