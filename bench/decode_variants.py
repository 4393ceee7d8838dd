"""Decode kernel variants side by side on one GPU (docs/history/cuda_kernels_notes.md, run 4).

Each variant is an environment setting read once by the library (PAGEDLLM_DECODE_TMA,
PAGEDLLM_DECODE_KERNEL), so each runs bench/cuda_kernels.py in its own process over the same decode
cases (GQA 32/8, d128, bf16, CUDA-graph replay, inputs rotated past 4x L2, SDPA in the same
process). The documents are merged into one JSON: DIR/<date>-h200-<name>.json (--name).

    python3 bench/decode_variants.py --out DIR [--variants base,cpasync,...] [--cases ...]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {
    "base": {},
    "warp": {"PAGEDLLM_DECODE_MODE": "warp"},  # v2 work items on warps only (run 4's kernel)
    "pair": {"PAGEDLLM_DECODE_MODE": "pair"},  # v2 work items on pairs of warps only (merge in smem)
    "cta": {"PAGEDLLM_DECODE_MODE": "cta"},  # v2 work items on CTAs only (4 warps merge in smem)
    "noeven": {"PAGEDLLM_DECODE_EVEN": "0"},  # partitions fixed by the block-table width
    "ctareduce": {"PAGEDLLM_REDUCE": "cta"},  # run 4's CTA-per-row split-K reduction at any split count
    "nopdl": {"PAGEDLLM_NO_PDL": "1"},  # the split-K reduction without programmatic dependent launch
    "cpasync": {"PAGEDLLM_DECODE_TMA": "0"},  # d128 tiles by cp.async instead of TMA
    "v1": {"PAGEDLLM_DECODE_KERNEL": "v1"},  # the CTA-per-item decode kernel
    "run4like": {"PAGEDLLM_DECODE_MODE": "warp", "PAGEDLLM_DECODE_EVEN": "0", "PAGEDLLM_REDUCE": "cta"},
    "base2": {},  # the default again, last: the run-to-run spread
    # Run 7: how split-K partitions are combined (the plan itself is the cost model's either way).
    "kernel": {"PAGEDLLM_SPLITK_COMBINE": "kernel"},  # the reduction kernel after the decode kernel (run 6)
    "inkernel": {"PAGEDLLM_SPLITK_COMBINE": "inkernel"},  # last-arriver combine in the decode kernel, any split count
    "kernel2": {"PAGEDLLM_SPLITK_COMBINE": "kernel"},  # again, alternating: the run-to-run spread
    "inkernel2": {"PAGEDLLM_SPLITK_COMBINE": "inkernel"},
    "kernel3": {"PAGEDLLM_SPLITK_COMBINE": "kernel"},
    "inkernel3": {"PAGEDLLM_SPLITK_COMBINE": "inkernel"},
    # Session 5 (run 8b-8d; the heads-fastest order, the fence arrival and the cluster combine were
    # removed after losing): the single-pass plans of 64 x 4,096 again; the launch floor; CTA and
    # warp items under each combine; block size 32. Run 8d's 2-deep TMA rings
    # (PAGEDLLM_DECODE_STAGES=2 then) are the default now.
    "pair2": {"PAGEDLLM_DECODE_MODE": "pair"},
    "cta2": {"PAGEDLLM_DECODE_MODE": "cta"},
    "floor": {},
    "floorin": {"PAGEDLLM_SPLITK_COMBINE": "inkernel", "PAGEDLLM_DECODE_MODE": "cta"},
    "ctain": {"PAGEDLLM_DECODE_MODE": "cta", "PAGEDLLM_SPLITK_COMBINE": "inkernel"},
    "ctakern": {"PAGEDLLM_DECODE_MODE": "cta", "PAGEDLLM_SPLITK_COMBINE": "kernel"},
    "warpin": {"PAGEDLLM_DECODE_MODE": "warp", "PAGEDLLM_SPLITK_COMBINE": "inkernel"},
    "warpkern": {"PAGEDLLM_DECODE_MODE": "warp", "PAGEDLLM_SPLITK_COMBINE": "kernel"},
    "bs32": {},
    "base3": {},
}
DEFAULT_CASES = {  # 1x300:w32 is the engine's batch-1 step (Llama-3-8B shape, max_model_len 512)
    "base": "1x4096,8x4096,16x1024,64x4096,256x1024,128x2048,1x32768,1x300:w32,4x300:w32,1x300:w256,"
            "64x4096:seq",
    "warp": "1x4096,8x4096,64x4096,1x300:w32",
    "pair": "64x4096,64x4096:s2,256x1024,8x4096",
    "cta": "1x4096:s16,1x4096:s32,64x4096",
    "noeven": "1x4096,1x300:w32,1x300:w256",
    "ctareduce": "64x4096,8x4096,1x300:w32",
    "nopdl": "1x4096,1x300:w32",
    "cpasync": "64x4096,1x4096",
    "v1": "1x4096,64x4096",
    "run4like": "1x4096,8x4096,64x4096,1x300:w32",
    "base2": "64x4096,1x4096,1x300:w32",
    "kernel": "64x4096,8x4096,256x1024,128x2048,16x1024,1x4096,1x300:w32",
    "inkernel": "64x4096,8x4096,256x1024,128x2048,16x1024,1x4096,1x300:w32",
    "kernel2": "64x4096,1x4096",
    "inkernel2": "64x4096,1x4096",
    "kernel3": "64x4096",
    "inkernel3": "64x4096",
    "pair2": "64x4096:s0",
    "cta2": "64x4096:s0",
    "floor": "1x16:s0,1x16:s2,1x16:s16,1x4096",
    "floorin": "1x16:s2,1x16:s16",
    "ctain": "1x16:s2,1x16:s8,1x16:s16,1x4096:s16,1x4096:s8,1x300:w32,1x2000:w256",
    "ctakern": "1x16:s2,1x16:s8,1x16:s16,1x4096:s16,1x4096:s8,1x300:w32,1x2000:w256",
    "warpin": "1x16:s2,64x4096:s2,8x4096:s16,16x1024:s3",
    "warpkern": "1x16:s2,64x4096:s2,8x4096:s16,16x1024:s3",
    "bs32": "64x4096:b32,64x4096,1x4096:b32,1x4096,256x1024:b32,256x1024",
    "base3": "64x4096,1x4096,1x300:w32,256x1024,8x4096",
}
# Run 4's first device call (commit 23a08c7) also had "nz" (cp.async without the zero-fill
# operand), "tma" (now the default), "4x5" (5-deep rings), "fused" / "fused_memset" (split-K
# combined by the last CTA of the CTA-per-item kernel); the losers were removed (notes).


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="base,warp,pair,cta,noeven,ctareduce,run4like,base2")
    ap.add_argument("--cases", default="", help="the same cases for every variant (default: per variant)")
    ap.add_argument("--name", default="kernels-run4")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per variant")
    args = ap.parse_args()
    merged = {"bench": "decode_variants", "date": datetime.date.today().isoformat(), "variants": {}}
    for name in args.variants.split(","):
        env = dict(os.environ, **VARIANTS[name])
        cases = args.cases or DEFAULT_CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, os.path.join(HERE, "cuda_kernels.py"), "--out", tmp, "--no-prefill",
                   "--cases", cases, "--tag", name]
            print(f"== variant {name}: {VARIANTS[name]} cases {cases}", file=sys.stderr, flush=True)
            try:
                subprocess.run(cmd, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                merged["variants"][name] = {"env": VARIANTS[name], "error": str(e)}
                continue
            doc = json.load(open(glob.glob(os.path.join(tmp, "*.json"))[0]))
            for k in ("commit", "gpu", "sms", "torch", "shape", "timing"):
                merged.setdefault(k, doc.get(k))
            merged["variants"][name] = {"env": VARIANTS[name], "decode": doc["decode"]}
    os.makedirs(args.out, exist_ok=True)
    gpu = "h200" if "H200" in str(merged.get("gpu")) else str(merged.get("gpu")).replace(" ", "-").lower()
    path = os.path.join(args.out, f"{merged['date']}-{gpu}-{args.name}.json")
    with open(path, "w") as f:
        f.write(json.dumps(merged, indent=1) + "\n")
    # Short table last (the device tool returns the end of the output).
    print(f"{'variant':13s} {'case':16s} {'ours_us':>9s} {'sdpa_us':>9s} {'ratio':>6s} {'err':>8s}")
    for name, v in merged["variants"].items():
        if "error" in v:
            print(f"{name:13s} ERROR {v['error'][:80]}")
            continue
        for r in v["decode"]:
            case = f"{r['batch']}x{r['context']}" + ("" if r["split_k"] == "auto" else f":s{r['split_k']}")
            bs = r.get("block_size", 16)
            case += (f":w{r['block_table_width']}" if r.get("block_table_width", 0) * bs > r["context"] + bs - 1 else "")
            case += f":b{bs}" if bs != 16 else ""
            print(f"{name:13s} {case:16s} {r['ours_us']:9.2f} {r['sdpa_us']:9.2f} {r['speed_vs_sdpa']:6.3f} "
                  f"{r['rel_l2_vs_sdpa_fp32']:8.1e}")


if __name__ == "__main__":
    main()
