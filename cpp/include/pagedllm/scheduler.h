// pagedllm/scheduler.h — continuous batching over a KVCacheManager: the token-budget scheduler
// with chunked prefill, prefix-cache hits, preemption by recompute, n > 1 forking, and the stop
// rules applied to each step's sampled tokens.
//
// Algorithm (vLLM v1's scheduler, vllm/v1/core/sched/scheduler.py; Orca's iteration-level
// scheduling, Yu et al., OSDI 2022; Sarathi-Serve's chunked prefill, Agrawal et al., OSDI 2024):
// the scheduler speaks in tokens. Each step starts with a budget of max_num_batched_tokens.
//  1. Running sequences get their pending tokens (1 for a decode, the rest of the prompt for a
//     chunked prefill or a replay) capped by what is left of the budget: decodes first, then the
//     others, each in running order. When the KV pool cannot supply the blocks, the running
//     sequence that is scheduled last under the policy (lowest priority, latest arrival) and not
//     yet scheduled this step is preempted by
//     recompute: its blocks are freed, its computed count drops to 0, and it goes back to the
//     FRONT of the waiting queue keeping its generated tokens, so that its replay recomputes
//     prompt + outputs and then continues exactly where it stopped.
//  2. If nothing was preempted this step, waiting sequences in policy order: the longest cached
//     prefix is skipped (not for requests that still owe prompt logprobs), the rest of the tokens
//     is capped by the budget (chunked prefill; with chunking off a sequence that does not fit
//     waits), and admission stops at the first sequence that finds no blocks or no room under
//     max_num_seqs (a request with n > 1 reserves n sequence slots before its fork).
// A sequence whose step ends at its last known token gets a sampled row. In the step that
// computes a request's last prompt token for the first time, n - 1 children are created (same
// sampled row, distinct sequence ids); update_from_output forks their KV from the parent
// (KVCacheManager::fork: shared blocks, copy-on-write at the first append).
//
// Sequences of a SchedulerOutput not yet passed to update_from_output are "in flight": later
// schedule() calls skip them (so a second step can be prepared while one runs) and never pick
// them as preemption victims. Full blocks are registered in the prefix cache in
// update_from_output, once their KV is known to be computed.
//
// Async scheduling (SchedulerConfig::async_scheduling; vLLM v1's async scheduling, where the
// scheduler counts "output placeholders"): a sequence sampled in the previous step (step_id - 1),
// still in flight, is scheduled again for one decode token whose id is not known yet — a
// placeholder: input_ids holds 0 and prev_sample_rows names the previous step's sampled row that
// the model runner copies in on the device. So step N + 1 can be launched before step N's tokens
// reach the host. Only when (a) that previous step sampled the sequence without forking it,
// (b) the placeholder token cannot end it by length (max_tokens, max_model_len) and (c) its slot
// allocates without preempting anyone. Likewise a prompt (or replay) whose previous chunk is in
// flight gets its next chunk (known tokens), so chunked prefill does not wait a step per chunk. If step N's token ends the sequence (EOS, a stop id or
// string), step N + 1's row is computed in vain and ignored: update_from_output(N) frees its
// blocks at once — safe because every later step runs after step N + 1 on the device — and the
// row of N + 1 no longer matches the released sequence. update_from_output must be called in
// step order. Preemption bumps a sequence's generation, so rows of any other in-flight output of
// a preempted (e.g. cancelled) sequence are ignored too.
//
// Speculative decoding (SchedulerConfig::speculative, pagedllm/spec_decode.h): while fewer than
// disable_by_batch_size sequences run, once every decode of the step has its slot, each decoding
// sequence past its prompt that allows speculation gets up to k n-gram drafts, capped so that its
// emitted tokens cannot pass max_tokens / max_model_len, by the token budget and by the free
// blocks (drafts never preempt anyone); its query becomes its last token plus the drafts, and it
// gets k + 1 sampled rows (SchedulerOutput::draft_token_ids).
// update_from_output emits the run spec_decode.h describes, each token through the stop rules (a
// stop inside the run ends it there), sets the computed count to the tokens whose KV is right
// (all but the last emitted) and truncates the block table to it: a rejected draft's slots go back
// to the pool. Those slots lie past the sequence's committed tokens, in blocks it alone holds
// (allocate_slots made copy-on-write copies of a shared last block before the step), and full
// blocks are registered in the prefix cache only up to accepted tokens. With async scheduling, a
// step that speculates gives no placeholder to a sequence that allows speculation (its drafts need
// its last token): it is scheduled again once its step is updated — except for kSpecRetrySteps
// steps after its n-gram found nothing, when it is pipelined as usual; steps above
// disable_by_batch_size pipeline as without speculation.
//
// Beam search (RequestParams::use_beam_search, pagedllm/beam_search.h): the request's prompt is
// computed once and forked into its W beams as for n > 1. From then on the W sequences form a
// group that moves in lockstep: its decodes are scheduled all together or not at all (budget and
// blocks for all W are found first, preempting others or the whole group), update_from_output
// runs the beam step on the group's W top-k rows (SampledTopK) and re-forms the beams: a beam
// that survives keeps its sequence and appends its token; a beam that continues a parent already
// kept takes the sequence of a dropped beam, whose blocks are freed and which forks the parent's
// table (KVCacheManager::fork: shared blocks, copy-on-write of the partial last block at the next
// append). So a group holds at most ceil(prompt / block_size) + W x (ceil(generated / block_size)
// + 1) blocks. Preemption takes the whole group. It is admitted again through one beam (the
// leader), which replays up to its last token but one; then every other beam forks the leader's KV
// up to their common prefix and replays only its own tail, so a replay needs about the blocks the
// group held. The beams decode together once all have caught up. Beams never get placeholders (async scheduling) or drafts. When the search ends,
// every member finishes and UpdateResult::beam_results holds the hypotheses.
//
// Not thread-safe: one thread drives a Scheduler (and its EngineCore).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "pagedllm/beam_search.h"
#include "pagedllm/kv_cache_manager.h"
#include "pagedllm/request.h"
#include "pagedllm/scheduler_output.h"
#include "pagedllm/scheduling_policy.h"
#include "pagedllm/spec_decode.h"

namespace pagedllm {

struct SchedulerConfig {
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  int32_t max_model_len = 2048;
  bool enable_chunked_prefill = true;
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;
  bool async_scheduling = false;  ///< placeholder decodes of in-flight sequences (see above)
  SpeculativeConfig speculative;  ///< n-gram speculative decoding (see above); off by default
};

/// Monotonic counters (tokens unless said otherwise).
struct SchedulerCounters {
  int64_t num_preemptions = 0;        ///< sequences preempted (recompute)
  int64_t num_prompt_tokens = 0;      ///< prompt lengths of requests whose prompt completed
  int64_t num_generation_tokens = 0;  ///< sampled tokens appended
  int64_t num_steps = 0;              ///< schedule() calls that scheduled >= 1 token
  int64_t num_scheduled_tokens = 0;   ///< all tokens computed, replays included
  int64_t num_recomputed_tokens = 0;  ///< tokens computed again after a preemption
  int64_t num_chunked_prefills = 0;   ///< prefill chunks that stopped short of the last token
  int64_t num_forks = 0;              ///< child sequences forked (n > 1)
  int64_t num_copy_orders = 0;        ///< copy-on-write orders issued
  int64_t prefix_cache_queries = 0;   ///< tokens looked up at admission
  int64_t prefix_cache_hits = 0;      ///< of those, tokens found cached
  int64_t num_finished_requests = 0;  ///< requests finished by a stop rule or finish_sequence
  int64_t num_aborted_requests = 0;
};

class Scheduler {
 public:
  /// kv must outlive the scheduler. Throws InvalidArgument on a bad config.
  Scheduler(const SchedulerConfig& config, KVCacheManager& kv);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Queue a request (already validated by EngineCore::add_request, request_id unused).
  /// Returns the id of its index-0 sequence.
  SeqId add_request(std::string request_id, std::vector<int32_t> prompt, const RequestParams& p);
  /// Finish every sequence of the request with "abort", freeing its blocks. False if unknown.
  bool abort_request(const std::string& request_id);
  /// Finish one live sequence with "stop" (the caller matched a stop string). Returns true
  /// when this was the request's last unfinished sequence. Throws on an unknown seq id.
  bool finish_sequence(SeqId seq_id, StopReason stop_reason);

  /// Fill `out` (reset first) with the next step; out.step_id = 0, 1, 2... per call.
  /// out.state becomes kScheduled. max_step_seqs > 0: no sequence is added once the step holds
  /// that many (a beam group's decodes are added together and may pass it).
  void schedule(SchedulerOutput& out, int32_t max_step_seqs = 0);
  /// Apply the sampled tokens (int32 [out.num_sampled], in sample row order) of a scheduled
  /// step: append, stop rules, free finished sequences, cache full blocks, fork children.
  /// Rows of sequences aborted meanwhile are ignored. Throws InvalidArgument (changing
  /// nothing) on a wrong length, a negative token id, or an output that is not kScheduled.
  /// topk: the step's top-k logprobs per sampled row; needed when a beam-search group decodes in
  /// this step (k >= its beams_to_keep), ignored otherwise.
  void update_from_output(SchedulerOutput& out, std::span<const int32_t> sampled,
                          UpdateResult& result, const SampledTopK& topk = {});
  /// A scheduled step that will never be updated (the model failed): its sequences are
  /// preempted (recompute), so nothing is lost or leaked. out.state becomes kFree.
  void cancel(SchedulerOutput& out);

  bool has_request(const std::string& request_id) const { return requests_.count(request_id) > 0; }
  /// The live sequence with this id, or nullptr.
  const Sequence* find_sequence(SeqId seq_id) const;
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_unfinished_requests() const { return static_cast<int32_t>(requests_.size()); }
  bool has_unfinished_requests() const { return !requests_.empty(); }
  const SchedulerCounters& counters() const { return counters_; }
  const SpecDecodeCounters& spec_counters() const { return spec_counters_; }
  const SchedulerConfig& config() const { return config_; }
  /// Sequence slots held against max_num_seqs (an unforked running request holds n).
  int32_t num_running_slots() const { return num_running_slots_; }

 private:
  Sequence* new_sequence(Request* req, int32_t index);
  void release_sequence(Sequence* seq);
  int32_t slots_of(const Sequence* seq) const;
  /// Longest the request's sequences can get: min(prompt_len + max_tokens, max_model_len).
  int32_t max_seq_tokens(const Request& req) const;
  /// Remove a running sequence from running_ (O(n)).
  void remove_running(Sequence* seq);
  void preempt(Sequence* seq);
  /// Mark finished, free KV, count; does not touch running_ (caller compacts or removes).
  void finish(Sequence* seq, FinishReason reason, StopReason stop_reason);
  /// Record a successfully allocated chunk of seq into the step's scheduled list.
  void record(Sequence* seq, int32_t num_new, SchedulerOutput& out, int32_t prev_row = -1);
  /// Speculative decoding, after the decode pass: extend the scheduled decodes of
  /// spec_candidates_ with drafts where the budget and free blocks allow (no preemption); returns
  /// the draft tokens added.
  int32_t add_drafts(SchedulerOutput& out, int32_t budget);
  /// Async scheduling: steps a sequence whose n-gram found nothing is pipelined before it waits
  /// for its token to try again.
  static constexpr int32_t kSpecRetrySteps = 4;
  /// Reserve num_new more slots for running `seq` (copy orders in copies_), preempting victims under
  /// the policy until they allocate; false when `seq` itself was preempted (alone or with its beam
  /// group) or nobody is left to preempt. Sets `preempted` when anyone was.
  bool allocate_or_preempt(Sequence* seq, int32_t num_new, bool& preempted);
  /// Admission bookkeeping of the waiting queue's front `seq`, whose slots were just allocated with
  /// hit_ as its cached prefix: out of the queue, computed up to the hit, running, `slots` held.
  void start_running_front(Sequence* seq, int32_t slots, bool use_cache);

  // ---- beam search (see above)
  /// seq belongs to a beam-search request that has forked into its beams.
  static bool in_beam_group(const Sequence* seq);
  /// The group's leader is running and no beam is in flight (the group may be preempted).
  static bool group_idle(const Request* req);
  /// Preempt every beam of the group: the leader (index 0) goes to the front of the waiting queue,
  /// the others are parked (waiting, outside the queue) until attach_parked.
  void preempt_group(Request* req);
  /// The re-admitted leader has computed its tokens but the last: each parked beam forks its KV
  /// up to their common prefix (KVCacheManager::fork_prefix) and replays its own tail.
  void attach_parked(Request* req);
  /// Preempt victim, with its whole group when it is a beam.
  void preempt_victim(Sequence* victim);
  /// candidates_ = the running sequences that may be preempted now (not in flight; a beam only
  /// when no beam of its group is).
  void collect_victims();
  /// Decode pass: the group's W decodes, all or none (may preempt others or the group itself).
  void schedule_beam_decodes(Request* req, SchedulerOutput& out, int32_t& budget, bool& preempted);
  /// Admission of a preempted group through its leader (slots for all W; its replay up to its last
  /// token but one); false when it could not.
  bool admit_beam_group(Request* req, SchedulerOutput& out, int32_t& budget);
  /// update_from_output: the beam step of one group from its W sampled rows (rows[b]: beam b's).
  void apply_beam_step(Request* req, std::span<const int32_t> rows, const SampledTopK& topk,
                       UpdateResult& result);

  /// update_from_output: append one sampled token to running seq, report it in result, apply
  /// the stop rules; true when they finished it (then it is in finished_scratch_).
  bool append_token(Sequence* seq, int32_t token, UpdateResult& result);
  /// update_from_output for the k + 1 sampled rows [r, r + k] of one speculating sequence.
  void apply_speculative_run(const SchedulerOutput& out, int32_t r, int32_t num_draft,
                             std::span<const int32_t> sampled, UpdateResult& result);
  /// Async scheduling: whether in-flight seq may get a placeholder decode in step `step_id`.
  bool placeholder_allowed(const Sequence* seq, int64_t step_id) const;
  void fill_buffers(SchedulerOutput& out);
  void fill_row(const SchedulerOutput::Scheduled& s, SchedulerOutput& out);
  void append_copies(SchedulerOutput& out);

  SchedulerConfig config_;
  KVCacheManager& kv_;
  int32_t block_size_;
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::unordered_map<SeqId, Sequence*> live_seqs_;
  std::vector<std::unique_ptr<Sequence>> slab_;  ///< every Sequence ever made, reused
  std::vector<int32_t> free_slots_;
  SeqId next_seq_id_ = 0;
  int64_t next_step_id_ = 0;
  std::vector<Sequence*> running_;
  WaitingQueue waiting_;
  int32_t num_running_slots_ = 0;
  SchedulerCounters counters_;
  SpecDecodeCounters spec_counters_;
  // scratch, reused every step (no allocation once warm)
  PrefixHit hit_;
  std::vector<CopyOrder> copies_;
  std::vector<Sequence*> candidates_;
  std::vector<Sequence*> running_snapshot_;
  std::vector<Sequence*> finished_scratch_;
  std::vector<int32_t> spec_candidates_;  ///< indices into out.scheduled of this step's candidates
  std::vector<Request*> done_scratch_;
  std::vector<std::pair<Request*, std::vector<int32_t>>> beam_rows_;  ///< group -> rows by beam
  std::vector<int64_t> beam_tokens_;
  std::vector<float> beam_logprobs_;
  std::vector<BeamChoice> beam_choices_;
  std::vector<int32_t> beam_place_;
  std::vector<uint8_t> beam_claimed_;
};

}  // namespace pagedllm
