"""Hardware counters of one decode call, ours against SDPA on the same K/V (issue 4's 64 x 4,096 gap).

Builds the case the way bench/cuda_kernels.py does (GQA 32/8, d128, bf16, block size 16, shuffled
block ids; SDPA on contiguous K/V holding the same values), warms both up, then runs each once
between cudaProfilerStart/Stop so that `ncu --profile-from-start off` measures exactly those kernels:

    ncu --clock-control none --profile-from-start off --metrics <list> python3 bench/ncu_decode.py [--batch 64 --ctx 4096]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import pagedllm.ops as ops

HQ, HKV, D, BS = 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    b, ctx, dev, dt = args.batch, args.ctx, "cuda", torch.bfloat16
    nb = math.ceil(ctx / BS)
    kc = torch.randn(b * nb, HKV, BS, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.randperm(b * nb, device=dev).to(torch.int32).view(b, nb)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, HQ, D, device=dev, dtype=dt)
    out = torch.empty_like(q)
    ids = bt.long()
    k = kc[ids].permute(0, 2, 1, 3, 4).reshape(b, HKV, nb * BS, D)[:, :, :ctx].contiguous()
    v = vc[ids].permute(0, 2, 1, 3, 4).reshape(b, HKV, nb * BS, D)[:, :, :ctx].contiguous()
    scale = D ** -0.5

    def ours():
        ops.paged_attention(out, q, kc, vc, bt, seq_lens, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    for _ in range(3):
        ours()
        sdpa()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ours()
    torch.cuda.synchronize()
    sdpa()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    ref = sdpa().squeeze(2).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ours()
    print(f"batch {b} context {ctx}: relative difference ours vs SDPA {err:.2e}; plan {ops.last_cuda_decode_plan()}")


if __name__ == "__main__":
    main()
