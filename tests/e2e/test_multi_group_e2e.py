"""Two executor groups on the default model: requests spread over both, a shared prefix hits
the cache, and killing one group mid-run still completes every request with the same
greedy output (its requests are recomputed on the other group)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from types import SimpleNamespace

import pytest
from processes import start_service, stop_all

from shared.bus import Bus
from shared.engine_client import EngineClient
from shared.messages import SamplingParams, SchedulerStats, StatsQuery
from shared.pings import wait_engine_ready
from shared.subjects import Subjects

SYSTEM = ("You are a meticulous assistant. Always answer in one short sentence, without lists, "
          "and never repeat the question. Be kind, precise and brief.")
QUESTIONS = [f"Question {i}: name a fruit that is {c}." for i, c in
             enumerate(["red", "yellow", "green", "orange", "purple", "brown", "pink", "blue", "white", "black"])]


def start(name: str, env: dict[str, str], group: str | None = None) -> subprocess.Popen:
    return start_service(name, {**env, "PAGEDLLM_GROUP_ID": group} if group else env)


async def generate_all(client: EngineClient, params: SamplingParams) -> list[list[int]]:
    ids = [f"mg-{uuid.uuid4().hex}" for _ in QUESTIONS]
    for rid, q in zip(ids, QUESTIONS, strict=True):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        reply = await client.submit(rid, messages=messages, sampling_params=params)
        assert reply.error is None

    async def collect(rid: str) -> list[int]:
        tokens = []
        async for delta in client.stream(rid):
            assert delta.error is None, delta.error
            tokens.extend(delta.token_ids)
        return tokens

    return list(await asyncio.gather(*(collect(r) for r in ids)))


async def stats(bus: Bus, model: str) -> SchedulerStats:
    return await bus.request(Subjects(model).stats_get, StatsQuery(), SchedulerStats, timeout=5)


@pytest.mark.timeout(400)
async def test_two_groups_spread_share_and_survive_a_killed_group(nats_url, smollm2_path):
    model = f"mg-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    env.update(PAGEDLLM_NATS_URL=nats_url, PAGEDLLM_MODEL=str(smollm2_path), PAGEDLLM_SERVED_MODEL_NAME=model,
               PAGEDLLM_DTYPE="float32", PAGEDLLM_KV_CACHE_MEMORY_BYTES=str(48 << 20),
               PAGEDLLM_HEARTBEAT_INTERVAL_S="0.5", PAGEDLLM_HEARTBEAT_TIMEOUT_S="3", PAGEDLLM_LOG_LEVEL="WARNING")
    procs = {name: start(name, env) for name in ("scheduler", "tokenizer", "detokenizer")}
    procs["ga"] = start("executor", env, "ga")
    procs["gb"] = start("executor", env, "gb")
    bus = await Bus.connect(nats_url)
    client = EngineClient(bus, model)
    await client.start()
    try:
        await wait_engine_ready(bus, model, num_detokenizer_shards=1, timeout=180)
        deadline = time.monotonic() + 60
        while len((await stats(bus, model)).groups) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        baseline = await generate_all(client, params)
        s = await stats(bus, model)
        by_group = {g.group_id: g for g in s.groups}
        assert set(by_group) == {"ga", "gb"}
        assert all(g.prefix_cache_queries > 0 for g in s.groups), "requests did not spread over both groups"
        assert sum(g.prefix_cache_hits for g in s.groups) >= 16 * 4  # the shared system prompt hit
        assert all(len(t) == 16 for t in baseline)

        # run again and kill group "gb" while it holds running requests
        task = asyncio.create_task(generate_all(client, params))
        deadline = time.monotonic() + 60
        while True:
            s = await stats(bus, model)
            if any(g.group_id == "gb" and g.num_running > 0 for g in s.groups):
                break
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.02)
        procs["gb"].send_signal(signal.SIGKILL)
        again = await asyncio.wait_for(task, 240)
        assert again == baseline
        s = await stats(bus, model)
        assert [g.group_id for g in s.groups] == ["ga"]
        assert s.num_running == 0 and s.num_waiting == 0
        assert all(g.num_free_blocks == g.num_blocks for g in s.groups)
    finally:
        await client.stop()
        await bus.close()
        stop_all(procs.values())


class _StubRunner:
    """A ModelRunner stand-in (no model load): what registration reads."""

    num_blocks, block_size = 8, 16

    def __init__(self, settings, model_info) -> None:
        self.requests: dict = {}
        self.structured = SimpleNamespace(close=lambda: None)  # the grammar threads, closed at stop

    def reset(self) -> None:
        self.requests.clear()


async def test_a_second_executor_of_a_group_id_is_refused(nats_url, monkeypatch):
    """Two executors with one --group-id would both run every step of the group and answer it
    twice: the second refuses to start, naming the group. Another group id starts, and the
    first one, re-registering (after a failed step), does not refuse itself."""
    from pathlib import Path

    from services.executor import service as executor_service
    from shared.config import Settings
    from shared.messages import RegisterAck, RegisterGroup
    from shared.model_source import ModelInfo
    from shared.pings import ServiceConflictError

    monkeypatch.setattr(executor_service, "ModelRunner", _StubRunner)
    model = f"dup-{uuid.uuid4().hex[:6]}"
    info = ModelInfo(path=Path("/models/x"), name=model, max_model_len=64, eos_token_ids=(2,), vocab_size=100)
    bus = await Bus.connect(nats_url, name="fake-scheduler")
    registered: list[str] = []

    async def on_register(msg: RegisterGroup) -> RegisterAck:
        registered.append(msg.group_id)
        return RegisterAck(group_id=msg.group_id, accepted=True)

    await bus.subscribe(Subjects(model).register, RegisterGroup, on_register)
    settings = Settings(nats_url=nats_url, group_id="g1", heartbeat_interval_s=60)
    first = executor_service.ExecutorService(settings, info)
    duplicate = executor_service.ExecutorService(settings, info)
    other = executor_service.ExecutorService(settings.model_copy(update={"group_id": "g2"}), info)
    try:
        await first.start()
        await asyncio.wait_for(first.wait_registered(), 5)
        with pytest.raises(ServiceConflictError, match="another executor of group 'g1' already serves") as exc:
            await duplicate.start()
        assert "--group-id" in str(exc.value)
        await other.start()
        await asyncio.wait_for(other.wait_registered(), 5)
        await first._start_rejoin()  # what a failed step does
        deadline = time.monotonic() + 5
        while registered.count("g1") < 2 or first.state is not executor_service.ExecutorState.SERVING:
            assert time.monotonic() < deadline, registered
            await asyncio.sleep(0.05)
        assert sorted(registered) == ["g1", "g1", "g2"]
    finally:
        for service in (first, duplicate, other):
            await service.stop()
        await bus.close()
