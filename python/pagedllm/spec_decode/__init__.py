"""Speculative decoding (docs/speculative_decoding.md). The n-gram proposer and the verification
of its drafts run in the native scheduler (cpp/include/pagedllm/spec_decode.h); here: the user's
``speculative_config`` (config.py), a Python n-gram reference (ngram_proposer.py), and in
sample/rejection_sampler.py the residual draw that draft models with a real distribution need."""

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
