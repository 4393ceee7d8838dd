// pagedllm/spec_decode.h — speculative decoding in the native core: the n-gram proposer and the
// configuration the scheduler verifies proposals with.
//
// Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
// Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
// Sampling"): a decoding sequence with k proposed (draft) tokens x_0 .. x_{k-1} is computed as a
// query chunk of k + 1 tokens (its last token and the drafts), and the sampler samples a token
// y_j at each of the k + 1 positions from the target's distribution given the context that ends
// with x_0 .. x_{j-1}. The scheduler then emits y_0, y_1, ... while the previous draft matched
// (y_j == x_j), i.e. up to and including the first y_j != x_j, or all k + 1 when every draft
// matched (the last is the "bonus" token).
//
// For proposals without a draft distribution (n-gram: q is one-hot on x_j) this IS the rejection
// sampler of both papers: x_j is accepted with probability p_j(x_j) = min(1, p_j(x_j) / q_j(x_j)),
// and after a rejection y_j ~ p_j conditioned on y_j != x_j, which is norm(max(0, p_j - q_j)).
// So each emitted token follows the target's distribution exactly, and a greedy row emits exactly
// the tokens of greedy decoding. (Draft models with a real q need the residual draw of
// python/pagedllm/sample/rejection_sampler.py.)
//
// The n-gram proposer is vLLM's method "ngram" (prompt lookup decoding, Saxena 2023): for n from
// prompt_lookup_max down to prompt_lookup_min, the EARLIEST earlier occurrence of the context's
// last n tokens; the up to k tokens that followed it are the proposal (vLLM v1's
// _find_longest_matched_ngram_and_propose_tokens: longest n, earliest position).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pagedllm {

struct SpeculativeConfig {
  /// Draft tokens per sequence and step (k); 0 turns speculation off.
  int32_t num_speculative_tokens = 0;
  int32_t prompt_lookup_min = 1;
  int32_t prompt_lookup_max = 4;
  /// No proposals in a step whose running sequences number at least this (0: no limit): at large
  /// batches a decode step is compute-bound and verification tokens cost as much as real ones.
  int32_t disable_by_batch_size = 0;
  /// Debug (vLLM's rejection_sample_method "synthetic" at acceptance length k + 1): every draft is
  /// accepted whatever was sampled, and a sequence always gets k drafts (what the n-gram finds,
  /// padded with the context's last token), to measure verification cost on random weights.
  bool accept_all = false;
  /// The caller proposes (a draft model): the scheduler reserves up to k draft slots for each
  /// sequence that may speculate, with draft token 0 in input_ids and draft_token_ids, and the
  /// caller overwrites both before running the step (update_from_output verifies what
  /// draft_token_ids then holds). The n-gram bounds are unused.
  bool external_drafts = false;

  bool enabled() const { return num_speculative_tokens > 0; }
  /// Throws InvalidArgument naming a bad field.
  void validate() const;
};

/// Up to max_k tokens that followed the earliest earlier occurrence of the longest suffix of
/// token_ids of length in [min_n, max_n] (see above) into *out (cleared first; empty when no
/// n-gram matches). O(len * max_n) worst case, no allocation once *out has capacity.
void propose_ngram(std::span<const int32_t> token_ids, int32_t min_n, int32_t max_n, int32_t max_k,
                   std::vector<int32_t>* out);

/// Monotonic speculative-decoding counters (vLLM's spec_decode_* metrics).
struct SpecDecodeCounters {
  int64_t num_drafts = 0;           ///< spec_decode_num_drafts: sequence-steps with >= 1 draft
  int64_t num_draft_tokens = 0;     ///< spec_decode_num_draft_tokens
  int64_t num_accepted_tokens = 0;  ///< spec_decode_num_accepted_tokens
  /// spec_decode_num_accepted_tokens_per_pos: [k], entry j counts accepted drafts at position j
  std::vector<int64_t> accepted_per_pos;
};

}  // namespace pagedllm
