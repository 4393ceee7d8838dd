// pagedllm/block_table.h — one sequence's pages: the logical-to-physical block list.
//
// Token position p of the sequence lives in physical block block_ids()[p / block_size] at offset
// p % block_size, i.e. at KV slot block_ids()[p / block_size] * block_size + p % block_size
// (the "slot mapping" that reshape_and_cache writes to; PagedAttention, Kwon et al., SOSP 2023,
// section 4.2).
//
// fork() makes a child table that shares every block (ref_count + 1 each; vLLM v0's
// BlockSpaceManager.fork). Appending into a shared (ref_count > 1), partly filled last block is
// copy-on-write (same paper, section 4.4): a fresh block replaces it in this table, the old block
// loses this table's reference, and a CopyOrder{src = old, dst = new} is returned for the
// copy_blocks kernel to execute before the step's forward pass. Full shared blocks are never
// copied: their content is final and new tokens go to a new block.
//
// A BlockTable does not own a pool; every mutating call takes the BlockPool its blocks come
// from (always the same one). Appends are all-or-nothing. The table must be free()d before it
// is destroyed, or its blocks stay held.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "pagedllm/block_pool.h"

namespace pagedllm {

/// Copy-on-write order: copy the KV content of block src into block dst (all layers, K and V).
struct CopyOrder {
  BlockId src;
  BlockId dst;
  bool operator==(const CopyOrder&) const = default;
};

/// Block sizes the core accepts: powers of two in [kMinBlockSize, kMaxBlockSize].
inline constexpr int32_t kMinBlockSize = 8;
inline constexpr int32_t kMaxBlockSize = 128;

/// Throws InvalidArgument naming block_size unless it is a power of two in [8, 128].
void check_block_size(int32_t block_size);

class BlockTable {
 public:
  /// An empty table for blocks of `block_size` tokens (checked by check_block_size).
  explicit BlockTable(int32_t block_size);

  int32_t block_size() const { return block_size_; }
  /// Token slots reserved so far.
  int32_t num_tokens() const { return num_tokens_; }
  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  /// Physical block ids in logical order.
  std::span<const BlockId> block_ids() const { return blocks_; }
  /// KV slot of token `position` (checked: 0 <= position < num_tokens(), else InvalidArgument).
  int64_t slot(int32_t position) const;

  /// Blocks append_slots(pool, num_new_tokens) would take from the pool's free queue: new blocks
  /// plus one when copy-on-write is due. num_new_tokens >= 0 (else InvalidArgument).
  int32_t num_blocks_needed(const BlockPool& pool, int32_t num_new_tokens) const;

  /// Reserve num_new_tokens more slots. Returns false and changes nothing when the pool has fewer
  /// free blocks than num_blocks_needed(). On copy-on-write appends {old, new} to *copies; throws
  /// InvalidArgument (changing nothing) if copy-on-write is due and copies is null.
  bool append_slots(BlockPool& pool, int32_t num_new_tokens, std::vector<CopyOrder>* copies);

  /// Start an empty table with `blocks` (full blocks, e.g. a prefix-cache hit) shared: ref + 1
  /// each (a free block leaves the free queue). Requires num_tokens() == 0 (else InvalidArgument);
  /// every id is checked before any reference is taken.
  void share_full_blocks(BlockPool& pool, std::span<const BlockId> blocks);

  /// Make room for num_blocks block ids without reallocating (may throw bad_alloc; no other change).
  void reserve(size_t num_blocks) {
    if (blocks_.capacity() < num_blocks) blocks_.reserve(std::max(num_blocks, 2 * blocks_.capacity()));
  }

  /// A child table sharing every block of this one (ref + 1 each) and the same token count.
  BlockTable fork(BlockPool& pool) const;
  /// Same, into an empty table *child of the same block size (reusing its capacity).
  void fork_into(BlockPool& pool, BlockTable* child) const;

  /// Keep only the first num_tokens slots: blocks past ceil(num_tokens / block_size) are released,
  /// last first (speculative decoding: the slots of rejected draft tokens). 0 <= num_tokens <=
  /// num_tokens() (else InvalidArgument, nothing changed).
  void truncate(BlockPool& pool, int32_t num_tokens);
  /// Release every block, last block first (so a cached chain's tail is evicted first), and
  /// become empty (the list keeps its capacity for reuse).
  void free(BlockPool& pool);

 private:
  int32_t block_size_;
  int32_t block_shift_;  // log2(block_size)
  int32_t num_tokens_ = 0;
  std::vector<BlockId> blocks_;
};

}  // namespace pagedllm
