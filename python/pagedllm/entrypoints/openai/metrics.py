"""/metrics: the engine's metrics (``AsyncLLM.get_metrics()``) exported through prometheus_client.

A custom Collector turns the metric list into Prometheus families at scrape time, so /metrics
and get_metrics() always agree. Names are vLLM v1's with the ``pagedllm:`` prefix (``--metrics-prefix
vllm`` serves them as ``vllm:...``, so that vLLM's Grafana dashboards and alerts work unchanged); counters get
prometheus_client's ``_total`` suffix (``pagedllm:prompt_tokens_total``), histograms their
``_bucket`` / ``_sum`` / ``_count`` series, ``cache_config_info`` is a gauge of 1 whose labels
give block_size and num_gpu_blocks (as vLLM's).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pagedllm.metrics import Counter, Gauge, Histogram, Metric, Vector

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
    "time_per_output_token_seconds": "Time per output token (vLLM's older name of inter_token_latency_seconds).",
    "request_queue_time_seconds": "Time a request waited before its first step, in seconds.",
    "request_inference_time_seconds": "Time from a request's first step to its last token, in seconds.",
    "request_prefill_time_seconds": "Time from a request's first step to its first token, in seconds.",
    "request_decode_time_seconds": "Time from a request's first token to its last, in seconds.",
    "request_prompt_tokens": "Prompt tokens per finished request.",
    "request_generation_tokens": "Generated tokens per finished request (all of its sequences).",
    "request_max_num_generation_tokens": "Most tokens one sequence of a finished request generated.",
    "request_params_max_tokens": "The max_tokens of finished requests.",
    "request_params_n": "The n of finished requests.",
    "iteration_tokens_total": "Tokens per engine step.",
    "pipeline_steps_in_flight": "Pipeline parallelism: engine steps in flight when one is submitted (itself "
                                "included); 2 or more means the stages computed different steps at once.",
    "spec_decode_num_drafts": "Number of spec decoding drafts (sequence-steps with draft tokens).",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}


class EngineMetricsCollector(Collector):
    """Yields Prometheus families for ``get_metrics()`` (a callable returning pagedllm Metrics)."""

    def __init__(self, get_metrics: Callable[[], list[Metric]], prefix: str = "pagedllm"):
        self.get_metrics = get_metrics
        self.prefix = prefix

    def describe(self):
        return []

    def collect(self):
        families: dict[str, object] = {}
        for m in self.get_metrics():
            short = m.name.split(":", 1)[-1]
            name = f"{self.prefix}:{short}"
            doc = _HELP.get(short, short.replace("_", " "))
            labels = sorted(m.labels)
            fam = families.get(name)
            if isinstance(m, Counter):
                if fam is None:
                    fam = families[name] = CounterMetricFamily(name, doc, labels=labels)
                fam.add_metric([m.labels[k] for k in labels], m.value)
            elif isinstance(m, Gauge):
                if fam is None:
                    fam = families[name] = GaugeMetricFamily(name, doc, labels=labels)
                fam.add_metric([m.labels[k] for k in labels], m.value)
            elif isinstance(m, Vector):  # one counter per position, as vLLM exports it
                if fam is None:
                    fam = families[name] = CounterMetricFamily(name, doc, labels=labels + ["position"])
                for pos, v in enumerate(m.values):
                    fam.add_metric([m.labels[k] for k in labels] + [str(pos)], v)
            elif isinstance(m, Histogram):
                if fam is None:
                    fam = families[name] = HistogramMetricFamily(name, doc, labels=labels)
                buckets = [(_bound(b), float(c)) for b, c in m.buckets.items()]
                fam.add_metric([m.labels[k] for k in labels], buckets, m.sum)
        yield from families.values()


def _bound(b: str) -> str:
    return "+Inf" if b == "+Inf" else repr(float(b))


def make_registry(get_metrics: Callable[[], list[Metric]], prefix: str = "pagedllm") -> CollectorRegistry:
    """A registry serving get_metrics() under `prefix` ("pagedllm", or "vllm" for vLLM's names)."""
    if not prefix or not prefix.replace("_", "a").isalnum() or prefix[0].isdigit():
        raise ValueError(f"metrics prefix must be a Prometheus name part ([a-zA-Z_][a-zA-Z0-9_]*), got {prefix!r}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineMetricsCollector(get_metrics, prefix))
    return registry


__all__ = ["EngineMetricsCollector", "make_registry"]
