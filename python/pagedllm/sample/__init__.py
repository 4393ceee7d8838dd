"""Sampling: logits of the rows to sample -> next token ids (+ logprobs).

Contract for the engine loop (the LLM class):

1. ``sampler = Sampler(vocab_size, seed=llm_seed)`` once per engine.
2. For each ``(seq_id, request_id, index)`` in ``SchedulerOutput.new_seqs``:
   ``sampler.add_sequence(seq_id, params, prompt_token_ids, index, eos_token_ids)``
   (ValueError for out-of-vocabulary logit_bias / stop_token_ids: reject the request).
3. ``out = sampler(logits, sched_out.sample_seq_ids)`` -> SamplerOutput with
   ``sampled_token_ids`` int32 [R] for ``core.update_from_output`` and, when any row asked,
   ``logprobs`` (LogprobsTensors; ``logprob_dict(out.logprobs, r, TokenTextCache(tok))`` gives
   row r as vLLM's {token_id: Logprob}).
4. ``sampler.append_output_tokens(result.seq_ids, result.token_ids)`` with the UpdateResult.
5. ``sampler.remove_sequence(seq_id)`` for every finished / aborted sequence.

Prompt logprobs: ``compute_prompt_logprobs(logits_rows, next_prompt_token_ids, k)``.
"""

from pagedllm.sample.logprobs import TokenTextCache, compute_prompt_logprobs, logprob_dict
from pagedllm.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "LogprobsTensors", "compute_prompt_logprobs", "logprob_dict", "TokenTextCache"]
