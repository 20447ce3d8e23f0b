"""Prometheus metrics of one gateway (``GET /metrics``), with vLLM's metric names.

Engine state comes from the scheduler's ``SchedulerStats``, published on
``Subjects(model).stats`` every second; request latencies (TTFT, ITL, end to end) and token
counts are measured here from the ``RequestDelta``s each request receives. Each gateway has
its own ``CollectorRegistry`` (several gateways or tests in one process never clash).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.bus import Bus
from shared.messages import RequestDelta, SchedulerStats
from shared.subjects import Subjects

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _SchedulerCollector:
    """Yields gauges/counters from the latest ``SchedulerStats`` (cumulative totals as counters)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        stats, model = self.metrics.latest, self.metrics.model_name
        if stats is None:
            return
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests running on executors",
                                    labels=["model_name"])
        running.add_metric([model], stats.num_running)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                                    labels=["model_name"])
        waiting.add_metric([model], stats.num_waiting)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)",
                                  labels=["model_name", "group"])
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=["model_name", "group"])
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   labels=["model_name", "group"])
        for g in stats.groups:
            usage.add_metric([model, g.group_id], 1.0 - g.num_free_blocks / g.num_blocks)
            queries.add_metric([model, g.group_id], g.prefix_cache_queries)
            hits.add_metric([model, g.group_id], g.prefix_cache_hits)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Requests preempted (recomputed later)",
                                          labels=["model_name"])
        preemptions.add_metric([model], stats.num_preemptions)
        yield from (running, waiting, usage, queries, hits, preemptions)


class RequestTimer:
    """Times one request from its deltas: TTFT, inter-token latencies, end to end (seconds)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last_token: float | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.done = False

    def observe(self, delta: RequestDelta) -> None:
        now = time.perf_counter()
        m = self.metrics
        if delta.token_ids:
            if self.last_token is None:
                m.ttft.labels(m.model_name).observe(now - self.start)
            elif delta.index == 0:  # ITL of the first sample (one observation per step)
                m.itl.labels(m.model_name).observe(now - self.last_token)
            if delta.index == 0 or self.last_token is None:
                self.last_token = now
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens += len(delta.token_ids)
        if delta.finished and delta.index == 0 and not self.done:
            self.done = True
            m.e2e.labels(m.model_name).observe(now - self.start)
            m.success.labels(m.model_name, delta.finish_reason or "stop").inc()
            m.prompt_tokens.labels(m.model_name).inc(self.num_prompt_tokens)
        if delta.token_ids:
            m.generation_tokens.labels(m.model_name).inc(len(delta.token_ids))


class GatewayMetrics:
    """The gateway's Prometheus registry and the latest scheduler statistics."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: SchedulerStats | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.success = Counter("vllm:request_success", "Finished requests", ["model_name", "finished_reason"],
                               registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", ["model_name"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(_SchedulerCollector(self))

    async def subscribe(self, bus: Bus) -> None:
        """Keep the latest ``SchedulerStats`` of this model."""

        async def on_stats(stats: SchedulerStats) -> None:
            self.latest = stats

        await bus.subscribe(Subjects(self.model_name).stats, SchedulerStats, on_stats)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        """The metrics in Prometheus' text exposition format."""
        return generate_latest(self.registry)
