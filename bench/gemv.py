"""GEMV microbenchmark (issue 7, batch-1 decode): pagedllm.ops.gemv against cuBLAS
(torch.nn.functional.linear) on the Llama-3-8B and Qwen2-0.5B projection shapes, bf16.

Per (shape, M tokens, implementation): a CUDA graph of R launches, each reading another copy of
the weight (the copies together exceed the L2 several times, so every launch streams from HBM),
replayed `reps` times after a warm-up; the median replay time / R gives the time per launch and
weight bytes / time the weight-read bandwidth (TB/s). Consecutive GEMV launches in the graph are
programmatic dependents of each other when PDL is on (as in a model), so the figure includes that
overlap. Also measured: every tuning variant for M = 1 and 8 (``--sweep``), the down projection
with SiLU-and-mul fused (staged in shared memory) against silu_and_mul + gemv, each GEMV fusion
(RMSNorm prologue, residual epilogue) against its unfused pair, and a Llama-3-8B decode "layer
chain" at M = 1 and 8 (per layer fused_add_rms_norm, qkv, o, fused_add_rms_norm, gate_up,
SiLU-and-mul, down; 32 layers + the LM head; no attention) with cuBLAS, the GEMV without PDL and
with PDL, and the fused chains (norms and residual adds in the GEMVs, optionally SiLU too: 5 or 4
kernels per layer instead of 7), against the floor of reading those weights once at the copy
bandwidth measured in the same run.

    python3 bench/gemv.py [--sweep] [--chain-only] [--out DIR] [--name gemv]
JSON: <out>/<date>-<machine>-<name>.json (commit from PAGEDLLM_COMMIT or git).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_gpu import copy_bandwidth  # noqa: E402

SHAPES = {  # name -> (N, K)
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)},
    "qwen2-0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
                   "lm_head": (151936, 896)},
}
L2_BYTES = 50 << 20


def time_graph(fn, launches: int, reps: int = 5) -> float:
    """Seconds per launch: median over `reps` replays of a graph that calls fn(i) for i < launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(launches, 2)):
            fn(i)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(launches):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / launches)
    del graph
    return statistics.median(times)


def weights(n: int, k: int, min_total: int = 3 * L2_BYTES) -> list[torch.Tensor]:
    nbytes = n * k * 2
    copies = max(2, -(-min_total // nbytes))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def bench_shape(ops, n: int, k: int, ms: list[int], sweep: bool) -> dict:
    ws = weights(n, k)
    nbytes = n * k * 2
    launches = max(len(ws), min(64, -(-(8 * L2_BYTES) // nbytes)))
    out: dict = {"N": n, "K": k, "weight_bytes": nbytes, "launches_per_graph": launches, "M": {}}
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        row: dict = {}
        t = time_graph(lambda i: F.linear(x, ws[i % len(ws)]), launches)
        row["cublas"] = {"us": t * 1e6, "tb_s": nbytes / t / 1e12}
        for pdl in (True, False):
            ops.set_pdl_enabled(pdl)
            t = time_graph(lambda i: ops.gemv(x, ws[i % len(ws)], out=y), launches)
            row["gemv" if pdl else "gemv_no_pdl"] = {"us": t * 1e6, "tb_s": nbytes / t / 1e12}
        ops.set_pdl_enabled(True)
        if sweep and m in (1, 8):
            best = None
            for variant, warps, splits, prefetch in itertools.product((1, 2, 3), (4, 8), (1, 2, 4), (0, 1)):
                cfg = dict(variant=variant, warps=warps, splits=splits, prefetch=prefetch)
                t = time_graph(lambda i: ops.gemv(x, ws[i % len(ws)], out=y, config=cfg), launches, reps=3)
                key = f"v{variant}w{warps}s{splits}p{prefetch}"
                row.setdefault("sweep_tb_s", {})[key] = nbytes / t / 1e12
                if best is None or t < best[1]:
                    best = (key, t)
            row["best"] = {"config": best[0], "us": best[1] * 1e6, "tb_s": nbytes / best[1] / 1e12}
        out["M"][m] = row
        print(json.dumps({"N": n, "K": k, "M": m, **{kk: (v if kk != "sweep_tb_s" else "...") for kk, v in row.items()}}),
              flush=True)
    del ws
    torch.cuda.empty_cache()
    return out


def bench_silu_down(ops, n: int, k: int) -> dict:
    ws = weights(n, k)
    nbytes = n * k * 2
    launches = max(len(ws), min(64, -(-(8 * L2_BYTES) // nbytes)))
    res = {}
    for m in (1, 4, 8):
        gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        act = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fused = time_graph(lambda i: ops.gemv(gu, ws[i % len(ws)], out=y, silu_and_mul=True), launches)

        def two(i):
            ops.silu_and_mul(act, gu)
            ops.gemv(act, ws[i % len(ws)], out=y)

        res[m] = {"fused_us": fused * 1e6, "silu_then_gemv_us": time_graph(two, launches) * 1e6,
                  "fused_tb_s": nbytes / fused / 1e12}
    print(json.dumps({"silu_down": res}), flush=True)
    return res


def bench_chain(ops, bw: float, m: int = 1, layers: int = 32, sleep_variants: bool = True) -> dict:
    """Llama-3-8B decode at M = m tokens without attention: the projections, norms and SiLU of
    every layer and the LM head, one CUDA graph per variant; ms per token (step) against the
    weight floor. Variants: cublas; gemv (no PDL / PDL: per layer fused_add_rms_norm, qkv, o,
    fused_add_rms_norm, gate_up, silu_and_mul, down = 7 kernels); gemv_fused_silu (SiLU staged in
    the down GEMV, 6 kernels); gemv_fuse1 (norms in the qkv / gate_up GEMVs' prologue, residual
    adds in the o / down GEMVs' epilogue, separate silu_and_mul: 5 kernels; the final norm in the
    LM head GEMV); gemv_fuse2 (fuse1 + SiLU staged in the down GEMV: 4 kernels)."""
    h, inter, qkv_n, vocab = 4096, 14336, 6144, 128256
    e = lambda *s: torch.empty(*s, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)  # noqa: E731
    W = [dict(qkv=e(qkv_n, h), o=e(h, h), gate_up=e(2 * inter, h), down=e(h, inter), n1=e(h) + 1, n2=e(h) + 1)
         for _ in range(layers)]
    head = e(vocab, h)
    norm_f = e(h) + 1
    weight_bytes = 2 * (layers * (qkv_n * h + h * h + 2 * inter * h + h * inter) + vocab * h)
    x0 = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    act_buf = lambda: torch.empty(m, inter, device="cuda", dtype=torch.bfloat16)  # noqa: E731

    def step(mode: str):
        if mode.startswith("gemv_fuse"):
            return step_fused(mode.startswith("gemv_fuse2"))
        hidden, res = x0.clone(), x0.clone()
        for w in W:
            ops.fused_add_rms_norm(hidden, res, w["n1"], 1e-5)
            if mode == "cublas":
                qkv = F.linear(hidden, w["qkv"])
                if attention_cycles:
                    torch.cuda._sleep(attention_cycles)
                o = F.linear(qkv[:, :h].contiguous(), w["o"])
            else:
                qkv = ops.gemv(hidden, w["qkv"])
                if attention_cycles:
                    torch.cuda._sleep(attention_cycles)
                o = ops.gemv(qkv[:, :h], w["o"])
            ops.fused_add_rms_norm(o, res, w["n2"], 1e-5)
            if mode == "cublas":
                gu = F.linear(o, w["gate_up"])
                hidden = F.linear(ops.silu_and_mul(act_buf(), gu), w["down"])
            elif mode.endswith("fused_silu"):
                gu = ops.gemv(o, w["gate_up"])
                hidden = ops.gemv(gu, w["down"], silu_and_mul=True)
            else:
                gu = ops.gemv(o, w["gate_up"])
                hidden = ops.gemv(ops.silu_and_mul(act_buf(), gu), w["down"])
        return F.linear(hidden, head) if mode == "cublas" else ops.gemv(hidden, head)

    def step_fused(silu_in_down: bool):
        stream = x0.clone()  # the residual stream, updated in place by the o and down GEMVs
        for w in W:
            qkv = ops.gemv(stream, w["qkv"], norm_weight=w["n1"], eps=1e-5)
            if attention_cycles:
                torch.cuda._sleep(attention_cycles)
            ops.gemv(qkv[:, :h], w["o"], out=stream, residual=stream)
            gu = ops.gemv(stream, w["gate_up"], norm_weight=w["n2"], eps=1e-5)
            act = gu if silu_in_down else ops.silu_and_mul(act_buf(), gu)
            ops.gemv(act, w["down"], out=stream, residual=stream, silu_and_mul=silu_in_down)
        return ops.gemv(stream, head, norm_weight=norm_f, eps=1e-5)

    res = {"m": m, "weight_bytes": weight_bytes, "floor_ms": weight_bytes / bw * 1e3}
    # without attention, then with a 16 us spin kernel in its place (torch.cuda._sleep; one decode
    # attention of ~300 tokens measured ~16 us per layer in the engine profile)
    attention_cycles = 0
    modes = [("cublas", True), ("gemv_no_pdl", False), ("gemv", True), ("gemv_fused_silu", True),
             ("gemv_fuse1", True), ("gemv_fuse2", True), ("gemv_fuse1_no_pdl", False)]
    for mode, pdl in modes:
        ops.set_pdl_enabled(pdl)
        t = time_graph(lambda i: step(mode), 1, reps=7)
        res[mode] = {"ms_per_token": t * 1e3, "x_floor": t / (weight_bytes / bw)}
    if sleep_variants:
        attention_cycles = 31700  # 16 us at the H200's 1,980 MHz SM clock
        res["sleep_cycles_per_layer"] = attention_cycles
        for mode, pdl in (("cublas", True), ("gemv", True), ("gemv_fuse1", True), ("gemv_fuse2", True)):
            ops.set_pdl_enabled(pdl)
            t = time_graph(lambda i: step(mode), 1, reps=7)
            res[mode + "+sleep16us"] = {"ms_per_token": t * 1e3, "x_floor": t / (weight_bytes / bw)}
    ops.set_pdl_enabled(True)
    print(json.dumps({"chain": res}), flush=True)
    del W, head
    torch.cuda.empty_cache()
    return res


def bench_fused_ops(ops, m_list=(1, 4, 8)) -> dict:
    """Each fusion against its unfused pair, Llama-3-8B shapes, one graph of rotating weights:
    rms_norm + gemv vs norm-prologue gemv (qkv, gate_up, LM head); gemv + fused_add_rms_norm's add
    (as gemv + torch add) vs residual-epilogue gemv (o, down); silu_and_mul + gemv vs staged-SiLU
    gemv (down). us per launch pair / fused launch."""
    h = 4096
    out: dict = {}
    for name, (n, k) in SHAPES["llama3-8b"].items():
        ws = weights(n, k)
        nbytes = n * k * 2
        launches = max(len(ws), min(64, -(-(8 * L2_BYTES) // nbytes)))
        g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in m_list:
            row = {}
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            xn = torch.empty_like(x)
            row["gemv_us"] = time_graph(lambda i: ops.gemv(x, ws[i % len(ws)], out=y), launches) * 1e6
            if k == h and name != "o":
                def two(i):
                    ops.rms_norm(xn, x, g, 1e-5)
                    ops.gemv(xn, ws[i % len(ws)], out=y)
                row["rms_norm_then_gemv_us"] = time_graph(two, launches) * 1e6
                row["norm_gemv_us"] = time_graph(
                    lambda i: ops.gemv(x, ws[i % len(ws)], out=y, norm_weight=g, eps=1e-5), launches) * 1e6
            if name in ("o", "down"):
                r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                row["residual_gemv_us"] = time_graph(
                    lambda i: ops.gemv(x, ws[i % len(ws)], out=r, residual=r), launches) * 1e6
            out[f"{name}/m{m}"] = row
            print(json.dumps({"fused_ops": name, "m": m, **row}), flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="every tuning variant for M = 1 and 8")
    p.add_argument("--chain-only", action="store_true",
                   help="only the fused-op pairs and the layer chains (skip the per-shape table)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--ms", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--machine", default="h200")
    p.add_argument("--name", default="gemv")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    import pagedllm.ops as ops

    commit = os.environ.get("PAGEDLLM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    bw = copy_bandwidth()
    result = {"bench": "gemv", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": args.machine, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": commit or "unknown", "copy_bytes_per_s": bw, "pdl_default": ops.pdl_enabled(),
              "shapes": {}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.date.today().isoformat()}-{args.machine}-{args.name}.json"
    for model in args.shapes if not args.chain_only else []:
        for name, (n, k) in SHAPES[model].items():
            result["shapes"][f"{model}/{name}"] = bench_shape(ops, n, k, args.ms, args.sweep)
            path.write_text(json.dumps(result, indent=1) + "\n")
    result["silu_down"] = {f"{m}/down": bench_silu_down(ops, *SHAPES[m]["down"]) for m in args.shapes}
    if "llama3-8b" in args.shapes:
        result["fused_ops_llama3_8b"] = bench_fused_ops(ops)
        path.write_text(json.dumps(result, indent=1) + "\n")
        result["chain_llama3_8b_m1"] = bench_chain(ops, bw)
        path.write_text(json.dumps(result, indent=1) + "\n")
        result["chain_llama3_8b_m8"] = bench_chain(ops, bw, m=8, sleep_variants=False)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
