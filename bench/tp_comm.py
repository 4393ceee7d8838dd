"""Tensor-parallel communication on one host, CPU: what a collective and a step hand-off cost, and
the collectives' share of a decode step.

1. all_reduce of [rows, hidden] float32 / bfloat16 (decode rows and a prefill chunk) between
   `--world` processes: pagedllm's shared-memory communicator ("shm", the CPU default) against
   gloo over TCP on 127.0.0.1 (PAGEDLLM_CPU_TP_BACKEND=gloo). Median / p90 microseconds per call.
2. The step hand-off to the workers: a decode step of 256 sequences and a prefill step of 8192
   tokens as flat arrays (executor/step_message.py) through the shared-memory MessageQueue against
   a gloo broadcast of the same bytes, 0.5 ms and 5 ms after the previous one (the reader polls
   for 2 ms, then sleeps). Median microseconds from put to the reader's copy.
3. --engine: a SmolLM2-135M-sized model (ENGINE_SHAPE, random weights: 8 heads so that 2 ranks
   divide them; --tiny: TINY_SHAPE, 4 small layers, where a step is mostly overhead) in each of
   --layouts (default tp1 and tp<world>: "tpN" / "ppN" / "tpNxppM", "-ray" for the Ray backend
   instead of "mp", "-gloo" for "mp" with gloo's collectives), fp32 decode steps of --batch sequences: the median engine.step() time, the
   time per decode round (every sequence one token; pipeline steps hold a share of the sequences),
   its overhead against tp1 in microseconds, and the time rank 0 spends in all_reduce / all_gather.

    PYTHONPATH=python python3 bench/tp_comm.py [--world 2] [--engine] [--batch 1 16 64]
        [--tiny --layouts tp1 tp2 tp2-ray pp2 pp2-ray --skip-collectives]

Prints JSON and writes bench/results/<YYYY-MM-DD>-<hostname>-tp_comm.json with the git commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import pagedllm  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))

ALLREDUCE_SHAPES = [(1, 576), (16, 576), (64, 576), (1, 4096), (64, 4096), (2048, 576)]


def _stats(times: list[float]) -> dict:
    t = np.array(times) * 1e6
    return {"median_us": round(float(np.median(t)), 1), "p90_us": round(float(np.percentile(t, 90)), 1)}


def _group(rank: int, world: int, backend: str, port: int, handle):
    from pagedllm.distributed.parallel_state import GroupCoordinator

    torch.set_num_threads(1)
    return GroupCoordinator.init(rank, world, torch.device("cpu"), backend, port=port, shm_handle=handle)


def _allreduce_rank(rank, world, backend, port, handle, iters, out_q):
    g = _group(rank, world, backend, port, handle)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rows, hidden in ALLREDUCE_SHAPES:
            x = torch.randn(rows, hidden).to(dtype)
            n = max(5, iters // (1 + rows * hidden // 100000))
            times = []
            for i in range(n + 5):
                g.barrier()
                t0 = time.perf_counter()
                g.all_reduce(x)
                if i >= 5:
                    times.append(time.perf_counter() - t0)
            results[f"{str(dtype).removeprefix('torch.')}/{rows}x{hidden}"] = _stats(times)
    if rank == 0:
        out_q.put(results)
    g.barrier()
    g.destroy()


def bench_allreduce(world: int, backend: str, iters: int) -> dict:
    from pagedllm.distributed.parallel_state import GroupCoordinator, free_port

    ctx = mp.get_context("spawn")
    port, handle, owner = free_port(), None, None
    if backend == "shm":
        owner = GroupCoordinator.init(0, world, torch.device("cpu"), "shm")  # keeps the region alive
        handle = owner.shm.handle()
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, backend, port, handle, iters, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join()
    if owner is not None:
        owner.destroy()
    return result


def _fake_step(tokens: int, seqs: int, width: int):
    class S:
        pass

    s = S()
    s.step_id, s.num_tokens, s.num_seqs, s.num_sampled = 0, tokens, seqs, seqs
    s.max_query_len, s.num_placeholders = tokens // seqs, 0
    s.input_ids = np.arange(tokens, dtype=np.int32)
    s.positions = np.arange(tokens, dtype=np.int64)
    s.slot_mapping = np.arange(tokens, dtype=np.int64)
    s.prev_sample_rows = np.full(tokens, -1, dtype=np.int32)
    s.seq_lens = np.full(seqs, 100, dtype=np.int32)
    s.query_start_loc = np.arange(seqs + 1, dtype=np.int32) * (tokens // seqs)
    s.block_tables = np.zeros((seqs, width), dtype=np.int32)
    s.logits_indices = np.arange(seqs, dtype=np.int64)
    s.copy_orders = np.zeros((0, 2), dtype=np.int64)
    s.prompt_logprob_rows = []
    return s


STEPS = {"decode_256": (256, 256, 128), "prefill_8192": (8192, 4, 512)}


def _dispatch_reader(kind, reader, world, port, rank, n, ack_q):
    """Reader side: receive n messages; gloo: the flat bytes by broadcast; ack each by queue."""
    torch.set_num_threads(1)
    if kind == "shm":
        for _ in range(n):
            reader.get()
            ack_q.put(time.perf_counter())
        reader.close()
        return
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for _ in range(n):
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0)
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0)
        ack_q.put(time.perf_counter())
    dist.destroy_process_group()


#: host time between two hand-offs: within the reader's 2 ms of polling, and past it (it sleeps)
DISPATCH_GAPS_S = (0.0005, 0.005)


def bench_dispatch(world: int, n: int) -> dict:
    """Median microseconds from the writer's put to the (last) reader holding its copy, after a
    gap of DISPATCH_GAPS_S between messages (a step's host work on rank 0)."""
    out = {}
    for gap in DISPATCH_GAPS_S:
        for key, value in _bench_dispatch(world, n, gap).items():
            out[f"{key}/gap_{gap * 1e3:g}ms"] = value
    return out


def _bench_dispatch(world: int, n: int, gap: float) -> dict:
    from pagedllm.distributed.parallel_state import free_port
    from pagedllm.distributed.shm_broadcast import MessageQueue
    from pagedllm.executor.step_message import encode_step, max_step_bytes

    ctx = mp.get_context("spawn")
    out = {}
    for name, (tokens, seqs, width) in STEPS.items():
        parts = encode_step(_fake_step(tokens, seqs, width))
        nbytes = sum(p.nbytes for p in parts)
        for kind in ("shm", "gloo"):
            ack = ctx.Queue()
            port = free_port()
            q = MessageQueue(world - 1, max_step_bytes(8192, 256, 512), ctx) if kind == "shm" else None
            procs = [ctx.Process(target=_dispatch_reader,
                                 args=(kind, q.reader(r - 1) if q else None, world, port, r, n, ack))
                     for r in range(1, world)]
            for p in procs:
                p.start()
            if kind == "gloo":
                import torch.distributed as dist

                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world)
                flat = torch.from_numpy(np.concatenate([p.view(np.uint8).reshape(-1) for p in parts]))
            else:
                time.sleep(2)  # the readers attach and block
            times = []
            for i in range(n):
                time.sleep(gap)  # rank 0's host work between hand-offs (readers wait meanwhile)
                t0 = time.perf_counter()
                if kind == "shm":
                    q.put(parts)
                else:
                    dist.broadcast(torch.tensor([flat.numel()], dtype=torch.int64), 0)
                    dist.broadcast(flat, 0)
                done = max(ack.get() for _ in range(world - 1))
                times.append(done - t0)
            for p in procs:
                p.join()
            if kind == "gloo":
                dist.destroy_process_group()
            else:
                q.close()
            out[f"{name}/{kind}"] = {**_stats(times[3:]), "bytes": int(nbytes)}
    return out


#: SmolLM2-135M's dimensions (30 layers, hidden 576 -> 512, 9 -> 8 query heads of 64, 3 -> 2 KV
#: heads, intermediate 1536, vocabulary 49152) so that 2 and 4 ranks divide the heads; random weights
ENGINE_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 2048,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "float32"}


TINY_SHAPE = dict(ENGINE_SHAPE, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  vocab_size=1024)


def parse_layout(text: str) -> tuple[int, int, str]:
    """"tp2" / "pp2" / "tp2xpp2", optionally "-ray" (the Ray backend) or "-gloo" ("mp" with gloo
    for the CPU's tensor-parallel collectives) -> (tp, pp, backend)."""
    body, _, backend = text.partition("-")
    tp = pp = 1
    for part in body.split("x"):
        if part.startswith("tp"):
            tp = int(part[2:])
        elif part.startswith("pp"):
            pp = int(part[2:])
        else:
            raise ValueError(f"layout {text!r}: expected tpN, ppN or tpNxppM with an optional -ray")
    return tp, pp, backend or "mp"


def bench_engine(world: int, batches: list[int], steps: int, layouts: list[str] | None = None,
                 shape: dict = ENGINE_SHAPE) -> dict:
    """Decode-step time of `shape` (random weights) in each layout, and rank 0's time in
    collectives."""
    import tempfile

    from pagedllm import LLM, SamplingParams
    from pagedllm.distributed.parallel_state import GroupCoordinator

    folder = tempfile.mkdtemp(prefix="tp-comm-")
    (Path(folder) / "config.json").write_text(json.dumps(shape))
    layouts = layouts or [f"tp{n}" for n in sorted({1, world})]

    spent = {"all_reduce": 0.0, "all_gather": 0.0, "all_reduce_calls": 0, "all_gather_calls": 0}
    originals = {k: getattr(GroupCoordinator, k) for k in ("all_reduce", "all_gather")}

    def timed(name):
        def call(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return originals[name](self, *a, **k)
            finally:
                if self.world_size > 1:
                    spent[name] += time.perf_counter() - t0
                    spent[name + "_calls"] += 1
        return call

    for name in originals:
        setattr(GroupCoordinator, name, timed(name))
    out = {}
    try:
        for layout in layouts:
            tp, pp, backend = parse_layout(layout)
            os.environ["PAGEDLLM_CPU_TP_BACKEND"] = "gloo" if backend == "gloo" else "shm"
            llm = LLM(folder, load_format="dummy", dtype="float32", device="cpu", tensor_parallel_size=tp,
                      pipeline_parallel_size=pp,
                      distributed_executor_backend=None if tp * pp == 1 else "ray" if backend == "ray" else "mp",
                      max_model_len=512, num_gpu_blocks_override=1024)
            if tp * pp == 1:
                torch.set_num_threads(world)  # the same cores as the ranks together
            engine = llm.llm_engine
            for batch in batches:
                params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
                for i in range(batch):
                    engine.add_request(f"b{batch}-{i}", None, list(range(100 + i, 164 + i)), params)
                for _ in range(3):  # the prefill (one step: batch x 64 tokens) and two decodes
                    engine.step()
                times = []
                before = dict(spent)
                generated = engine.core.stats().num_generation_tokens
                start = time.perf_counter()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - t0)
                elapsed = time.perf_counter() - start
                rounds = (engine.core.stats().num_generation_tokens - generated) / batch  # every sequence +1
                after = dict(spent)
                while engine.has_unfinished_requests():
                    engine.step()
                step_ms = float(np.median(times)) * 1e3
                comm_ms = (after["all_reduce"] + after["all_gather"] - before["all_reduce"] - before["all_gather"]) \
                    / steps * 1e3
                out[f"{layout}/batch{batch}"] = {
                    "decode_step_ms": round(step_ms, 3), "rank0_collectives_ms_per_step": round(comm_ms, 3),
                    "collective_share": round(comm_ms / step_ms, 3) if tp > 1 else 0.0,
                    "decode_round_ms": round(elapsed / max(rounds, 1e-9) * 1e3, 3),
                    "all_reduces_per_step": (after["all_reduce_calls"] - before["all_reduce_calls"]) / steps,
                    "all_gathers_per_step": (after["all_gather_calls"] - before["all_gather_calls"]) / steps}
            llm.shutdown()
    finally:
        for name, fn in originals.items():
            setattr(GroupCoordinator, name, fn)
    for key, row in out.items():  # the overhead of each layout's decode round against one rank's
        base = out.get(f"tp1/{key.split('/')[1]}")
        if base is not None:
            row["decode_round_overhead_us_vs_tp1"] = round((row["decode_round_ms"] - base["decode_round_ms"]) * 1e3, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--engine", action="store_true", help="also time decode steps of the bundled model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-gloo", action="store_true")
    ap.add_argument("--skip-collectives", action="store_true", help="only --engine (no all-reduce / hand-off parts)")
    ap.add_argument("--tiny", action="store_true", help="--engine on TINY_SHAPE (steps are mostly overhead)")
    ap.add_argument("--layouts", nargs="+", default=None,
                    help="--engine layouts: tpN, ppN, tpNxppM, with -ray for the Ray backend (default tp1 tp<world>)")
    ap.add_argument("--name", default="tp_comm", help="result file: <date>-<hostname>-<name>.json")
    args = ap.parse_args()
    result = {
        "bench": "tp_comm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpus": os.cpu_count(), "world": args.world,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    shape = TINY_SHAPE if args.tiny else ENGINE_SHAPE
    result["engine_shape"] = shape
    if not args.skip_collectives:
        result["all_reduce"] = {"shm": bench_allreduce(args.world, "shm", args.iters)}
        if not args.skip_gloo:
            result["all_reduce"]["gloo"] = bench_allreduce(args.world, "gloo", max(10, args.iters // 10))
            result["dispatch"] = bench_dispatch(args.world, 40)
    if args.engine:
        result["engine"] = bench_engine(args.world, args.batch, args.steps, args.layouts, shape)
    text = json.dumps(result, indent=2)
    print(text)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{datetime.date.today().isoformat()}-{platform.node() or 'machine'}-{args.name}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
