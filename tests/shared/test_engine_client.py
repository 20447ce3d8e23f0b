"""``EngineClient`` against a real nats-server, a fake tokenizer and a fake scheduler that
answers ``RequestsQuery`` as scripted: the liveness watch ends a request that the scheduler
does not hold, or that goes unanswered, twice in a row (a 503 ``request_lost``); an answer
or an output in between starts the row again. Acceptance and aborts end the state it keeps
per request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest_asyncio

from shared import subjects
from shared.bus import Bus
from shared.engine_client import EngineClient
from shared.messages import (
    GatewayStep,
    RequestDelta,
    RequestsKnown,
    RequestsQuery,
    SamplingParams,
    ServiceError,
    TokenizeReply,
    TokenizeRequest,
)
from shared.subjects import TOKENIZER_QUEUE, Subjects

IDLE_S, CHECK_S = 0.5, 0.2


class FakeScheduler:
    """Answers each ``RequestsQuery`` about ``request_id`` with the next of ``answers``
    (True: held; False: not held; None: no answer at all); publishes an output for it after
    the answers listed in ``output_after``."""

    def __init__(self, bus: Bus, gateway_id: str, answers: list[bool | None], output_after: set[int]) -> None:
        self.bus, self.gateway_id = bus, gateway_id
        self.answers, self.output_after = answers, output_after
        self.queries = 0

    async def on_query(self, query: RequestsQuery) -> RequestsKnown:
        answer = self.answers[min(self.queries, len(self.answers) - 1)]
        self.queries += 1
        if answer is None:
            await asyncio.sleep(3.0)  # past the client's 2 s: unanswered
        if self.queries in self.output_after:
            delta = RequestDelta(request_id=query.request_ids[0], text="x", token_ids=[7], num_output_tokens=1)
            asyncio.get_running_loop().call_later(0.01, lambda: asyncio.ensure_future(
                self.bus.publish(subjects.gateway(self.gateway_id), GatewayStep(outputs=[delta]))))
        return RequestsKnown(known=list(query.request_ids) if answer else [])


@pytest_asyncio.fixture
async def env(nats_url: str) -> AsyncIterator[SimpleNamespace]:
    model = f"client-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="fake-engine")

    async def tokenize(req: TokenizeRequest) -> TokenizeReply:
        return TokenizeReply(request_id=req.request_id, prompt_token_ids=[1, 2])

    await bus.subscribe(Subjects(model).tokenize, TokenizeRequest, tokenize, queue=TOKENIZER_QUEUE)
    client = EngineClient(bus, model)
    client.liveness_idle_s, client.liveness_check_s = IDLE_S, CHECK_S
    await client.start()

    async def scheduler(answers: list[bool | None], output_after: frozenset[int] = frozenset()) -> FakeScheduler:
        fake = FakeScheduler(bus, client.gateway_id, answers, set(output_after))
        await bus.subscribe(Subjects(model).requests_get, RequestsQuery, fake.on_query)
        await bus.flush()
        return fake

    yield SimpleNamespace(bus=bus, client=client, scheduler=scheduler)
    await client.stop()
    await bus.close()


async def _outputs(client: EngineClient, request_id: str, timeout: float = 15.0) -> list[RequestDelta]:
    async def collect() -> list[RequestDelta]:
        return [delta async for delta in client.stream(request_id)]

    return await asyncio.wait_for(collect(), timeout)


async def test_a_request_the_scheduler_does_not_hold_twice_in_a_row_is_lost(env):
    fake = await env.scheduler([False])
    await env.client.submit("r1", prompt="hi", sampling_params=SamplingParams())
    (delta,) = await _outputs(env.client, "r1")
    assert (delta.finished, delta.finish_reason, delta.error.status, delta.error.code) == (True, "error", 503,
                                                                                           "request_lost")
    assert delta.error.type == "server_error" and "lost this request" in delta.error.message
    assert fake.queries == 2 and env.client.num_in_flight == 0


async def test_checks_nobody_answers_are_misses(env):
    """No scheduler at all (NATS says so at once), or one that does not answer in time: each
    such check is a miss like 'not held'."""
    await env.client.submit("r4", prompt="hi", sampling_params=SamplingParams())
    (delta,) = await _outputs(env.client, "r4")
    assert delta.error.code == "request_lost"
    fake = await env.scheduler([None, False])
    await env.client.submit("r5", prompt="hi", sampling_params=SamplingParams())
    (delta,) = await _outputs(env.client, "r5")
    assert delta.error.code == "request_lost" and fake.queries == 2


async def test_an_answer_or_an_output_between_misses_starts_the_row_again(env):
    """Not held, then an output; not held, held, not held: no two misses in a row yet. The
    next miss makes two: the request ends there, at the fifth check."""
    fake = await env.scheduler([False, False, True, False, False], output_after=frozenset({1}))
    await env.client.submit("r2", prompt="hi", sampling_params=SamplingParams())
    output, lost = await _outputs(env.client, "r2")
    assert output.text == "x" and lost.error.code == "request_lost"
    assert fake.queries == 5


async def test_a_request_the_scheduler_holds_is_never_lost(env):
    fake = await env.scheduler([True])
    await env.client.submit("r3", prompt="hi", sampling_params=SamplingParams(n=2))
    while fake.queries < 3:
        await asyncio.sleep(0.05)
    assert env.client.num_in_flight == 1 and env.client._pending["r3"].queue.empty()
    assert env.client._misses.misses("r3") == 0
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
    assert sorted(env.client._pending) == ["ok"] and env.client._pending["ok"].queue.empty()
    await env.client.abort(["ok"])
    assert env.client.num_in_flight == 0
