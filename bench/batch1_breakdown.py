"""Where a batch-1 decode token goes on the GPU (issue 7's latency goal): engine wall time per
token against the GPU time of the step's CUDA graph alone, and the host's share.

Llama-3-8B shape (bench/throughput_gpu.py's SHAPES), random bf16 weights on the GPU, one
request of 256 random prompt tokens and 256 greedy output tokens (ignore_eos), CUDA graphs on.
Reported (all in microseconds):
- token_us: wall time per output token through LLM.generate (TTFT removed), as throughput_gpu;
- graph_us: one replay of the batch-1 decode graph (all its segments), timed by CUDA events over
  200 back-to-back replays (the GPU's part of a step: embeddings, 32 layers, final norm, LM head,
  logits copy); graph_launch_host_us / first_segment_launch_host_us: host time of submitting all
  segments / the first one (perf_counter, GPU idle before each);
- argmax_torch_us / argmax_native_us: torch.argmax vs pagedllm.ops.argmax_rows on the graph's
  float32 logits row (GPU time: 20 calls captured in a CUDA graph, replays timed);
- host phases of engine.step (perf_counter medians over 100 steps, no synchronisation added):
  schedule, execute_model (input copies + graph launch), sampler (includes waiting for the GPU),
  update_from_output + release; step_us their total. step_us - graph_us - argmax is what the GPU
  waits for the host per token; a cProfile of 50 steps goes beside the JSON (-host-profile.txt).
JSON to <out>/<date>-<machine>-<name>.json.

With async scheduling (the CUDA default; --async-scheduling false turns it off) the sampler phase
is sample_async (launching the step's argmax and its copy to the host) and the wait for the
previous step's ids falls in neither phase; the host gap is then what the host's work of a step
does not hide behind the GPU.

    python3 bench/batch1_breakdown.py [--shape llama3-8b] [--async-scheduling auto|true|false]
        [--out DIR] [--name batch1_breakdown]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_gpu import SHAPES, host_profile  # noqa: E402


def cuda_time_us(fn, reps: int = 200) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def graph_time_us(fn, reps: int = 20) -> float:
    """GPU time of one fn() call: `reps` calls captured in one CUDA graph, replays timed (no
    host launch cost in the figure)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    return cuda_time_us(graph.replay, 20) / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--machine", default="h200")
    p.add_argument("--name", default="batch1_breakdown")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    from pagedllm import LLM, SamplingParams
    from pagedllm import ops

    cfg = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg["vocab_size"], (args.input_len,), generator=g).tolist()
    result = {"bench": "batch1_breakdown", "machine": args.machine, "gpu": torch.cuda.get_device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": os.environ.get("PAGEDLLM_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                  cwd=Path(__file__).parent).stdout.strip() or "unknown",
              "shape": args.shape, "input_len": args.input_len, "output_len": args.output_len}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(cfg))
        llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=args.input_len + args.output_len,
                  max_num_seqs=8, async_scheduling={"auto": None, "true": True, "false": False}[args.async_scheduling])
    engine = llm.llm_engine
    result["async_scheduling"] = bool(engine.async_scheduling)
    result["gemv_rope_epilogue"] = engine.runner.model.layers[0].rope_counters is not None
    runner = engine.runner
    one = [{"prompt_token_ids": prompt}]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(one, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(one, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(one, greedy, use_tqdm=False)
    result["token_us"] = (time.perf_counter() - t - ttft) / (args.output_len - 1) * 1e6
    result["ttft_us"] = ttft * 1e6

    # host phases of engine.step at batch 1 (wrapped, no synchronisation added)
    phases: dict[str, list[float]] = {"schedule": [], "execute_model": [], "sampler": [], "update": []}
    core, sampler = engine.core, engine.sampler

    class Timed:
        def __init__(self, obj, name, key):
            self.obj, self.fn, self.key = obj, getattr(obj, name), key

        def __call__(self, *a, **k):
            t0 = time.perf_counter()
            out = self.fn(*a, **k)
            phases[self.key].append(time.perf_counter() - t0)
            return out

        def __getattr__(self, name):  # the wrapped object's other attributes (e.g. the sampler's)
            return getattr(self.obj, name)

    engine.add_request("b1", None, prompt, greedy)
    for _ in range(4):
        engine.step()
    orig = (engine.core, engine.runner.execute_model, engine.sampler)

    class CoreProxy:
        def __init__(self, c):
            self._c = c
            self.schedule = Timed(c, "schedule", "schedule")
            self.update_from_output = Timed(c, "update_from_output", "update")

        def __getattr__(self, name):
            return getattr(self._c, name)

    engine.core = CoreProxy(core)
    runner.execute_model = Timed(runner, "execute_model", "execute_model")
    engine.sampler = Timed(sampler, "sample_async" if engine.async_scheduling else "__call__", "sampler")
    steps = []
    for _ in range(100):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    engine.core, engine.sampler = orig[0], orig[2]
    del runner.execute_model
    host_text = host_profile(engine, 50, 30)
    while engine.has_unfinished_requests():
        engine.step()
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    result["step_us"] = med(steps)
    result["host_phases_us"] = {k: med(v) for k, v in phases.items() if v}

    # the batch-1 graph alone, and the greedy argmax on its logits row
    graphs = runner.graphs
    size = graphs.graph_size(1)
    result["graph_segments"] = len(graphs._graphs[size])
    result["graph_us"] = cuda_time_us(lambda: graphs.replay(size))
    launches = []
    for _ in range(50):  # host time of submitting the graph(s), GPU drained before each
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs.replay(size)
        launches.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    result["graph_launch_host_us"] = statistics.median(launches) * 1e6
    first = graphs._graphs[size][0]
    launches.clear()
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first.replay()
        launches.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    result["first_segment_launch_host_us"] = statistics.median(launches) * 1e6
    row = graphs._logits[:1, : cfg["vocab_size"]]
    result["argmax_torch_us"] = graph_time_us(lambda: row.argmax(dim=-1))
    result["argmax_native_us"] = graph_time_us(lambda: ops.argmax_rows(row))
    assert int(row.argmax(dim=-1)) == int(ops.argmax_rows(row))
    result["host_gap_us"] = result["token_us"] - result["graph_us"] - result["argmax_native_us"]
    llm.shutdown()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.date.today().isoformat()}-{args.machine}-{args.name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    path.with_name(path.stem + "-host-profile.txt").write_text(
        "cProfile of 50 batch-1 decode steps (engine.step), by own time\n" + host_text)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
