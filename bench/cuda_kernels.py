"""CUDA kernel benchmark (issue 4's GPU goals), GPU time by CUDA-graph replay.

Decode: GQA 32/8, d128, bf16, block size 16, a grid of batch x context; prefill: one 4,096-token
prompt. Each of our calls is compared with torch SDPA on contiguous K/V in the same run
(decode: enable_gqa=True; prefill: pinned to the flash backend, causal).

Timing: R calls are captured in one CUDA graph and replayed; time per call = median replay time / R
(CUDA events). Graphs remove the Python/launch overhead that otherwise dominates small calls
(an eager call is host-bound at tens of microseconds), for both sides alike. Inputs rotate over
enough independent buffer sets that the bytes touched per replay exceed 4x the L2 cache, so a
call reads its K/V from HBM as in a real decode step. Eager (host-inclusive) medians are
reported too. Bytes = K+V read once (decode); FLOPs = 2 * S^2 * H * d for causal prefill.

    python3 bench/cuda_kernels.py [--out DIR] [--quick] [--prefill-only] [--kv-cache-dtype auto fp8]
Prints one JSON document and writes it to DIR/<date>-<gpu>-cuda-kernels.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import pagedllm.ops as ops

DEV = "cuda"
HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16


def git_commit() -> str:
    if os.environ.get("PAGEDLLM_COMMIT"):  # a copied tree run inside another checkout (device runs)
        return os.environ["PAGEDLLM_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return os.environ.get("PAGEDLLM_COMMIT", "unknown")


def graph_time_us(calls, replays=10, warmup=3) -> float:
    """Median GPU time per call (us) of the list of zero-arg callables, captured as one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:  # warm-up outside capture (kernel attributes, pool, autotune)
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(warmup):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]


def eager_time_us(fn, iters=30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def num_sets(bytes_per_call: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(256, math.ceil(4 * l2 / bytes_per_call)))


KV_DTYPES = {"auto": DTYPE, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def bench_decode(batch: int, ctx: int, split_k=None, sequential=False, width=None, block_size=BS,
                 kv_cache_dtype="auto") -> dict:
    """width: block-table width in blocks (default: just the context), as the engine's
    ceil(max_model_len / block_size); block_size: tokens per cache block (16 unless a case says);
    kv_cache_dtype: "auto" (bf16) or an FP8 cache (k/v scales 0.5; SDPA then reads the
    dequantized values in bf16)."""
    BS = block_size  # noqa: N806 (the module default, overridden per case)
    cache_dtype = KV_DTYPES[kv_cache_dtype]
    elem = torch.empty((), dtype=cache_dtype).element_size()
    kv_bytes = batch * ctx * HKV * D * 2 * elem
    nsets = num_sets(kv_bytes)
    blocks_per_seq = math.ceil(ctx / BS)
    num_blocks = nsets * batch * blocks_per_seq
    kc = torch.randn(num_blocks, HKV, BS, D, device=DEV, dtype=DTYPE).to(cache_dtype)
    vc = torch.randn(num_blocks, HKV, BS, D, device=DEV, dtype=DTYPE).to(cache_dtype)
    fp8 = cache_dtype != DTYPE
    scales = dict(k_scale=torch.tensor([0.5], device=DEV), v_scale=torch.tensor([0.5], device=DEV)) if fp8 else {}
    ids = torch.arange(num_blocks, device=DEV) if sequential else torch.randperm(num_blocks, device=DEV)
    perm = ids.to(torch.int32).view(nsets, batch, blocks_per_seq)
    bts = perm
    if width is not None and width > blocks_per_seq:  # unused entries: valid ids, never read
        pad = perm[:, :, :1].expand(nsets, batch, width - blocks_per_seq)
        bts = torch.cat([perm, pad], dim=2).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    qs = [torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE) for _ in range(nsets)]
    outs = [torch.empty_like(q) for q in qs]
    scale = D ** -0.5
    reps = max(nsets, 8 if kv_bytes > 2**28 else 32)

    def ours(i):
        j = i % nsets
        return lambda: ops.paged_attention(outs[j], qs[j], kc, vc, bts[j], seq_lens, scale, split_k=split_k, **scales)

    t_ours = graph_time_us([ours(i) for i in range(reps)])
    t_ours_eager = eager_time_us(ours(0))

    # SDPA on contiguous K/V holding the same values as set 0 (for the check), other sets random.
    def contiguous(cache, j):  # (an FP8 cache dequantized: code * 0.5)
        ids = perm[j].long()  # [B, nb]
        x = cache[ids].to(DTYPE) * (0.5 if fp8 else 1.0)  # [B, nb, Hkv, BS, D]
        return x.permute(0, 2, 1, 3, 4).reshape(batch, HKV, blocks_per_seq * BS, D)[:, :, :ctx].contiguous()

    ksets = [contiguous(kc, 0)] + [torch.randn(batch, HKV, ctx, D, device=DEV, dtype=DTYPE) for _ in range(nsets - 1)]
    vsets = [contiguous(vc, 0)] + [torch.randn(batch, HKV, ctx, D, device=DEV, dtype=DTYPE) for _ in range(nsets - 1)]
    sdpa_out = [None] * nsets

    def sdpa(i):
        j = i % nsets

        def f():
            sdpa_out[j] = F.scaled_dot_product_attention(qs[j].unsqueeze(2), ksets[j], vsets[j], scale=scale,
                                                         enable_gqa=True)
        return f

    t_sdpa = graph_time_us([sdpa(i) for i in range(reps)])
    t_sdpa_eager = eager_time_us(sdpa(0))
    # same function: ours vs SDPA on set 0
    ops.paged_attention(outs[0], qs[0], kc, vc, bts[0], seq_lens, scale, split_k=split_k, **scales)
    plan = ops.last_cuda_decode_plan()
    ref = F.scaled_dot_product_attention(qs[0].unsqueeze(2).float(), ksets[0].float(), vsets[0].float(),
                                         scale=scale, enable_gqa=True).squeeze(2)
    err = ((outs[0].float() - ref).norm() / ref.norm()).item()
    del kc, vc, ksets, vsets
    torch.cuda.empty_cache()
    return {
        "batch": batch, "context": ctx, "split_k": "auto" if split_k is None else split_k,
        "kv_cache_dtype": str(cache_dtype).removeprefix("torch."), "plan": plan,
        "block_table_width": bts.shape[2], "block_size": BS,
        "block_ids": "sequential" if sequential else "shuffled",
        "kv_bytes": kv_bytes, "buffer_sets": nsets,
        "ours_us": round(t_ours, 2), "ours_TBps": round(kv_bytes / t_ours / 1e6, 3),
        "sdpa_us": round(t_sdpa, 2), "sdpa_TBps": round(kv_bytes / t_sdpa / 1e6, 3),
        "speed_vs_sdpa": round(t_sdpa / t_ours, 3),
        "ours_eager_us": round(t_ours_eager, 2), "sdpa_eager_us": round(t_sdpa_eager, 2),
        "rel_l2_vs_sdpa_fp32": float(f"{err:.2e}"),
    }


def bench_prefill(seq: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    blocks = math.ceil(seq / BS)
    kc = torch.randn(blocks + 7, HKV, BS, D, device=DEV, dtype=DTYPE)
    vc = torch.randn_like(kc)
    bt = torch.randperm(blocks + 7, device=DEV)[:blocks].to(torch.int32).view(1, blocks)
    seq_lens = torch.tensor([seq], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, seq], dtype=torch.int32, device=DEV)
    q = torch.randn(seq, HQ, D, device=DEV, dtype=DTYPE)
    out = torch.empty_like(q)
    scale = D ** -0.5
    flops = 2 * seq * seq * HQ * D

    def ours():
        ops.paged_prefill_attention(out, q, kc, vc, bt, seq_lens, qsl, scale)

    t_ours = graph_time_us([ours] * 5)
    k = kc[bt[0].long()].permute(1, 0, 2, 3).reshape(1, HKV, blocks * BS, D)[:, :, :seq].contiguous()
    v = vc[bt[0].long()].permute(1, 0, 2, 3).reshape(1, HKV, blocks * BS, D)[:, :, :seq].contiguous()
    qt = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, S, D]
    note = "flash backend, enable_gqa=True"
    res = {}

    def sdpa_gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            res["o"] = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)

    kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)

    def sdpa_rep():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            res["o"] = F.scaled_dot_product_attention(qt, kr, vr, is_causal=True, scale=scale)

    try:
        sdpa_gqa()
        sdpa = sdpa_gqa
    except RuntimeError:
        note = "flash backend on K/V repeated to 32 heads (flash refused enable_gqa)"
        sdpa = sdpa_rep
    t_sdpa = graph_time_us([sdpa] * 5)
    ours()
    sdpa()
    ref = res["o"][0].transpose(0, 1).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return {
        "seq": seq, "flops": flops,
        "ours_us": round(t_ours, 1), "ours_TFLOPs": round(flops / t_ours / 1e6, 1),
        "sdpa_us": round(t_sdpa, 1), "sdpa_TFLOPs": round(flops / t_sdpa / 1e6, 1),
        "ratio_vs_sdpa": round(t_sdpa / t_ours, 3), "sdpa": note,
        "variant": {k: v for k, v in os.environ.items() if k.startswith("PAGEDLLM_") and k != "PAGEDLLM_COMMIT"},
        "rel_l2_vs_sdpa": float(f"{err:.2e}"),
    }


def run_case(doc: dict, kv_cache_dtypes: list[str], **kw) -> None:
    """bench_decode of one case for each KV-cache dtype, appended to doc["decode"] (and printed)."""
    first = None
    for kv in kv_cache_dtypes:
        r = bench_decode(kv_cache_dtype=kv, **kw)
        if first is None:
            first = r
        else:
            r[f"speed_vs_{kv_cache_dtypes[0]}"] = round(first["ours_us"] / r["ours_us"], 3)
        doc["decode"].append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help="only the goal cases")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (e.g. a variant)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=list(KV_DTYPES),
                    help="decode: run every case with each KV-cache dtype (auto = bf16); the later ones get "
                         "speed_vs_<first> (time of the first / their time) on the same case")
    ap.add_argument("--cases", default="",
                    help="decode cases instead of the default grid: BxCTX[:sSPLIT][:seq][:wWIDTH][:bBLOCK], "
                         "comma-separated (e.g. 1x4096,1x4096:s16,64x4096:s2,1x300:w32,64x4096:b32); wWIDTH: "
                         "block-table width in blocks; bBLOCK: block size in tokens (default 16)")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    doc = {
        "bench": "cuda_kernels", "commit": git_commit(),
        "variant": {k: v for k, v in os.environ.items() if k.startswith("PAGEDLLM_") and k != "PAGEDLLM_COMMIT"}, "date": datetime.date.today().isoformat(),
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "shape": {"num_heads": HQ, "num_kv_heads": HKV, "head_size": D, "block_size": BS, "dtype": "bfloat16"},
        "timing": "CUDA-graph replay, median of 10 replays / calls per graph; inputs rotated past 4x L2",
        "decode": [], "prefill": [],
    }
    if args.cases:
        for case in args.cases.split(","):
            parts = case.split(":")
            batch, ctx = (int(x) for x in parts[0].split("x"))
            kw = dict(batch=batch, ctx=ctx)
            for extra in parts[1:]:
                if extra == "seq":
                    kw["sequential"] = True
                elif extra.startswith("b"):
                    kw["block_size"] = int(extra[1:])
                elif extra.startswith("s"):
                    kw["split_k"] = int(extra[1:])
                elif extra.startswith("w"):
                    kw["width"] = int(extra[1:])
            run_case(doc, args.kv_cache_dtype, **kw)
    elif not args.prefill_only:
        grid = [(1, 4096), (64, 4096)] if args.quick else \
            [(1, 4096), (1, 32768), (8, 4096), (16, 1024), (64, 4096), (256, 1024), (128, 2048)]
        for batch, ctx in grid:
            run_case(doc, args.kv_cache_dtype, batch=batch, ctx=ctx)
        extra = [] if args.quick else \
            [dict(batch=1, ctx=4096, split_k=k) for k in (0, 16, 32, 64, 128)] + \
            [dict(batch=64, ctx=4096, sequential=True), dict(batch=1, ctx=4096, sequential=True)]
        for kw in extra:
            run_case(doc, args.kv_cache_dtype, **kw)
    if not args.no_prefill:
        doc["prefill"].append(bench_prefill(4096))
        print(json.dumps(doc["prefill"][-1]), file=sys.stderr, flush=True)
    text = json.dumps(doc, indent=1)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    gpu = "h200" if "H200" in props.name else props.name.replace(" ", "-").lower()
    suffix = ("-prefill" if args.prefill_only else "") + (f"-{args.tag}" if args.tag else "")
    path = os.path.join(args.out, f"{doc['date']}-{gpu}-cuda-kernels{suffix}.json")
    with open(path, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
