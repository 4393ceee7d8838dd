"""Batch-1 decode attention inside an engine-shaped layer sequence (issue 7's batch-1 step).

The Llama-3-8B attention block of one decode token, for L layers in one CUDA graph: the qkv
projection (x [1, 4096] @ W_qkv^T, 50 MB of bf16 weights per layer, which also pushes the
previous layer's data out of L2 as in the engine), rotary_embedding_and_cache (writes this
token's K/V into the layer's paged cache), paged decode attention over a context of CTX tokens
(block size 16, block-table width ceil(max_model_len / 16)), then the o projection. Two graphs:
  none       the same without attention (the o projection reads the rotated query instead)
  attention  with paged_attention
Attention's cost per layer = (graph time - graph time of `none`) / L: what it adds to a token,
launch gaps included. Median of 20 replays (CUDA events); `none` is timed first and last, and the
smaller time is used.

    python3 bench/decode_layer.py [--ctx 300] [--max-model-len 512] [--layers 32] [--out DIR]
Prints one JSON document (and writes DIR/<date>-<gpu>-decode-layer.json with --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

import pagedllm.ops as ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_kernels import git_commit  # noqa: E402

HIDDEN, HQ, HKV, D, BS = 4096, 32, 8, 128, 16
DTYPE = torch.bfloat16


def graph_time_us(fn, replays=20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default="")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    L, ctx = args.layers, args.ctx
    width = math.ceil(args.max_model_len / BS)
    nblk = math.ceil(ctx / BS)
    qkv_out = (HQ + 2 * HKV) * D
    w_qkv = [torch.randn(qkv_out, HIDDEN, device="cuda", dtype=DTYPE) * 0.02 for _ in range(L)]
    w_o = [torch.randn(HIDDEN, HQ * D, device="cuda", dtype=DTYPE) * 0.02 for _ in range(L)]
    caches = []
    for _ in range(L):
        kc = torch.randn(width + 4, HKV, BS, D, device="cuda", dtype=DTYPE)
        caches.append((kc, torch.randn_like(kc)))
    bt = torch.randperm(width + 4, device="cuda")[:width].to(torch.int32).view(1, width)
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    pos = torch.tensor([ctx - 1], dtype=torch.int64, device="cuda")
    slot = (bt[0, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS).view(1)
    half = D // 2
    inv = 1.0 / (500000 ** (torch.arange(half, device="cuda", dtype=torch.float64) / half))
    ang = torch.arange(args.max_model_len, device="cuda", dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().to(DTYPE), ang.sin().to(DTYPE)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=DTYPE)
    query = torch.empty(1, HQ, D, device="cuda", dtype=DTYPE)
    attn = torch.empty(1, HQ, D, device="cuda", dtype=DTYPE)
    y = torch.empty(1, HIDDEN, device="cuda", dtype=DTYPE)

    def step(mode):
        def f():
            for layer in range(L):
                qkv = x @ w_qkv[layer].t()
                q = qkv[:, :HQ * D].view(1, HQ, D)
                k = qkv[:, HQ * D:(HQ + HKV) * D].view(1, HKV, D)
                v = qkv[:, (HQ + HKV) * D:].view(1, HKV, D)
                kc, vc = caches[layer]
                ops.rotary_embedding_and_cache(pos, q, k, v, cos, sin, query, kc, vc, slot)
                src = query
                if mode != "none":
                    ops.paged_attention(attn, query, kc, vc, bt, seq_lens, D ** -0.5)
                    src = attn
                torch.mm(src.view(1, HQ * D), w_o[layer].t(), out=y)
        return f

    times = {m: graph_time_us(step(m)) for m in ("none", "attention")}
    times["none"] = min(times["none"], graph_time_us(step("none")))  # again last: the spread
    doc = {
        "bench": "decode_layer", "commit": git_commit(), "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_properties(0).name,
        "variant": {k: v for k, v in os.environ.items() if k.startswith("PAGEDLLM_") and k != "PAGEDLLM_COMMIT"},
        "shape": {"hidden": HIDDEN, "num_heads": HQ, "num_kv_heads": HKV, "head_size": D, "block_size": BS,
                  "dtype": "bfloat16", "context": ctx, "block_table_width": width, "layers": L},
        "graph_us": {m: round(t, 1) for m, t in times.items()},
        "attention_us_per_layer": round((times["attention"] - times["none"]) / L, 2),
    }
    text = json.dumps(doc, indent=1)
    print(text)
    print("SUMMARY " + json.dumps({"context": ctx, "width": width, "variant": doc["variant"],
                                   "graph_us": doc["graph_us"], "attn_us_per_layer": doc["attention_us_per_layer"]}))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = "h200" if "H200" in doc["gpu"] else doc["gpu"].replace(" ", "-").lower()
        suffix = f"-{args.tag}" if args.tag else ""
        with open(os.path.join(args.out, f"{doc['date']}-{gpu}-decode-layer{suffix}.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
