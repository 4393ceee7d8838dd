// pagedllm/scheduler_output.h — one step's work as flat arrays (the batch buffers), and what
// update_from_output returns.
//
// A SchedulerOutput is a preallocated buffer set owned by the EngineCore (at least two exist):
// schedule() fills a free one in place and hands it out; it stays valid and unchanged until
// EngineCore::release() gives it back, so the next step can be scheduled while this one runs.
// Python sees the arrays zero-copy (numpy views whose base is the SchedulerOutput).
//
// Layout (T = num_tokens, S = num_seqs, R = num_sampled, C = num_copies):
//   input_ids        int32 [T]   token ids, sequence after sequence (rows of the flattened batch)
//   positions        int64 [T]   position of each token in its sequence
//   slot_mapping     int64 [T]   KV slot (block_id * block_size + offset) each token's K/V goes to
//   block_tables     int32 [S, max_blocks_per_seq]  physical blocks of each sequence; entries
//                                past a sequence's blocks are 0 (padding, never read)
//   seq_lens         int32 [S]   context length incl. this step's tokens
//   query_start_loc  int32 [S+1] first row of each sequence; query_start_loc[S] = T
//   seq_ids          int64 [S]   sequence id of each row of block_tables
//   logits_indices   int64 [R]   rows of the flattened hidden states to sample (a row repeats
//                                when a prompt completes with n > 1: one per child)
//   sample_seq_ids   int64 [R]   the sequence each sampled token belongs to
//   copy_orders      int64 [C, 2] copy-on-write (src_block, dst_block), to run before the step's
//                                forward pass (before any reshape_and_cache of this step)
//   draft_token_ids  int32 [R]   speculative decoding: the draft token that the token sampled in row
//                                r is checked against, or -1 (a plain row, or the last row of a
//                                sequence's run: the bonus position). A sequence with k drafts has
//                                k + 1 consecutive sampled rows (its last k + 1 token rows), the
//                                first k with drafts; num_draft_tokens drafts in all
//   prev_sample_rows int32 [T]   -1, or (a placeholder token, async scheduling only) the sampled
//                                row of step step_id - 1 whose token goes here: input_ids holds 0
//                                and the model runner takes the token from that step's sampled
//                                ids on the device (num_placeholders such tokens)
// Sequences are ordered decodes first: rows [0, num_decode_seqs) have query length 1; rows
// [num_decode_seqs, S) (num_prefill_seqs of them) have longer queries (prompt chunks, replays, and
// speculative verification: a decode with k drafts has a query of k + 1 tokens).
//
// Requirement on the model runner: within each layer, every token's reshape_and_cache write
// precedes that layer's attention, and copy_orders run before both. With placeholders, the
// previous step's forward pass and sampling run before this step's (one stream, in order).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pagedllm/beam_search.h"
#include "pagedllm/request.h"

namespace pagedllm {

/// A sequence that appears for the first time in this step (first scheduling of a request's
/// index-0 sequence, or the n-1 children forked when its prompt completes).
struct NewSequence {
  SeqId seq_id;
  std::string request_id;
  int32_t index;  ///< CompletionOutput.index
};

/// Rows first_row .. first_row + num_rows - 1 of the flattened tokens hold the positions
/// first_position .. first_position + num_rows - 1 of the request's prompt; the logits of row
/// first_row + i score prompt token first_position + i + 1 (vLLM's prompt_logprobs; position 0
/// has no logprob). Each prompt position is handed out once over the request's life.
struct PromptLogprobRows {
  std::string request_id;
  int32_t first_row;
  int32_t num_rows;
  int32_t first_position;
};

/// A sequence that finished in update_from_output.
struct FinishedSequence {
  std::string request_id;
  SeqId seq_id;
  int32_t index;
  FinishReason finish_reason;
  StopReason stop_reason;  ///< the stop token id for a stop_token_ids match, else none
};

/// A beam-search request that finished: its hypotheses, best score first (beam_search.h).
struct BeamSearchResult {
  std::string request_id;
  std::vector<BeamHypothesis> hypotheses;
};

/// Top-k token ids and logprobs of each sampled row of a step (beam search reads them):
/// token_ids int64 [R, k], logprobs float32 [R, k], row r descending by logprob. Empty when no
/// row of the step belongs to a beam search.
struct SampledTopK {
  std::span<const int64_t> token_ids;
  std::span<const float> logprobs;
  int32_t k = 0;
};

/// What update_from_output returns: the tokens appended this step and what finished.
struct UpdateResult {
  std::vector<SeqId> seq_ids;      ///< int64 [K]
  std::vector<int32_t> token_ids;  ///< int32 [K], token_ids[k] appended to seq_ids[k]
  std::vector<FinishedSequence> finished;
  /// Requests whose every sequence has now finished (their state is freed).
  std::vector<std::string> request_finished;
  /// Beam-search requests that finished this step (also listed in request_finished).
  std::vector<BeamSearchResult> beam_results;

  void clear() {
    beam_results.clear();
    seq_ids.clear();
    token_ids.clear();
    finished.clear();
    request_finished.clear();
  }
};

class SchedulerOutput {
 public:
  enum class State : int8_t { kFree, kScheduled, kUpdated };

  /// Buffers for up to max_tokens tokens, max_seqs sequences and max_sampled sampled rows
  /// (0: max_seqs; speculative decoding needs max_seqs * (k + 1)).
  SchedulerOutput(int32_t max_tokens, int32_t max_seqs, int32_t max_blocks_per_seq,
                  int32_t max_sampled = 0);

  int32_t num_tokens = 0;
  int32_t num_seqs = 0;
  int32_t num_sampled = 0;
  int32_t num_decode_seqs = 0;
  int32_t num_prefill_seqs = 0;
  int32_t num_prefill_tokens = 0;
  int32_t max_query_len = 0;
  int32_t max_seq_len = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t num_draft_tokens = 0;  ///< speculative draft tokens in this step (draft_token_ids >= 0)
  int32_t num_placeholders = 0;  ///< tokens whose id is step step_id - 1's sample (prev_sample_rows)
  /// The most blocks any row of this step's block_tables holds: every column from it on is 0.
  int32_t max_row_blocks = 0;
  int64_t step_id = -1;  ///< 0, 1, 2... per schedule() call of the engine
  State state = State::kFree;

  std::vector<int32_t> input_ids;
  std::vector<int64_t> positions;
  std::vector<int64_t> slot_mapping;
  std::vector<int32_t> block_tables;
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> query_start_loc;
  std::vector<int64_t> seq_ids;
  std::vector<int64_t> logits_indices;
  std::vector<int64_t> sample_seq_ids;
  std::vector<int32_t> draft_token_ids;
  std::vector<int64_t> copy_orders;  ///< 2 * num_copies()
  std::vector<int32_t> prev_sample_rows;
  std::vector<NewSequence> new_seqs;
  std::vector<PromptLogprobRows> prompt_logprob_rows;

  int32_t num_copies() const { return static_cast<int32_t>(copy_orders.size() / 2); }
  int32_t capacity_tokens() const { return static_cast<int32_t>(input_ids.size()); }
  int32_t capacity_seqs() const { return static_cast<int32_t>(seq_lens.size()); }

  // ---- the scheduler's bookkeeping for update_from_output (not part of the Python view) ----
  /// A handle that notices when its sequence was released (aborted, finished) meanwhile.
  struct SeqRef {
    Sequence* seq;
    uint32_t generation;
    bool valid() const { return seq->generation == generation; }
  };
  struct Scheduled {
    SeqRef ref;
    int32_t start;       ///< num_computed_tokens before this step
    int32_t num_new;     ///< tokens computed this step
    bool completes_prompt;  ///< first time this request's prompt is fully computed
    int32_t fork_begin;     ///< children created by this entry: forks[fork_begin, fork_end)
    int32_t fork_end;
    int32_t prev_row;       ///< >= 0: a placeholder decode of the token sampled in row prev_row
                            ///< of step step_id - 1 (async scheduling)
    int32_t num_draft;      ///< speculative draft tokens among num_new (the query's last ones)
  };
  std::vector<Scheduled> scheduled;
  std::vector<SeqRef> samples;                   ///< [R]: whom sampled row r belongs to
  std::vector<std::pair<SeqRef, SeqRef>> forks;  ///< (parent, child) to fork in update

  /// Empty the step (keeps capacity; block_tables padding is maintained incrementally).
  void reset();
  /// Write row `row` of block_tables from `blocks`, zeroing what a previous longer row left.
  void set_block_table_row(int32_t row, const int32_t* blocks, int32_t num_blocks);

 private:
  std::vector<int32_t> row_len_;  ///< blocks written in each row by an earlier step
};

}  // namespace pagedllm
