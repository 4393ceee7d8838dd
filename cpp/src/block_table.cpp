// BlockTable: logical-to-physical blocks, fork and copy-on-write append (see pagedllm/block_table.h).
#include "pagedllm/block_table.h"

#include <algorithm>
#include <bit>

namespace pagedllm {

void check_block_size(int32_t block_size) {
  PAGEDLLM_CHECK(block_size >= kMinBlockSize && block_size <= kMaxBlockSize &&
                     std::has_single_bit(static_cast<uint32_t>(block_size)),
                 "block_size must be a power of two in [", kMinBlockSize, ", ", kMaxBlockSize,
                 "], got ", block_size);
}

BlockTable::BlockTable(int32_t block_size) : block_size_(block_size), block_shift_(0) {
  check_block_size(block_size);
  block_shift_ = std::countr_zero(static_cast<uint32_t>(block_size));
}

int64_t BlockTable::slot(int32_t position) const {
  PAGEDLLM_CHECK(position >= 0 && position < num_tokens_, "position ", position,
                 " out of range [0, ", num_tokens_, ")");
  return static_cast<int64_t>(blocks_[position >> block_shift_]) * block_size_ +
         (position & (block_size_ - 1));
}

int32_t BlockTable::num_blocks_needed(const BlockPool& pool, int32_t num_new_tokens) const {
  PAGEDLLM_CHECK(num_new_tokens >= 0, "num_new_tokens must be >= 0, got ", num_new_tokens);
  if (num_new_tokens == 0) return 0;
  const int64_t total = static_cast<int64_t>(num_tokens_) + num_new_tokens;
  const int64_t blocks_after = (total + block_size_ - 1) >> block_shift_;
  int64_t needed = blocks_after - static_cast<int64_t>(blocks_.size());
  const bool partial_last = (num_tokens_ & (block_size_ - 1)) != 0;
  if (partial_last && pool.ref_count(blocks_.back()) > 1) ++needed;  // copy-on-write
  PAGEDLLM_CHECK(total <= INT32_MAX, "num_tokens would overflow: ", num_tokens_, " + ",
                 num_new_tokens);
  return static_cast<int32_t>(needed);
}

bool BlockTable::append_slots(BlockPool& pool, int32_t num_new_tokens,
                              std::vector<CopyOrder>* copies) {
  const int32_t needed = num_blocks_needed(pool, num_new_tokens);
  if (needed > pool.num_free_blocks()) return false;
  if (num_new_tokens == 0) return true;
  const bool partial_last = (num_tokens_ & (block_size_ - 1)) != 0;
  const bool cow = partial_last && pool.ref_count(blocks_.back()) > 1;
  PAGEDLLM_CHECK(!cow || copies != nullptr, "copy-on-write of shared block ", blocks_.back(),
                 " is due but no copy-order list was given (copies == nullptr)");
  // Reserve table capacity first: the only step that can throw (bad_alloc) runs before the pool
  // is touched.
  const int32_t total = num_tokens_ + num_new_tokens;
  const size_t blocks_after = static_cast<size_t>((total + block_size_ - 1) >> block_shift_);
  if (blocks_.capacity() < blocks_after) blocks_.reserve(std::max(blocks_after, 2 * blocks_.capacity()));
  if (cow && copies->size() == copies->capacity()) {
    copies->reserve(std::max<size_t>(16, 2 * copies->capacity()));
  }
  if (cow) {
    const BlockId old_block = blocks_.back();
    const BlockId new_block = pool.allocate();
    pool.release(old_block);  // still held by the other sharers: ref stays >= 1
    blocks_.back() = new_block;
    copies->push_back({old_block, new_block});
  }
  while (blocks_.size() < blocks_after) blocks_.push_back(pool.allocate());
  num_tokens_ = total;
  return true;
}

void BlockTable::share_full_blocks(BlockPool& pool, std::span<const BlockId> blocks) {
  PAGEDLLM_CHECK(num_tokens_ == 0, "share_full_blocks needs an empty table, this one holds ",
                 num_tokens_, " tokens");
  for (BlockId b : blocks) pool.check_id(b);
  PAGEDLLM_CHECK(static_cast<int64_t>(blocks.size()) * block_size_ <= INT32_MAX,
                 "too many blocks: ", blocks.size());
  blocks_.reserve(blocks.size());
  for (BlockId b : blocks) {
    pool.incref(b);
    blocks_.push_back(b);
  }
  num_tokens_ = static_cast<int32_t>(blocks.size()) * block_size_;
}

BlockTable BlockTable::fork(BlockPool& pool) const {
  BlockTable child(block_size_);
  fork_into(pool, &child);
  return child;
}

void BlockTable::fork_into(BlockPool& pool, BlockTable* child) const {
  PAGEDLLM_CHECK(child->num_tokens_ == 0 && child->blocks_.empty(),
                 "fork_into needs an empty child table, it holds ", child->num_tokens_, " tokens");
  PAGEDLLM_CHECK(child->block_size_ == block_size_, "fork_into: child block_size ",
                 child->block_size_, " != ", block_size_);
  child->blocks_.assign(blocks_.begin(), blocks_.end());  // may allocate: before any reference
  for (BlockId b : blocks_) pool.incref(b);
  child->num_tokens_ = num_tokens_;
}

void BlockTable::truncate(BlockPool& pool, int32_t num_tokens) {
  PAGEDLLM_CHECK(num_tokens >= 0 && num_tokens <= num_tokens_, "truncate: num_tokens must be in [0, ",
                 num_tokens_, "], got ", num_tokens);
  const size_t keep = static_cast<size_t>((num_tokens + block_size_ - 1) >> block_shift_);
  while (blocks_.size() > keep) {
    pool.release(blocks_.back());
    blocks_.pop_back();
  }
  num_tokens_ = num_tokens;
}

void BlockTable::free(BlockPool& pool) {
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) pool.release(*it);
  blocks_.clear();
  num_tokens_ = 0;
}

}  // namespace pagedllm
