"""End to end over real NATS: the service commands of docker-compose.yml started as plain
processes against the compose file's nats-server (deploy/nats.conf: each service connects as
its own user, allowed only its subjects), the default SmolLM2 model, the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import websockets
import yaml
from processes import compose_nats_passwords, compose_nats_url, start_compose_nats, stop_all

from shared.bus import Bus
from shared.config import DEFAULT_MODEL_NAME
from shared.messages import SchedulerStats, StatsQuery
from shared.nats_server import free_port
from shared.subjects import Subjects

ROOT = Path(__file__).resolve().parents[2]
MODEL = DEFAULT_MODEL_NAME
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def compose_commands() -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each pagedllm service of docker-compose.yml: its command and environment."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    out = {}
    for name, svc in compose["services"].items():
        if name == "nats":
            assert "-c" in svc["command"] and "nats.conf" in " ".join(svc["volumes"])
            continue
        out[name] = (list(svc["command"]), {k: str(v) for k, v in (svc.get("environment") or {}).items()})
    return out


async def scheduler_stats(nats_url: str) -> SchedulerStats:
    bus = await Bus.connect(nats_url)
    try:
        return await bus.request(Subjects(MODEL).stats_get, StatsQuery(), SchedulerStats, timeout=5)
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def compose_nats(tmp_path_factory):
    """deploy/nats.conf's nats-server: ``(its directory, the services' passwords, its port)``;
    no user broke a permission (its log says so) by the end."""
    workdir = tmp_path_factory.mktemp("compose-nats")
    passwords = compose_nats_passwords()
    proc, port = start_compose_nats(workdir, passwords)
    yield workdir, passwords, port
    stop_all([proc])
    violations = [line for line in (workdir / "nats-server.log").read_text().splitlines() if "Violation" in line]
    assert not violations, violations[:5]


@pytest.fixture(scope="module")
def nats_url(compose_nats):
    """The gateway's URL (the tests read the scheduler's statistics as the gateway does)."""
    _, passwords, port = compose_nats
    return compose_nats_url(compose_commands()["gateway"][1]["PAGEDLLM_NATS_URL"], passwords, port)


@pytest.fixture(scope="module")
def stack(compose_nats, nats_url, smollm2_path, tmp_path_factory):
    services = compose_commands()
    assert set(services) == {"scheduler", "tokenizer", "detokenizer", "executor", "gateway", "batch"}
    _, passwords, nats_port = compose_nats
    port = free_port()
    logs = tmp_path_factory.mktemp("stack-logs")
    procs = []
    for name, (command, environment) in services.items():
        assert command[:2] == ["pagedllm", "service"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
        env.update(environment)
        env.update(
            # the compose network's `nats` is our local server here, each service its own user
            PAGEDLLM_NATS_URL=compose_nats_url(environment["PAGEDLLM_NATS_URL"], passwords, nats_port),
            PAGEDLLM_HOST="127.0.0.1",
            PAGEDLLM_PORT=str(port),
            PAGEDLLM_DTYPE="float32",
            PAGEDLLM_KV_CACHE_MEMORY_BYTES=str(128 << 20),
            PAGEDLLM_CACHE_DIR=str(smollm2_path.parent),
        )
        exe = str(Path(sys.executable).parent / command[0])
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen([exe, *command[1:]], env=env, stdout=log, stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert all(p.poll() is None for p in procs), f"a service exited; logs in {logs}"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200 and asyncio.run(
                scheduler_stats(nats_url)
            ).groups:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, f"stack did not come up; logs in {logs}"
        time.sleep(0.5)
    yield base
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            assert p.wait(20) == 0 or p.returncode == -signal.SIGTERM
        except subprocess.TimeoutExpired:
            p.kill()
            raise


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack + "/v1", api_key="unused", max_retries=0, timeout=300)


async def test_chat_mentions_paris_streaming_equals_non_streaming(client):
    resp = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 10
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == text
    # the same prompt again: its full blocks come from the prefix cache
    again = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1) // 16 * 16 and cached > 0
    assert again.choices[0].message.content == text


async def test_completion_streaming_equals_non_streaming(client):
    args = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=20)
    resp = await client.completions.create(**args)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 20
    stream = await client.completions.create(**args, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == resp.choices[0].text


async def test_parallel_samples_n(client):
    greedy = await client.completions.create(model=MODEL, prompt="My favourite animal is", temperature=0,
                                             max_tokens=10, extra_body={"ignore_eos": True})
    resp = await client.completions.create(model=MODEL, prompt="My favourite animal is", temperature=0, n=3,
                                           max_tokens=10, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.text == greedy.choices[0].text for c in resp.choices)
    assert resp.usage.completion_tokens == 30
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.8, seed=1, n=2,
                                                  max_tokens=12, stream=True)
    texts = ["", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts)


async def test_websocket_answers_chat(stack, client):
    expected = (await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)).choices[0].message.content
    async with websockets.connect(stack.replace("http", "ws") + "/v1/stream") as ws:
        body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 32}
        await ws.send(json.dumps({"type": "chat", "id": "a", "request": body}))
        await ws.send(json.dumps({"type": "completion", "id": "b",
                                  "request": {"model": MODEL, "prompt": "Hello", "max_tokens": 5}}))
        text, done = "", {}
        while len(done) < 2:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if msg["type"] == "chunk" and msg["id"] == "a":
                text += msg["chunk"]["choices"][0]["delta"].get("content") or ""
            elif msg["type"] == "done":
                done[msg["id"]] = msg["response"]
            else:
                assert msg["type"] == "chunk", msg
    assert text == expected == done["a"]["choices"][0]["message"]["content"]
    assert done["b"]["usage"]["completion_tokens"] == 5


async def test_sixteen_concurrent_requests_complete(client):
    async def one(i: int):
        return await client.completions.create(
            model=MODEL, prompt=f"Count from {i}:", temperature=0, max_tokens=12 + i, extra_body={"ignore_eos": True}
        )

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert [r.usage.completion_tokens for r in results] == [12 + i for i in range(16)]


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 100_000}, 400, "max_tokens"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": QUESTION, "temperature": -1}, 400, "temperature"),
        ({"model": "no-such-model", "messages": QUESTION}, 404, "model"),
        (b'{"model": "SmolLM2-135M-Instruct", "messages": [', 400, None),
    ],
)
async def test_bad_input_gets_openai_error_then_server_keeps_serving(stack, client, body, status, param):
    async with httpx.AsyncClient(base_url=stack, timeout=60) as http:
        kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(
            body, bytes) else {"json": body}
        r = await http.post("/v1/chat/completions", **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    ok = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
    assert ok.choices[0].message.content


async def test_a_batch_of_prompts_equals_the_prompts_one_by_one(client):
    """/v1/completions with a list of prompts (and echo) gives each prompt's greedy text, as
    the same prompts sent one by one; token-id prompts are echoed as their text."""
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    batch = await client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8, echo=True)
    singles = [await client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8) for p in prompts]
    assert [c.text for c in batch.choices] == [p + s.choices[0].text for p, s in zip(prompts, singles, strict=True)]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 3 * 8
    ids = [[504, 3575, 282, 4649, 314], [34, 28, 216, 35, 28]]  # "The capital of France is", "2, 3,"
    out = await client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4, echo=True)
    single = await client.completions.create(model=MODEL, prompt=ids[0], temperature=0, max_tokens=4)
    assert out.choices[0].text == "The capital of France is" + single.choices[0].text
    assert out.choices[1].text.startswith("2, 3,")


async def test_a_stream_the_scheduler_refuses_is_a_400(client):
    """The scheduler refuses a priority under the fcfs policy after tokenization: a streaming
    request still gets a plain 400 (the SDK's BadRequestError), not a 200 with an error event."""
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True, max_tokens=4,
                                             extra_body={"priority": -1})
    assert exc.value.param == "priority"
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True, max_tokens=4)
    assert len([c async for c in stream]) >= 2


async def test_client_disconnect_aborts_and_every_block_is_free(stack, nats_url, client):
    async with httpx.AsyncClient(base_url=stack, timeout=60) as http:
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break  # leave mid-stream
    deadline = time.monotonic() + 30
    while True:
        stats = await scheduler_stats(nats_url)
        if stats.num_running == 0 and stats.num_waiting == 0:
            break
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.2)
    assert stats.groups and all(g.num_free_blocks == g.num_blocks for g in stats.groups)
    models = (await client.models.list()).data
    assert [m.id for m in models] == [MODEL]


async def test_echo_logprobs_score_a_continuation_as_hugging_face(client, smollm2_path):
    """lm-evaluation-harness's loglikelihood request through the whole stack: a batch of
    token-id prompts (context + continuation) with echo, logprobs 1 and max_tokens 0. The
    continuation's summed log probability equals HF's float32 one, each token's entry holds
    the most likely token, and nothing is generated."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    pairs = [([504, 3575, 282, 4649, 314], [7042, 30]), ([34, 28, 216, 35, 28], [216, 36])]  # "... is" " Paris."
    out = await client.completions.create(model=MODEL, prompt=[c + x for c, x in pairs], echo=True, logprobs=1,
                                          max_tokens=0, temperature=0)
    assert out.usage.completion_tokens == 0
    for choice, (context, continuation) in zip(out.choices, pairs, strict=True):
        ids = context + continuation
        lp = choice.logprobs
        assert choice.finish_reason == "length" and len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        expected = sum(ref[p - 1, ids[p]].item() for p in range(len(context), len(ids)))
        assert sum(lp.token_logprobs[len(context):]) == pytest.approx(expected, abs=1e-3)
        for p in range(1, len(ids)):
            best = ref[p - 1].argmax().item()
            assert max(lp.top_logprobs[p].values()) == pytest.approx(ref[p - 1, best].item(), abs=1e-3)


async def test_a_batch_job_runs_through_the_gateway_and_the_batch_service(client):
    """The Files and Batch API across the gateway and the batch service, each its own NATS user
    (JetStream's API, the batch streams, the file and batch buckets)."""
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 4, "temperature": 0}}
             for i, q in enumerate(["Say hello.", "Name a fruit."])]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = await client.files.create(file=("questions.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    out = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["q0", "q1"]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert (await client.files.delete(file.id)).deleted
