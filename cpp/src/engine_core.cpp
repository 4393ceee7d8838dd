#include "pagedllm/engine_core.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "pagedllm/errors.h"

namespace pagedllm {

namespace {

SchedulerConfig scheduler_config(const EngineConfig& c) {
  SchedulerConfig s;
  s.max_num_seqs = c.max_num_seqs;
  s.max_num_batched_tokens = c.max_num_batched_tokens;
  s.max_model_len = c.max_model_len;
  s.enable_chunked_prefill = c.enable_chunked_prefill;
  s.policy = parse_scheduling_policy(c.scheduling_policy);
  s.async_scheduling = c.async_scheduling;
  s.speculative = c.speculative;
  return s;
}

}  // namespace

EngineCore::EngineCore(const EngineConfig& config) : config_(config) {
  PAGEDLLM_CHECK(config.num_blocks >= 1, "num_blocks must be >= 1, got ", config.num_blocks);
  PAGEDLLM_CHECK(config.max_model_len >= 2, "max_model_len must be >= 2, got ", config.max_model_len);
  PAGEDLLM_CHECK(config.num_buffer_sets >= 2 && config.num_buffer_sets <= kMaxBufferSets,
                 "num_buffer_sets must be in [2, ", kMaxBufferSets, "], got ", config.num_buffer_sets);
  const SchedulerConfig sc = scheduler_config(config);  // validates the policy name
  kv_ = std::make_unique<KVCacheManager>(config.num_blocks, config.block_size,
                                         config.enable_prefix_caching);
  scheduler_ = std::make_unique<Scheduler>(sc, *kv_);
  max_blocks_per_seq_ = (config.max_model_len + config.block_size - 1) / config.block_size;
  for (int32_t i = 0; i < config.num_buffer_sets; ++i)
    buffers_.push_back(std::make_unique<SchedulerOutput>(
        config.max_num_batched_tokens, config.max_num_seqs, max_blocks_per_seq_, max_sampled()));
}

int32_t EngineCore::max_sampled() const {
  return config_.max_num_seqs * (1 + config_.speculative.num_speculative_tokens);
}

EngineCore::~EngineCore() = default;

SeqId EngineCore::add_request(const std::string& request_id,
                              std::span<const int32_t> prompt, const RequestParams& p) {
  const int64_t max_len = config_.max_model_len;
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  PAGEDLLM_CHECK(!request_id.empty(), "request_id must not be empty");
  PAGEDLLM_CHECK(!scheduler_->has_request(request_id), "request_id \"", request_id,
                 "\" is already in use");
  PAGEDLLM_CHECK(prompt_len >= 1, "request \"", request_id, "\": the prompt is empty");
  for (size_t i = 0; i < prompt.size(); ++i)
    PAGEDLLM_CHECK(prompt[i] >= 0, "request \"", request_id, "\": prompt_token_ids[", i, "] = ",
                   prompt[i], " is not a token id (must be >= 0)");
  PAGEDLLM_CHECK(prompt_len < max_len, "request \"", request_id, "\": the prompt has ", prompt_len,
                 " tokens, which is not less than max_model_len (", max_len, ")");
  PAGEDLLM_CHECK(p.max_tokens >= -1, "request \"", request_id, "\": max_tokens must be >= 0 or -1, got ",
                 p.max_tokens);
  PAGEDLLM_CHECK(p.max_tokens < 0 || prompt_len + p.max_tokens <= max_len, "request \"", request_id,
                 "\": prompt_len (", prompt_len, ") + max_tokens (", p.max_tokens, ") = ",
                 prompt_len + p.max_tokens, " exceeds max_model_len (", max_len, ")");
  PAGEDLLM_CHECK(p.min_tokens >= 0, "request \"", request_id, "\": min_tokens must be >= 0, got ",
                 p.min_tokens);
  PAGEDLLM_CHECK(p.max_tokens < 0 || p.min_tokens <= p.max_tokens, "request \"", request_id,
                 "\": min_tokens (", p.min_tokens, ") must be <= max_tokens (", p.max_tokens, ")");
  PAGEDLLM_CHECK(p.n >= 1 && p.n <= config_.max_num_seqs, "request \"", request_id,
                 "\": n must be in [1, max_num_seqs = ", config_.max_num_seqs, "], got ", p.n);
  if (p.use_beam_search) {
    PAGEDLLM_CHECK(p.max_tokens >= 1, "request \"", request_id,
                   "\": beam search needs max_tokens >= 1, got ", p.max_tokens);
    PAGEDLLM_CHECK(std::isfinite(p.length_penalty), "request \"", request_id,
                   "\": length_penalty must be finite, got ", p.length_penalty);
    PAGEDLLM_CHECK(!p.prompt_logprobs, "request \"", request_id,
                   "\": beam search does not return prompt logprobs");
    PAGEDLLM_CHECK(p.n <= config_.max_num_batched_tokens, "request \"", request_id,
                   "\": beam search decodes its n = ", p.n, " beams in one step, so n must be <= "
                   "max_num_batched_tokens = ", config_.max_num_batched_tokens);
    // the group at its largest: the prompt's blocks shared, each beam's own generated blocks + 1
    const int64_t bs = config_.block_size;
    const int64_t group_blocks = (prompt_len + bs - 1) / bs + p.n * ((p.max_tokens + bs - 1) / bs + 1);
    PAGEDLLM_CHECK(group_blocks <= config_.num_blocks, "request \"", request_id, "\": beam search with ",
                   p.n, " beams over ", prompt_len, " prompt + ", p.max_tokens, " tokens may hold ",
                   group_blocks, " KV blocks but the pool has only num_blocks = ", config_.num_blocks,
                   "; it could never run");
  }
  const int64_t max_tokens_total = p.max_tokens < 0 ? max_len : prompt_len + p.max_tokens;
  const int64_t blocks = (max_tokens_total + config_.block_size - 1) / config_.block_size;
  PAGEDLLM_CHECK(blocks <= config_.num_blocks, "request \"", request_id, "\": up to ",
                 max_tokens_total, " tokens (prompt_len ", prompt_len, " + ",
                 p.max_tokens < 0 ? "up to max_model_len " + std::to_string(max_len)
                                  : "max_tokens " + std::to_string(p.max_tokens),
                 ") need ", blocks, " KV blocks of ", config_.block_size,
                 " tokens but the pool has only num_blocks = ", config_.num_blocks,
                 "; it could never run");
  return scheduler_->add_request(request_id, std::vector<int32_t>(prompt.begin(), prompt.end()), p);
}

bool EngineCore::abort_request(const std::string& request_id) {
  return scheduler_->abort_request(request_id);
}

bool EngineCore::finish_sequence(SeqId seq_id, StopReason stop_reason) {
  return scheduler_->finish_sequence(seq_id, std::move(stop_reason));
}

SchedulerOutput& EngineCore::schedule(int32_t max_step_seqs) {
  PAGEDLLM_CHECK(max_step_seqs >= 0, "schedule: max_step_seqs must be >= 0, got ", max_step_seqs);
  SchedulerOutput* out = nullptr;
  for (auto& b : buffers_)
    if (b->state == SchedulerOutput::State::kFree) {
      out = b.get();
      break;
    }
  if (!out) {
    if (static_cast<int32_t>(buffers_.size()) >= kMaxBufferSets)
      throw std::runtime_error("EngineCore::schedule: all " + std::to_string(buffers_.size()) +
                               " buffer sets are held; release() the SchedulerOutputs you are done with");
    buffers_.push_back(std::make_unique<SchedulerOutput>(
        config_.max_num_batched_tokens, config_.max_num_seqs, max_blocks_per_seq_, max_sampled()));
    out = buffers_.back().get();
  }
  scheduler_->schedule(*out, max_step_seqs);  // sets out->step_id
  return *out;
}

std::shared_ptr<UpdateResult> EngineCore::update_from_output(SchedulerOutput& out,
                                                             std::span<const int32_t> sampled,
                                                             const SampledTopK& topk) {
  PAGEDLLM_CHECK(std::any_of(buffers_.begin(), buffers_.end(), [&](auto& b) { return b.get() == &out; }),
                 "update_from_output: this SchedulerOutput belongs to another EngineCore");
  std::shared_ptr<UpdateResult> result;
  for (auto& r : results_)
    if (r.use_count() == 1) {
      result = r;
      break;
    }
  if (!result) {
    result = std::make_shared<UpdateResult>();
    if (results_.size() < 8) results_.push_back(result);
  }
  scheduler_->update_from_output(out, sampled, *result, topk);
  return result;
}

void EngineCore::release(SchedulerOutput& out) {
  PAGEDLLM_CHECK(std::any_of(buffers_.begin(), buffers_.end(), [&](auto& b) { return b.get() == &out; }),
                 "release: this SchedulerOutput belongs to another EngineCore");
  scheduler_->cancel(out);
}

int32_t EngineCore::num_outputs_held() const {
  return static_cast<int32_t>(std::count_if(buffers_.begin(), buffers_.end(), [](auto& b) {
    return b->state != SchedulerOutput::State::kFree;
  }));
}

EngineStats EngineCore::stats() const {
  EngineStats s;
  const KVCacheStats kv = kv_->stats();
  const SchedulerCounters& c = scheduler_->counters();
  s.num_running = scheduler_->num_running();
  s.num_waiting = scheduler_->num_waiting();
  s.num_unfinished_requests = scheduler_->num_unfinished_requests();
  s.num_preemptions = c.num_preemptions;
  s.kv_usage = kv.usage;
  s.num_blocks = kv.num_blocks;
  s.block_size = config_.block_size;
  s.num_free_blocks = kv.num_free_blocks;
  s.num_cached_blocks = kv.num_cached_blocks;
  s.prefix_cache_queries = c.prefix_cache_queries;
  s.prefix_cache_hits = c.prefix_cache_hits;
  s.num_prompt_tokens = c.num_prompt_tokens;
  s.num_generation_tokens = c.num_generation_tokens;
  s.num_steps = c.num_steps;
  s.num_scheduled_tokens = c.num_scheduled_tokens;
  s.num_recomputed_tokens = c.num_recomputed_tokens;
  s.num_chunked_prefills = c.num_chunked_prefills;
  s.num_forks = c.num_forks;
  s.num_copy_orders = c.num_copy_orders;
  s.num_finished_requests = c.num_finished_requests;
  s.num_aborted_requests = c.num_aborted_requests;
  const SpecDecodeCounters& spec = scheduler_->spec_counters();
  s.spec_decode_num_drafts = spec.num_drafts;
  s.spec_decode_num_draft_tokens = spec.num_draft_tokens;
  s.spec_decode_num_accepted_tokens = spec.num_accepted_tokens;
  s.spec_decode_num_accepted_tokens_per_pos = spec.accepted_per_pos;
  return s;
}

}  // namespace pagedllm
