"""Prometheus metrics of a serving engine: vLLM's names under the `turnout:` prefix, fed from the engine
core's per-step SchedulerStats and IterationStats (never by reading the scheduler from the HTTP side)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily

from turnout.engine.async_llm import IterationStats
from turnout.engine.messages import SchedulerStats

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0]  # fmt: skip
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
FINISH_REASONS = ("stop", "length", "error")  # error: the engine died, or the drain's deadline cut it


class BulkHistogram:
    """A histogram fed a batch at a time (one numpy pass), for the per-token series: at 256 running
    requests one observe() per token would cost the event loop more than the rest of a step's news."""

    def __init__(
        self, name: str, doc: str, model_name: str, buckets: list[float], registry: CollectorRegistry
    ):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = np.array([*buckets, np.inf])
        self.counts = np.zeros(len(self.bounds), dtype=np.int64)
        self.sum = 0.0
        registry.register(self)

    def observe_many(self, values: list[float]) -> None:
        if values:
            v = np.asarray(values)
            self.counts += np.bincount(np.searchsorted(self.bounds, v), minlength=len(self.bounds))
            self.sum += float(v.sum())

    def collect(self) -> Iterator[HistogramMetricFamily]:
        h = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        le = ["+Inf" if np.isinf(b) else repr(float(b)) for b in self.bounds]
        h.add_metric([self.model_name], list(zip(le, np.cumsum(self.counts).tolist())), self.sum)
        yield h


class PrometheusStatLogger:
    """One registry per server; every series carries the served model's name."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series beside each counter and histogram (process-wide)
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"turnout:{name}", doc, label, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:  # exposed as <name>_total
            return Counter(f"turnout:{name}", doc, label, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"turnout:{name}", doc, label, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 = every block held by a request.")
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries since start, in tokens.")
        self.queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = Counter(
            "turnout:request_success",
            "Requests finished: stop, length, or error where the engine ended them with one.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:  # both series exist from the start, at 0
            self.success.labels(model_name, reason)
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = BulkHistogram(
            "turnout:inter_token_latency_seconds",
            "Time between two tokens of a request.",
            model_name,
            ITL_BUCKETS,
            r,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "A request's mean time per output token.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self._last = SchedulerStats()

    def record(self, s: SchedulerStats | None, it: IterationStats) -> None:
        if s is not None:
            last, self._last = self._last, s
            self.running.set(s.num_running)
            self.waiting.set(s.num_waiting)
            self.kv_usage.set(s.kv_cache_usage)
            self.queries.inc(s.prefix_cache_queries - last.prefix_cache_queries)
            self.hits.inc(s.prefix_cache_hits - last.prefix_cache_hits)
            self.hit_rate.set(s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
            self.preemptions.inc(s.num_preemptions - last.num_preemptions)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for x in it.time_to_first_tokens:
            self.ttft.observe(x)
        self.itl.observe_many(it.inter_token_latencies)
        if it.num_failed:
            self.success.labels(self.model_name, "error").inc(it.num_failed)
        for reason, e2e, tpot in it.finished:
            self.success.labels(self.model_name, reason).inc()
            self.e2e.observe(e2e)
            if tpot is not None:
                self.tpot.observe(tpot)

    def expose(self) -> bytes:
        return generate_latest(self.registry)
