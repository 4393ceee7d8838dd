"""`pagedllm bench`: the kernel harness checks every kernel against its float64 reference before it
times it (a deliberately wrong kernel registered here fails and is not timed), and every
subcommand runs on the CPU at tiny sizes, writing valid JSON (and the kernel harness a PNG)."""

from __future__ import annotations

import json

import pytest
import torch

TINY = ["--batch", "1", "5", "--context", "33", "100", "--num-heads", "4", "--num-kv-heads", "2",
        "--head-size", "64", "--hidden-size", "96", "--trials", "2", "--threads", "1"]


def test_kernels_every_op_checked_timed_json_and_png(tmp_path):
    from pagedllm.cli import main

    out, png = tmp_path / "k.json", tmp_path / "k.png"
    assert main(["bench", "kernels", "--device", "cpu", "--dtype", "float32", "bfloat16", *TINY,
                 "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert doc["failed_checks"] == 0 and doc["device"] == "cpu" and doc["commit"]
    ops = {r["op"] for r in doc["rows"]}
    assert ops == {"paged_decode", "rms_norm", "silu_and_mul", "reshape_and_cache"}
    for r in doc["rows"]:
        assert r["check"] == "passed" and r["time_us"] > 0 and 0 < r["roofline_fraction"] < 10, r
    kernels = {(r["op"], r["kernel"]) for r in doc["rows"]}
    assert ("paged_decode", "sdpa") in kernels and ("rms_norm", "torch") in kernels
    decode = [r for r in doc["rows"] if r["op"] == "paged_decode"]
    assert {r["context"] for r in decode} == {33, 100} and {r["batch"] for r in decode} == {1, 5}
    for roof in doc["roofline"].values():
        assert roof["bandwidth_bytes_per_s"] > 0 and roof["matmul_flops_per_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wrong_registered_kernel_fails_its_reference_check(tmp_path):
    """A registered kernel beside ours: a correct one passes and is timed; one that forgets the
    norm's weight fails the check (its error reported, not timed) and the command exits 1."""
    from pagedllm.benchmarks import kernels

    def right(x):
        h = x["x"].float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + x["eps"])).to(x["x"].dtype) * x["weight"]

    def wrong(x):  # no weight
        h = x["x"].float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + x["eps"])).to(x["x"].dtype)

    kernels.register_kernel("rms_norm", "test-right", right)
    kernels.register_kernel("rms_norm", "test-wrong", wrong)
    try:
        with pytest.raises(ValueError, match="already has a kernel named 'test-right'"):
            kernels.register_kernel("rms_norm", "test-right", right)
        with pytest.raises(ValueError, match="op 'nope' is not one of"):
            kernels.register_kernel("nope", "x", right)
        result = kernels.run(kernels.BenchConfig(ops=["rms_norm"], batch=[3], dtype=["float32"], device="cpu",
                                                 compare=["test-right", "test-wrong"], hidden_size=96, trials=2,
                                                 threads=1))
        rows = {r["kernel"]: r for r in result["rows"]}
        assert rows["pagedllm"]["check"] == "passed" and rows["test-right"]["check"] == "passed"
        assert rows["test-wrong"]["check"] == "failed" and rows["test-wrong"]["max_rel_error"] > 0.1
        assert "time_us" not in rows["test-wrong"] and rows["test-right"]["time_us"] > 0
        assert result["failed_checks"] == 1
        assert kernels.main(["--op", "rms_norm", "--device", "cpu", "--dtype", "float32", "--batch", "3",
                             "--hidden-size", "96", "--trials", "2", "--threads", "1", "--compare", "test-wrong",
                             "--json", str(tmp_path / "w.json")]) == 1
    finally:
        kernels.OPS["rms_norm"].kernels.pop("test-right", None)
        kernels.OPS["rms_norm"].kernels.pop("test-wrong", None)


@pytest.mark.slow
def test_latency_json(tmp_path):
    from pagedllm.cli import main

    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "6",
                 "--num-iters-warmup", "1", "--num-iters", "2", "--device", "cpu", "--no-progress",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["iterations"]) == 2 and set(doc["latency_percentiles_s"]) == {"10", "25", "50", "75", "90", "99"}
    for it in doc["iterations"]:
        assert 0 < it["prefill_s"] <= it["latency_s"] and it["decode_s_per_token"] > 0
    assert doc["settings"]["batch_size"] == 2 and doc["median_decode_ms_per_token"] > 0
    assert main(["bench", "latency", "--batch-size", "0"]) == 2


@pytest.mark.slow
def test_serve_load_generator_json(tmp_path):
    """pagedllm bench serve against a running pagedllm server: every request answered, the
    latency fields present and consistent."""
    from server_utils import DEFAULT_ARGS, shared_server

    from pagedllm.cli import main

    server = shared_server("bench-serve", DEFAULT_ARGS)
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", server.url, "--concurrency", "2", "--num-prompts", "4",
                 "--input-len", "8", "--output-len", "4", "--warmup", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (level,) = doc["runs"]
    assert level["concurrency"] == 2 and level["completed"] == 4 and level["errors"] == 0
    assert level["total_output_tokens"] == 16 and level["output_throughput_tok_s"] > 0
    assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"] and doc["git_commit"]


@pytest.mark.cuda
def test_kernels_on_cuda(tmp_path):
    from pagedllm.benchmarks import kernels

    result = kernels.run(kernels.BenchConfig(ops=["paged_decode", "rms_norm"], batch=[2], context=[300],
                                             dtype=["bfloat16", "float16"], device="cuda", num_heads=8,
                                             num_kv_heads=2, head_size=128, hidden_size=512, trials=3))
    assert result["failed_checks"] == 0
    assert all(r["time_us"] > 0 for r in result["rows"])
