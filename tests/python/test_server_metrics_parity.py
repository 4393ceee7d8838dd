"""/metrics as vLLM's dashboards read it (issue 31): every vLLM v1 metric family exists with the
model_name label, `--metrics-prefix vllm` serves them under vLLM's names, the per-request
histograms count a finished request with consistent values, and every series the bundled Grafana
dashboard (docs/grafana/pagedllm.json) queries exists on a running server."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, ROOT, shared_server  # noqa: E402

#: vLLM v1's metric families (vllm/v1/metrics/loggers.py; exposition names with their suffixes)
VLLM_SERIES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info",
    "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
    "num_preemptions_total", "request_success_total",
    *[f"{h}_{s}" for h in (
        "iteration_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
        "time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
        "request_params_n", "request_params_max_tokens") for s in ("bucket", "sum", "count")],
]


@pytest.fixture(scope="module")
def vllm_named():
    return shared_server("metrics-vllm", [*DEFAULT_ARGS, "--metrics-prefix", "vllm"])


def _series(text: str) -> dict[str, list[str]]:
    """{series name: [label strings]} of a Prometheus exposition."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s", line)
            out.setdefault(m.group(1), []).append(m.group(2) or "")
    return out


def _value(text: str, series: str, label_part: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(series) and label_part in line and not line.startswith(series + "_"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} {label_part} not in /metrics")


def test_every_vllm_family_under_vllm_names_with_consistent_request_histograms(vllm_named):
    url = vllm_named.url
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 7, "n": 2, "ignore_eos": True,
            "temperature": 1.0, "seed": 1}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(url + "/metrics").text
    series = _series(text)
    missing = [s for s in VLLM_SERIES if "vllm:" + s not in series]
    assert not missing, missing
    assert not any(name.startswith("pagedllm:") for name in series)
    assert all('model_name="tiny"' in labels for labels in series["vllm:num_requests_running"])
    # the request above: n = 2, max_tokens = 7, 14 generated tokens, 7 at most per sequence
    count = _value(text, "vllm:request_params_n_count")
    assert count >= 1
    assert _value(text, "vllm:request_params_n_bucket", 'le="2.0"') >= 1
    assert _value(text, "vllm:request_generation_tokens_sum") >= 14
    assert _value(text, "vllm:request_max_num_generation_tokens_bucket", 'le="10.0"') >= 1
    for h in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds"):
        assert _value(text, f"vllm:{h}_count") == count and _value(text, f"vllm:{h}_sum") >= 0
    # inference = prefill + decode for every request (sums over the same requests)
    inference = _value(text, "vllm:request_inference_time_seconds_sum")
    parts = _value(text, "vllm:request_prefill_time_seconds_sum") + _value(text, "vllm:request_decode_time_seconds_sum")
    assert abs(inference - parts) <= 1e-6 + 1e-6 * inference


def test_dashboard_queries_only_series_the_server_exposes():
    server = shared_server("default", DEFAULT_ARGS)
    httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
    series = _series(httpx.get(server.url + "/metrics").text)
    dashboard = json.loads((ROOT / "docs" / "grafana" / "pagedllm.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][0]["query"])
    used = {name for e in exprs for name in re.findall(r"pagedllm:[a-z0-9_]+", e)}
    assert len(used) >= 12
    missing = sorted(name for name in used if name not in series)
    assert not missing, missing
