"""One call of each CUDA attention kernel of interest, for Nsight Compute (no timing here):
    ncu --clock-control none --set detailed -k regex:'paged|splitk' python3 bench/cuda_profile.py
decode 64 x 4096 and 1 x 4096 (split-K + reduction), prefill 4096; GQA 32/8, d128, bf16."""
import math

import torch

import pagedllm.ops as ops

HQ, HKV, D, BS = 32, 8, 128, 16


def paged(batch, ctx):
    nb = math.ceil(ctx / BS)
    kc = torch.randn(batch * nb + 3, HKV, BS, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(batch * nb + 3, device="cuda")[:batch * nb].to(torch.int32).view(batch, nb)
    return kc, vc, bt, torch.full((batch,), ctx, dtype=torch.int32, device="cuda")


for batch in (64, 1):
    kc, vc, bt, sl = paged(batch, 4096)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    ops.paged_attention(torch.empty_like(q), q, kc, vc, bt, sl, D ** -0.5)
kc, vc, bt, sl = paged(1, 4096)
q = torch.randn(4096, HQ, D, device="cuda", dtype=torch.bfloat16)
ops.paged_prefill_attention(torch.empty_like(q), q, kc, vc, bt, sl,
                            torch.tensor([0, 4096], dtype=torch.int32, device="cuda"), D ** -0.5)
torch.cuda.synchronize()
print("profiled calls done")
