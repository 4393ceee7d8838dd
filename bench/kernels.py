"""Kernel benchmark: pagedllm paged attention vs torch SDPA on contiguous K/V (issue 4).

Prints one JSON document and writes it to <out>/<YYYY-MM-DD>-<machine>-kernels.json with the git
commit. Parts (chosen by --device):

  cpu   decode, batch x context 1 x 4096 and 16 x 1024, SmolLM2-135M attention shape (9 query
        heads, 3 KV heads, head size 64), float32 and bfloat16, --threads threads (default 2) for
        both pagedllm and torch; wall-clock median per call.
  cuda  decode grid (batch x context) with GQA 32/8, d128, bf16: median per-call time from CUDA
        events over CUDA-graph replays (so Python launch overhead is excluded for both), bytes of
        K/V read / time, against SDPA (enable_gqa=True) on contiguous K/V in the same run; decode
        1 x 4096 also with split-K forced off; prefill batch 1 x 4096, FLOPs 2*S^2*H*d (causal),
        against SDPA pinned to its flash backend.

Each row also records the max |difference| between the paged kernel's output and SDPA's on the
same data, so a fast-but-wrong kernel shows. Usage:
    PYTHONPATH=python python3 bench/kernels.py --device cpu [--out bench/results] [--machine NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

# pagedllm's kernels and torch each run their own OpenMP runtime; with the default (spinning)
# wait policy, one runtime's idle workers spin for milliseconds while the other's work, which on a
# small shared machine dominates every timing. Both runtimes read this when they load (before
# `import torch`); export OMP_WAIT_POLICY=ACTIVE to measure the default behaviour instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import pagedllm.ops as ops  # noqa: E402

BLOCK_SIZE = 16


def git_commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.check_output(["git", "-C", root, "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - a copied tree without .git
        return os.environ.get("PAGEDLLM_GIT_COMMIT", "unknown")


def make_decode_inputs(batch, context, hq, hkv, d, dtype, device, gen):
    """Contiguous K/V [B, Hkv, L, D] and the same data in a paged cache with shuffled blocks."""
    k = torch.randn(batch, hkv, context, d, generator=gen).to(dtype).to(device)
    v = torch.randn(batch, hkv, context, d, generator=gen).to(dtype).to(device)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype).to(device)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    kc, vc = ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, hkv, d, dtype, device)
    perm = torch.randperm(num_blocks, generator=gen).to(device)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    pos = torch.arange(context, device=device)
    slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    ops.reshape_and_cache(k.transpose(1, 2).reshape(-1, hkv, d).contiguous(),
                          v.transpose(1, 2).reshape(-1, hkv, d).contiguous(), kc, vc, slots)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, kc, vc, tables, seq_lens


def wall_pair(fn_a, fn_b, iters, warmup=3):
    """(wall median, wall min, process CPU-time median) seconds per call of fn_a and of fn_b,
    calls interleaved so that load from other processes on a shared machine hits both alike.
    The CPU time (all threads of this process) is what a call costs regardless of how long the
    OS kept it waiting for a core."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    ta, tb, ca, cb = [], [], [], []
    for _ in range(iters):
        c0, t0 = time.process_time(), time.perf_counter()
        fn_a()
        c1, t1 = time.process_time(), time.perf_counter()
        fn_b()
        tb.append(time.perf_counter() - t1)
        cb.append(time.process_time() - c1)
        ta.append(t1 - t0)
        ca.append(c1 - c0)
    return ((statistics.median(ta), min(ta), statistics.median(ca)),
            (statistics.median(tb), min(tb), statistics.median(cb)))


def cuda_pair(fn_a, fn_b):
    return (cuda_median(fn_a), None, None), (cuda_median(fn_b), None, None)


def cuda_median(fn, reps=20, trials=15):
    """Median seconds per call: `reps` calls captured in a CUDA graph, replayed `trials` times
    between CUDA events (falls back to an eager loop if capture fails)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    run = None
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def timing_fields(prefix, t):
    median, fastest, cpu = t
    row = {f"{prefix}_us": median * 1e6}
    if fastest is not None:
        row[f"{prefix}_min_us"] = fastest * 1e6
    if cpu is not None:
        row[f"{prefix}_cpu_time_us"] = cpu * 1e6
    return row


def decode_row(batch, context, hq, hkv, d, dtype, device, gen, timer, split_k=None):
    q, k, v, kc, vc, tables, seq_lens = make_decode_inputs(batch, context, hq, hkv, d, dtype, device, gen)
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]

    def paged():
        ops.paged_attention(out, q, kc, vc, tables, seq_lens, scale, split_k=split_k)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    tp, ts = timer(paged, sdpa)
    t_paged, t_sdpa = tp[0], ts[0]
    paged()
    diff = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
    kv_bytes = 2 * batch * context * hkv * d * q.element_size()
    return {
        "batch": batch, "context": context, "num_heads": hq, "num_kv_heads": hkv, "head_size": d,
        "dtype": str(dtype).removeprefix("torch."), "block_size": BLOCK_SIZE,
        "split_k": "auto" if split_k is None else split_k,
        **timing_fields("paged", tp), **timing_fields("sdpa", ts),
        "speed_vs_sdpa": t_sdpa / t_paged,
        "kv_bytes": kv_bytes, "paged_GBps": kv_bytes / t_paged / 1e9, "sdpa_GBps": kv_bytes / t_sdpa / 1e9,
        "max_abs_diff_vs_sdpa": diff,
    }


def prefill_row(seq, hq, hkv, d, dtype, device, gen, timer, flash_only):
    q, k, v, kc, vc, tables, seq_lens = make_decode_inputs(1, seq, hq, hkv, d, dtype, device, gen)
    qs = torch.randn(seq, hq, d, generator=gen).to(dtype).to(device)
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(qs)
    qsl = torch.tensor([0, seq], dtype=torch.int32, device=device)
    q4 = qs.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, S, D]

    def paged():
        ops.paged_prefill_attention(out, qs, kc, vc, tables, seq_lens, qsl, scale)

    def sdpa():
        if hq != hkv:  # flash has no GQA: expand K/V outside the timed region is unfair; time it
            kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        else:
            kk, vv = k, v
        return F.scaled_dot_product_attention(q4, kk, vv, scale=scale, is_causal=True)

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, is_causal=True, enable_gqa=True)

    backend = "default (enable_gqa)"
    if flash_only:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            try:
                tp, ts = timer(paged, sdpa_gqa)
                ref = sdpa_gqa()
                backend = "flash (enable_gqa)"
            except RuntimeError:
                tp, ts = timer(paged, sdpa)
                ref = sdpa()
                backend = "flash (K/V repeated, repeat timed)"
    else:
        tp, ts = timer(paged, sdpa_gqa)
        ref = sdpa_gqa()
    t_paged, t_sdpa = tp[0], ts[0]
    paged()
    diff = (out.float() - ref.squeeze(0).transpose(0, 1).float()).abs().max().item()
    flops = 2 * seq * seq * hq * d
    return {
        "seq_len": seq, "num_heads": hq, "num_kv_heads": hkv, "head_size": d,
        "dtype": str(dtype).removeprefix("torch."), "block_size": BLOCK_SIZE, "sdpa_backend": backend,
        **timing_fields("paged", tp), **timing_fields("sdpa", ts), "speed_vs_sdpa": t_sdpa / t_paged,
        "flops": flops, "paged_TFLOPs": flops / t_paged / 1e12, "sdpa_TFLOPs": flops / t_sdpa / 1e12,
        "max_abs_diff_vs_sdpa": diff,
    }


def run_cpu(args, gen):
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    timer = lambda a, b: wall_pair(a, b, args.iters)  # noqa: E731
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in ((1, 4096), (16, 1024)):
            row = decode_row(batch, context, 9, 3, 64, dtype, "cpu", gen, timer)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    prefill = []
    for dtype in (torch.float32, torch.bfloat16):
        row = prefill_row(1024, 9, 3, 64, dtype, "cpu", gen, lambda a, b: wall_pair(a, b, 7, 1), False)
        prefill.append(row)
        print(json.dumps(row), file=sys.stderr)
    return {"threads": args.threads, "load_average": os.getloadavg(),
            "timer": "wall-clock median (and min) per call, pagedllm and SDPA calls interleaved; "
                     "cpu_time: median process CPU time per call (all threads)",
            "decode": rows,
            "prefill": prefill}


def run_cuda(args, gen):
    timer = cuda_pair
    rows = []
    grid = [(1, 4096), (8, 4096), (64, 4096), (256, 1024), (16, 16384), (128, 2048)]
    for batch, context in grid:
        row = decode_row(batch, context, 32, 8, 128, torch.bfloat16, "cuda", gen, timer)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    row = decode_row(1, 4096, 32, 8, 128, torch.bfloat16, "cuda", gen, timer, split_k=0)
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
    prefill = [prefill_row(4096, 32, 8, 128, torch.bfloat16, "cuda", gen, timer, True)]
    print(json.dumps(prefill[0]), file=sys.stderr)
    return {"timer": "CUDA events over CUDA-graph replays, median per call",
            "gpu": torch.cuda.get_device_name(), "decode": rows, "prefill": prefill}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="cpu")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for pagedllm and torch")
    p.add_argument("--iters", type=int, default=100, help="timed CPU iterations per case")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--machine", default=socket.gethostname(), help="name used in the file name")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    result = {
        "bench": "kernels", "date": datetime.date.today().isoformat(), "machine": args.machine,
        "git_commit": git_commit(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    if args.device in ("cpu", "all"):
        result["cpu"] = run_cpu(args, gen)
    if args.device in ("cuda", "all"):
        result["cuda"] = run_cuda(args, gen)
    text = json.dumps(result, indent=2)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{result['date']}-{args.machine}-kernels.json")
    with open(path, "w") as f:
        f.write(text + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
