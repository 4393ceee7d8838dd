// BlockPool: ref counts and the intrusive free queue (see pagedllm/block_pool.h).
#include "pagedllm/block_pool.h"

namespace pagedllm {

BlockPool::BlockPool(int32_t num_blocks)
    : num_blocks_(num_blocks), num_free_(0), sentinel_(num_blocks) {
  PAGEDLLM_CHECK(num_blocks >= 1, "num_blocks must be >= 1, got ", num_blocks);
  ref_count_.assign(num_blocks, 0);
  prev_.assign(static_cast<size_t>(num_blocks) + 1, 0);
  next_.assign(static_cast<size_t>(num_blocks) + 1, 0);
  prev_[sentinel_] = next_[sentinel_] = sentinel_;
  for (BlockId b = 0; b < num_blocks; ++b) push_back(b);
}

void BlockPool::unlink(BlockId block) {
  const int32_t p = prev_[block], n = next_[block];
  next_[p] = n;
  prev_[n] = p;
  --num_free_;
}

void BlockPool::push_front(BlockId block) {
  const int32_t n = next_[sentinel_];
  prev_[block] = sentinel_;
  next_[block] = n;
  prev_[n] = block;
  next_[sentinel_] = block;
  ++num_free_;
}

void BlockPool::push_back(BlockId block) {
  const int32_t p = prev_[sentinel_];
  prev_[block] = p;
  next_[block] = sentinel_;
  next_[p] = block;
  prev_[sentinel_] = block;
  ++num_free_;
}

BlockId BlockPool::allocate() {
  const BlockId block = next_[sentinel_];
  if (block == sentinel_) return kNoBlock;
  unlink(block);
  ref_count_[block] = 1;
  if (hooks_ != nullptr) hooks_->on_reuse(block);
  return block;
}

void BlockPool::incref(BlockId block) {
  check_id(block);
  if (ref_count_[block] == 0) unlink(block);
  ++ref_count_[block];
}

void BlockPool::release(BlockId block) {
  check_id(block);
  PAGEDLLM_CHECK(ref_count_[block] > 0, "block ", block, " is already free (double free)");
  if (--ref_count_[block] > 0) return;
  if (hooks_ != nullptr && hooks_->holds_reusable_content(block)) {
    push_back(block);
  } else {
    push_front(block);
  }
}

std::vector<BlockId> BlockPool::free_queue() const {
  std::vector<BlockId> out;
  out.reserve(num_free_);
  for (int32_t b = next_[sentinel_]; b != sentinel_; b = next_[b]) out.push_back(b);
  return out;
}

}  // namespace pagedllm
