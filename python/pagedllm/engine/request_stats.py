"""RequestStats: vLLM v1's per-request latency and size histograms (vllm.v1.metrics.loggers),
observed by the EngineLoop as it hands out each step's outputs, so that every front end (the
AsyncLLM of this process, or several API server processes) reads the same series.

Histograms (vLLM's names and bucket bounds; seconds unless named tokens):
  time_to_first_token_seconds     first output token - arrival (the front end's add_request)
  inter_token_latency_seconds     between consecutive outputs that carry new tokens (also exported
                                  under vLLM's older name time_per_output_token_seconds)
  e2e_request_latency_seconds     finish - arrival
  request_queue_time_seconds, request_prefill_time_seconds, request_decode_time_seconds,
  request_inference_time_seconds  from the request's RequestMetrics (queued -> scheduled -> first
                                  token -> last token)
  request_prompt_tokens, request_generation_tokens, request_max_num_generation_tokens,
  request_params_max_tokens, request_params_n
and the counter request_success{finished_reason} (stop, length, abort, error).

Times: ``arrival`` is the front end's ``time.monotonic()`` (system-wide on Linux, so it holds
across the engine process); ``now`` the loop's when it emits the step's outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from pagedllm.metrics import PREFIX, Counter, HistogramData, Metric
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# Bucket bounds of vLLM's front-end histograms (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
#: vLLM's request_params_n buckets
N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclasses.dataclass
class _Request:
    arrival: float
    params: SamplingParams
    delta: bool
    tokens_seen: int = 0
    last_token_time: Optional[float] = None
    seq_tokens: dict = dataclasses.field(default_factory=dict)  # sequence index -> output tokens


class RequestStats:
    """The histograms and counter of the module docstring for one engine; max_model_len sets the
    token-count buckets (1, 2, 5, 10, ... up to it)."""

    def __init__(self, max_model_len: int):
        tokens = buckets_1_2_5(max_model_len)
        self.histograms = {
            "time_to_first_token_seconds": HistogramData(TTFT_BUCKETS),
            "inter_token_latency_seconds": HistogramData(ITL_BUCKETS),
            "e2e_request_latency_seconds": HistogramData(E2E_BUCKETS),
            "request_queue_time_seconds": HistogramData(E2E_BUCKETS),
            "request_inference_time_seconds": HistogramData(E2E_BUCKETS),
            "request_prefill_time_seconds": HistogramData(E2E_BUCKETS),
            "request_decode_time_seconds": HistogramData(E2E_BUCKETS),
            "request_prompt_tokens": HistogramData(tokens),
            "request_generation_tokens": HistogramData(tokens),
            "request_max_num_generation_tokens": HistogramData(tokens),
            "request_params_max_tokens": HistogramData(tokens),
            "request_params_n": HistogramData(N_BUCKETS),
        }
        self.finished_by_reason = {r: 0 for r in FINISH_REASONS}
        self._requests: dict[str, _Request] = {}

    def on_add(self, request_id: str, params: SamplingParams, arrival: float) -> None:
        self._requests[request_id] = _Request(arrival, params, params.output_kind == RequestOutputKind.DELTA)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is not None:
                self._observe(req, out, now)
                if out.finished:
                    del self._requests[out.request_id]

    def on_failed(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._requests.pop(rid, None) is not None:
                self.finished_by_reason["error"] += 1

    def metrics(self, labels: dict[str, str]) -> list[Metric]:
        out: list[Metric] = [hist.metric(PREFIX + name, dict(labels)) for name, hist in self.histograms.items()]
        # vLLM's older name of the same series (its dashboards still query it)
        out.append(self.histograms["inter_token_latency_seconds"].metric(
            PREFIX + "time_per_output_token_seconds", dict(labels)))
        for reason, count in self.finished_by_reason.items():
            out.append(Counter(PREFIX + "request_success", {**labels, "finished_reason": reason}, count))
        return out

    def _observe(self, req: _Request, out: RequestOutput, now: float) -> None:
        for c in out.outputs:
            req.seq_tokens[c.index] = req.seq_tokens.get(c.index, 0) * req.delta + len(c.token_ids)
        total = sum(req.seq_tokens.values())
        hist = self.histograms
        if total > req.tokens_seen:
            if req.last_token_time is None:
                hist["time_to_first_token_seconds"].observe(now - req.arrival)
            else:
                hist["inter_token_latency_seconds"].observe(now - req.last_token_time)
            req.last_token_time = now
            req.tokens_seen = total
        if out.finished:
            hist["e2e_request_latency_seconds"].observe(now - req.arrival)
            reason = out.outputs[0].finish_reason if out.outputs else "abort"
            self.finished_by_reason[reason if reason in self.finished_by_reason else "abort"] += 1
            self._observe_finished(req, out, total)

    def _observe_finished(self, req: _Request, out: RequestOutput, total: int) -> None:
        hist, m = self.histograms, out.metrics
        if m is not None and m.first_scheduled_time is not None:
            hist["request_queue_time_seconds"].observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                last = m.last_token_time if m.last_token_time is not None else m.first_token_time
                hist["request_prefill_time_seconds"].observe(m.first_token_time - m.first_scheduled_time)
                hist["request_decode_time_seconds"].observe(last - m.first_token_time)
                hist["request_inference_time_seconds"].observe(last - m.first_scheduled_time)
        hist["request_prompt_tokens"].observe(len(out.prompt_token_ids))
        hist["request_generation_tokens"].observe(total)
        hist["request_max_num_generation_tokens"].observe(max(req.seq_tokens.values(), default=0))
        hist["request_params_n"].observe(req.params.n)
        if req.params.max_tokens is not None:
            hist["request_params_max_tokens"].observe(req.params.max_tokens)
