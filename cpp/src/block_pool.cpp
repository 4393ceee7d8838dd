// BlockPool: ref counts and the intrusive free queue (see pagedllm/block_pool.h).
#include "pagedllm/block_pool.h"

namespace pagedllm {

BlockPool::BlockPool(int32_t num_blocks)
    : num_blocks_(num_blocks), num_free_(0), sentinel_(num_blocks) {
  PAGEDLLM_CHECK(num_blocks >= 1, "num_blocks must be >= 1, got ", num_blocks);
  nodes_.assign(static_cast<size_t>(num_blocks) + 1, Node{0, 0, 0, 0});
  nodes_[sentinel_].prev = nodes_[sentinel_].next = sentinel_;
  for (BlockId b = 0; b < num_blocks; ++b) push_back(b);
}

void BlockPool::unlink(BlockId block) {
  const int32_t p = nodes_[block].prev, n = nodes_[block].next;
  nodes_[p].next = n;
  nodes_[n].prev = p;
  --num_free_;
}

void BlockPool::push_front(BlockId block) {
  const int32_t n = nodes_[sentinel_].next;
  nodes_[block].prev = sentinel_;
  nodes_[block].next = n;
  nodes_[n].prev = block;
  nodes_[sentinel_].next = block;
  ++num_free_;
}

void BlockPool::push_back(BlockId block) {
  const int32_t p = nodes_[sentinel_].prev;
  nodes_[block].prev = p;
  nodes_[block].next = sentinel_;
  nodes_[p].next = block;
  nodes_[sentinel_].prev = block;
  ++num_free_;
}

BlockId BlockPool::allocate() {
  const BlockId block = nodes_[sentinel_].next;
  if (block == sentinel_) return kNoBlock;
  unlink(block);
  Node& node = nodes_[block];
  node.ref_count = 1;
  if (node.reusable) {
    node.reusable = 0;
    if (hooks_ != nullptr) hooks_->on_reuse(block);
  }
  return block;
}

void BlockPool::incref(BlockId block) {
  check_id(block);
  if (nodes_[block].ref_count == 0) unlink(block);
  ++nodes_[block].ref_count;
}

void BlockPool::release(BlockId block) {
  check_id(block);
  PAGEDLLM_CHECK(nodes_[block].ref_count > 0, "block ", block, " is already free (double free)");
  if (--nodes_[block].ref_count > 0) return;
  if (nodes_[block].reusable) {
    push_back(block);
  } else {
    push_front(block);
  }
}

std::vector<BlockId> BlockPool::free_queue() const {
  std::vector<BlockId> out;
  out.reserve(num_free_);
  for (int32_t b = nodes_[sentinel_].next; b != sentinel_; b = nodes_[b].next) out.push_back(b);
  return out;
}

}  // namespace pagedllm
