"""Two executor groups on the default model: requests spread over both, a shared prefix hits
the cache, and killing one group mid-run still completes every request with the same
greedy output (its requests are recomputed on the other group)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from gateway.client import EngineClient
from shared.bus import Bus
from shared.messages import SamplingParams, SchedulerStats, StatsQuery
from shared.service import wait_engine_ready
from shared.subjects import Subjects

SYSTEM = ("You are a meticulous assistant. Always answer in one short sentence, without lists, "
          "and never repeat the question. Be kind, precise and brief.")
QUESTIONS = [f"Question {i}: name a fruit that is {c}." for i, c in
             enumerate(["red", "yellow", "green", "orange", "purple", "brown", "pink", "blue", "white", "black"])]


def start(name: str, env: dict[str, str], group: str | None = None) -> subprocess.Popen:
    e = dict(env)
    if group:
        e["PAGEDLLM_GROUP_ID"] = group
    return subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "service", name], env=e,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
