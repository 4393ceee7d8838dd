"""Engine metrics as vLLM's ``LLM.get_metrics()`` returns them (vllm.v1.metrics.reader): a list of
Counter / Gauge / Histogram objects with a name (vLLM v1 names, prefix ``pagedllm:``), labels and
value(s). The same list feeds the server's /metrics endpoint.

Names: num_requests_running, num_requests_waiting (gauges, sequences), kv_cache_usage_perc (gauge,
0..1 fraction; blocks held only by the prefix cache count as free), prefix_cache_queries and
prefix_cache_hits (counters, tokens), num_preemptions, prompt_tokens, generation_tokens, and
pagedllm's own: num_steps, num_chunked_prefills, num_forks, num_finished_requests,
num_aborted_requests; cache_config_info (gauge 1, labels block_size and num_gpu_blocks);
iteration_tokens_total and iteration_num_seqs (histograms of tokens and sequences per step);
under pipeline parallelism pipeline_steps_in_flight (steps in flight at each submission).
With speculative decoding: spec_decode_num_drafts, spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens (counters) and spec_decode_num_accepted_tokens_per_pos (a Vector:
accepted drafts at each position 0..k-1; Prometheus gets one counter per "position" label).
"""

from __future__ import annotations

import bisect
import dataclasses

PREFIX = "pagedllm:"


@dataclasses.dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    value: int


@dataclasses.dataclass
class Gauge(Metric):
    value: float


@dataclasses.dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # cumulative counts per upper bound ("+Inf" last), as Prometheus


@dataclasses.dataclass
class Vector(Metric):
    """Ordered integer counters (vLLM's reader.Vector; only spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


class HistogramData:
    """A cumulative histogram over fixed upper bounds (Prometheus semantics)."""

    def __init__(self, bounds: list[float]):
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, total = {}, 0
        for bound, c in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += c
            buckets[bound] = total
        return Histogram(name, labels, self.count, self.sum, buckets)


_COUNTERS = {  # metric name -> EngineStats field
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "num_prompt_tokens",
    "generation_tokens": "num_generation_tokens",
    "num_steps": "num_steps",
    "num_chunked_prefills": "num_chunked_prefills",
    "num_forks": "num_forks",
    "num_finished_requests": "num_finished_requests",
    "num_aborted_requests": "num_aborted_requests",
}


def metrics_from_stats(stats, model_name: str = "", histograms: dict[str, HistogramData] | None = None,
                       extra_waiting: int = 0) -> list[Metric]:
    """The metric list for an EngineStats (pagedllm._C) plus optional Python-side histograms.
    extra_waiting: requests the engine holds before the scheduler (structured outputs whose grammar
    compiles), counted as waiting."""
    labels = {"model_name": model_name} if model_name else {}
    out: list[Metric] = [
        Gauge(PREFIX + "num_requests_running", dict(labels), float(stats.num_running)),
        Gauge(PREFIX + "num_requests_waiting", dict(labels), float(stats.num_waiting + extra_waiting)),
        Gauge(PREFIX + "kv_cache_usage_perc", dict(labels), float(stats.kv_usage)),
    ]
    for name, field in _COUNTERS.items():
        if hasattr(stats, field):
            out.append(Counter(PREFIX + name, dict(labels), int(getattr(stats, field))))
    out.append(Gauge(PREFIX + "cache_config_info",
                     {"block_size": str(stats.block_size), "num_gpu_blocks": str(stats.num_blocks)}, 1.0))
    per_pos = list(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", []) or [])
    if per_pos:  # speculative decoding is on
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            out.append(Counter(PREFIX + name, dict(labels), int(getattr(stats, name))))
        out.append(Vector(PREFIX + "spec_decode_num_accepted_tokens_per_pos", dict(labels), [int(v) for v in per_pos]))
    for name, hist in (histograms or {}).items():
        out.append(hist.metric(PREFIX + name, dict(labels)))
    return out


__all__ = ["Metric", "Counter", "Gauge", "Histogram", "HistogramData", "Vector", "metrics_from_stats"]
