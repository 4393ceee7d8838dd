// pagedllm/engine_core.h — the engine object a model runner drives, step after step:
//
//   EngineCore core(cfg);
//   core.add_request("r0", prompt_ids, params);
//   while (core.has_unfinished_requests()) {
//     SchedulerOutput& out = core.schedule();          // the step's flat buffers
//     ... run the model on out, sample out.num_sampled tokens (one per logits_indices row) ...
//     auto result = core.update_from_output(out, sampled_ids);   // appended tokens, finished
//     core.release(out);                                // hand the buffer set back
//   }
//
// It owns the KVCacheManager (the paged KV pool's bookkeeping), the Scheduler (scheduler.h) and
// a pool of SchedulerOutput buffer sets (scheduler_output.h): at least num_buffer_sets (>= 2),
// so the next step can be scheduled while the previous output is still in use; an output is
// owned by the caller from schedule() until release(). Errors name the bad value
// (InvalidArgument -> Python ValueError; misuse of the buffer pool -> std::runtime_error).
// Not thread-safe: one thread drives an EngineCore.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pagedllm/kv_cache_manager.h"
#include "pagedllm/request.h"
#include "pagedllm/scheduler.h"
#include "pagedllm/scheduler_output.h"

namespace pagedllm {

struct EngineConfig {
  int32_t num_blocks = 0;   ///< KV blocks in the pool (>= 1; required)
  int32_t block_size = 16;  ///< tokens per block: a power of two in [8, 128]
  int32_t max_num_seqs = 256;               ///< sequences per step / running at once
  int32_t max_num_batched_tokens = 8192;    ///< token budget per step
  int32_t max_model_len = 0;                ///< longest sequence, prompt + output (>= 2; required)
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  std::string scheduling_policy = "fcfs";   ///< "fcfs" | "priority"
  int32_t num_buffer_sets = 2;              ///< SchedulerOutput sets preallocated (>= 2)
  /// Placeholder decodes of in-flight sequences, so that step N + 1 is scheduled before step N's
  /// tokens are known (scheduler.h, "Async scheduling"); update_from_output in step order.
  bool async_scheduling = false;
  /// N-gram speculative decoding (pagedllm/spec_decode.h, scheduler.h); off while
  /// num_speculative_tokens is 0.
  SpeculativeConfig speculative;
};

/// Everything the server exports (vLLM v1 metric names in comments). Sequence counts follow
/// vLLM v1, where each of a request's n samples is a request of its own.
struct EngineStats {
  int32_t num_running = 0;              ///< num_requests_running (sequences)
  int32_t num_waiting = 0;              ///< num_requests_waiting (sequences)
  int32_t num_unfinished_requests = 0;  ///< requests added and not finished/aborted
  int64_t num_preemptions = 0;          ///< num_preemptions_total
  double kv_usage = 0.0;                ///< kv_cache_usage_perc, 0..1 (cached-only blocks are free)
  int32_t num_blocks = 0;               ///< cache_config_info num_gpu_blocks
  int32_t block_size = 0;               ///< cache_config_info block_size
  int32_t num_free_blocks = 0;
  int32_t num_cached_blocks = 0;
  int64_t prefix_cache_queries = 0;     ///< prefix_cache_queries_total (tokens)
  int64_t prefix_cache_hits = 0;        ///< prefix_cache_hits_total (tokens)
  int64_t num_prompt_tokens = 0;        ///< prompt_tokens_total
  int64_t num_generation_tokens = 0;    ///< generation_tokens_total
  int64_t num_steps = 0;                ///< engine steps that computed >= 1 token
  int64_t num_scheduled_tokens = 0;     ///< tokens computed, recomputation included
  int64_t num_recomputed_tokens = 0;    ///< tokens computed again after preemption
  int64_t num_chunked_prefills = 0;     ///< prefill chunks that stopped short of the end
  int64_t num_forks = 0;                ///< n > 1 child sequences forked
  int64_t num_copy_orders = 0;          ///< copy-on-write block copies issued
  int64_t num_finished_requests = 0;
  int64_t num_aborted_requests = 0;
  int64_t spec_decode_num_drafts = 0;           ///< spec_decode_num_drafts_total
  int64_t spec_decode_num_draft_tokens = 0;     ///< spec_decode_num_draft_tokens_total
  int64_t spec_decode_num_accepted_tokens = 0;  ///< spec_decode_num_accepted_tokens_total
  /// spec_decode_num_accepted_tokens_per_pos_total: [k], accepted drafts at each position
  std::vector<int64_t> spec_decode_num_accepted_tokens_per_pos;
};

class EngineCore {
 public:
  /// Throws InvalidArgument naming a bad config field.
  explicit EngineCore(const EngineConfig& config);
  ~EngineCore();
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  /// Queue a request. Throws InvalidArgument (changing nothing) when: request_id is empty or in
  /// use; the prompt is empty or holds a negative id; prompt_len >= max_model_len;
  /// max_tokens >= 0 and prompt_len + max_tokens > max_model_len; max_tokens < -1; min_tokens < 0
  /// or > max_tokens; n < 1 or n > max_num_seqs; or the sequence can never fit the KV pool
  /// (ceil(min(prompt_len + max_tokens, max_model_len) / block_size) > num_blocks, with
  /// max_tokens = -1 meaning max_model_len). Returns the seq id of its index-0 sequence.
  SeqId add_request(const std::string& request_id, std::span<const int32_t> prompt_token_ids,
                    const RequestParams& params);
  /// Finish every sequence of the request ("abort"), freeing its blocks; false if unknown.
  /// Not reported again in UpdateResult. Rows of its sequences in outputs still in flight are
  /// ignored by update_from_output.
  bool abort_request(const std::string& request_id);
  /// Finish one live sequence with "stop" (a stop string matched on the caller's side), freeing
  /// its blocks; not reported again in UpdateResult. Returns true when the request is now
  /// finished (and forgotten). Throws InvalidArgument on an unknown seq id.
  bool finish_sequence(SeqId seq_id, StopReason stop_reason);

  /// Schedule the next step into a free buffer set. num_tokens == 0 when nothing can run.
  /// Throws std::runtime_error when every buffer set is held (release() outputs).
  /// max_step_seqs > 0 caps the sequences of this step (pipeline parallelism: each step in flight
  /// takes its share of the running sequences; a beam group's W decodes count once, and may pass it).
  SchedulerOutput& schedule(int32_t max_step_seqs = 0);
  /// Sequences running (in flight or not) and waiting.
  int32_t num_running_seqs() const { return scheduler_->num_running(); }
  int32_t num_waiting_seqs() const { return scheduler_->num_waiting(); }
  /// Apply the step's sampled token ids (int32 [out.num_sampled]); see Scheduler. topk: the
  /// rows' top-k logprobs, which a step with beam-search groups needs (scheduler_output.h). The
  /// result object is reused by a later step only once the caller dropped every reference to it.
  std::shared_ptr<UpdateResult> update_from_output(SchedulerOutput& out,
                                                   std::span<const int32_t> sampled_token_ids,
                                                   const SampledTopK& topk = {});
  /// Hand a buffer set back. An output that was scheduled but never updated is cancelled: its
  /// sequences are preempted (recomputed later), nothing is leaked. Throws InvalidArgument for
  /// an output of another engine.
  void release(SchedulerOutput& out);

  bool has_unfinished_requests() const { return scheduler_->has_unfinished_requests(); }
  EngineStats stats() const;

  const EngineConfig& config() const { return config_; }
  /// ceil(max_model_len / block_size): the width of block_tables.
  int32_t max_blocks_per_seq() const { return max_blocks_per_seq_; }
  const KVCacheManager& kv_cache() const { return *kv_; }
  const Scheduler& scheduler() const { return *scheduler_; }
  /// Buffer sets allocated / currently handed out.
  int32_t num_buffer_sets() const { return static_cast<int32_t>(buffers_.size()); }
  int32_t num_outputs_held() const;

 private:
  static constexpr int32_t kMaxBufferSets = 16;
  /// Sampled rows a step can have: max_num_seqs * (1 + num_speculative_tokens).
  int32_t max_sampled() const;
  EngineConfig config_;
  int32_t max_blocks_per_seq_;
  std::unique_ptr<KVCacheManager> kv_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<std::unique_ptr<SchedulerOutput>> buffers_;
  std::vector<std::shared_ptr<UpdateResult>> results_;
};

}  // namespace pagedllm
