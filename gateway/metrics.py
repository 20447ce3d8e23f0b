"""Prometheus metrics of one gateway (``GET /metrics``), with vLLM's metric names.

Engine state comes from the scheduler's ``SchedulerStats``, published on
``Subjects(model).stats`` every second (the latest is kept; none is shown once it is
older than ``STALE_AFTER_S``). Request metrics are measured here, per request, from the
``RequestDelta``s the gateway receives (``RequestTimer``):

- ``vllm:time_to_first_token_seconds``: from the request's arrival (before tokenization)
  to its first token, once per request;
- ``vllm:inter_token_latency_seconds``: between consecutive token deltas of one sample;
- ``vllm:e2e_request_latency_seconds``: arrival to the last sample's end, once per request;
- ``vllm:request_success_total{finished_reason}``: one per finished sample (as vLLM, where
  each of the ``n`` samples is an engine request); ``"error"`` when the engine failed,
  ``"abort"`` for each unfinished sample of a request whose client left;
- ``vllm:prompt_tokens_total``: once per request, at its first token (prefill done);
- ``vllm:generation_tokens_total``: every token delivered;
- ``pagedllm:request_resubmissions_total`` (pagedllm's own, vLLM has none): requests the
  engine lost (a part died under them) sent again by this gateway's ``EngineClient``
  (``num_resubmitted``), so their streams go on.

A request whose client leaves before it finishes counts its tokens and its aborted samples
but no end-to-end latency. A request the engine refused (a 4xx error: the scheduler's
checks) counts nothing, as vLLM counts no request it rejected. Each gateway has its own
``CollectorRegistry``, so several gateways (or tests) in one process never clash. Every
metric has a ``model_name`` label.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from nats.aio.subscription import Subscription
from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.bus import Bus
from shared.messages import RequestDelta, SchedulerStats
from shared.subjects import Subjects

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
disable_created_metrics()  # no `*_created` series beside each counter and histogram, as vLLM
STALE_AFTER_S = 10.0  # engine metrics disappear when the scheduler has been silent this long
# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _SchedulerCollector:
    """Gauges and counters from the latest ``SchedulerStats`` (its cumulative totals as counters)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats, model = self.metrics.current_stats(), self.metrics.model_name
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
            used = 1.0 - g.num_free_blocks / g.num_blocks if g.num_blocks else 0.0
            usage.add_metric([model, g.group_id], used)
            queries.add_metric([model, g.group_id], g.prefix_cache_queries)
            hits.add_metric([model, g.group_id], g.prefix_cache_hits)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Requests preempted (recomputed later)",
                                          labels=["model_name"])
        preemptions.add_metric([model], stats.num_preemptions)
        yield from (running, waiting, usage, queries, hits, preemptions)


class _ResubmissionCollector:
    """The engine client's resubmissions so far, as a counter."""

    def __init__(self, model_name: str, resubmitted: Callable[[], int]) -> None:
        self.model_name = model_name
        self.resubmitted = resubmitted

    def collect(self) -> Iterator[Metric]:
        counter = CounterMetricFamily("pagedllm:request_resubmissions",
                                      "Requests the engine lost, sent again with their client's tokens so far",
                                      labels=["model_name"])
        counter.add_metric([self.model_name], self.resubmitted())
        yield counter


class RequestTimer:
    """Measures one request (``n`` samples) from its deltas; ``observe`` each one in order."""

    __slots__ = ("metrics", "start", "num_prompt_tokens", "last_token", "first", "unfinished")

    def __init__(self, metrics: GatewayMetrics, n: int = 1, num_prompt_tokens: int = 0,
                 start: float | None = None) -> None:
        self.metrics = metrics
        self.start = time.perf_counter() if start is None else start  # arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.last_token: list[float | None] = [None] * n  # per sample: when its latest token came
        self.first = True
        self.unfinished = n

    def observe(self, delta: RequestDelta) -> None:
        now = time.perf_counter()
        m = self.metrics
        if delta.token_ids:
            last = self.last_token[delta.index]
            if self.first:
                self.first = False
                m.ttft.observe(now - self.start)
                m.prompt_tokens.inc(delta.num_prompt_tokens or self.num_prompt_tokens)
            elif last is not None:
                m.itl.observe(now - last)
            self.last_token[delta.index] = now
            m.generation_tokens.inc(len(delta.token_ids))
        if delta.finished and self.unfinished > 0:
            if delta.error is not None and delta.error.status < 500:  # refused, never served
                self.unfinished = 0
                return
            reason = "error" if delta.error is not None else (delta.finish_reason or "stop")
            m.success.labels(m.model_name, reason).inc()
            self.unfinished -= 1
            if self.unfinished == 0 or delta.error is not None:  # an error ends every sample
                self.unfinished = 0
                m.e2e.observe(now - self.start)

    def aborted(self) -> None:
        """The client left: each sample not finished yet counts as ``abort``."""
        if self.unfinished > 0:
            self.metrics.success.labels(self.metrics.model_name, "abort").inc(self.unfinished)
            self.unfinished = 0


class GatewayMetrics:
    """One gateway's Prometheus registry and the latest scheduler statistics; ``resubmitted``
    (its ``EngineClient.num_resubmitted``) is shown as ``pagedllm:request_resubmissions_total``."""

    def __init__(self, model_name: str, resubmitted: Callable[[], int] | None = None) -> None:
        self.model_name = model_name
        self.latest: SchedulerStats | None = None
        self.received = 0.0  # time.monotonic() of ``latest``
        self._sub: Subscription | None = None
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.success = Counter("vllm:request_success", "Finished requests (samples), by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        # children bound to the model label: nothing to look up per delta
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels,
                                         registry=r).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from arrival)", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a sample",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        r.register(_SchedulerCollector(self))
        if resubmitted is not None:
            r.register(_ResubmissionCollector(model_name, resubmitted))

    def update(self, stats: SchedulerStats) -> None:
        """Keep ``stats`` as the latest scheduler statistics."""
        self.latest = stats
        self.received = time.monotonic()

    def current_stats(self) -> SchedulerStats | None:
        """The latest statistics, or None when none came within ``STALE_AFTER_S``."""
        if self.latest is None or time.monotonic() - self.received > STALE_AFTER_S:
            return None
        return self.latest

    async def subscribe(self, bus: Bus) -> None:
        """Follow this model's ``SchedulerStats`` on ``bus`` (until ``close``)."""

        async def on_stats(stats: SchedulerStats) -> None:
            self.update(stats)

        self._sub = await bus.subscribe(Subjects(self.model_name).stats, SchedulerStats, on_stats)

    async def close(self) -> None:
        """Stop following the statistics."""
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection is already closed or draining
                await self._sub.unsubscribe()
            self._sub = None

    def timer(self, n: int = 1, num_prompt_tokens: int = 0, start: float | None = None) -> RequestTimer:
        """A timer for one request of ``n`` samples that arrived at ``start`` (perf_counter; default now)."""
        return RequestTimer(self, n, num_prompt_tokens, start)

    def render(self) -> bytes:
        """The metrics in Prometheus' text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
