"""The Python reference of the native n-gram proposer the scheduler runs (pagedllm._C.propose_ngram,
cpp/include/pagedllm/spec_decode.h; tests check they agree). N-gram (prompt lookup) proposals for speculative decoding (vLLM's ``method: "ngram"``;
Saxena 2023, "Prompt Lookup Decoding"): the output often repeats spans of the prompt (an edit, a
quote, code), so the tokens that followed an earlier occurrence of the context's last n tokens are
a cheap guess of what comes next.

``NgramProposer(k, prompt_lookup_min, prompt_lookup_max).propose(token_ids)``: for n from
prompt_lookup_max down to prompt_lookup_min, the earliest earlier occurrence of the last n
tokens of ``token_ids`` (prompt + output so far; longest n and earliest position, as vLLM v1);
the up to k tokens that followed it are the proposal (fewer when the occurrence is near the end; an empty array when no n matches).
token_ids: int sequence or int64 array. Errors: ValueError for bounds outside
1 <= prompt_lookup_min <= prompt_lookup_max and k >= 1.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} and "
                             f"{prompt_lookup_max}")
        self.k = int(num_speculative_tokens)
        self.min_n = int(prompt_lookup_min)
        self.max_n = int(prompt_lookup_max)

    def propose(self, token_ids) -> np.ndarray:
        t = np.asarray(token_ids, dtype=np.int64)
        L = t.shape[0]
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = t[L - n:]
            # windows t[i:i + n] for i in [0, L - n): every earlier start (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if hits.size:
                start = int(hits[0]) + n  # the earliest occurrence
                return t[start:start + self.k].copy()
        return np.zeros(0, dtype=np.int64)


__all__ = ["NgramProposer"]
