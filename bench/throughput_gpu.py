"""GPU mode of the throughput benchmark (issue 7): pagedllm vs HF transformers vs the roofline.

For each model shape (Llama-3-8B and a Qwen2-0.5B-like shape, ../shared/models.md), with random
bf16 weights drawn on the GPU (pagedllm: LLM(load_format="dummy") on a config-only folder; HF:
from_config under torch.device("cuda")):
- pagedllm on N requests of `input_len` random tokens / `output_len` output tokens (ignore_eos,
  greedy), after a warm-up; output tok/s;
- HF transformers `generate` on one static batch of the first `hf_batch` of the same requests;
- the workload's roofline from a bf16 GEMM TFLOP/s and a device copy bandwidth measured here:
  max(matrix FLOPs / TFLOP/s, bytes of weights and KV read / bandwidth), both summed over the
  workload with decode steps of max_num_seqs sequences;
- batch-1 decode: seconds per output token of one request (TTFT removed) against the floor of
  reading the weights once per token (weight bytes / copy bandwidth);
- a torch.profiler summary of a few decode steps beside the JSON (<name>-<shape>-profile.txt).

    python3 bench/throughput_gpu.py [--shapes llama3-8b qwen2-0.5b] [--num-prompts 1000]
        [--input-len 256 --output-len 256 --hf-batch 256] [--kv-cache-dtype auto fp8] [--out DIR]
JSON: <out>/<date>-h200-throughput_gpu.json (--machine sets the middle part).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

SHAPES = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen2-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                       intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, torch_dtype="bfloat16"),
}


def measure_device() -> dict:
    """bf16 GEMM TFLOP/s (8192^3, mean of 10 after 3 warm-ups) and copy bandwidth (bytes read +
    written per second, 4 GiB device-to-device copy, mean of 10)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    tflops = 2 * n**3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    del a, b
    return {"gemm_bf16_tflops": tflops, "copy_bytes_per_s": copy_bandwidth()}


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 4 GiB device-to-device copy (mean of 10 after 3
    warm-ups): the bandwidth of the roofline and of the batch-1 floor (also bench/gemv.py's and
    bench/batch1_graph.py's)."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bw = 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bw


#: bytes per decoder-projection weight of each --quantization (the LM head stays 16-bit); int4:
#: half a byte plus a bfloat16 scale and zero per group of 128
PROJECTION_BYTES = {None: 2.0, "fp8": 1.0, "int4": 0.5 + 4 / 128}


def model_numbers(cfg: dict, quantization: str | None = None) -> dict:
    h, L, inter, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter
    matmul_params = L * per_layer + V * h  # + the LM head
    weight_bytes = 2 * (matmul_params + (0 if cfg["tie_word_embeddings"] else V * h))
    read = PROJECTION_BYTES[quantization] * L * per_layer + 2 * V * h
    return {"matmul_params": matmul_params, "weight_bytes_read_per_step": read,
            "weight_bytes_total": weight_bytes, "kv_bytes_per_token": 2 * L * hkv * d * 2, "L": L, "hq": hq, "d": d}


def roofline(cfg: dict, dev: dict, n_req: int, n_in: int, n_out: int, batch: int,
             quantization: str | None = None) -> dict:
    """The bf16 GEMM rate bounds compute (fp8's tensor cores are twice as fast: its compute bound
    is halved); the memory bound reads each format's weight bytes once per decode step."""
    m = model_numbers(cfg, quantization)
    tokens = n_req * (n_in + n_out)
    flops = 2 * m["matmul_params"] * tokens  # dense matrices
    flops += 4 * m["L"] * m["hq"] * m["d"] * n_req * sum(n_in / 2 + i for i in range(n_out))  # attention (approx)
    decode_steps = -(-n_req // batch) * n_out
    kv_read = m["kv_bytes_per_token"] * n_req * sum(n_in + i for i in range(n_out))
    bytes_read = m["weight_bytes_read_per_step"] * decode_steps + kv_read
    t_compute = flops / (dev["gemm_bf16_tflops"] * 1e12 * (2 if quantization == "fp8" else 1))
    t_memory = bytes_read / dev["copy_bytes_per_s"]
    seconds = max(t_compute, t_memory)
    return {"matrix_flops": flops, "bytes_read": bytes_read, "compute_s": t_compute, "memory_s": t_memory,
            "seconds": seconds, "output_tok_s": n_req * n_out / seconds,
            "batch1_floor_s_per_token": m["weight_bytes_read_per_step"] / dev["copy_bytes_per_s"]}


def host_profile(engine, steps: int, rows: int) -> str:
    """cProfile of `steps` calls of engine.step(): the `rows` functions with the most own time."""
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        engine.step()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def bench_pagedllm(folder: Path, prompts, args, profile_path: Path, kv_cache_dtype: str = "auto") -> dict:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size,
              quantization=args.quantization, kv_cache_dtype=kv_cache_dtype,
              async_scheduling={"auto": None, "true": True, "false": False}[args.async_scheduling])
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:32]], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    # batch 1: TTFT and the per-token decode time of one request
    one = [{"prompt_token_ids": prompts[0]}]
    llm.generate(one, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    t2 = time.perf_counter()
    llm.generate(one, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    ttft = time.perf_counter() - t2
    t3 = time.perf_counter()
    llm.generate(one, params, use_tqdm=False)
    b1 = (time.perf_counter() - t3 - ttft) / (args.output_len - 1)
    # profile: a few decode steps at the full batch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    # batch-1 decode under the profiler: GPU time per step against the step's wall time
    greedy40 = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("prof-b1", None, prompts[0], greedy40)
    for _ in range(6):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof1:
        t5 = time.perf_counter()
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
        b1_step_s = (time.perf_counter() - t5) / 8
    while engine.has_unfinished_requests():
        engine.step()
    b1_gpu_s = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                   for e in prof1.key_averages()) / 8 / 1e6
    b1_text = (f"batch-1 decode: 8 engine steps, {b1_step_s * 1e3:.3f} ms per step under the profiler, "
               f"{b1_gpu_s * 1e3:.3f} ms of GPU kernel time per step\n\n"
               + prof1.key_averages().table(sort_by="self_cuda_time_total", row_limit=20) + "\n\n"
               + prof1.key_averages().table(sort_by="self_cpu_time_total", row_limit=15) + "\n\n")
    prof_batch = min(256, args.max_num_seqs)
    for i, p in enumerate(prompts[:prof_batch]):  # greedy, as the measured workload
        engine.add_request(f"prof{i}", None, p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for _ in range(12):  # the prefill steps and the first decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t4 = time.perf_counter()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - t4) / 4
    host_text = host_profile(engine, 3, 25)
    while engine.has_unfinished_requests():
        engine.step()
    profile_path.write_text(
        f"4 engine steps (decode, batch {prof_batch}), {step_s * 1e3:.2f} ms per step under the profiler\n\n"
        + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25) + "\n\n"
        + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        + "\n\nHost (cProfile, 3 decode steps, by own time):\n" + host_text + "\n\n" + b1_text)
    result = {
        "output_tokens": n_out, "seconds": seconds, "output_tok_s": n_out / seconds,
        "total_tok_s": (n_out + len(prompts) * args.input_len) / seconds, "startup_s": startup,
        "startup_phases_s": dict(runner.phase_seconds), "num_blocks": runner.num_blocks,
        "weight_bytes": runner.weight_bytes, "kv_cache_dtype": kv_cache_dtype,
        "kv_cache_torch_dtype": str(runner.cache_dtype).removeprefix("torch."),
        "kv_tokens": runner.num_blocks * runner.block_size,
        "cuda_graph_replays": metrics.get("pagedllm:cuda_graph_replays"),
        "num_preemptions": metrics.get("pagedllm:num_preemptions"), "num_steps": metrics.get("pagedllm:num_steps"),
        "batch1_ttft_s": ttft, "batch1_s_per_token": b1, "profiled_step_s": step_s,
        "batch1_profiled_step_s": b1_step_s, "batch1_gpu_kernel_s_per_step": b1_gpu_s,
        "fused_layer_ops": bool(runner.model.fused),
        "gemv_max_tokens": int(getattr(runner.model, "gemv_max_tokens", 0)),
        "pdl": bool(getattr(__import__("pagedllm")._C, "pdl_enabled", lambda: False)()),
        "async_output_processing": bool(engine.async_output_processing),
        "async_scheduling": bool(engine.async_scheduling),
        "gemv_rope_epilogue": bool(runner.model.layers and runner.model.layers[0].rope_counters is not None),
    }
    llm.shutdown()
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def bench_hf(cfg: dict, prompts, args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                          if k not in ("architectures", "model_type", "torch_dtype")})
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.eval()
    startup = time.perf_counter() - t0
    ids = torch.tensor(prompts[: args.hf_batch], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(input_ids=ids[:, :16], max_new_tokens=4, min_new_tokens=4, **dict(kw, attention_mask=torch.ones_like(ids[:, :16])))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out = model.generate(input_ids=ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **kw)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t1
    n_out = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
    del model, out
    gc.collect()
    torch.cuda.empty_cache()
    return {"batch": int(ids.shape[0]), "output_tokens": n_out, "seconds": seconds, "output_tok_s": n_out / seconds,
            "startup_s": startup}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=1024, help="vLLM v1's default on H100-class GPUs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="pagedllm's ranks, one GPU each (HF runs on one GPU; the roofline is one GPU's)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pagedllm's pipeline stages (x --tensor-parallel-size ranks, one GPU each)")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "true", "false"],
                   help="schedule step N + 1 before step N's tokens are known (auto: on, CUDA)")
    p.add_argument("--quantization", default=None, choices=["fp8", "int4"],
                   help="pagedllm's weights quantized at load (LLM(quantization=...)); HF stays bf16")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV-cache dtypes to run, one after the other on the same prompts (the first is 'pagedllm', "
                        "the others 'pagedllm_kv_<dtype>' with their ratio to the first)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--machine", default="h200")
    p.add_argument("--name", default="throughput_gpu")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    commit = os.environ.get("PAGEDLLM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    dev = measure_device()
    result = {"bench": "throughput_gpu", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": args.machine, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": commit or "unknown", "device_measured": dev,
              "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                           "hf_batch": args.hf_batch, "dtype": "bfloat16", "greedy": True, "ignore_eos": True,
                           "max_num_seqs": args.max_num_seqs, "enforce_eager": args.enforce_eager,
                           "tensor_parallel_size": args.tensor_parallel_size,
                           "pipeline_parallel_size": args.pipeline_parallel_size,
                           "async_scheduling": args.async_scheduling, "quantization": args.quantization,
                           "kv_cache_dtype": args.kv_cache_dtype},
              "shapes": {}}
    path = out_dir / f"{day}-{args.machine}-{args.name}.json"
    for shape in args.shapes:
        cfg = SHAPES[shape]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, cfg["vocab_size"], (args.num_prompts, args.input_len), generator=g).tolist()
        entry: dict = {"config": cfg, "roofline": roofline(cfg, dev, args.num_prompts, args.input_len, args.output_len,
                                                             args.max_num_seqs, args.quantization)}
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "config.json").write_text(json.dumps(cfg))
            for i, kv in enumerate(args.kv_cache_dtype):
                key = "pagedllm" if i == 0 else f"pagedllm_kv_{kv}"
                suffix = "" if i == 0 else f"-kv-{kv}"
                try:
                    entry[key] = bench_pagedllm(Path(folder), prompts, args,
                                                out_dir / f"{day}-{args.machine}-{args.name}-{shape}{suffix}-profile.txt",
                                                kv)
                except Exception as exc:  # keep going: the other engine and shape still measure
                    import traceback

                    traceback.print_exc()
                    entry[key] = {"error": repr(exc)}
                first = entry["pagedllm"].get("output_tok_s")
                if i > 0 and first and entry[key].get("output_tok_s"):
                    entry[f"kv_{kv}_vs_{args.kv_cache_dtype[0]}"] = {
                        "output_tok_s": entry[key]["output_tok_s"] / first,
                        "kv_tokens": entry[key]["kv_tokens"] / entry["pagedllm"]["kv_tokens"]}
        if not args.skip_hf:
            try:
                entry["hf_transformers"] = bench_hf(cfg, prompts, args)
            except Exception as exc:
                entry["hf_transformers"] = {"error": repr(exc)}
        ours = entry["pagedllm"].get("output_tok_s")
        if ours:
            entry["fraction_of_roofline"] = ours / entry["roofline"]["output_tok_s"]
            entry["batch1_vs_floor"] = entry["pagedllm"]["batch1_s_per_token"] / entry["roofline"]["batch1_floor_s_per_token"]
            hf = entry.get("hf_transformers", {}).get("output_tok_s")
            if hf:
                entry["ratio_vs_hf"] = ours / hf
        result["shapes"][shape] = entry
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({shape: {k: v for k, v in entry.items() if k != "config"}}, indent=1), flush=True)
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
