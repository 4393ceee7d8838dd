// pagedllm/prefix_cache.h — automatic prefix caching: full KV blocks keyed by a chained hash.
//
// A full block i of a sequence is identified by its whole token prefix. As in vLLM v1's automatic
// prefix caching (vllm/v1/core/kv_cache_utils.py, hash_block_tokens) the key is a chained hash
//     hash_i = H(hash_{i-1}, token ids of block i, extra_key),   hash_{-1} = kRootHash,
// where extra_key carries what else changes the KV content (cache salt, LoRA adapter id; 0 =
// none). H is a 64-bit wyhash-style multiply-mix over the token ids (hash_block()).
//
// How collisions are ruled out: the hash only narrows the search, it never decides a hit. Each
// cached block stores its token ids, its extra_key and a link to its parent entry (parent block
// id + that block's cache generation; the generation changes whenever a block's entry is created
// or dropped, so a link names one entry's lifetime, never a later reuse of the block). lookup()
// walks a prefix from the root and accepts block i only if its stored tokens and extra_key are
// equal to the query's AND its parent link is exactly the entry accepted for block i-1. By
// induction an accepted chain holds exactly the queried token prefix, whatever the hash values:
// two different prefixes with the same 64-bit hash cost at most a miss (the table keeps one
// entry per hash value), never a wrong hit.
//
// The PrefixCache keeps no reference counts: the KVCacheManager shares hit blocks through the
// BlockPool. When attached to the pool, the cache marks its blocks reusable in the pool (so freed
// cached blocks join the LRU tail), and the pool tells it (BlockPool::CacheHooks) when a free
// cached block is reused, which drops its entry (lazy eviction). Lookup and insert allocate no heap memory: the
// entries, their token ids and an open-addressing hash table (linear probing, backward-shift
// deletion, at most half full) are flat arrays sized at construction: 4 * block_size + 73 to 97
// bytes per block (the table is 2 to 4 slots per block): 14 to 16 MB for 100,000 blocks of 16.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "pagedllm/block_pool.h"

namespace pagedllm {

/// Chain hash of the (empty) prefix before block 0.
inline constexpr uint64_t kRootHash = 0x9e3779b97f4a7c15ull;

/// Where a chain stands after some full blocks: the last block's chained hash and the cache entry
/// its successor must name as parent. root() before block 0; dead() when the last block could not
/// be cached (its successors are then stored but unreachable, which is harmless).
struct ChainLink {
  uint64_t hash = kRootHash;
  BlockId block = kNoBlock;     // the parent entry's block; kNoBlock for root and dead
  uint64_t generation = 0;      // that entry's generation; kDeadGeneration for dead
  static constexpr uint64_t kDeadGeneration = ~uint64_t{0};
  static ChainLink root() { return {}; }
  static ChainLink dead(uint64_t hash) { return {hash, kNoBlock, kDeadGeneration}; }
  bool operator==(const ChainLink&) const = default;
};

class PrefixCache : public BlockPool::CacheHooks {
 public:
  /// A cache for the blocks [0, num_blocks) of one pool, each of block_size tokens (checked:
  /// num_blocks >= 1, block_size a power of two in [8, 128]). With a pool (same num_blocks,
  /// checked), the cache attaches itself: it installs its hooks and keeps the pool's reusable
  /// marks; it must then outlive its attachment (the destructor detaches).
  PrefixCache(int32_t num_blocks, int32_t block_size, BlockPool* pool = nullptr);
  ~PrefixCache() override;
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  int32_t block_size() const { return block_size_; }

  /// H(parent_hash, tokens, extra_key): 64-bit, seeded, order-sensitive. tokens may have any
  /// length (normally block_size).
  static uint64_t hash_block(uint64_t parent_hash, std::span<const int32_t> tokens, uint64_t extra_key);

  /// The cached block that follows `parent` with exactly these block_size tokens and extra_key,
  /// or kNoBlock. `hash` must be hash_block(parent.hash, tokens, extra_key).
  BlockId lookup(const ChainLink& parent, uint64_t hash, std::span<const int32_t> tokens,
                 uint64_t extra_key) const;

  /// Longest cached chain for the full blocks of `tokens` (at most max_blocks of them): appends
  /// the block ids to *out (cleared first) and returns the link after the last hit block.
  ChainLink match_prefix(std::span<const int32_t> tokens, uint64_t extra_key, int32_t max_blocks,
                         std::vector<BlockId>* out) const;

  /// Record that `block` holds the full block that follows `parent` with these tokens and
  /// extra_key (hash = hash_block(parent.hash, tokens, extra_key); tokens.size() == block_size).
  /// Returns the link successors must use:
  ///   - the block's own entry when it was inserted (or already held exactly this entry),
  ///   - the existing entry when another block already caches the same content (a duplicate:
  ///     this block stays uncached),
  ///   - ChainLink::dead(hash) when the content cannot be cached (a different live entry owns the
  ///     hash value — a true 64-bit collision — or the block holds another entry).
  /// An existing entry whose parent link is stale (its parent was evicted) is replaced.
  ChainLink insert(BlockId block, const ChainLink& parent, uint64_t hash,
                   std::span<const int32_t> tokens, uint64_t extra_key);

  /// Drop the block's entry, if it has one.
  void evict(BlockId block);

  bool is_cached(BlockId block) const;
  /// Link naming the block's current entry (requires is_cached(block), else InvalidArgument).
  ChainLink link(BlockId block) const;
  /// Number of blocks that carry an entry.
  int32_t num_cached_blocks() const { return num_cached_; }
  /// Entries dropped so far (evict(), reuse of a free cached block, replaced stale entries):
  /// lookups made before the last eviction may name blocks that no longer hold their content.
  uint64_t num_evictions() const { return num_evictions_; }

  // BlockPool::CacheHooks
  void on_reuse(BlockId block) override { evict(block); }

 private:
  bool link_is_live(const ChainLink& link) const;
  bool entry_matches(BlockId block, const ChainLink& parent, std::span<const int32_t> tokens,
                     uint64_t extra_key) const;
  int64_t find_slot(uint64_t hash) const;  // table index holding hash, or -1
  void table_insert(uint64_t hash, BlockId block);
  void table_erase(uint64_t hash);

  int32_t num_blocks_;
  int32_t block_size_;
  BlockPool* pool_;  // attached pool, or null
  int32_t num_cached_ = 0;
  uint64_t num_evictions_ = 0;
  // Per-block entry, valid while cached_[b].
  std::vector<uint8_t> cached_;
  std::vector<uint64_t> generation_;  // +1 on every insert and evict (64 bits: never wraps)
  std::vector<uint64_t> hash_;
  std::vector<uint64_t> extra_key_;
  std::vector<ChainLink> parent_;
  std::vector<int32_t> tokens_;  // [num_blocks * block_size]
  // Open addressing: hash -> block; table_block_[i] == kNoBlock marks an empty slot.
  uint64_t table_mask_;
  std::vector<uint64_t> table_hash_;
  std::vector<BlockId> table_block_;
};

}  // namespace pagedllm
