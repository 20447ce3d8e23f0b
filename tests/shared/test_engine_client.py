"""``EngineClient`` against a real nats-server, a fake tokenizer and a fake scheduler that
answers ``RequestsQuery`` as scripted: a request that the scheduler does not hold, or that
goes unanswered, twice in a row, one the engine says it lost, and one whose deltas skip
tokens are resubmitted under a new engine id with the tokens its client has; after
``MAX_RESUBMITS`` attempts it ends with a 503 ``request_lost``; an answer or an output in
between starts the row again. A scheduler that starts has the requests it does not hold
resubmitted at once. Acceptance and aborts end the state it keeps per request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import nats.errors
import pytest
import pytest_asyncio

from shared import inflight, subjects
from shared.bus import Bus
from shared.engine_client import EngineClient
from shared.messages import (
    GatewayStep,
    RequestDelta,
    RequestsKnown,
    RequestsQuery,
    SamplingParams,
    SchedulerStarted,
    ServiceError,
    TokenizeReply,
    TokenizeRequest,
)
from shared.subjects import TOKENIZER_QUEUE, Subjects

IDLE_S, CHECK_S, QUERY_S = 0.5, 0.2, 0.5


class FakeScheduler:
    """Answers each ``RequestsQuery`` with the next of ``answers`` (True: held; False: not
    held; None: no answer at all); publishes an output for the first id asked after the
    answers listed in ``output_after``."""

    def __init__(self, bus: Bus, gateway_id: str, answers: list[bool | None], output_after: set[int]) -> None:
        self.bus, self.gateway_id = bus, gateway_id
        self.answers, self.output_after = answers, output_after
        self.queries = 0

    async def on_query(self, query: RequestsQuery) -> RequestsKnown:
        answer = self.answers[min(self.queries, len(self.answers) - 1)]
        self.queries += 1
        if answer is None:
            await asyncio.sleep(QUERY_S + 1.0)  # past the client's query timeout: unanswered
        if self.queries in self.output_after:
            delta = RequestDelta(request_id=query.request_ids[0], text="x", token_ids=[7], num_output_tokens=1)
            asyncio.get_running_loop().call_later(0.01, lambda: asyncio.ensure_future(self.publish(delta)))
        return RequestsKnown(known=list(query.request_ids) if answer else [])

    async def publish(self, *deltas: RequestDelta) -> None:
        await self.bus.publish(subjects.gateway(self.gateway_id), GatewayStep(outputs=list(deltas)))


@pytest_asyncio.fixture
async def env(nats_url: str, monkeypatch) -> AsyncIterator[SimpleNamespace]:
    monkeypatch.setattr(inflight, "MAX_RESUBMITS", 2)
    model = f"client-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="fake-engine")
    tokenized: list[TokenizeRequest] = []

    async def tokenize(req: TokenizeRequest) -> TokenizeReply:
        tokenized.append(req)
        return TokenizeReply(prompt_token_ids=[1, 2])

    await bus.subscribe(Subjects(model).tokenize, TokenizeRequest, tokenize, queue=TOKENIZER_QUEUE)
    client = EngineClient(bus, model)
    client.requests.liveness_idle_s, client.requests.liveness_check_s = IDLE_S, CHECK_S
    client.requests.held_query_timeout_s = QUERY_S
    await client.start()

    async def scheduler(answers: list[bool | None], output_after: frozenset[int] = frozenset()) -> FakeScheduler:
        fake = FakeScheduler(bus, client.gateway_id, answers, set(output_after))
        await bus.subscribe(Subjects(model).requests_get, RequestsQuery, fake.on_query)
        await bus.flush()
        return fake

    yield SimpleNamespace(bus=bus, client=client, scheduler=scheduler, tokenized=tokenized, model=model)
    await client.stop()
    await bus.close()


async def _outputs(client: EngineClient, request_id: str, timeout: float = 15.0) -> list[RequestDelta]:
    async def collect() -> list[RequestDelta]:
        return [delta async for delta in client.stream(request_id)]

    return await asyncio.wait_for(collect(), timeout)


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _ids(env) -> list[str]:
    return [req.spec.request_id for req in env.tokenized]


async def test_a_request_the_scheduler_does_not_hold_twice_in_a_row_is_resubmitted_then_lost(env):
    fake = await env.scheduler([False])
    await env.client.submit("r1", prompt="hi", sampling_params=SamplingParams())
    (delta,) = await _outputs(env.client, "r1")
    assert (delta.finished, delta.finish_reason, delta.error.status, delta.error.code) == (True, "error", 503,
                                                                                           "request_lost")
    assert delta.error.type == "server_error" and "lost this request" in delta.error.message
    assert _ids(env) == ["r1", "r1~1", "r1~2"]  # two resubmissions (MAX_RESUBMITS here), then lost
    assert [req.prompt for req in env.tokenized] == ["hi"] * 3
    assert fake.queries == 6 and env.client.num_in_flight == 0 and env.client.num_resubmitted == 2


async def test_checks_nobody_answers_are_misses(env):
    """No scheduler at all (NATS says so at once), or one that does not answer in time: each
    such check is a miss like 'not held'."""
    await env.client.submit("r4", prompt="hi", sampling_params=SamplingParams())
    await _until(lambda: len(env.tokenized) == 2)
    fake = await env.scheduler([None, False])
    (delta,) = await _outputs(env.client, "r4")
    assert delta.error.code == "request_lost" and _ids(env) == ["r4", "r4~1", "r4~2"] and fake.queries >= 2


async def test_an_answer_or_an_output_between_misses_starts_the_row_again(env):
    """Not held, then an output; not held, held, not held: no two misses in a row yet. The
    next miss makes two: the request is resubmitted there, at the fifth check, with the
    token its client has."""
    fake = await env.scheduler([False, False, True, False, False, True], output_after=frozenset({1}))
    await env.client.submit("r2", prompt="hi", sampling_params=SamplingParams())
    await _until(lambda: len(env.tokenized) == 2)
    assert fake.queries == 5
    resubmitted = env.tokenized[1]
    assert (resubmitted.spec.request_id, resubmitted.spec.output_token_ids) == ("r2~1", [7])
    await env.client.abort(["r2"])


async def test_a_resubmitted_request_continues_under_its_new_engine_id(env):
    """A ``request_lost`` error is not shown to the client: the request goes again with the
    tokens delivered, its prompt log probabilities (delivered) no longer asked for; deltas of
    the attempt before are ignored; the client's stream reads as one."""
    await env.scheduler([True])
    params = SamplingParams(max_tokens=5, prompt_logprobs=0)
    await env.client.submit("r6", prompt="hi", sampling_params=params)
    stream = asyncio.create_task(_outputs(env.client, "r6"))
    fake = FakeScheduler(env.bus, env.client.gateway_id, [True], set())
    first = RequestDelta(request_id="r6", text="a", token_ids=[3, 4], num_output_tokens=2,
                         prompt_logprobs=[])
    lost = RequestDelta(request_id="r6", finished=True, finish_reason="error", error=ServiceError(
        message="the detokenizer stopped", type="server_error", code="request_lost", status=503))
    await fake.publish(first, lost)
    await _until(lambda: len(env.tokenized) == 2)
    again = env.tokenized[1]
    assert (again.spec.request_id, again.spec.output_token_ids, again.spec.sampling_params.prompt_logprobs) == ("r6~1", [3, 4], 0)
    stale = RequestDelta(request_id="r6", text="zzz", token_ids=[9], num_output_tokens=3)
    rest = RequestDelta(request_id="r6~1", text="b", token_ids=[5], num_output_tokens=3, finished=True,
                        finish_reason="length")
    await fake.publish(stale, rest)
    deltas = await stream
    assert [(d.request_id, d.text, d.token_ids) for d in deltas] == [("r6", "a", [3, 4]), ("r6", "b", [5])]
    assert deltas[-1].finish_reason == "length" and env.client.num_in_flight == 0


async def test_a_delta_that_skips_tokens_makes_the_request_go_again(env):
    """A delta whose ``num_output_tokens`` counts tokens the client never got (an update lost
    in a NATS outage) is not delivered: the request goes again from the tokens it has."""
    await env.scheduler([True])
    await env.client.submit("r7", prompt="hi", sampling_params=SamplingParams())
    fake = FakeScheduler(env.bus, env.client.gateway_id, [True], set())
    await fake.publish(RequestDelta(request_id="r7", text="a", token_ids=[3], num_output_tokens=1),
                       RequestDelta(request_id="r7", text="c", token_ids=[5], num_output_tokens=3))
    await _until(lambda: len(env.tokenized) == 2)
    assert (env.tokenized[1].spec.request_id, env.tokenized[1].spec.output_token_ids) == ("r7~1", [3])
    await env.client.abort(["r7"])


async def test_an_n_greater_than_one_request_with_output_is_lost_not_resubmitted(env):
    await env.scheduler([True])
    await env.client.submit("r8", prompt="hi", sampling_params=SamplingParams(n=2))
    fake = FakeScheduler(env.bus, env.client.gateway_id, [True], set())
    lost = ServiceError(message="lost", type="server_error", code="request_lost", status=503)
    await fake.publish(RequestDelta(request_id="r8", index=1, text="a", token_ids=[3], num_output_tokens=1),
                       RequestDelta(request_id="r8", finished=True, finish_reason="error", error=lost))
    deltas = await _outputs(env.client, "r8")
    assert [d.text for d in deltas] == ["a", ""] and deltas[-1].error.code == "request_lost"
    assert _ids(env) == ["r8"]


async def test_a_scheduler_that_starts_has_what_it_does_not_hold_resubmitted_at_once(env):
    """The liveness check would wait IDLE_S; the start notice needs no idle time and one miss."""
    env.client.requests.liveness_idle_s = 60.0
    fake = await env.scheduler([False])
    await env.client.submit("r9", prompt="hi", sampling_params=SamplingParams())
    await env.bus.publish(Subjects(env.model).scheduler_started, SchedulerStarted(instance_id="new"))
    await _until(lambda: len(env.tokenized) == 2)
    assert _ids(env) == ["r9", "r9~1"] and fake.queries == 1
    await env.client.abort(["r9"])


async def test_submit_waits_for_a_tokenizer_that_is_restarting(nats_url):
    """NoResponders (no tokenizer yet) is retried until ``tokenize_timeout_s``."""
    model = f"client-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="late-tokenizer")
    client = EngineClient(bus, model, tokenize_timeout_s=5.0)
    await client.start()

    async def tokenize(req: TokenizeRequest) -> TokenizeReply:
        return TokenizeReply(prompt_token_ids=[1])

    async def late_tokenizer() -> None:
        await asyncio.sleep(1.0)
        await bus.subscribe(Subjects(model).tokenize, TokenizeRequest, tokenize, queue=TOKENIZER_QUEUE)

    try:
        started = asyncio.get_running_loop().time()
        task = asyncio.create_task(late_tokenizer())
        reply = await client.submit("late", prompt="hi", sampling_params=SamplingParams())
        await task
        assert reply.error is None and reply.prompt_token_ids == [1]
        assert asyncio.get_running_loop().time() - started >= 1.0
        await client.abort(["late"])
        nobody = EngineClient(bus, model + "-none", tokenize_timeout_s=0.5)
        with pytest.raises(nats.errors.NoRespondersError):
            await nobody.submit("nobody", prompt="hi", sampling_params=SamplingParams())
        assert nobody.num_in_flight == 0
    finally:
        await client.stop()
        await bus.close()


async def test_a_request_the_scheduler_holds_is_never_lost(env):
    fake = await env.scheduler([True])
    await env.client.submit("r3", prompt="hi", sampling_params=SamplingParams(n=2))
    while fake.queries < 3:
        await asyncio.sleep(0.05)
    assert env.client.num_in_flight == 1 and env.client.requests.pending["r3"].queue.empty()
    assert env.client.requests.misses.misses("r3") == 0 and _ids(env) == ["r3"]
    outputs = asyncio.create_task(_outputs(env.client, "r3"))
    await asyncio.sleep(0.05)
    await env.client.abort(["r3"])
    assert [(d.index, d.finish_reason) for d in await outputs] == [(0, "abort"), (1, "abort")]
    assert env.client.num_in_flight == 0


async def test_a_refusal_ends_the_wait_for_acceptance_and_forgets_the_request(env):
    """``wait_accepted``: None once the scheduler accepts (the acceptance is not an output),
    the error of a refusal (the request is then forgotten)."""
    for request_id in ("ok", "refused"):
        await env.client.submit(request_id, prompt="hi", sampling_params=SamplingParams(), notify_accepted=True)
    refusal = ServiceError(message="priority=-1 needs --scheduling-policy priority", param="priority")
    step = GatewayStep(accepted=["ok"], outputs=[RequestDelta(request_id="refused", finished=True,
                                                              finish_reason="error", error=refusal)])
    await env.bus.publish(subjects.gateway(env.client.gateway_id), step)
    assert await asyncio.wait_for(env.client.wait_accepted("ok"), 5) is None
    assert await asyncio.wait_for(env.client.wait_accepted("refused"), 5) == refusal
    assert sorted(env.client.requests.pending) == ["ok"] and env.client.requests.pending["ok"].queue.empty()
    await env.client.abort(["ok"])
    assert env.client.num_in_flight == 0


async def test_submit_refuses_what_would_not_decode_before_sending_it(env):
    """A request whose fields are of the wrong type is refused by the client, naming the field,
    and nothing reaches the tokenizer (its records are not checked again there)."""
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        await env.client.submit("t1", prompt="hi", sampling_params={"temperature": 0.5})
    with pytest.raises(ValueError, match=r"\$\.prompt"):
        await env.client.submit("t2", prompt=["not", "token ids"], sampling_params=SamplingParams())
    with pytest.raises(ValueError, match=r"\$\.spec\.priority"):
        await env.client.submit("t3", prompt="hi", sampling_params=SamplingParams(), priority=0.5)
    await env.client.submit("t4", prompt="hi", sampling_params=SamplingParams())
    assert _ids(env) == ["t4"] and env.client.num_in_flight == 1
    await env.client.abort(["t4"])
