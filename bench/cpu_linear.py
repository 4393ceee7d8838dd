"""CPU projection kernels: pagedllm's int8 W8A8 kernel (ops.int8_linear) and, where the CPU has AMX,
its bf16 AMX kernel (ops.amx_linear) against oneDNN's packed bf16 product (what the CPU engine runs
otherwise), per projection shape and batch size, the same threads for all.

Shapes: SmolLM2-135M's (the bundled model: qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536, LM head 49152x576) by default, --shapes llama3-8b for Llama-3-8B's. Median microseconds
per call over --iters calls, and each kernel's speed-up over oneDNN.

    PYTHONPATH=python python3 bench/cpu_linear.py [--batch 1 16 64 256] [--threads 2] [--shapes smollm2]

Prints JSON and writes bench/results/<YYYY-MM-DD>-<hostname>-cpu_linear.json with the git commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    from pagedllm import ops
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))
    from pagedllm import ops

SHAPES = {  # name -> {projection: (out_features, in_features)}
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                "lm_head": (49152, 576)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}


def median_us(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    amx = ops.amx_linear_supported()
    result = {
        "bench": "cpu_linear", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "threads": args.threads, "shapes": args.shapes,
        "int8_vnni": ops.int8_linear_vnni(), "amx": amx,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "loadavg_1m": round(os.getloadavg()[0], 2), "results": {},
    }
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES[args.shapes].items():
        w = torch.randn(n, k, generator=g).bfloat16()
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        codes, scale = ops.int8_quantize_weight(w)
        packed, comp = ops.int8_pack_linear_weight(codes)
        amx_packed = ops.amx_pack_linear_weight(w) if amx else None
        for m in args.batch:
            x = torch.randn(m, k, generator=g).bfloat16()
            row = {"onednn_bf16_us": median_us(
                lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), args.iters)}
            row["int8_us"] = median_us(lambda: ops.int8_linear(x, packed, comp, scale), args.iters)
            if amx:
                out = torch.empty(m, n, dtype=torch.bfloat16)
                row["amx_bf16_us"] = median_us(lambda: ops.amx_linear(out, x, amx_packed), args.iters)
            for key in [k_ for k_ in row if k_ != "onednn_bf16_us"]:
                row[key.replace("_us", "_speedup")] = round(row["onednn_bf16_us"] / row[key], 3)
            result["results"][f"{name}/{n}x{k}/M={m}"] = {k_: round(v, 1) if k_.endswith("_us") else v
                                                         for k_, v in row.items()}
    text = json.dumps(result, indent=2)
    print(text)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{datetime.date.today().isoformat()}-{platform.node() or 'machine'}-cpu_linear.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
