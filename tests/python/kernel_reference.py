"""Float64 reference attention and paged-cache builders shared by the CPU and CUDA kernel tests.

The reference attends over the ORIGINAL contiguous K/V of each sequence (never over the paged
cache), so a wrong gather in a kernel shows as a mismatch. The paged cache is built from the same
K/V rounded to the cache dtype, with shuffled physical block ids and NaN in every slot that no
sequence owns (whole unowned blocks, the tail of each sequence's last block, and unused
block-table entries point at a NaN block), so reading a wrong slot poisons the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

#: Cache dtypes each device supports (CPU refuses float16 with an error listing these).
CPU_DTYPES = [torch.float32, torch.bfloat16]
CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

#: Parametrize values for (device, dtype) and for device alone; CUDA ones carry the `cuda` marker.
DEVICE_DTYPES = [pytest.param("cpu", dt, id=f"cpu-{str(dt)[6:]}") for dt in CPU_DTYPES] + [
    pytest.param("cuda", dt, id=f"cuda-{str(dt)[6:]}", marks=pytest.mark.cuda) for dt in CUDA_DTYPES]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]

#: Absolute / relative tolerances of kernel outputs against the float64 reference, per dtype.
#: float32: fp32 accumulation over a few hundred tokens (errors ~1e-6) plus the kernels' exp
#: approximation (~2e-7 relative). bfloat16 / float16: dominated by rounding the output to the
#: dtype (2^-8 and 2^-11 relative) plus inputs of that precision.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-4},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 1.5e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """out (any device, kernel dtype) against ref (float64) with the dtype's tolerance."""
    tol = TOLERANCES[dtype]
    got = out.detach().to("cpu", torch.float64)
    assert not torch.isnan(got).any(), "kernel output contains NaN (a poisoned slot was read, or a row was not written)"
    torch.testing.assert_close(got, ref, atol=tol["atol"], rtol=tol["rtol"])


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None) -> torch.Tensor:
    """Naive float64 attention of one sequence.

    q: [n, Hq, D] queries at `positions` ([n] int); k, v: [L, Hkv, D] the sequence's whole
    contiguous context (position j = row j). Query i sees key j iff j <= positions[i] and
    (no window or j > positions[i] - sliding_window). Scores: (q.k) * scale, then
    soft_cap * tanh(score / soft_cap) when soft_cap. A query that sees no key gives zeros.
    Returns [n, Hq, D] float64 on the CPU.
    """
    q = q.to("cpu", torch.float64)
    k = k.to("cpu", torch.float64)
    v = v.to("cpu", torch.float64)
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    if n == 0 or length == 0:
        return out
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale  # [Hq, n, L]
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    j = torch.arange(length).view(1, length)
    p = positions.to("cpu", torch.int64).view(n, 1)
    visible = j <= p
    if sliding_window:
        visible &= j > p - sliding_window
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows that see nothing
    return torch.einsum("hnl,lhd->nhd", probs, v)


@dataclass
class PagedKV:
    """A paged cache built from per-sequence contiguous K/V (see build_paged_cache)."""

    key_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D], cache dtype, NaN where unowned
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, M]
    keys: list[torch.Tensor]  # per sequence [L_b, Hkv, D], cache dtype, CPU (the originals)
    values: list[torch.Tensor]
    slot_mappings: list[torch.Tensor]  # per sequence int64 [L_b]: slot of each position


def random_kv(seq_lens: list[int], num_kv_heads: int, head_size: int, dtype: torch.dtype,
              generator: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fresh random K/V [L_b, Hkv, D] per sequence, rounded to `dtype` (kept on the CPU)."""
    ks, vs = [], []
    for length in seq_lens:
        ks.append(torch.randn(length, num_kv_heads, head_size, generator=generator).to(dtype))
        vs.append(torch.randn(length, num_kv_heads, head_size, generator=generator).to(dtype))
    return ks, vs


def build_paged_cache(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int,
                      dtype: torch.dtype, device: str | torch.device, generator: torch.Generator,
                      extra_blocks: int = 3, extra_table_cols: int = 1,
                      num_kv_heads: int | None = None, head_size: int | None = None) -> PagedKV:
    """Scatter each sequence's contiguous K/V into a NaN-filled paged cache.

    Physical block ids are a random permutation; `extra_blocks` unowned blocks stay NaN, and
    every block-table entry past a sequence's last block points at one of them (or is -1 when
    there are none), as does the tail of the last block. `extra_table_cols` widens the table.
    For an empty batch pass num_kv_heads and head_size.
    """
    if keys:
        num_kv_heads, head_size = keys[0].shape[1], keys[0].shape[2]
    assert num_kv_heads and head_size, "an empty batch needs num_kv_heads and head_size"
    needed = [math.ceil(k.shape[0] / block_size) for k in keys]
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    owned, spare = perm[: sum(needed)], perm[sum(needed):]
    max_blocks = max(needed, default=0) + extra_table_cols
    fill = int(spare[0]) if len(spare) else -1
    tables = torch.full((len(keys), max(max_blocks, 1)), fill, dtype=torch.int32)
    kc = torch.full((num_blocks, num_kv_heads, block_size, head_size), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    slot_mappings = []
    start = 0
    for b, (k, v) in enumerate(zip(keys, values)):
        blocks = owned[start:start + needed[b]]
        start += needed[b]
        tables[b, : needed[b]] = blocks.to(torch.int32)
        pos = torch.arange(k.shape[0])
        blk = blocks[pos // block_size] if len(pos) else torch.zeros(0, dtype=torch.int64)
        row = pos % block_size
        kc[blk, :, row, :] = k.to(dtype)
        vc[blk, :, row, :] = v.to(dtype)
        slot_mappings.append((blk * block_size + row).to(torch.int64))
    return PagedKV(kc.to(device), vc.to(device), tables.to(device), [k.to(dtype) for k in keys],
                   [v.to(dtype) for v in values], slot_mappings)


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN, so an element the kernel fails to write shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
