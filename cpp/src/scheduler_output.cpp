#include "pagedllm/scheduler_output.h"

#include <algorithm>
#include <cstring>

#include "pagedllm/errors.h"

namespace pagedllm {

SchedulerOutput::SchedulerOutput(int32_t max_tokens, int32_t max_seqs, int32_t max_blocks,
                                 int32_t max_sampled)
    : max_blocks_per_seq(max_blocks),
      input_ids(max_tokens),
      positions(max_tokens),
      slot_mapping(max_tokens),
      block_tables(static_cast<size_t>(max_seqs) * max_blocks, 0),
      seq_lens(max_seqs),
      query_start_loc(static_cast<size_t>(max_seqs) + 1),
      seq_ids(max_seqs),
      logits_indices(max_sampled > 0 ? max_sampled : max_seqs),
      sample_seq_ids(max_sampled > 0 ? max_sampled : max_seqs),
      draft_token_ids(max_sampled > 0 ? max_sampled : max_seqs, -1),
      prev_sample_rows(max_tokens, -1),
      row_len_(max_seqs, 0) {
  PAGEDLLM_CHECK(max_tokens >= 1 && max_seqs >= 1 && max_blocks >= 1,
                 "SchedulerOutput: max_tokens, max_seqs, max_blocks_per_seq must be >= 1, got ",
                 max_tokens, ", ", max_seqs, ", ", max_blocks);
  copy_orders.reserve(2 * static_cast<size_t>(max_seqs));
  scheduled.reserve(max_seqs);
  samples.reserve(max_sampled > 0 ? max_sampled : max_seqs);
  query_start_loc[0] = 0;
}

void SchedulerOutput::reset() {
  num_tokens = num_seqs = num_sampled = 0;
  num_decode_seqs = num_prefill_seqs = num_prefill_tokens = num_placeholders = num_draft_tokens = 0;
  max_query_len = max_seq_len = max_row_blocks = 0;
  query_start_loc[0] = 0;
  copy_orders.clear();
  new_seqs.clear();
  prompt_logprob_rows.clear();
  scheduled.clear();
  samples.clear();
  forks.clear();
}

void SchedulerOutput::set_block_table_row(int32_t row, const int32_t* blocks, int32_t n) {
  int32_t* dst = block_tables.data() + static_cast<size_t>(row) * max_blocks_per_seq;
  std::memcpy(dst, blocks, sizeof(int32_t) * n);
  if (row_len_[row] > n) std::fill(dst + n, dst + row_len_[row], 0);
  row_len_[row] = n;
  max_row_blocks = std::max(max_row_blocks, n);
}

}  // namespace pagedllm
