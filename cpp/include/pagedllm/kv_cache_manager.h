// pagedllm/kv_cache_manager.h — the paged KV-cache manager: per-sequence block tables over one
// block pool, with copy-on-write forking and automatic prefix caching.
//
// Sources: PagedAttention / vLLM (Kwon et al., SOSP 2023: paged KV blocks section 4.2,
// copy-on-write sharing section 4.4), vLLM v0's ref-counted fork, vLLM v1's hash-chained prefix
// cache and free-block queue (vllm/v1/core/kv_cache_manager.py, block_pool.py).
//
// Units: tokens and blocks; a KV slot is block_id * block_size + offset.
// The caller (the scheduler) names sequences with SeqIds unique among live sequences.
//
// Typical use for one request:
//   PrefixHit hit = kv.find_cached_prefix(prompt, salt);           // longest cached prefix
//   if (kv.allocate_slots(seq, prompt.size() - hit.num_tokens, &hit, &copies)) ... // schedule it
//   ... run the model, then  kv.cache_full_blocks(seq, all_tokens, num_computed, salt);
//   each decode step: kv.allocate_slots(seq, 1, nullptr, &copies);   finally kv.free(seq).
// A PrefixHit is valid until the next call that allocates blocks (allocate_slots, fork-then-CoW)
// or reset_prefix_cache(): use it in the allocate_slots call right after the lookup. If any
// prefix-cache entry was evicted after the lookup, the hit is rejected (InvalidArgument "stale
// prefix hit"), so a stale hit can never share blocks whose content has changed.
//
// Invariants (checked by the randomized tests): each block's ref count equals the number of block
// tables holding it; a block is in the free queue iff its ref count is 0; every copy order goes
// from a block still held by another table to one the writer alone holds; when every sequence is
// freed, every block is free.
//
// Errors: bad input throws pagedllm::InvalidArgument (Python ValueError) whose message names the
// value, and changes nothing: block size not a power of two in [8, 128], num_blocks < 1, unknown
// sequence (incl. double free), negative token counts, a position out of range, a hit for an
// existing sequence, a stale or malformed hit (uncached, repeated or out-of-range blocks, wrong
// num_tokens), a fork onto a live id. Running out of blocks is not an error:
// allocate_slots returns false.
//
// Not thread-safe: one thread (the scheduler's) drives a KVCacheManager.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "pagedllm/block_pool.h"
#include "pagedllm/block_table.h"
#include "pagedllm/prefix_cache.h"

namespace pagedllm {

/// A sequence id, chosen by the caller (the scheduler), unique among live sequences.
using SeqId = int64_t;

/// Result of a prefix-cache lookup: the cached full blocks, in order, that hold the first
/// num_tokens tokens of the query (num_tokens = blocks.size() * block_size).
struct PrefixHit {
  std::vector<BlockId> blocks;
  int32_t num_tokens = 0;
  /// Set by find_cached_prefix: the prefix cache's eviction count at lookup time. A non-empty hit
  /// whose count is not the current one is stale (allocate_slots/num_blocks_needed throw).
  uint64_t cache_epoch = 0;
};

/// Usage and prefix-cache counters (vLLM's kv_cache_usage_perc / prefix_cache_queries / hits).
struct KVCacheStats {
  int32_t num_blocks = 0;
  int32_t num_free_blocks = 0;    // free queue length incl. cached blocks nobody holds
  int32_t num_cached_blocks = 0;  // blocks that carry a prefix-cache hash
  double usage = 0.0;             // 1 - num_free_blocks / num_blocks (0 when idle)
  int64_t prefix_cache_queries = 0;  // in tokens
  int64_t prefix_cache_hits = 0;     // in tokens
};

class KVCacheManager {
 public:
  /// num_blocks >= 1; block_size a power of two in [8, 128]. Throws InvalidArgument otherwise.
  KVCacheManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching);
  ~KVCacheManager();
  KVCacheManager(const KVCacheManager&) = delete;
  KVCacheManager& operator=(const KVCacheManager&) = delete;

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return pool_.num_blocks(); }
  int32_t num_free_blocks() const { return pool_.num_free_blocks(); }
  bool prefix_caching_enabled() const { return prefix_cache_ != nullptr; }

  /// Longest cached prefix of full blocks of token_ids under extra_key (salt/adapter id; 0 =
  /// none). Never the whole sequence: at least one token is left to compute. When record_stats,
  /// adds token_ids.size() to queries and the hit tokens to hits. Changes nothing else. Empty when
  /// caching is off. Hashes the ids: O(token_ids.size()).
  PrefixHit find_cached_prefix(std::span<const int32_t> token_ids, uint64_t extra_key,
                               bool record_stats = true);
  /// Same, into *hit (reusing its capacity: no heap allocation once warm).
  void find_cached_prefix(std::span<const int32_t> token_ids, uint64_t extra_key, PrefixHit* hit,
                          bool record_stats = true);

  /// New blocks allocate_slots(seq, num_new_tokens, hit) would take from the free queue (hit
  /// blocks that sit in the free queue count too, copy-on-write included). An unknown seq counts
  /// as new. num_new_tokens >= 0.
  int32_t num_blocks_needed(SeqId seq, int32_t num_new_tokens, const PrefixHit* hit = nullptr) const;

  /// Reserve KV slots for num_new_tokens more tokens of seq. An unknown seq is created, starting
  /// with hit->blocks shared (ref + 1, taken out of the free queue in O(1)); a non-empty hit for
  /// a live seq throws. All-or-nothing: returns false and changes nothing when the pool cannot
  /// supply the blocks. If the last block is shared (ref > 1) and partly filled, copy-on-write: a
  /// new block is allocated and {old, new} appended to *copies (copies may be null only if the
  /// caller knows no CoW can happen; otherwise InvalidArgument is thrown and nothing changes).
  bool allocate_slots(SeqId seq, int32_t num_new_tokens, const PrefixHit* hit = nullptr,
                      std::vector<CopyOrder>* copies = nullptr);

  /// Physical block ids of seq, in logical order (valid until seq's table changes).
  std::span<const BlockId> block_ids(SeqId seq) const;
  /// Slots reserved so far for seq.
  int32_t num_tokens(SeqId seq) const;
  /// KV slot of token `position` of seq: block_ids[pos / bs] * bs + pos % bs
  /// (checked: 0 <= position < num_tokens(seq)).
  int64_t slot(SeqId seq, int32_t position) const;
  /// Slots of positions [start, start + out.size()) of seq into out (checked range).
  void slots(SeqId seq, int32_t start, std::span<int64_t> out) const;

  /// Give every full block among seq's first num_computed_tokens tokens its chained hash so later
  /// lookups can hit it. token_ids holds at least num_computed_tokens ids of this sequence (its
  /// whole token list so far); num_computed_tokens <= num_tokens(seq). Idempotent and incremental
  /// (keeps per-seq chain state: each block is hashed once). No-op when caching is off.
  void cache_full_blocks(SeqId seq, std::span<const int32_t> token_ids, int32_t num_computed_tokens,
                         uint64_t extra_key);

  /// child shares every block of parent (ref + 1) and its chain state; the first append of either
  /// into a shared partly filled block is copy-on-write. Throws if child is live or parent unknown.
  void fork(SeqId parent, SeqId child);
  /// child shares parent's first num_tokens slots: the blocks that hold them (ref + 1; a partly
  /// used last block is copied on the child's first append), no prefix-cache chain (the caller
  /// registers the child's full blocks again with cache_full_blocks: the same blocks, the same
  /// hashes). Throws if child is live, parent unknown or num_tokens outside [0, num_tokens(parent)].
  /// The child's partly used last block may be a full, cached block of the parent: the parent must
  /// keep holding it until the child's first append (then ref > 1 and the append copies it), as
  /// beam search's re-admission does (the leader lives until its group decodes).
  void fork_prefix(SeqId parent, SeqId child, int32_t num_tokens);

  /// Shrink seq's reservation to its first num_tokens slots, releasing the blocks past them (last
  /// first). Speculative decoding gives back the slots of rejected draft tokens this way. Throws
  /// InvalidArgument (nothing changed) on an unknown seq, num_tokens outside [0, num_tokens(seq)],
  /// or a cut into the blocks already registered in the prefix cache.
  void truncate(SeqId seq, int32_t num_tokens);

  /// Release seq's blocks, last block first (cached ones stay cached until reused: lazy
  /// eviction). Throws InvalidArgument on an unknown seq (incl. double free).
  void free(SeqId seq);

  bool contains(SeqId seq) const { return index_.find(seq) >= 0; }
  /// Number of live sequences.
  int32_t num_seqs() const { return index_.size(); }

  KVCacheStats stats() const;

  /// Drop the prefix-cache entry of every block nobody holds (blocks held by live sequences keep
  /// theirs). Counters are kept.
  void reset_prefix_cache();

  /// Read access for tests and tools.
  const BlockPool& pool() const { return pool_; }
  const PrefixCache* prefix_cache() const { return prefix_cache_.get(); }

 private:
  struct Sequence {
    explicit Sequence(int32_t block_size) : table(block_size) {}
    BlockTable table;
    int32_t num_hashed_blocks = 0;   // leading full blocks already given to the prefix cache
    ChainLink chain;                 // link after those blocks
  };

  // SeqId -> index into slots_: open addressing (linear probing, backward-shift deletion), at
  // most half full. It allocates only when it grows, i.e. when the number of live sequences
  // reaches a new high.
  class SeqIndex {
   public:
    SeqIndex();
    int32_t find(SeqId id) const;         // slot index, or -1
    void reserve(int32_t n);              // room for n entries (may throw bad_alloc)
    void insert(SeqId id, int32_t slot);  // id absent, room reserved: never throws
    void erase(SeqId id);                 // id present
    int32_t size() const { return size_; }

   private:
    uint64_t home(SeqId id) const;
    uint64_t mask_;
    int32_t size_ = 0;
    std::vector<SeqId> keys_;
    std::vector<int32_t> vals_;  // -1 = empty
  };

  const Sequence& get(SeqId seq) const;
  Sequence& get(SeqId seq);
  int32_t check_hit(const PrefixHit& hit) const;  // validates; returns hit blocks now free
  // Index of an empty Sequence for `seq`, registered in index_ (strong exception guarantee).
  int32_t new_sequence(SeqId seq);

  int32_t block_size_;
  BlockPool pool_;
  std::unique_ptr<PrefixCache> prefix_cache_;  // null when prefix caching is off
  // Sequences live in recycled slots: a freed slot keeps its block table's capacity, so once the
  // manager is warm, creating, growing, forking and freeing sequences allocate no heap memory.
  std::vector<Sequence> slots_;
  std::vector<int32_t> free_slots_;  // capacity kept >= slots_.size(): push_back never allocates
  SeqIndex index_;
  mutable std::vector<uint32_t> mark_;  // scratch for check_hit (epoch stamps per block)
  mutable uint32_t mark_epoch_ = 0;
  int64_t prefix_cache_queries_ = 0;
  int64_t prefix_cache_hits_ = 0;
};

}  // namespace pagedllm
