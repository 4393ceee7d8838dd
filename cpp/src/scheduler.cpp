#include "pagedllm/scheduler.h"

#include <algorithm>

#include "pagedllm/beam_search.h"
#include "pagedllm/errors.h"

namespace pagedllm {

Scheduler::Scheduler(const SchedulerConfig& config, KVCacheManager& kv)
    : config_(config), kv_(kv), block_size_(kv.block_size()), waiting_(config.policy) {
  PAGEDLLM_CHECK(config.max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", config.max_num_seqs);
  PAGEDLLM_CHECK(config.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1, got ",
                 config.max_num_batched_tokens);
  PAGEDLLM_CHECK(config.max_model_len >= 2, "max_model_len must be >= 2, got ", config.max_model_len);
  PAGEDLLM_CHECK(config.enable_chunked_prefill ||
                     config.max_num_batched_tokens >= config.max_model_len,
                 "with chunked prefill disabled, max_num_batched_tokens (",
                 config.max_num_batched_tokens, ") must be >= max_model_len (", config.max_model_len,
                 ") so that every sequence fits in one step");
  config.speculative.validate();
  spec_counters_.accepted_per_pos.assign(static_cast<size_t>(config.speculative.num_speculative_tokens), 0);
  running_.reserve(static_cast<size_t>(config.max_num_seqs));
  running_snapshot_.reserve(static_cast<size_t>(config.max_num_seqs));
  candidates_.reserve(static_cast<size_t>(config.max_num_seqs));
}

Scheduler::~Scheduler() = default;

// ------------------------------------------------------------------ sequences and requests

Sequence* Scheduler::new_sequence(Request* req, int32_t index) {
  int32_t slot;
  if (free_slots_.empty()) {
    slot = static_cast<int32_t>(slab_.size());
    slab_.push_back(std::make_unique<Sequence>());
    slab_.back()->slot = slot;
  } else {
    slot = free_slots_.back();
    free_slots_.pop_back();
  }
  Sequence* s = slab_[slot].get();
  s->seq_id = next_seq_id_++;
  s->bind(req);
  s->index = index;
  s->token_ids.clear();
  s->num_computed_tokens = 0;
  s->max_computed_tokens = 0;
  s->status = SequenceStatus::kWaiting;
  s->in_flight = 0;
  s->pending_row = -1;
  s->pending_step = -1;
  s->announced = false;
  s->spec_skip = 0;
  s->finish_reason = FinishReason::kNone;
  s->stop_reason = std::monostate{};
  req->seqs[index] = s;
  live_seqs_.emplace(s->seq_id, s);
  return s;
}

void Scheduler::release_sequence(Sequence* seq) {
  live_seqs_.erase(seq->seq_id);
  seq->request->seqs[seq->index] = nullptr;
  seq->request = nullptr;
  ++seq->generation;  // every SeqRef to it is now stale
  free_slots_.push_back(seq->slot);
}

const Sequence* Scheduler::find_sequence(SeqId seq_id) const {
  auto it = live_seqs_.find(seq_id);
  return it == live_seqs_.end() ? nullptr : it->second;
}

int32_t Scheduler::max_seq_tokens(const Request& req) const {
  const int64_t limit = req.params.max_tokens < 0
                            ? config_.max_model_len
                            : static_cast<int64_t>(req.prompt_len()) + req.params.max_tokens;
  return static_cast<int32_t>(std::min<int64_t>(limit, config_.max_model_len));
}

int32_t Scheduler::slots_of(const Sequence* seq) const {
  const Request* req = seq->request;
  if (!req->forked) return req->params.n;
  return seq->index == 0 ? 1 + req->beam_parked : 1;  // a group's leader holds its parked beams' slots
}

SeqId Scheduler::add_request(std::string request_id, std::vector<int32_t> prompt,
                             const RequestParams& params) {
  PAGEDLLM_CHECK(!requests_.count(request_id), "request_id \"", request_id, "\" is already in use");
  auto req = std::make_unique<Request>();
  req->request_id = std::move(request_id);
  req->prompt_token_ids = std::move(prompt);
  req->params = params;
  req->extra_key = cache_salt_key(params.cache_salt);
  if (params.use_beam_search) {
    req->params.allow_speculation = false;  // one token per beam and step
    std::vector<int32_t> eos(params.eos_token_ids);
    std::sort(eos.begin(), eos.end());
    const int32_t num_eos =
        params.ignore_eos ? 0 : static_cast<int32_t>(std::unique(eos.begin(), eos.end()) - eos.begin());
    req->beam = std::make_shared<BeamSearch>(params.n, params.length_penalty, num_eos);
  }
  req->seqs.assign(static_cast<size_t>(params.n), nullptr);
  Sequence* seq = new_sequence(req.get(), 0);
  seq->token_ids.reserve(static_cast<size_t>(max_seq_tokens(*req)));  // no growth while decoding
  seq->token_ids = req->prompt_token_ids;
  waiting_.push_back(seq);
  const std::string& key = req->request_id;
  requests_.emplace(key, std::move(req));
  return seq->seq_id;
}

void Scheduler::remove_running(Sequence* seq) {
  auto it = std::find(running_.begin(), running_.end(), seq);
  if (it != running_.end()) running_.erase(it);
}

void Scheduler::preempt(Sequence* seq) {
  remove_running(seq);
  num_running_slots_ -= slots_of(seq);
  if (kv_.contains(seq->seq_id)) kv_.free(seq->seq_id);
  seq->num_computed_tokens = 0;
  seq->status = SequenceStatus::kWaiting;
  seq->in_flight = 0;
  seq->pending_row = -1;
  seq->pending_step = -1;
  ++seq->generation;  // rows of another in-flight output (async scheduling) no longer match
  waiting_.push_front(seq);
  ++counters_.num_preemptions;
}

void Scheduler::finish(Sequence* seq, FinishReason reason, StopReason stop_reason) {
  if (seq->status == SequenceStatus::kRunning) num_running_slots_ -= slots_of(seq);
  else if (seq->status == SequenceStatus::kWaiting) waiting_.remove(seq);
  if (kv_.contains(seq->seq_id)) kv_.free(seq->seq_id);
  seq->status = SequenceStatus::kFinished;
  seq->in_flight = 0;
  seq->pending_row = -1;
  seq->finish_reason = reason;
  seq->stop_reason = std::move(stop_reason);
  Request* req = seq->request;
  ++req->num_finished_seqs;
  // A request that never forked has no other sequence to wait for.
  if (!req->forked) req->num_finished_seqs = req->params.n;
}

bool Scheduler::abort_request(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  Request* req = it->second.get();
  for (Sequence* seq : req->seqs) {
    if (!seq) continue;
    if (seq->status == SequenceStatus::kRunning) remove_running(seq);
    if (seq->status != SequenceStatus::kFinished) finish(seq, FinishReason::kAbort, std::monostate{});
    release_sequence(seq);
  }
  requests_.erase(it);
  ++counters_.num_aborted_requests;
  return true;
}

bool Scheduler::finish_sequence(SeqId seq_id, StopReason stop_reason) {
  auto it = live_seqs_.find(seq_id);
  PAGEDLLM_CHECK(it != live_seqs_.end(), "finish_sequence: no live sequence with seq_id ", seq_id);
  Sequence* seq = it->second;
  Request* req = seq->request;
  PAGEDLLM_CHECK(!req->beam, "finish_sequence: seq_id ", seq_id, " is a beam of beam-search request \"",
                 req->request_id, "\" (its beams end together; abort the request instead)");
  if (seq->status == SequenceStatus::kRunning) remove_running(seq);
  finish(seq, FinishReason::kStop, std::move(stop_reason));
  release_sequence(seq);
  if (!req->finished()) return false;
  // Sequences not created yet (an unforked request) or finished earlier: release what is left.
  for (Sequence* s : req->seqs) {
    if (!s) continue;
    if (s->status == SequenceStatus::kRunning) remove_running(s);
    if (s->status != SequenceStatus::kFinished) finish(s, FinishReason::kAbort, std::monostate{});
    release_sequence(s);
  }
  requests_.erase(requests_.find(req->request_id));
  ++counters_.num_finished_requests;
  return true;
}

// ------------------------------------------------------------------ schedule

void Scheduler::append_copies(SchedulerOutput& out) {
  for (const CopyOrder& c : copies_) {
    out.copy_orders.push_back(c.src);
    out.copy_orders.push_back(c.dst);
  }
  counters_.num_copy_orders += static_cast<int64_t>(copies_.size());
}

void Scheduler::record(Sequence* seq, int32_t num_new, SchedulerOutput& out, int32_t prev_row) {
  Request* req = seq->request;
  const int32_t start = seq->num_computed_tokens;
  const int32_t end = start + num_new;
  const bool completes_prompt = !seq->prompt_done && end >= seq->prompt_len();
  const int32_t fork_begin = static_cast<int32_t>(out.forks.size());
  counters_.num_scheduled_tokens += num_new;
  counters_.num_recomputed_tokens += std::max(0, std::min(end, seq->max_computed_tokens) - start);
  if (end < seq->num_tokens()) ++counters_.num_chunked_prefills;
  seq->num_computed_tokens = end;
  seq->max_computed_tokens = std::max(seq->max_computed_tokens, end);
  ++seq->in_flight;
  if (completes_prompt) {
    // The n - 1 children take n - 1 of the n slots the parent held: num_running_slots_ is unchanged.
    req->forked = true;
    seq->prompt_done = true;  // children bind() to the forked request
    counters_.num_prompt_tokens += req->prompt_len();
    for (int32_t k = 1; k < req->params.n; ++k) {
      Sequence* child = new_sequence(req, k);
      child->token_ids.reserve(static_cast<size_t>(max_seq_tokens(*req)));
      child->token_ids = req->prompt_token_ids;
      child->num_computed_tokens = end;
      child->max_computed_tokens = end;
      child->status = SequenceStatus::kRunning;
      child->in_flight = 1;
      child->announced = true;
      running_.push_back(child);
      out.new_seqs.push_back({child->seq_id, req->request_id, k});
      out.forks.push_back({{seq, seq->generation}, {child, child->generation}});
      ++counters_.num_forks;
    }
  }
  out.scheduled.push_back({{seq, seq->generation}, start, num_new, completes_prompt, fork_begin,
                           static_cast<int32_t>(out.forks.size()), prev_row, 0});
}

int32_t Scheduler::add_drafts(SchedulerOutput& out, int32_t budget) {
  const SpeculativeConfig& spec = config_.speculative;
  int32_t used = 0;
  for (const int32_t idx : spec_candidates_) {
    if (budget - used <= 0) break;
    SchedulerOutput::Scheduled& s = out.scheduled[idx];
    Sequence* seq = s.ref.seq;
    // every emitted token (drafts accepted + 1) must fit max_tokens / max_model_len
    const int32_t room = max_seq_tokens(*seq->request) - seq->num_tokens() - 1;
    const int32_t max_k = std::min({spec.num_speculative_tokens, room, budget - used});
    if (max_k <= 0) continue;
    std::vector<int32_t>& drafts = seq->draft_token_ids;
    if (spec.external_drafts)
      drafts.assign(static_cast<size_t>(max_k), 0);  // the caller's draft model fills them in
    else
      propose_ngram(seq->token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, max_k, &drafts);
    // accept_all (debug): always max_k drafts, the n-gram's padded with the context's last token
    while (spec.accept_all && static_cast<int32_t>(drafts.size()) < max_k)
      drafts.push_back(drafts.empty() ? seq->token_ids.back() : drafts.back());
    const int32_t num_draft = static_cast<int32_t>(drafts.size());
    if (num_draft == 0) {  // no n-gram match: under async scheduling, pipeline it for a while
      seq->spec_skip = kSpecRetrySteps;
      continue;
    }
    seq->spec_skip = 0;
    copies_.clear();  // (the decode's own slot made any copy-on-write copy: these blocks are new)
    if (!kv_.allocate_slots(seq->seq_id, num_draft, nullptr, &copies_)) {
      drafts.clear();
      continue;
    }
    append_copies(out);
    s.num_new += num_draft;
    s.num_draft = num_draft;
    seq->num_computed_tokens += num_draft;
    counters_.num_scheduled_tokens += num_draft;
    used += num_draft;
  }
  spec_candidates_.clear();
  return used;
}

bool Scheduler::placeholder_allowed(const Sequence* seq, int64_t step_id) const {
  // Sampled in the previous step without a fork (the row is known), computed up to its last
  // known token, and not ended by length once that token is appended.
  return config_.async_scheduling && seq->in_flight == 1 && seq->pending_row >= 0 &&
         seq->pending_step == step_id - 1 && seq->num_computed_tokens == seq->num_tokens() &&
         seq->num_tokens() + 1 < config_.max_model_len &&
         (seq->max_tokens < 0 || seq->num_output_tokens() + 1 < seq->max_tokens);
}

void Scheduler::schedule(SchedulerOutput& out, int32_t max_step_seqs) {
  out.reset();
  const size_t cap = max_step_seqs > 0 ? static_cast<size_t>(max_step_seqs) : SIZE_MAX;
  out.step_id = next_step_id_++;
  const bool chunked = config_.enable_chunked_prefill;
  int32_t budget = config_.max_num_batched_tokens;
  bool preempted = false;
  const SpeculativeConfig& spec = config_.speculative;
  const bool speculate = spec.enabled() && (spec.disable_by_batch_size == 0 ||
                                            num_running() < spec.disable_by_batch_size);

  // 1. Running sequences: decodes first, then unfinished prompt chunks (and replays), each pass
  //    in running order. A snapshot is walked because preemption removes from running_.
  running_snapshot_ = running_;
  const size_t num_snapshot = running_snapshot_.size();
  for (const bool decode_pass : {true, false}) {
    for (size_t i = 0; i < num_snapshot; ++i) {
      if (budget <= 0 || out.scheduled.size() >= cap) break;
      Sequence* seq = running_snapshot_[i];
      if (seq->status != SequenceStatus::kRunning) continue;
      if (seq->request->beam && seq->in_flight > 0) continue;  // beams: no placeholders
      if (in_beam_group(seq)) {
        Request* req = seq->request;
        const int32_t pending = seq->num_tokens() - seq->num_computed_tokens;
        if (pending == 1) {  // at its last token: the group decodes together
          if (decode_pass && req->beam_scheduled_step != out.step_id) {
            req->beam_scheduled_step = out.step_id;
            schedule_beam_decodes(req, out, budget, preempted);
          }
          continue;
        }
        // a replay after preemption: up to its last token but one (then it waits for the group)
        int32_t num_new = pending - 1;
        if (decode_pass || num_new <= 0 || (!chunked && num_new > budget)) continue;
        num_new = std::min(num_new, budget);
        if (!allocate_or_preempt(seq, num_new, preempted)) continue;
        append_copies(out);
        record(seq, num_new, out);
        budget -= num_new;
        continue;
      }
      if (seq->in_flight > 0) {
        // Async scheduling, only where the slots are free to take (no preemption for these):
        if (!config_.async_scheduling || seq->in_flight != 1) continue;
        int32_t num_new = 1, prev_row = -1;
        if (seq->num_computed_tokens == seq->num_tokens()) {
          // sampled in the previous step: a placeholder decode of that token (not while this step
          // speculates: such a sequence waits for its token, then gets drafts)
          const bool due = speculate && seq->allow_speculation && seq->spec_skip == 0;
          if (!decode_pass || due || !placeholder_allowed(seq, out.step_id)) continue;
          if (speculate && seq->spec_skip > 0) --seq->spec_skip;
          prev_row = seq->pending_row;
        } else {
          // the next chunk of a prompt (or replay) whose previous chunk is in flight: known tokens
          num_new = seq->num_tokens() - seq->num_computed_tokens;
          if (num_new <= 0 || (num_new == 1) != decode_pass || (!chunked && num_new > budget)) continue;
          num_new = std::min(num_new, budget);
        }
        copies_.clear();
        if (!kv_.allocate_slots(seq->seq_id, num_new, nullptr, &copies_)) continue;
        append_copies(out);
        record(seq, num_new, out, prev_row);
        budget -= num_new;
        continue;
      }
      int32_t num_new = seq->num_tokens() - seq->num_computed_tokens;
      if (num_new <= 0 || (num_new == 1) != decode_pass || (!chunked && num_new > budget)) continue;
      // a decode past the prompt (not the prompt's last token: its request may fork) may get drafts
      // once every decode of the step has its slot (add_drafts: drafts never preempt anyone)
      const bool candidate = speculate && num_new == 1 && seq->allow_speculation &&
                             seq->num_computed_tokens >= seq->prompt_len();
      num_new = std::min(num_new, budget);
      if (!allocate_or_preempt(seq, num_new, preempted)) continue;
      append_copies(out);
      record(seq, num_new, out);
      budget -= num_new;
      if (candidate) spec_candidates_.push_back(static_cast<int32_t>(out.scheduled.size()) - 1);
    }
    if (decode_pass) budget -= add_drafts(out, budget);
  }

  // 2. Waiting sequences, unless this step had to preempt (vLLM v1: no admission then).
  while (!preempted && budget > 0 && !waiting_.empty() && out.scheduled.size() < cap) {
    Sequence* seq = waiting_.front();
    Request* req = seq->request;
    if (in_beam_group(seq)) {
      if (!admit_beam_group(req, out, budget)) break;
      continue;
    }
    const int32_t slots = slots_of(seq);
    if (num_running_slots_ + slots > config_.max_num_seqs) break;
    hit_.blocks.clear();
    hit_.num_tokens = 0;
    const bool use_cache = kv_.prefix_caching_enabled() && !req->needs_prompt_logprobs();
    if (use_cache) kv_.find_cached_prefix(seq->token_ids, req->extra_key, &hit_, false);
    int32_t num_new = seq->num_tokens() - hit_.num_tokens;
    if (num_new > budget) {
      if (!chunked) break;
      num_new = budget;
    }
    copies_.clear();
    if (!kv_.allocate_slots(seq->seq_id, num_new, use_cache ? &hit_ : nullptr, &copies_)) break;
    start_running_front(seq, slots, use_cache);
    if (!seq->announced) {
      seq->announced = true;
      out.new_seqs.push_back({seq->seq_id, req->request_id, seq->index});
    }
    append_copies(out);
    record(seq, num_new, out);
    budget -= num_new;
  }

  fill_buffers(out);
  if (out.num_tokens > 0) ++counters_.num_steps;
  out.state = SchedulerOutput::State::kScheduled;
}

void Scheduler::fill_buffers(SchedulerOutput& out) {
  // Decodes (query length 1) first, then prefills.
  for (const auto& s : out.scheduled)
    if (s.num_new == 1) fill_row(s, out);
  out.num_decode_seqs = out.num_seqs;
  for (const auto& s : out.scheduled)
    if (s.num_new != 1) fill_row(s, out);
  out.num_prefill_seqs = out.num_seqs - out.num_decode_seqs;
  out.query_start_loc[out.num_seqs] = out.num_tokens;
}

void Scheduler::fill_row(const SchedulerOutput::Scheduled& s, SchedulerOutput& out) {
  Sequence* seq = s.ref.seq;
  const int32_t row = out.num_seqs++;
  const int32_t t0 = out.num_tokens;
  const int32_t start = s.start;
  const int32_t end = s.start + s.num_new;
  std::span<const BlockId> blocks = kv_.block_ids(seq->seq_id);
  out.set_block_table_row(row, blocks.data(), static_cast<int32_t>(blocks.size()));
  out.query_start_loc[row] = t0;
  out.seq_ids[row] = seq->seq_id;
  out.seq_lens[row] = end;
  out.max_query_len = std::max(out.max_query_len, s.num_new);
  out.max_seq_len = std::max(out.max_seq_len, end);
  if (s.num_new != 1) out.num_prefill_tokens += s.num_new;

  const int32_t bs = block_size_;
  const int32_t* tokens = seq->token_ids.data();
  int32_t* ids = out.input_ids.data() + t0;
  int64_t* pos = out.positions.data() + t0;
  int64_t* slots = out.slot_mapping.data() + t0;
  int32_t* prev = out.prev_sample_rows.data() + t0;
  const bool placeholder = s.prev_row >= 0;
  const int32_t known_end = end - s.num_draft;  // drafts are not in token_ids
  for (int32_t p = start; p < known_end; ++p) {
    const int32_t k = p - start;
    ids[k] = placeholder ? 0 : tokens[p];
    prev[k] = placeholder ? s.prev_row : -1;
    pos[k] = p;
    slots[k] = static_cast<int64_t>(blocks[p / bs]) * bs + (p % bs);
  }
  out.num_tokens = t0 + s.num_new;
  if (placeholder) ++out.num_placeholders;

  if (s.num_draft > 0) {  // speculative: the drafts' token rows, then k + 1 sampled rows
    const int32_t* drafts = seq->draft_token_ids.data();
    for (int32_t p = known_end; p < end; ++p) {
      const int32_t k = p - start;
      ids[k] = drafts[p - known_end];
      prev[k] = -1;
      pos[k] = p;
      slots[k] = static_cast<int64_t>(blocks[p / bs]) * bs + (p % bs);
    }
    seq->pending_row = -1;
    seq->pending_step = out.step_id;
    for (int32_t j = 0; j <= s.num_draft; ++j) {
      out.logits_indices[out.num_sampled] = t0 + s.num_new - 1 - s.num_draft + j;
      out.draft_token_ids[out.num_sampled] = j < s.num_draft ? drafts[j] : -1;
      out.sample_seq_ids[out.num_sampled++] = seq->seq_id;
      out.samples.push_back(s.ref);
    }
    out.num_draft_tokens += s.num_draft;
    return;  // a decoding sequence: no fork, no prompt logprobs
  }

  if (end == seq->num_tokens() + (placeholder ? 1 : 0) && seq->max_tokens != 0) {
    const int64_t logits_row = t0 + s.num_new - 1;
    // Where the next step finds this row's token before the host does (no fork: a child's KV
    // exists only after update_from_output).
    seq->pending_row = s.fork_begin == s.fork_end && !seq->request->beam ? out.num_sampled : -1;
    seq->pending_step = out.step_id;
    out.logits_indices[out.num_sampled] = logits_row;
    out.draft_token_ids[out.num_sampled] = -1;
    out.sample_seq_ids[out.num_sampled++] = seq->seq_id;
    out.samples.push_back(s.ref);
    for (int32_t f = s.fork_begin; f < s.fork_end; ++f) {
      const auto& child = out.forks[f].second;
      out.logits_indices[out.num_sampled] = logits_row;
      out.draft_token_ids[out.num_sampled] = -1;
      out.sample_seq_ids[out.num_sampled++] = child.seq->seq_id;
      out.samples.push_back(child);
    }
  }

  if (seq->wants_prompt_logprobs) {
    Request* r = seq->request;
    const int32_t p0 = std::max(start, r->prompt_logprobs_next_pos);
    const int32_t p1 = std::min(end, r->prompt_len() - 1);
    if (p1 > p0) {
      out.prompt_logprob_rows.push_back({r->request_id, t0 + (p0 - start), p1 - p0, p0});
      r->prompt_logprobs_next_pos = p1;
    }
  }
}

// ------------------------------------------------------------------ beam search

bool Scheduler::in_beam_group(const Sequence* seq) {
  return seq->request->beam != nullptr && seq->request->forked;
}

bool Scheduler::group_idle(const Request* req) {
  // the others are running too, or parked while the leader replays (both preemptible with it)
  if (req->seqs[0]->status != SequenceStatus::kRunning) return false;
  for (const Sequence* m : req->seqs)
    if (m->in_flight > 0) return false;
  return true;
}

void Scheduler::preempt_group(Request* req) {
  for (auto it = req->seqs.rbegin(); it != req->seqs.rend(); ++it)
    if ((*it)->status == SequenceStatus::kRunning) preempt(*it);  // (the leader's slots: its parked ones')
  // The group comes back through its leader (index 0) alone; the others wait outside the queue,
  // parked, until the leader has replayed, then fork its KV up to their common prefix
  // (attach_parked). So a replay costs the group's distinct tokens, not W whole contexts.
  for (Sequence* m : req->seqs)
    if (m->index != 0) waiting_.remove(m);
  req->beam_parked = req->params.n - 1;
}

void Scheduler::attach_parked(Request* req) {
  Sequence* leader = req->seqs[0];
  const bool has_kv = kv_.contains(leader->seq_id);
  const int32_t limit = leader->num_computed_tokens;
  for (Sequence* m : req->seqs) {
    if (m == leader || m->status != SequenceStatus::kWaiting) continue;
    int32_t common = 0;
    while (common < limit && common < m->num_tokens() - 1 && m->token_ids[static_cast<size_t>(common)] ==
                                                                  leader->token_ids[static_cast<size_t>(common)])
      ++common;
    if (has_kv && common > 0) {
      kv_.fork_prefix(leader->seq_id, m->seq_id, common);
      kv_.cache_full_blocks(m->seq_id, m->token_ids, common, req->extra_key);  // its own hash chain
    } else {
      common = 0;
    }
    m->num_computed_tokens = common;
    m->status = SequenceStatus::kRunning;
    m->in_flight = 0;
    m->pending_row = -1;
    running_.push_back(m);
    --req->beam_parked;  // its slot moves from the leader's count to its own
  }
}

void Scheduler::preempt_victim(Sequence* victim) {
  if (in_beam_group(victim))
    preempt_group(victim->request);
  else
    preempt(victim);
}

void Scheduler::collect_victims() {
  candidates_.clear();
  for (Sequence* r : running_)
    if (!r->in_flight && (!in_beam_group(r) || group_idle(r->request))) candidates_.push_back(r);
}

bool Scheduler::allocate_or_preempt(Sequence* seq, int32_t num_new, bool& preempted) {
  for (;;) {
    copies_.clear();
    if (kv_.allocate_slots(seq->seq_id, num_new, nullptr, &copies_)) return true;
    // Victim: among running sequences not scheduled this step (nor in flight), seq included (a
    // beam only with its group, and not while a sibling's chunk is in this step).
    collect_victims();
    if (candidates_.empty()) return false;
    preempt_victim(select_victim(config_.policy, candidates_));
    preempted = true;
    if (seq->status != SequenceStatus::kRunning) return false;  // it was the victim (or in its group)
  }
}

void Scheduler::start_running_front(Sequence* seq, int32_t slots, bool use_cache) {
  waiting_.pop_front();
  if (use_cache) {
    counters_.prefix_cache_queries += seq->num_tokens();
    counters_.prefix_cache_hits += hit_.num_tokens;
  }
  seq->num_computed_tokens = hit_.num_tokens;
  seq->status = SequenceStatus::kRunning;
  running_.push_back(seq);
  num_running_slots_ += slots;
}

void Scheduler::schedule_beam_decodes(Request* req, SchedulerOutput& out, int32_t& budget,
                                      bool& preempted) {
  const int32_t width = req->params.n;
  for (const Sequence* m : req->seqs)  // every beam at its last token, none in flight
    if (!m || m->status != SequenceStatus::kRunning || m->in_flight > 0 ||
        m->num_tokens() - m->num_computed_tokens != 1)
      return;
  if (budget < width) return;  // all W or none: the group waits for a step with room
  for (;;) {
    int32_t need = 0;  // an upper bound: a shared last block is copied by all but its last holder
    for (const Sequence* m : req->seqs) need += kv_.num_blocks_needed(m->seq_id, 1);
    if (need <= kv_.num_free_blocks()) break;
    collect_victims();
    Sequence* victim = select_victim(config_.policy, candidates_);
    preempt_victim(victim);
    preempted = true;
    if (victim->request == req) return;
  }
  for (Sequence* m : req->seqs) {
    copies_.clear();
    PAGEDLLM_CHECK(kv_.allocate_slots(m->seq_id, 1, nullptr, &copies_),
                   "internal: a beam's slot did not allocate after the group's blocks were counted");
    append_copies(out);
    record(m, 1, out);
  }
  budget -= width;
}

bool Scheduler::admit_beam_group(Request* req, SchedulerOutput& out, int32_t& budget) {
  Sequence* leader = req->seqs[0];
  PAGEDLLM_CHECK(waiting_.front() == leader, "internal: a queued beam of \"", req->request_id,
                 "\" is not its group's leader (the others wait parked)");
  const int32_t slots = slots_of(leader);  // the whole group's
  if (num_running_slots_ + slots > config_.max_num_seqs) return false;
  const bool use_cache = kv_.prefix_caching_enabled();
  hit_.blocks.clear();
  hit_.num_tokens = 0;
  if (use_cache) kv_.find_cached_prefix(leader->token_ids, req->extra_key, &hit_, false);
  while (hit_.num_tokens > leader->num_tokens() - 1) {  // (never past its last token but one)
    hit_.blocks.pop_back();
    hit_.num_tokens -= block_size_;
  }
  int32_t num_new = leader->num_tokens() - 1 - hit_.num_tokens;  // the replay stops before its last token
  if (num_new > budget) {
    if (!config_.enable_chunked_prefill) return false;
    num_new = budget;
  }
  if (num_new > 0 || hit_.num_tokens > 0) {
    copies_.clear();
    if (!kv_.allocate_slots(leader->seq_id, num_new, use_cache ? &hit_ : nullptr, &copies_)) return false;
    append_copies(out);
  }
  start_running_front(leader, slots, use_cache);
  budget -= num_new;
  if (num_new > 0)
    record(leader, num_new, out);
  else
    attach_parked(req);  // nothing to replay: its KV up to its last token but one is there already
  return true;
}

void Scheduler::apply_beam_step(Request* req, std::span<const int32_t> rows, const SampledTopK& topk,
                                UpdateResult& result) {
  BeamSearch& beam = *req->beam;
  const int32_t width = beam.beam_width();
  const int32_t k = topk.k;  // (checked by update_from_output before anything changed)
  beam_tokens_.resize(static_cast<size_t>(width) * static_cast<size_t>(k));
  beam_logprobs_.resize(beam_tokens_.size());
  for (int32_t b = 0; b < width; ++b) {
    const int32_t r = rows[static_cast<size_t>(b)];
    std::copy_n(topk.token_ids.data() + static_cast<size_t>(r) * k, k, beam_tokens_.data() + static_cast<size_t>(b) * k);
    std::copy_n(topk.logprobs.data() + static_cast<size_t>(r) * k, k, beam_logprobs_.data() + static_cast<size_t>(b) * k);
  }
  const RequestParams& p = req->params;
  const int32_t prompt_len = req->prompt_len();
  const bool at_length = req->seqs[0]->num_tokens() + 1 >= max_seq_tokens(*req);
  auto is_eos = [&](int32_t t) {
    return !p.ignore_eos && std::find(p.eos_token_ids.begin(), p.eos_token_ids.end(), t) != p.eos_token_ids.end();
  };
  auto generated = [&](int32_t b) {
    const std::vector<int32_t>& ids = req->seqs[static_cast<size_t>(b)]->token_ids;
    return std::span<const int32_t>(ids.data() + prompt_len, ids.size() - static_cast<size_t>(prompt_len));
  };
  const bool done = beam.step(beam_tokens_, beam_logprobs_, k, at_length, is_eos, generated, &beam_choices_);
  counters_.num_generation_tokens += width;
  if (done) {
    for (Sequence* m : req->seqs) {
      finish(m, at_length ? FinishReason::kLength : FinishReason::kStop, std::monostate{});
      finished_scratch_.push_back(m);
    }
    result.beam_results.push_back({req->request_id, std::move(beam.finished())});
    return;
  }
  // A beam stays in its parent's sequence when it is the parent's first continuation; the others
  // take the sequences of dropped beams, which fork the parent (before any parent appends).
  beam_place_.assign(static_cast<size_t>(width), -1);
  beam_claimed_.assign(static_cast<size_t>(width), 0);
  for (int32_t j = 0; j < width; ++j) {
    const int32_t parent = beam_choices_[static_cast<size_t>(j)].parent;
    if (!beam_claimed_[static_cast<size_t>(parent)]) {
      beam_claimed_[static_cast<size_t>(parent)] = 1;
      beam_place_[static_cast<size_t>(j)] = parent;
    }
  }
  int32_t next_free = 0;
  for (int32_t j = 0; j < width; ++j) {
    if (beam_place_[static_cast<size_t>(j)] >= 0) continue;
    while (beam_claimed_[static_cast<size_t>(next_free)]) ++next_free;
    beam_claimed_[static_cast<size_t>(next_free)] = 1;
    beam_place_[static_cast<size_t>(j)] = next_free;
    Sequence* child = req->seqs[static_cast<size_t>(next_free)];
    const Sequence* parent = req->seqs[static_cast<size_t>(beam_choices_[static_cast<size_t>(j)].parent)];
    kv_.free(child->seq_id);
    kv_.fork(parent->seq_id, child->seq_id);
    child->token_ids.assign(parent->token_ids.begin(), parent->token_ids.end());
    child->num_computed_tokens = parent->num_computed_tokens;
    child->max_computed_tokens = parent->num_computed_tokens;
    ++counters_.num_forks;
  }
  for (int32_t j = 0; j < width; ++j)
    req->seqs[static_cast<size_t>(beam_place_[static_cast<size_t>(j)])]->token_ids.push_back(
        beam_choices_[static_cast<size_t>(j)].token);
  beam.place_running(beam_place_);
}

// ------------------------------------------------------------------ update

void Scheduler::update_from_output(SchedulerOutput& out, std::span<const int32_t> sampled,
                                   UpdateResult& result, const SampledTopK& topk) {
  PAGEDLLM_CHECK(out.state == SchedulerOutput::State::kScheduled,
                 "update_from_output: step ", out.step_id,
                 out.state == SchedulerOutput::State::kUpdated ? " was already updated"
                                                                : " is not a scheduled step");
  PAGEDLLM_CHECK(static_cast<int64_t>(sampled.size()) == out.num_sampled,
                 "sampled_token_ids has ", sampled.size(), " entries but step ", out.step_id,
                 " sampled ", out.num_sampled, " rows (num_sampled)");
  for (size_t r = 0; r < sampled.size(); ++r)
    PAGEDLLM_CHECK(sampled[r] >= 0 || (sampled[r] == -1 && r > 0 && out.draft_token_ids[r - 1] >= 0),
                   "sampled_token_ids[", r, "] = ", sampled[r],
                   " is not a token id (must be >= 0; -1 only past a rejection in a speculative run)");
  for (const auto& s : out.scheduled)  // a placeholder's token comes from the previous step
    PAGEDLLM_CHECK(s.prev_row < 0 || !s.ref.valid() || s.ref.seq->num_tokens() > s.start,
                   "update_from_output: step ", out.step_id, " computed a placeholder token of seq_id ",
                   s.ref.seq->seq_id, " whose step ", out.step_id - 1,
                   " was not updated yet (update steps in order)");
  // Beam groups: gather each group's rows (beam b's in rows[b]) and check them before changing
  // anything: a group decodes all W beams in a step, and its rows need top-k logprobs.
  beam_rows_.clear();
  for (int32_t r = 0; r < out.num_sampled; ++r) {
    const auto& ref = out.samples[r];
    if (!ref.valid() || ref.seq->status == SequenceStatus::kFinished || !ref.seq->request->beam) continue;
    Request* req = ref.seq->request;
    auto it = std::find_if(beam_rows_.begin(), beam_rows_.end(), [&](auto& e) { return e.first == req; });
    if (it == beam_rows_.end()) {
      beam_rows_.emplace_back(req, std::vector<int32_t>(static_cast<size_t>(req->params.n), -1));
      it = beam_rows_.end() - 1;
    }
    it->second[static_cast<size_t>(ref.seq->index)] = r;
  }
  const int64_t topk_rows = topk.k > 0 ? static_cast<int64_t>(topk.token_ids.size()) / topk.k : 0;
  for (const auto& [req, rows] : beam_rows_) {
    PAGEDLLM_CHECK(std::find(rows.begin(), rows.end(), -1) == rows.end(), "update_from_output: step ",
                   out.step_id, " sampled only some beams of beam-search request \"", req->request_id, "\"");
    PAGEDLLM_CHECK(topk.k >= req->beam->beams_to_keep() && topk.logprobs.size() == topk.token_ids.size() &&
                       topk_rows >= out.num_sampled,
                   "update_from_output: beam-search request \"", req->request_id, "\" needs the top ",
                   req->beam->beams_to_keep(), " logprobs of each of the step's ", out.num_sampled,
                   " sampled rows, got k = ", topk.k, " for ", topk_rows, " rows");
  }
  result.clear();
  finished_scratch_.clear();
  const bool caching = kv_.prefix_caching_enabled();
  const int32_t bs = block_size_;

  // 1. The computed tokens: register full blocks, prompt-only requests finish.
  for (const auto& s : out.scheduled) {
    if (!s.ref.valid()) continue;
    Sequence* seq = s.ref.seq;
    Request* req = seq->request;
    --seq->in_flight;
    // speculative: only the step's first token is known to be right before the run is applied
    const int32_t end = s.num_draft > 0 ? s.start + 1 : s.start + s.num_new;
    if (caching && end / bs > s.start / bs)
      kv_.cache_full_blocks(seq->seq_id, seq->token_ids, end, req->extra_key);
    if (req->beam_parked > 0 && seq->index == 0 && end == seq->num_tokens() - 1 &&
        seq->status == SequenceStatus::kRunning)
      attach_parked(req);  // a re-admitted group's leader has replayed: the others fork its KV
    if (s.completes_prompt && seq->max_tokens == 0) {
      finish(seq, FinishReason::kLength, std::monostate{});
      finished_scratch_.push_back(seq);
      for (int32_t f = s.fork_begin; f < s.fork_end; ++f) {
        Sequence* child = out.forks[f].second.seq;
        if (!out.forks[f].second.valid()) continue;
        finish(child, FinishReason::kLength, std::monostate{});
        finished_scratch_.push_back(child);
      }
    }
  }
  // 2. Children get the parent's KV (after the parent's blocks were registered, so they
  //    share its prefix-cache chain). A child whose parent went away recomputes.
  candidates_.clear();
  for (const auto& [parent, child] : out.forks) {
    if (!child.valid() || child.seq->status == SequenceStatus::kFinished) continue;
    --child.seq->in_flight;
    if (parent.valid() && parent.seq->status != SequenceStatus::kFinished)
      kv_.fork(parent.seq->seq_id, child.seq->seq_id);
    else
      candidates_.push_back(child.seq);
  }
  // 3. Sampled tokens and the stop rules (beam groups: step 3b).
  for (int32_t r = 0; r < out.num_sampled; ++r) {
    if (out.draft_token_ids[r] >= 0) {  // the first of a speculative run's k + 1 rows
      int32_t num_draft = 1;
      while (out.draft_token_ids[r + num_draft] >= 0) ++num_draft;
      apply_speculative_run(out, r, num_draft, sampled, result);
      r += num_draft;  // and ++r skips the run's last row
      continue;
    }
    const auto& ref = out.samples[r];
    if (!ref.valid() || ref.seq->status == SequenceStatus::kFinished) continue;
    Sequence* seq = ref.seq;
    if (seq->pending_step == out.step_id) seq->pending_row = -1;  // the token is known now
    if (seq->request->beam) continue;  // (step 3b)
    append_token(seq, sampled[r], result);
  }
  // 3b. Beam steps (rows gathered and checked above).
  for (auto& [req, rows] : beam_rows_) apply_beam_step(req, rows, topk, result);
  for (Sequence* orphan : candidates_)
    if (orphan->status == SequenceStatus::kRunning) preempt(orphan);
  out.state = SchedulerOutput::State::kUpdated;
  if (finished_scratch_.empty()) return;

  // 4. Drop finished sequences from running_, report them, free finished requests.
  std::erase_if(running_, [](const Sequence* s) { return s->status == SequenceStatus::kFinished; });
  for (Sequence* seq : finished_scratch_)
    result.finished.push_back({seq->request->request_id, seq->seq_id, seq->index,
                               seq->finish_reason, seq->stop_reason});
  std::vector<Request*>& done = done_scratch_;
  done.clear();
  for (Sequence* seq : finished_scratch_) {
    Request* req = seq->request;
    release_sequence(seq);
    if (req->finished() && !req->done) {
      req->done = true;
      done.push_back(req);
    }
  }
  for (Request* req : done) {
    result.request_finished.push_back(req->request_id);
    ++counters_.num_finished_requests;
    requests_.erase(requests_.find(req->request_id));
  }
}

bool Scheduler::append_token(Sequence* seq, int32_t token, UpdateResult& result) {
  seq->token_ids.push_back(token);
  result.seq_ids.push_back(seq->seq_id);
  result.token_ids.push_back(token);
  ++counters_.num_generation_tokens;
  StopReason stop_reason;
  const FinishReason reason = check_stop(*seq, config_.max_model_len, &stop_reason);
  if (reason == FinishReason::kNone) return false;
  finish(seq, reason, std::move(stop_reason));
  finished_scratch_.push_back(seq);
  return true;
}

void Scheduler::apply_speculative_run(const SchedulerOutput& out, int32_t r, int32_t num_draft,
                                      std::span<const int32_t> sampled, UpdateResult& result) {
  const auto& ref = out.samples[r];
  if (!ref.valid() || ref.seq->status == SequenceStatus::kFinished) return;
  Sequence* seq = ref.seq;
  if (seq->pending_step == out.step_id) seq->pending_row = -1;
  const bool accept_all = config_.speculative.accept_all;
  const int32_t* x = out.draft_token_ids.data() + r;
  const int32_t* y = sampled.data() + r;
  int32_t accepted = 0;  // drafts that match what the target sampled at their position
  while (accepted < num_draft && y[accepted] >= 0 && (accept_all || y[accepted] == x[accepted])) ++accepted;
  const int32_t emit = accepted + (y[accepted] >= 0 ? 1 : 0);
  ++spec_counters_.num_drafts;
  spec_counters_.num_draft_tokens += num_draft;
  spec_counters_.num_accepted_tokens += accepted;
  for (int32_t j = 0; j < accepted && j < static_cast<int32_t>(spec_counters_.accepted_per_pos.size()); ++j)
    ++spec_counters_.accepted_per_pos[j];
  for (int32_t j = 0; j < emit; ++j)  // a stop inside the run drops the rest, as without drafts
    if (append_token(seq, (accept_all && j < num_draft) ? x[j] : y[j], result)) return;
  // KV is right for every token but the last emitted (its KV is computed by the next step); the
  // slots past it (rejected drafts) go back to the pool.
  seq->num_computed_tokens = seq->num_tokens() - 1;
  seq->max_computed_tokens = std::max(seq->max_computed_tokens, seq->num_computed_tokens);
  kv_.truncate(seq->seq_id, seq->num_computed_tokens);
  if (kv_.prefix_caching_enabled())
    kv_.cache_full_blocks(seq->seq_id, seq->token_ids, seq->num_computed_tokens, seq->request->extra_key);
}

void Scheduler::cancel(SchedulerOutput& out) {
  if (out.state == SchedulerOutput::State::kScheduled) {
    // Hand the prompt-logprob positions out again.
    for (const auto& rows : out.prompt_logprob_rows) {
      auto it = requests_.find(rows.request_id);
      if (it != requests_.end())
        it->second->prompt_logprobs_next_pos =
            std::min(it->second->prompt_logprobs_next_pos, rows.first_position);
    }
    for (const auto& [parent, child] : out.forks)
      if (child.valid() && child.seq->status == SequenceStatus::kRunning) preempt(child.seq);
    for (auto it = out.scheduled.rbegin(); it != out.scheduled.rend(); ++it)
      if (it->ref.valid() && it->ref.seq->status == SequenceStatus::kRunning) {
        preempt_victim(it->ref.seq);
      }
  }
  out.reset();
  out.state = SchedulerOutput::State::kFree;
}

}  // namespace pagedllm
