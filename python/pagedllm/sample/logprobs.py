"""Logprobs for prompts and outputs, and their conversion to vLLM's {token_id: Logprob} dicts."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from pagedllm.outputs import Logprob, LogprobDict
from pagedllm.sample import ops
from pagedllm.sample.sampler import LogprobsTensors


@torch.inference_mode()
def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids, num_logprobs: int, vocab_size: Optional[int] = None) -> LogprobsTensors:
    """Prompt logprobs of N prompt positions.

    logits: [N, V'] (any float dtype, CPU/CUDA): row i scores prompt token ``next_token_ids[i]``
      (SchedulerOutput.prompt_logprob_rows gives which rows). next_token_ids: int [N].
    num_logprobs: top-k per position (>= 0; -1 = the whole vocabulary).
    vocab_size: columns beyond it (padding) are dropped. Returns LogprobsTensors (numpy).
    """
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    V = logits.shape[1]
    k = V if num_logprobs == -1 else int(num_logprobs)
    if k < 0:
        raise ValueError(f"prompt_logprobs must be >= 0 or -1, got {num_logprobs}")
    lp = ops.compute_logprobs(logits)
    targets = torch.as_tensor(np.asarray(next_token_ids, dtype=np.int64), device=lp.device)
    ids, vals, ranks = ops.gather_logprobs(lp, targets, min(k, V))
    n = logits.shape[0]
    return LogprobsTensors(ids.cpu().numpy(), vals.cpu().numpy(), ranks.cpu().numpy(), np.full(n, k, dtype=np.int64))


class TokenTextCache:
    """decoded_token strings for Logprob: ``tokenizer.decode([id])`` memoised per token id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def logprob_dict(
    tensors: LogprobsTensors, row: int, decode: Optional[Callable[[int], str]] = None
) -> Optional[LogprobDict]:
    """Row ``row`` of ``tensors`` as vLLM's {token_id: Logprob(logprob, rank, decoded_token)}.

    The first entry is the sampled / actual token (with its true rank), then the top-k tokens
    with ranks 1..k (a top-k token equal to the sampled one is not repeated). Returns None when
    the row asked for no logprobs (num_logprobs == -1).
    """
    k = int(tensors.num_logprobs[row])
    if k < 0:
        return None
    ids = tensors.token_ids[row]
    vals = tensors.logprobs[row]
    out: LogprobDict = {}
    tok = int(ids[0])
    out[tok] = Logprob(float(vals[0]), int(tensors.ranks[row]), decode(tok) if decode else None)
    for j in range(1, k + 1):
        t = int(ids[j])
        if t not in out:
            out[t] = Logprob(float(vals[j]), j, decode(t) if decode else None)
    return out
