"""Batched logits transforms and the random draw: pure functions on torch tensors.

Every function takes logits float32 [R, V] (R sampled rows, V vocabulary) and per-row
parameters as tensors on the same device, works on CPU and CUDA, and treats each row
independently (a row's result never depends on the other rows). The order used by the Sampler
follows vLLM v1's sampler: min_tokens mask and logit_bias, penalties, (greedy argmax),
temperature, min_p, top_k/top_p, then the draw.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

NEG_INF = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: Optional[torch.Tensor],
    output_counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties, in place (vLLM semantics).

    logits: float32 [R, V]; prompt_mask: bool [R, V] (token occurs in the prompt) or None;
    output_counts: int [R, V] (occurrences in the output so far); penalties: float32 [R].
    Repetition penalty (CTRL, Keskar et al. 2019, sec. 4.1) applies to tokens in the prompt or
    the output: logit / r when logit > 0, logit * r otherwise. Then
    logit -= frequency * count and logit -= presence * (count > 0) (OpenAI's definition).
    Returns logits.
    """
    output_mask = output_counts > 0
    seen = output_mask if prompt_mask is None else (output_mask | prompt_mask)
    rep = repetition_penalties.unsqueeze(1).expand_as(logits)
    rep = torch.where(seen, rep, torch.ones_like(rep))
    logits.copy_(torch.where(logits > 0, logits / rep, logits * rep))
    logits -= frequency_penalties.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence_penalties.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits / temperature per row, in place. temperatures: float32 [R], all > 0."""
    return logits.div_(temperatures.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * (top probability of the row), in place.

    min_p: float32 [R] in [0, 1] (0 keeps everything). Source: Nguyen et al. 2024, "Turning Up
    the Heat: Min-p Sampling", sec. 3.
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th kept), in place.

    k: int64 [R], each in [1, V] (V = no limit).
    """
    max_k = int(k.max())
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).clamp_(min=0).unsqueeze(1))
    return logits.masked_fill_(logits < kth, NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, k: Optional[torch.Tensor], p: Optional[torch.Tensor]) -> torch.Tensor:
    """Top-k then top-p (nucleus, Holtzman et al. 2020, sec. 3.1) masking.

    k: int64 [R] in [1, V] (V = no limit) or None; p: float32 [R] in (0, 1] or None.
    Top-p keeps a token when the probability mass (after top-k) of strictly more likely tokens
    is below p, so the most likely token always survives. Rows are routed to the cheapest exact
    method: top_k <= _TOPK_FAST_LIMIT -> top-p over the k candidates; top-p alone -> over the
    _TOPP_CANDIDATES most likely tokens when their mass reaches p; else a full sort.
    Returns the masked logits (may be a new tensor).
    """
    if p is None:
        return logits if k is None else apply_top_k_only(logits, k)
    R, V = logits.shape
    if k is None:
        k = torch.full((R,), V, dtype=torch.int64, device=logits.device)
    out = torch.empty_like(logits)
    done = p >= 1.0  # no top-p: top-k alone (or nothing)
    if bool(done.any()):
        rows = done.nonzero().squeeze(1)
        sub = logits[rows]
        limited = k[rows] < V
        if bool(limited.any()):
            lim = limited.nonzero().squeeze(1)
            sub[lim] = apply_top_k_only(sub[lim], k[rows][lim].clone())
        out[rows] = sub
    small_k = (k <= _TOPK_FAST_LIMIT) & ~done
    if bool(small_k.any()):
        rows = small_k.nonzero().squeeze(1)
        out[rows] = _top_k_then_p(logits[rows], k[rows], p[rows])
        done = done | small_k
    if not bool(done.all()):
        rows = (~done).nonzero().squeeze(1)
        sub, ok = _top_p_candidates(logits[rows], p[rows], min(V, _TOPP_CANDIDATES))
        out[rows[ok]] = sub[ok]
        done[rows[ok]] = True
    if not bool(done.all()):
        rows = (~done).nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(logits[rows], k[rows], p[rows])
    return out


def _top_k_then_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    max_k = int(k.max())
    vals, idx = logits.topk(max_k, dim=-1)  # descending
    kth = vals.gather(1, (k - 1).unsqueeze(1))
    vals.masked_fill_(vals < kth, NEG_INF)  # ties with the k-th value are kept (within max_k)
    probs = vals.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely candidates
    vals.masked_fill_(before >= p.unsqueeze(1), NEG_INF)  # column 0 (before = 0) survives
    return torch.full_like(logits, NEG_INF).scatter_(1, idx, vals)


def _top_p_candidates(logits: torch.Tensor, p: torch.Tensor, width: int):
    """Top-p alone over the `width` most likely tokens; ok[r] when their mass reaches p[r] (then
    every token outside them has mass >= p before it and is dropped anyway)."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    vals, idx = logits.topk(width, dim=-1)
    probs = (vals - lse).exp()
    cum = probs.cumsum(dim=-1)
    ok = cum[:, -1] >= p
    vals.masked_fill_((cum - probs) >= p.unsqueeze(1), NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter_(1, idx, vals), ok


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    index = (logits_sort.size(1) - k).unsqueeze(1)
    kth = logits_sort.gather(1, index)
    logits_sort.masked_fill_(logits_sort < kth, NEG_INF)
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    top_p_mask = probs_sum <= (1 - p).unsqueeze(1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, NEG_INF)
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


#: top-p-only rows first try the nucleus within this many most likely tokens.
_TOPP_CANDIDATES = 256
#: Rows whose top_k is at most this use the topk-then-top-p path (no full-vocabulary sort).
_TOPK_FAST_LIMIT = 1024


def random_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from softmax(logits) by inverse transform sampling.

    logits: float32 [R, V] (masked tokens -inf, at least one finite per row); uniforms: [R] in
    [0, 1), one per row (the Sampler draws them from each seeded sequence's own generator, so a
    seeded row's draw does not depend on the other rows). The cumulative sum of
    exp(logits - max) is searched for u * total: token i is chosen with probability p_i, and a
    masked token (weight 0) never is. Returns int64 [R]. logits is overwritten.
    """
    w = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    cdf = w.cumsum_(dim=-1)
    x = uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    V = cdf.shape[1]
    over = idx >= V  # u * total rounded up to total: take the last token with weight > 0
    if bool(over.any()):
        last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False).squeeze(1)
        idx = torch.where(over, last, idx)
    return idx


def apply_penalties_sparse(
    logits: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> None:
    """apply_penalties touching only the tokens that occurred, in place.

    rows: int64 [n] (rows of logits); token_ids: int64 [n, L] the distinct tokens of each row's
    prompt + output (padded by repeating a row's own entries); output_counts: [n, L] their
    counts in the output (0 = prompt only); penalties: float32 [n]. Same arithmetic, in the same
    order, as the dense apply_penalties.
    """
    r = rows.unsqueeze(1).expand_as(token_ids)
    x = logits[r, token_ids]
    rep = repetition_penalties.unsqueeze(1)
    x = torch.where(x > 0, x / rep, x * rep)
    counts = output_counts.to(x.dtype)
    x = x - frequency_penalties.unsqueeze(1) * counts
    x = x - presence_penalties.unsqueeze(1) * (counts > 0).to(x.dtype)
    logits[r, token_ids] = x


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw log-softmax (float32 [R, V]) of the model's logits, before any processing."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int):
    """Top-k logprobs plus the given tokens' logprobs and ranks.

    logprobs: float32 [R, V]; token_ids: int64 [R]; num_logprobs: k >= 0.
    Returns (ids int64 [R, k+1], values float32 [R, k+1], ranks int64 [R]): column 0 is the
    given token, columns 1..k the top-k tokens in descending order (their ranks are 1..k);
    ranks[r] = 1 + number of tokens with a strictly larger logprob than token_ids[r].
    """
    token_ids = token_ids.long()
    token_lp = logprobs.gather(-1, token_ids.unsqueeze(-1))
    ranks = (logprobs > token_lp).sum(-1) + 1
    if num_logprobs > 0:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat((token_ids.unsqueeze(-1), top_ids), dim=1)
        values = torch.cat((token_lp, top_lp), dim=1)
    else:
        ids, values = token_ids.unsqueeze(-1), token_lp
    return ids, values, ranks


def mask_tokens(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[Sequence[int]]) -> None:
    """Set logits[rows[i], token_ids[i]] = -inf (min_tokens masking of EOS / stop tokens)."""
    if not rows:
        return
    r_idx = [r for r, ids in zip(rows, token_ids) for _ in ids]
    t_idx = [t for ids in token_ids for t in ids]
    if t_idx:
        logits[torch.tensor(r_idx, device=logits.device), torch.tensor(t_idx, device=logits.device)] = NEG_INF
