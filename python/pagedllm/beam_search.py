"""What ``LLM.beam_search`` returns (vLLM's ``BeamSearchSequence`` / ``BeamSearchOutput``).

The search itself runs in the native engine (cpp/include/pagedllm/beam_search.h: Hugging Face's
beam search step; scheduler.h, "Beam search": the beams are copy-on-write forks of one request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class BeamSearchSequence:
    """One hypothesis.

    tokens: the prompt's token ids followed by the generated ones (its EOS included), as vLLM's.
    cum_logprob: sum of the generated tokens' logprobs (natural log). score: cum_logprob /
    len(generated) ** length_penalty, what the hypotheses are ranked by (Hugging Face's
    sequences_scores; not a vLLM field). text: the decoded tokens, prompt included (vLLM's), the EOS
    token's text left out unless include_stop_str_in_output. finish_reason: "stop" (EOS) or "length".
    """

    tokens: list[int]
    logprobs: list = field(default_factory=list)
    lora_request: None = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The beam_width best hypotheses of one prompt, best score first."""

    sequences: list[BeamSearchSequence]


__all__ = ["BeamSearchSequence", "BeamSearchOutput"]
