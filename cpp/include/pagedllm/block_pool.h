// pagedllm/block_pool.h — the physical KV blocks: ids, reference counts and the free queue.
//
// A BlockPool owns `num_blocks` KV blocks, identified by BlockId in [0, num_blocks). A block is
// either held (ref_count >= 1: it sits in some block tables) or free (ref_count == 0: it sits in
// the free queue). Nothing else: the KV data itself lives in the cache tensors that the kernels
// index with these ids.
//
// Free queue (after vLLM v1's FreeKVCacheBlockQueue, vllm/v1/core/kv_cache_utils.py): a doubly
// linked list kept in flat index arrays with one sentinel, so that
//   - allocate() pops the head (the least recently freed block) in O(1),
//   - a free block can be taken out of the MIDDLE in O(1) (incref() of a free block: a prefix-cache
//     hit on a block nobody holds),
//   - release() appends a block marked reusable (it holds prefix-cached content) at the tail, so
//     list order is LRU eviction order; an unmarked block goes to the head, so it is reused
//     before any cached block is evicted.
// Callers free a sequence's blocks tail-first (BlockTable::free), so the last blocks of a cached
// chain are evicted before its first ones. Eviction is lazy: a freed block keeps its cached
// content until allocate() hands it out again; then its reusable mark is cleared and the
// CacheHooks are told, so the cache drops the entry.
//
// Each block is one 16-byte node (ref count, links, reusable mark): an operation on a block
// touches one cache line. No operation allocates heap memory after construction. Invalid input
// (an id out of range, a release of a free block) throws pagedllm::InvalidArgument naming the
// value and changes nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedllm/errors.h"

namespace pagedllm {

/// Index of a physical KV block, in [0, num_blocks).
using BlockId = int32_t;

/// Returned by BlockPool::allocate when no block is free.
inline constexpr BlockId kNoBlock = -1;

class BlockPool {
 public:
  /// What a cache that keeps content in free blocks (the PrefixCache) is told.
  class CacheHooks {
   public:
    virtual ~CacheHooks() = default;
    /// A free block marked reusable is being handed out again: forget its content (lazy
    /// eviction). Called only for marked blocks.
    virtual void on_reuse(BlockId block) = 0;
  };

  /// num_blocks >= 1 (throws InvalidArgument naming the value otherwise). All blocks start free,
  /// in id order (block 0 is allocated first).
  explicit BlockPool(int32_t num_blocks);

  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  /// Install (or remove, with nullptr) the cache hooks. The pool does not own them.
  void set_cache_hooks(CacheHooks* hooks) { hooks_ = hooks; }

  int32_t num_blocks() const { return num_blocks_; }
  /// Length of the free queue (blocks with ref_count 0, cached ones included).
  int32_t num_free_blocks() const { return num_free_; }

  /// Pop the head of the free queue, set its ref_count to 1 and return it; kNoBlock when the
  /// pool is exhausted. O(1).
  BlockId allocate();

  /// ref_count + 1. A free block is first taken out of the free queue (O(1), from anywhere in it).
  void incref(BlockId block);

  /// ref_count - 1. At 0 the block joins the free queue: at the tail when it is marked reusable,
  /// else at the head. Throws InvalidArgument if the block is already free (double free). O(1).
  void release(BlockId block);

  /// Mark (or unmark) the block as holding reusable content (set by the PrefixCache on insert,
  /// cleared on evict). Only changes where release() queues it and whether allocate() calls the
  /// hooks; a block already in the free queue stays where it is.
  void set_reusable(BlockId block, bool reusable) {
    check_id(block);
    nodes_[block].reusable = reusable ? 1 : 0;
  }
  bool is_reusable(BlockId block) const {
    check_id(block);
    return nodes_[block].reusable != 0;
  }

  /// Reference count of `block` (0 = free). Throws InvalidArgument on an id out of range.
  int32_t ref_count(BlockId block) const {
    check_id(block);
    return nodes_[block].ref_count;
  }
  bool is_free(BlockId block) const { return ref_count(block) == 0; }

  /// The free queue from head (next to be allocated) to tail. O(num_free); for tests and tools.
  std::vector<BlockId> free_queue() const;

  /// Throws InvalidArgument naming `block` unless 0 <= block < num_blocks.
  void check_id(BlockId block) const {
    PAGEDLLM_CHECK(block >= 0 && block < num_blocks_, "block id ", block, " out of range [0, ",
                   num_blocks_, ")");
  }

 private:
  void unlink(BlockId block);
  void push_front(BlockId block);
  void push_back(BlockId block);

  // One 16-byte node per block (+ the sentinel): an operation on a block touches one cache line.
  struct alignas(16) Node {
    int32_t ref_count;
    int32_t prev;  // free-queue links; meaningful only while ref_count == 0
    int32_t next;
    int32_t reusable;  // 1 = holds prefix-cached content
  };

  int32_t num_blocks_;
  int32_t num_free_;
  int32_t sentinel_;         // == num_blocks_: index of the list's sentinel node
  std::vector<Node> nodes_;  // [num_blocks + 1]
  CacheHooks* hooks_ = nullptr;
};

}  // namespace pagedllm
