"""``GET /metrics``: engine metrics from the scheduler's ``SchedulerStats`` and request
metrics measured by the gateway, against a real nats-server and a fake backend
(tokenizer + detokenizer stand-in: ``gateway_fakes.FakeBackend``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest_asyncio
from gateway_fakes import FULL, PROMPT, FakeBackend
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import STALE_AFTER_S, GatewayMetrics
from gateway.service import GatewayService
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    GroupStats,
    RequestDelta,
    SchedulerStats,
    ServiceError,
)
from shared.model_source import ModelInfo
from shared.subjects import Subjects

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest_asyncio.fixture
async def gw(nats_url: str):
    """A fresh gateway (its own registry: exact values) and fake backend per test."""
    model = f"metrics-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="fake-backend")
    backend = FakeBackend(bus, model)
    await backend.start()
    info = ModelInfo(path=Path("/models") / model, name=model, max_model_len=106, eos_token_ids=(2,),
                     vocab_size=1000)
    service = GatewayService(Settings(nats_url=nats_url, host="127.0.0.1", port=0), info)
    await service.start()
    oai = openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key="x", max_retries=0, timeout=10)
    async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
        yield SimpleNamespace(model=model, bus=bus, subjects=backend.subjects, service=service, oai=oai, http=http)
    await oai.close()
    await service.stop()
    await bus.close()


def parse(text: str) -> Samples:
    """Every sample of a text exposition: ``(name, labels) -> value``."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def scrape(gw: SimpleNamespace) -> Samples:
    r = await gw.http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "_created" not in r.text  # no creation-time series beside counters and histograms (vLLM has none)
    return parse(r.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} not in {sorted(k[0] for k in samples)}"
    return samples[key]


async def test_engine_metrics_follow_the_latest_scheduler_stats(gw):
    samples = await scrape(gw)
    assert not any(name.startswith("vllm:num_requests") for name, _ in samples)  # no stats yet
    m = gw.model
    stats = SchedulerStats(
        num_running=3, num_waiting=2, num_preemptions=4, num_finished=9,
        groups=[
            GroupStats(group_id="g0", num_blocks=200, num_free_blocks=150, block_size=16, num_running=2,
                       prefix_cache_queries=1000, prefix_cache_hits=640),
            GroupStats(group_id="g1", num_blocks=64, num_free_blocks=64, block_size=16, num_running=1,
                       prefix_cache_queries=32, prefix_cache_hits=0),
        ],
    )
    await gw.bus.publish(gw.subjects.stats, stats)
    await gw.bus.flush()
    for _ in range(100):
        samples = await scrape(gw)
        if ("vllm:num_requests_running", frozenset({("model_name", m)})) in samples:
            break
        await asyncio.sleep(0.02)
    assert value(samples, "vllm:num_requests_running", model_name=m) == 3
    assert value(samples, "vllm:num_requests_waiting", model_name=m) == 2
    assert value(samples, "vllm:kv_cache_usage_perc", model_name=m, group="g0") == 1 - 150 / 200
    assert value(samples, "vllm:kv_cache_usage_perc", model_name=m, group="g1") == 0.0
    assert value(samples, "vllm:prefix_cache_queries_total", model_name=m, group="g0") == 1000
    assert value(samples, "vllm:prefix_cache_hits_total", model_name=m, group="g0") == 640
    assert value(samples, "vllm:prefix_cache_queries_total", model_name=m, group="g1") == 32
    assert value(samples, "vllm:prefix_cache_hits_total", model_name=m, group="g1") == 0
    assert value(samples, "vllm:num_preemptions_total", model_name=m) == 4

    # a newer publication replaces the values
    newer = stats.model_copy(update={"num_running": 0, "num_preemptions": 5, "groups": [
        GroupStats(group_id="g0", num_blocks=200, num_free_blocks=10, block_size=16, num_running=0,
                   prefix_cache_queries=1100, prefix_cache_hits=700)]})
    await gw.bus.publish(gw.subjects.stats, newer)
    await gw.bus.flush()
    for _ in range(100):
        samples = await scrape(gw)
        if value(samples, "vllm:num_preemptions_total", model_name=m) == 5:
            break
        await asyncio.sleep(0.02)
    assert value(samples, "vllm:num_requests_running", model_name=m) == 0
    assert value(samples, "vllm:kv_cache_usage_perc", model_name=m, group="g0") == 1 - 10 / 200
    assert value(samples, "vllm:prefix_cache_hits_total", model_name=m, group="g0") == 700
    assert ("vllm:kv_cache_usage_perc", frozenset({("model_name", m), ("group", "g1")})) not in samples

    # another model's statistics are not this gateway's
    await gw.bus.publish(Subjects(m + "-other").stats, stats)
    await gw.bus.flush()
    await asyncio.sleep(0.05)
    assert value(await scrape(gw), "vllm:num_preemptions_total", model_name=m) == 5


async def test_request_metrics_measured_by_the_gateway(gw):
    m = gw.model
    start = time.perf_counter()
    out = await gw.oai.completions.create(model=m, prompt=PROMPT)  # 6 prompt, 6 generated, "stop"
    assert out.choices[0].finish_reason == "stop"
    stream = await gw.oai.chat.completions.create(  # 6 prompt, 3 generated, "length"
        model=m, messages=[{"role": "user", "content": PROMPT}], max_tokens=3, stream=True
    )
    reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
    assert reasons[-1] == "length"
    elapsed = time.perf_counter() - start

    samples = await scrape(gw)
    assert value(samples, "vllm:request_success_total", model_name=m, finished_reason="stop") == 1
    assert value(samples, "vllm:request_success_total", model_name=m, finished_reason="length") == 1
    assert value(samples, "vllm:prompt_tokens_total", model_name=m) == 12
    assert value(samples, "vllm:generation_tokens_total", model_name=m) == 9
    assert value(samples, "vllm:time_to_first_token_seconds_count", model_name=m) == 2
    assert value(samples, "vllm:e2e_request_latency_seconds_count", model_name=m) == 2
    assert value(samples, "vllm:inter_token_latency_seconds_count", model_name=m) == 5 + 2
    # the fake backend waits 10 ms before the first token and 5 ms between tokens
    assert 0.02 <= value(samples, "vllm:time_to_first_token_seconds_sum", model_name=m) < elapsed
    assert 7 * 0.004 <= value(samples, "vllm:inter_token_latency_seconds_sum", model_name=m) < elapsed
    e2e = value(samples, "vllm:e2e_request_latency_seconds_sum", model_name=m)
    assert value(samples, "vllm:time_to_first_token_seconds_sum", model_name=m) < e2e < elapsed
    assert value(samples, "vllm:e2e_request_latency_seconds_bucket", model_name=m, le="+Inf") == 2
    assert all(("model_name", m) in labels for name, labels in samples if name.startswith("vllm:"))


async def test_engine_error_counts_as_error(gw):
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": "please fail now"})
    assert r.status_code == 500
    samples = await scrape(gw)
    m = gw.model
    assert value(samples, "vllm:request_success_total", model_name=m, finished_reason="error") == 1
    assert ("vllm:request_success_total", frozenset({("model_name", m), ("finished_reason", "stop")})) \
        not in samples
    assert value(samples, "vllm:prompt_tokens_total", model_name=m) == 3
    assert value(samples, "vllm:generation_tokens_total", model_name=m) == 1
    assert value(samples, "vllm:e2e_request_latency_seconds_count", model_name=m) == 1


async def test_a_request_the_engine_lost_and_the_gateway_sent_again_counts_as_a_resubmission(gw):
    m = gw.model
    assert value(await scrape(gw), "pagedllm:request_resubmissions_total", model_name=m) == 0
    out = await gw.oai.completions.create(model=m, prompt="lost once: " + PROMPT)
    assert out.choices[0].text == FULL and out.choices[0].finish_reason == "stop"  # the client saw no loss
    samples = await scrape(gw)
    assert value(samples, "pagedllm:request_resubmissions_total", model_name=m) == 1
    assert value(samples, "vllm:request_success_total", model_name=m, finished_reason="stop") == 1
    assert ("vllm:request_success_total", frozenset({("model_name", m), ("finished_reason", "error")})) \
        not in samples


def _delta(index: int, *tokens: int, reason: str | None = None) -> RequestDelta:
    return RequestDelta(request_id="r", index=index, token_ids=list(tokens), finished=reason is not None,
                        finish_reason=reason)


def test_timer_counts_each_sample_and_the_request_once():
    metrics = GatewayMetrics("m")
    timer = metrics.timer(n=2, num_prompt_tokens=5)
    for delta in [_delta(0, 1), _delta(1, 2), _delta(0, 3), _delta(1, 4, reason="length"),
                  _delta(0, 5, reason="stop")]:
        timer.observe(delta)
    get = metrics.registry.get_sample_value
    assert get("vllm:time_to_first_token_seconds_count", {"model_name": "m"}) == 1
    assert get("vllm:inter_token_latency_seconds_count", {"model_name": "m"}) == 3  # 2 per sample, less firsts
    assert get("vllm:e2e_request_latency_seconds_count", {"model_name": "m"}) == 1  # when both ended
    assert get("vllm:request_success_total", {"model_name": "m", "finished_reason": "stop"}) == 1
    assert get("vllm:request_success_total", {"model_name": "m", "finished_reason": "length"}) == 1
    assert get("vllm:prompt_tokens_total", {"model_name": "m"}) == 5
    assert get("vllm:generation_tokens_total", {"model_name": "m"}) == 5

    # a request whose client left before the first token: nothing but its (absent) tokens
    metrics.timer(n=1, num_prompt_tokens=5)
    assert get("vllm:prompt_tokens_total", {"model_name": "m"}) == 5


def test_registries_are_per_gateway_and_stale_stats_disappear():
    a, b = GatewayMetrics("same"), GatewayMetrics("same")  # no duplicate-timeseries error
    a.timer().observe(_delta(0, 1, reason="stop"))
    assert b.registry.get_sample_value("vllm:request_success_total",
                                       {"model_name": "same", "finished_reason": "stop"}) is None
    group = GroupStats(group_id="g0", num_blocks=0, num_free_blocks=0, block_size=16, num_running=0)
    a.update(SchedulerStats(num_running=1, num_waiting=0, groups=[group]))
    assert a.registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "same", "group": "g0"}) == 0.0
    assert b"vllm:num_requests_running" in a.render()
    a.received -= STALE_AFTER_S + 1  # the scheduler went silent
    assert b"vllm:num_requests_running" not in a.render()


def test_a_refused_request_counts_nothing_and_an_abandoned_one_counts_aborts():
    """A request the engine refused (4xx: the scheduler's checks) was never served: no
    success, no latency, as vLLM. A client that leaves counts each unfinished sample as
    ``abort`` (vLLM's finished_reason), once."""

    metrics = GatewayMetrics("m")
    get = metrics.registry.get_sample_value
    refused = RequestDelta(request_id="r", finished=True, finish_reason="error",
                           error=ServiceError(message="priority", param="priority"))
    metrics.timer(n=2).observe(refused)
    for reason in ("error", "stop", "abort"):
        assert get("vllm:request_success_total", {"model_name": "m", "finished_reason": reason}) is None
    assert get("vllm:e2e_request_latency_seconds_count", {"model_name": "m"}) == 0

    timer = metrics.timer(n=3, num_prompt_tokens=4)
    timer.observe(_delta(0, 1, reason="stop"))
    timer.observe(_delta(1, 2))
    timer.aborted()
    timer.aborted()
    assert get("vllm:request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 2
    assert get("vllm:request_success_total", {"model_name": "m", "finished_reason": "stop"}) == 1
    assert get("vllm:e2e_request_latency_seconds_count", {"model_name": "m"}) == 0
