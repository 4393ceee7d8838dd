"""Speculative decoding (issue 25), in progress: the proposers. Verification lives in
sample/rejection_sampler.py; the engine does not use either yet (docs/speculative_decoding.md)."""

from pagedllm.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer"]
