"""Results of generation, with vLLM's names and fields: RequestOutput, CompletionOutput, Logprob.

``logprobs`` of a completion is a list with one dict per output token,
``{token_id: Logprob}``: the sampled token plus the requested top-k tokens (ranks 1..k, by the
model's raw log-softmax). ``prompt_logprobs`` is the same per prompt token, with None as its
first entry (the first prompt token has no logits scoring it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass
class Logprob:
    """One token's log-probability.

    logprob: natural-log probability (float, <= 0) from the raw log-softmax of the logits.
    rank: 1 + number of vocabulary tokens with a strictly larger logprob (1 = most likely).
    decoded_token: the token's text on its own (``tokenizer.decode([id])``), or None.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: One output (or prompt) position: {token_id: Logprob}.
LogprobDict = dict[int, Logprob]
SampleLogprobs = list[LogprobDict]
PromptLogprobs = list[Optional[LogprobDict]]


@dataclass
class CompletionOutput:
    """One output sequence of a request.

    index: which of the request's n sequences (0..n-1).
    text: generated text (cut at a stop string; the stop token's own text is left out unless
      include_stop_str_in_output).
    token_ids: generated token ids (including a final EOS / stop token id).
    cumulative_logprob: sum of the sampled tokens' logprobs; None when logprobs were not asked.
    logprobs: per-token {token_id: Logprob} when SamplingParams.logprobs is set, else None.
    finish_reason: None while running, then "stop" (EOS, stop token, stop string), "length"
      (max_tokens or max_model_len) or "abort".
    stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


@dataclass
class RequestMetrics:
    """When a request went through the engine (vLLM's ``RequestOutput.metrics``), in seconds of
    ``time.time()``: arrival (add_request), first_scheduled (its first step), first_token /
    last_token (outputs), finished; None until it happens."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_in_queue(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """The output of one request (vLLM's ``RequestOutput``).

    request_id: the request's id; prompt: its text (None when given as token ids);
    prompt_token_ids: list[int]; prompt_logprobs: PromptLogprobs or None;
    outputs: one CompletionOutput per sequence, ordered by index; finished: every sequence done;
    metrics: RequestMetrics (the request's timestamps so far).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[object] = None
    num_cached_tokens: Optional[int] = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished})"
        )


__all__ = ["Logprob", "LogprobDict", "SampleLogprobs", "PromptLogprobs", "CompletionOutput", "RequestMetrics",
           "RequestOutput"]
