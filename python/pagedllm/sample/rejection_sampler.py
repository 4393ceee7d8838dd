"""Exact verification of speculative proposals (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", section 2.3; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling", algorithm 2), as vLLM v1's RejectionSampler.

For each sequence b with k_b proposed tokens x_0 .. x_{k_b - 1} and the target model's
distributions p_0 .. p_{k_b} at those positions (p_j: after the sampler's transforms —
temperature, top-k/p, min-p, penalties, logit_bias, min_tokens — for the context that ends with
x_0 .. x_{j-1}):

- greedy rows accept x_j while x_j == argmax p_j;
- random rows accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), q_j being the draft's
  distribution (n-gram proposals have none: q_j is one-hot on x_j, so the test is u < p_j(x_j));
- at the first rejection r the row emits a token drawn from norm(max(0, p_r - q_r)) (greedy:
  argmax p_r) and stops; when every proposal is accepted it emits a bonus token from p_{k_b}.

Each row emits 1 .. k_b + 1 tokens whose distribution is exactly the target's (the lemma of both
papers); greedy rows emit exactly the tokens greedy decoding would.

Shapes: target_probs float [B, K + 1, V]; draft_token_ids int64 [B, K] (entries past k_b are
ignored); num_draft int64 [B]; draft_probs float [B, K, V] or None (one-hot drafts); greedy bool
[B]. Random numbers come in explicitly (``uniforms`` [B, K] in [0, 1), ``noise`` [B, K + 1, V]
Exp(1) draws: a draw from distribution d is argmax d / noise, the exponential race), so that a
caller can make them from per-request generators (seeded requests stay reproducible) and a test
can replay them. Returns (output_token_ids int64 [B, K + 1], -1 past each row's end;
num_emitted int64 [B]; num_accepted int64 [B] = num_emitted - 1).
"""

from __future__ import annotations

from typing import Optional

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, K1, V = target_probs.shape
    K = K1 - 1
    if draft_token_ids.shape != (B, K) or num_draft.shape != (B,) or greedy.shape != (B,):
        raise ValueError(f"shapes: target_probs {tuple(target_probs.shape)} needs draft_token_ids [{B}, {K}], "
                         f"num_draft [{B}], greedy [{B}]; got {tuple(draft_token_ids.shape)}, "
                         f"{tuple(num_draft.shape)}, {tuple(greedy.shape)}")
    if draft_probs is not None and draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs must be [{B}, {K}, {V}], got {tuple(draft_probs.shape)}")
    if bool(((num_draft < 0) | (num_draft > K)).any()):
        raise ValueError(f"num_draft must be in [0, {K}], got {num_draft.tolist()}")
    device = target_probs.device
    p = target_probs.to(torch.float32)
    pos = torch.arange(K, device=device)
    valid = pos[None, :] < num_draft[:, None]  # [B, K]
    x = torch.where(valid, draft_token_ids, torch.zeros_like(draft_token_ids))
    p_x = p[:, :K].gather(2, x[..., None])[..., 0]  # p_j(x_j) [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.to(torch.float32).gather(2, x[..., None])[..., 0]
    argmax = p.argmax(dim=2)  # [B, K + 1]
    accept_random = uniforms.to(torch.float32) * q_x < p_x  # u < p / q, without dividing by q = 0
    accept = torch.where(greedy[:, None], argmax[:, :K] == x, accept_random) & valid
    # r: the first position not accepted (k_b when every proposal is)
    rejected = ~accept | ~valid
    r = torch.where(rejected.any(dim=1), rejected.to(torch.int8).argmax(dim=1), torch.full_like(num_draft, K))
    r = torch.minimum(r, num_draft)
    # the token at position r: from the residual (a rejection) or from p_{k_b} (the bonus)
    p_r = p.gather(1, r[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    residual = p_r
    is_rejection = r < num_draft
    if draft_probs is None:
        x_r = x.gather(1, torch.minimum(r, torch.full_like(r, max(K - 1, 0)))[:, None])[:, 0] if K else r
        drop = torch.zeros_like(p_r).scatter_(1, x_r[:, None], 1.0)
        residual = torch.where(is_rejection[:, None], p_r * (1 - drop), p_r)
    else:
        q_r = draft_probs.to(torch.float32).gather(
            1, torch.minimum(r, torch.full_like(r, max(K - 1, 0)))[:, None, None].expand(B, 1, V))[:, 0] if K else p_r
        residual = torch.where(is_rejection[:, None], torch.clamp(p_r - q_r, min=0.0), p_r)
    # a residual of zero mass (p == q up to rounding) falls back to p_r
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_r, residual)
    e_r = noise.to(torch.float32).gather(1, r[:, None, None].expand(B, 1, V))[:, 0]
    drawn = (residual / e_r).argmax(dim=1)
    last = torch.where(greedy, argmax.gather(1, r[:, None])[:, 0], drawn)
    out = torch.full((B, K1), -1, dtype=torch.int64, device=device)
    keep = pos[None, :] < r[:, None]
    out[:, :K] = torch.where(keep, x, out[:, :K])
    out.scatter_(1, r[:, None], last[:, None])
    return out, r + 1, r


def draw_random(num_rows: int, k: int, vocab: int, generators: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [B, k], noise [B, k + 1, V]) of rejection_sample, row b from generators[b] (a CPU
    torch.Generator, or None for the shared default stream)."""
    uniforms = torch.empty(num_rows, k)
    noise = torch.empty(num_rows, k + 1, vocab)
    for b, g in enumerate(generators):
        uniforms[b].uniform_(generator=g)
        noise[b].exponential_(generator=g)
    return uniforms.to(device), noise.to(device)


__all__ = ["draw_random", "rejection_sample"]
