"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", section 3.4), in the
"rotate half" (GPT-NeoX) layout that Hugging Face Llama-family checkpoints use.

Frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` exactly (float32 inverse frequencies,
positions times frequencies in float32), so logits match Hugging Face bit for bit in fp32:

- default: inv_freq[i] = 1 / theta^(2i / d)
- linear: inv_freq / factor (position interpolation, Chen et al. 2023)
- llama3: Meta's Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept,
  a smooth blend between (low_freq_factor, high_freq_factor) of original_max_position_embeddings.
"""

from __future__ import annotations

import math

import torch

from pagedllm.model_executor.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """float32 [rotary_dim / 2] inverse frequencies of `rope` (see the module docstring)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        if not old_len:
            raise ValueError("llama3 RoPE scaling needs original_max_position_embeddings")
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions) and their application to q and k.

    cos_sin(positions int64 [T]) -> (cos, sin), each [T, 1, rotary_dim / 2] in `dtype`, computed
    once per step and shared by every layer; apply(x [T, H, D], cos, sin) rotates the first
    rotary_dim features of every head and returns a new tensor. cos_sin_cache
    [max_positions, rotary_dim] (cos | sin) is the same table for the fused in-place kernel.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device):
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(rope, self.rotary_dim)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.max_positions = max_positions
        self.cos = freqs.cos().to(dtype=dtype, device=device)
        self.sin = freqs.sin().to(dtype=dtype, device=device)
        # [max_positions, rotary_dim]: cos | sin, the table of pagedllm.ops.rotary_embedding
        self.cos_sin_cache = torch.cat([self.cos, self.sin], dim=-1).contiguous()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.rotary_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half : self.rotary_dim]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.is_cuda:  # two kernels per half instead of three (fewer nodes in a decode CUDA graph)
            torch.addcmul(x1 * cos, x2, sin, value=-1, out=out[..., :half])
            torch.addcmul(x2 * cos, x1, sin, out=out[..., half : self.rotary_dim])
        else:
            torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
            torch.add(x2 * cos, x1 * sin, out=out[..., half : self.rotary_dim])
        if self.rotary_dim < self.head_dim:
            out[..., self.rotary_dim :] = x[..., self.rotary_dim :]
        return out
