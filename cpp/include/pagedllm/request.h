// pagedllm/request.h — per-request and per-sequence state of the engine, and the stop rules.
//
// A Request is what a user submitted: a prompt plus RequestParams. It owns 1..n Sequences
// (n = RequestParams::n, as vLLM's SamplingParams.n). Before its prompt is computed a request
// has exactly one sequence (index 0); in the step that computes the last prompt token the
// scheduler forks it into n sequences that share the prompt's KV blocks copy-on-write
// (KVCacheManager::fork), so no child recomputes the prompt. The scheduling unit is the
// Sequence: after the fork each one decodes, is preempted and finishes on its own.
//
// Token ids are int32, positions are token indices from 0. Lengths are in tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace pagedllm {

using SeqId = int64_t;

/// What the caller asks of one request (vLLM SamplingParams' engine-side part).
struct RequestParams {
  /// Tokens to generate per sequence; -1: until max_model_len; 0: prompt only (the prompt is
  /// computed, e.g. for prompt logprobs, nothing is sampled, finish_reason "length").
  int32_t max_tokens = -1;
  /// No stop rule (EOS, stop_token_ids) applies before this many output tokens.
  int32_t min_tokens = 0;
  /// End-of-sequence token ids; generating one finishes with "stop", stop_reason None.
  std::vector<int32_t> eos_token_ids;
  /// Generating one finishes with "stop", stop_reason = the token id. The token is kept.
  std::vector<int32_t> stop_token_ids;
  /// Do not stop at eos_token_ids (stop_token_ids still apply).
  bool ignore_eos = false;
  /// Number of output sequences (CompletionOutput.index 0..n-1).
  int32_t n = 1;
  /// Lower is more urgent (vLLM's convention); used by the "priority" policy.
  int32_t priority = 0;
  /// Seconds, any epoch; ties in scheduling order are broken by arrival then by sequence id.
  double arrival_time = 0.0;
  /// Prefix-cache salt: requests with different salts never share cached blocks.
  std::string cache_salt;
  /// The caller wants prompt logprobs: the whole prompt is computed (prefix-cache hits are
  /// skipped for it) and SchedulerOutput::prompt_logprob_rows says which rows score which tokens.
  bool prompt_logprobs = false;
  /// Speculative decoding may propose draft tokens for this request's sequences (when the engine
  /// speculates at all: SpeculativeConfig). Off for requests whose sampling cannot verify drafts
  /// (e.g. structured outputs: the grammar advances one token at a time).
  bool allow_speculation = true;
  /// Beam search (beam_search.h) with beam width n: the n sequences are the running beams, and the
  /// request's result is UpdateResult::beam_results. Greedy over the model's logprobs; needs
  /// max_tokens >= 1; min_tokens, stop_token_ids, prompt_logprobs and speculation do not apply.
  bool use_beam_search = false;
  /// Beam search: hypothesis score = cum_logprob / num_generated ^ length_penalty (HF's).
  float length_penalty = 1.0f;
};

enum class FinishReason : int8_t { kNone, kStop, kLength, kAbort };

/// "stop", "length", "abort" (vLLM's finish_reason strings); "" for kNone.
const char* finish_reason_name(FinishReason reason);

/// vLLM's stop_reason: none (EOS, length, abort), the stop token id, or a string given by the
/// caller of EngineCore::finish_sequence (a matched stop string).
using StopReason = std::variant<std::monostate, int32_t, std::string>;

enum class SequenceStatus : int8_t { kWaiting, kRunning, kFinished };

struct Request;
class BeamSearch;

/// One output sequence: prompt + its own generated tokens, and how much of it has KV.
struct Sequence {
  SeqId seq_id = -1;
  Request* request = nullptr;
  int32_t index = 0;  ///< CompletionOutput.index within the request
  // Copies of what every step needs from the request (bind()), so that scheduling and the stop
  // rules of hundreds of sequences touch no Request object (a cache miss each).
  int32_t prompt_tokens = 0;
  int32_t max_tokens = -1;
  int32_t min_tokens = 0;
  bool ignore_eos = false;
  bool prompt_done = false;  ///< the request's prompt was computed once (Request::forked)
  bool wants_prompt_logprobs = false;
  bool allow_speculation = true;  ///< RequestParams::allow_speculation
  bool stop_ids_spill = false;  ///< more eos + stop ids than fit inline: use the request's lists
  uint8_t num_eos = 0;          ///< stop_ids[0, num_eos): eos ids; then num_stop stop_token_ids
  uint8_t num_stop = 0;
  static constexpr int kInlineStopIds = 6;
  int32_t stop_ids[kInlineStopIds] = {};
  /// prompt followed by the generated tokens (prompt is copied so the token ids are contiguous,
  /// as KVCacheManager::find_cached_prefix / cache_full_blocks want them).
  std::vector<int32_t> token_ids;
  /// Tokens whose KV is computed or scheduled to be computed in a step not yet updated.
  int32_t num_computed_tokens = 0;
  SequenceStatus status = SequenceStatus::kWaiting;
  /// Highest num_computed_tokens ever reached (tokens below it are recomputed after preemption).
  int32_t max_computed_tokens = 0;
  /// SchedulerOutputs holding this sequence that have not been passed to update_from_output
  /// yet (0, 1, or 2 with async scheduling: the step that samples its next token and the step
  /// that already computes that token as a placeholder).
  int32_t in_flight = 0;
  /// The sampled row of this sequence in the in-flight output pending_step (-1: none), i.e. where
  /// the model runner finds its next token on the device before the host knows it.
  int32_t pending_row = -1;
  int64_t pending_step = -1;
  /// Draft tokens proposed for the step in flight (speculative decoding; scratch of the scheduler).
  std::vector<int32_t> draft_token_ids;
  /// Async scheduling + speculation: steps left in which this sequence is pipelined (placeholder
  /// decodes) before it waits for its token to try the n-gram again (its last try found nothing).
  int32_t spec_skip = 0;
  /// Already listed in some SchedulerOutput::new_seqs.
  bool announced = false;
  FinishReason finish_reason = FinishReason::kNone;
  StopReason stop_reason;
  /// Slab bookkeeping (Scheduler): slot index and generation, so stale handles are detected.
  int32_t slot = -1;
  uint32_t generation = 0;

  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  int32_t prompt_len() const { return prompt_tokens; }
  int32_t num_output_tokens() const { return num_tokens() - prompt_len(); }
  /// Attach to `req` and copy its hot fields (call again after changing req->params).
  void bind(Request* req);
};

/// One submitted request.
struct Request {
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  RequestParams params;
  /// KVCacheManager extra key derived from params.cache_salt (0 without a salt).
  uint64_t extra_key = 0;
  /// Sequences created so far (1 before the fork, n after), indexed by Sequence::index;
  /// an entry is nullptr once that sequence finished and was released.
  std::vector<Sequence*> seqs;
  bool forked = false;  ///< the prompt has been computed once and the request forked into n
  int32_t num_finished_seqs = 0;
  bool done = false;  ///< every sequence finished; being removed (Scheduler bookkeeping)
  /// Beam search state (RequestParams::use_beam_search), else null. shared_ptr: BeamSearch is
  /// incomplete here.
  std::shared_ptr<BeamSearch> beam;
  /// Beam search: beams parked while a re-admitted group's leader replays (scheduler.h).
  int32_t beam_parked = 0;
  /// Beam search: the step whose schedule() last scheduled the whole group's decodes.
  int64_t beam_scheduled_step = -1;
  /// First prompt position whose prompt-logprob row has not been handed out yet.
  int32_t prompt_logprobs_next_pos = 0;
  int32_t prompt_len() const { return static_cast<int32_t>(prompt_token_ids.size()); }
  /// True while prompt-logprob rows remain to be produced (then prefix hits are skipped).
  bool needs_prompt_logprobs() const {
    return params.prompt_logprobs && prompt_logprobs_next_pos < prompt_len() - 1;
  }
  bool finished() const { return num_finished_seqs == params.n; }
};

/// vLLM v1's stop rules (vllm/v1/core/sched/utils.py check_stop), applied after `seq`
/// appended one sampled token (its last token), in this order:
///   1. total length >= max_model_len, or max_tokens outputs (max_tokens >= 0) -> "length"
///   2. fewer than min_tokens outputs                                          -> keep going
///   3. an eos token id, unless ignore_eos                          -> "stop", stop_reason none
///   4. a stop_token_ids entry                                -> "stop", stop_reason = token id
/// Returns kNone when the sequence continues; sets *stop_reason for rule 4.
FinishReason check_stop(const Sequence& seq, int32_t max_model_len, StopReason* stop_reason);

/// Stable 64-bit FNV-1a hash of a cache salt, never 0 for a non-empty salt; 0 for "".
uint64_t cache_salt_key(const std::string& salt);

}  // namespace pagedllm
