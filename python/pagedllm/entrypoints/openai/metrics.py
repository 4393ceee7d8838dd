"""/metrics: the engine's metrics (``AsyncLLM.get_metrics()``) exported through prometheus_client.

A custom Collector turns the metric list into Prometheus families at scrape time, so /metrics
and get_metrics() always agree. Names are vLLM v1's with the ``pagedllm:`` prefix; counters get
prometheus_client's ``_total`` suffix (``pagedllm:prompt_tokens_total``), histograms their
``_bucket`` / ``_sum`` / ``_count`` series, ``cache_config_info`` is a gauge of 1 whose labels
give block_size and num_gpu_blocks (as vLLM's).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pagedllm.metrics import Counter, Gauge, Histogram, Metric

_HELP = {
    "num_requests_running": "Number of sequences in the running batch.",
    "num_requests_waiting": "Number of sequences waiting to be scheduled.",
    "kv_cache_usage_perc": "KV-cache usage, a fraction of the blocks (1 = 100%); prefix-cache-only blocks count as free.",
    "prefix_cache_queries": "Prefix-cache queries, in tokens.",
    "prefix_cache_hits": "Prefix-cache hits, in tokens.",
    "prompt_tokens": "Prefill (prompt) tokens processed.",
    "generation_tokens": "Generation tokens processed.",
    "num_preemptions": "Cumulative number of preemptions.",
    "cache_config_info": "Information of the KV-cache configuration.",
    "time_to_first_token_seconds": "Time to first token (from arrival), in seconds.",
    "inter_token_latency_seconds": "Time between consecutive output tokens, in seconds.",
    "e2e_request_latency_seconds": "End-to-end request latency, in seconds.",
    "request_success": "Finished requests, by finish reason.",
}


class EngineMetricsCollector(Collector):
    """Yields Prometheus families for ``get_metrics()`` (a callable returning pagedllm Metrics)."""

    def __init__(self, get_metrics: Callable[[], list[Metric]]):
        self.get_metrics = get_metrics

    def describe(self):
        return []

    def collect(self):
        families: dict[str, object] = {}
        for m in self.get_metrics():
            short = m.name.split(":", 1)[-1]
            doc = _HELP.get(short, short.replace("_", " "))
            labels = sorted(m.labels)
            fam = families.get(m.name)
            if isinstance(m, Counter):
                if fam is None:
                    fam = families[m.name] = CounterMetricFamily(m.name, doc, labels=labels)
                fam.add_metric([m.labels[k] for k in labels], m.value)
            elif isinstance(m, Gauge):
                if fam is None:
                    fam = families[m.name] = GaugeMetricFamily(m.name, doc, labels=labels)
                fam.add_metric([m.labels[k] for k in labels], m.value)
            elif isinstance(m, Histogram):
                if fam is None:
                    fam = families[m.name] = HistogramMetricFamily(m.name, doc, labels=labels)
                buckets = [(_bound(b), float(c)) for b, c in m.buckets.items()]
                fam.add_metric([m.labels[k] for k in labels], buckets, m.sum)
        yield from families.values()


def _bound(b: str) -> str:
    return "+Inf" if b == "+Inf" else repr(float(b))


def make_registry(get_metrics: Callable[[], list[Metric]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineMetricsCollector(get_metrics))
    return registry


__all__ = ["EngineMetricsCollector", "make_registry"]
