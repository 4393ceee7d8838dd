// KVCacheManager: sequences' block tables over one pool + prefix cache (see kv_cache_manager.h).
#include "pagedllm/kv_cache_manager.h"

#include <algorithm>
#include <utility>

namespace pagedllm {

KVCacheManager::KVCacheManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
    : block_size_((check_block_size(block_size), block_size)), pool_(num_blocks) {
  if (enable_prefix_caching) {
    prefix_cache_ = std::make_unique<PrefixCache>(num_blocks, block_size, &pool_);
  }
  mark_.assign(num_blocks, 0);
}

KVCacheManager::~KVCacheManager() = default;  // prefix_cache_ (declared after pool_) detaches first

// ------------------------------------------------------------------ sequence index
KVCacheManager::SeqIndex::SeqIndex() : mask_(15), keys_(16, 0), vals_(16, -1) {}

uint64_t KVCacheManager::SeqIndex::home(SeqId id) const {
  uint64_t x = static_cast<uint64_t>(id) + 0x9e3779b97f4a7c15ull;  // splitmix64 finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return (x ^ (x >> 31)) & mask_;
}

int32_t KVCacheManager::SeqIndex::find(SeqId id) const {
  for (uint64_t i = home(id);; i = (i + 1) & mask_) {
    if (vals_[i] < 0) return -1;
    if (keys_[i] == id) return vals_[i];
  }
}

void KVCacheManager::SeqIndex::reserve(int32_t n) {
  if (static_cast<uint64_t>(n) * 2 <= mask_ + 1) return;
  uint64_t capacity = mask_ + 1;
  while (static_cast<uint64_t>(n) * 2 > capacity) capacity *= 2;
  std::vector<SeqId> old_keys(capacity, 0);
  std::vector<int32_t> old_vals(capacity, -1);
  old_keys.swap(keys_);
  old_vals.swap(vals_);
  mask_ = capacity - 1;
  size_ = 0;
  for (size_t i = 0; i < old_vals.size(); ++i) {
    if (old_vals[i] >= 0) insert(old_keys[i], old_vals[i]);
  }
}

void KVCacheManager::SeqIndex::insert(SeqId id, int32_t slot) {
  uint64_t i = home(id);
  while (vals_[i] >= 0) i = (i + 1) & mask_;
  keys_[i] = id;
  vals_[i] = slot;
  ++size_;
}

void KVCacheManager::SeqIndex::erase(SeqId id) {
  uint64_t hole = home(id);
  while (keys_[hole] != id || vals_[hole] < 0) hole = (hole + 1) & mask_;
  // Backward-shift deletion, as in PrefixCache::table_erase.
  for (uint64_t j = (hole + 1) & mask_; vals_[j] >= 0; j = (j + 1) & mask_) {
    const uint64_t h = home(keys_[j]);
    const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
    if (!stays) {
      keys_[hole] = keys_[j];
      vals_[hole] = vals_[j];
      hole = j;
    }
  }
  vals_[hole] = -1;
  --size_;
}

// ------------------------------------------------------------------ sequences
const KVCacheManager::Sequence& KVCacheManager::get(SeqId seq) const {
  const int32_t slot = index_.find(seq);
  PAGEDLLM_CHECK(slot >= 0, "unknown sequence id ", seq, " (never allocated, or already freed)");
  return slots_[slot];
}

KVCacheManager::Sequence& KVCacheManager::get(SeqId seq) {
  return const_cast<Sequence&>(std::as_const(*this).get(seq));
}

int32_t KVCacheManager::new_sequence(SeqId seq) {
  index_.reserve(index_.size() + 1);  // may throw: nothing changed yet
  if (free_slots_.empty()) {
    slots_.emplace_back(block_size_);  // may throw: nothing changed yet
    try {
      free_slots_.reserve(slots_.capacity());
    } catch (...) {
      slots_.pop_back();
      throw;
    }
    free_slots_.push_back(static_cast<int32_t>(slots_.size()) - 1);
  }
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  index_.insert(seq, slot);
  return slot;
}

// ------------------------------------------------------------------ prefix lookup
void KVCacheManager::find_cached_prefix(std::span<const int32_t> token_ids, uint64_t extra_key,
                                        PrefixHit* hit, bool record_stats) {
  hit->blocks.clear();
  hit->num_tokens = 0;
  hit->cache_epoch = 0;
  if (!prefix_cache_) return;
  hit->cache_epoch = prefix_cache_->num_evictions();
  // Leave at least one token to compute: the model must produce logits for the last one.
  const int64_t n = static_cast<int64_t>(token_ids.size());
  const int32_t max_blocks = n > 0 ? static_cast<int32_t>((n - 1) / block_size_) : 0;
  prefix_cache_->match_prefix(token_ids, extra_key, max_blocks, &hit->blocks);
  hit->num_tokens = static_cast<int32_t>(hit->blocks.size()) * block_size_;
  if (record_stats) {
    prefix_cache_queries_ += n;
    prefix_cache_hits_ += hit->num_tokens;
  }
}

PrefixHit KVCacheManager::find_cached_prefix(std::span<const int32_t> token_ids, uint64_t extra_key,
                                             bool record_stats) {
  PrefixHit hit;
  find_cached_prefix(token_ids, extra_key, &hit, record_stats);
  return hit;
}

int32_t KVCacheManager::check_hit(const PrefixHit& hit) const {
  const int64_t n = static_cast<int64_t>(hit.blocks.size());
  PAGEDLLM_CHECK(static_cast<int64_t>(hit.num_tokens) == n * block_size_, "prefix hit num_tokens ",
                 hit.num_tokens, " != blocks (", n, ") * block_size (", block_size_, ")");
  if (n == 0) return 0;
  PAGEDLLM_CHECK(prefix_cache_ != nullptr, "a prefix hit of ", n,
                 " blocks was given but prefix caching is off");
  PAGEDLLM_CHECK(hit.cache_epoch == prefix_cache_->num_evictions(),
                 "stale prefix hit: taken at cache epoch ", hit.cache_epoch, ", now ",
                 prefix_cache_->num_evictions(),
                 " (blocks were evicted since; look the prefix up again right before allocate_slots)");
  if (++mark_epoch_ == 0) {  // epoch wrapped: clear the stamps
    std::fill(mark_.begin(), mark_.end(), 0);
    mark_epoch_ = 1;
  }
  int32_t num_free = 0;
  for (BlockId b : hit.blocks) {
    pool_.check_id(b);
    PAGEDLLM_CHECK(mark_[b] != mark_epoch_, "block ", b, " appears twice in the prefix hit");
    mark_[b] = mark_epoch_;
    PAGEDLLM_CHECK(prefix_cache_->is_cached(b), "prefix-hit block ", b,
                   " is no longer cached (a hit is valid only until the next allocation)");
    if (pool_.ref_count(b) == 0) ++num_free;
  }
  return num_free;
}

// ------------------------------------------------------------------ allocation
int32_t KVCacheManager::num_blocks_needed(SeqId seq, int32_t num_new_tokens, const PrefixHit* hit) const {
  PAGEDLLM_CHECK(num_new_tokens >= 0, "num_new_tokens must be >= 0, got ", num_new_tokens);
  const int32_t slot = index_.find(seq);
  if (slot >= 0) {
    PAGEDLLM_CHECK(hit == nullptr || hit->blocks.empty(), "a prefix hit was given for sequence ",
                   seq, ", which already exists (hits apply to new sequences only)");
    return slots_[slot].table.num_blocks_needed(pool_, num_new_tokens);
  }
  const int32_t free_hit_blocks = hit != nullptr ? check_hit(*hit) : 0;
  const int64_t hit_blocks = hit != nullptr ? static_cast<int64_t>(hit->blocks.size()) : 0;
  const int64_t total = hit_blocks * block_size_ + num_new_tokens;
  PAGEDLLM_CHECK(total <= INT32_MAX, "sequence ", seq, " would hold ", total, " tokens");
  const int64_t new_blocks = (total + block_size_ - 1) / block_size_ - hit_blocks;
  return free_hit_blocks + static_cast<int32_t>(new_blocks);
}

bool KVCacheManager::allocate_slots(SeqId seq, int32_t num_new_tokens, const PrefixHit* hit,
                                    std::vector<CopyOrder>* copies) {
  const int32_t existing = index_.find(seq);
  if (existing >= 0) {
    PAGEDLLM_CHECK(hit == nullptr || hit->blocks.empty(), "a prefix hit was given for sequence ",
                   seq, ", which already exists (hits apply to new sequences only)");
    return slots_[existing].table.append_slots(pool_, num_new_tokens, copies);
  }
  // A new sequence: validate everything, then commit (no step below can fail half-way).
  const int32_t needed = num_blocks_needed(seq, num_new_tokens, hit);
  if (needed > pool_.num_free_blocks()) return false;
  const bool has_hit = hit != nullptr && !hit->blocks.empty();
  const size_t total_blocks =
      (static_cast<size_t>(has_hit ? hit->num_tokens : 0) + num_new_tokens + block_size_ - 1) / block_size_;
  const int32_t slot = new_sequence(seq);
  Sequence& s = slots_[slot];
  try {
    s.table.reserve(total_blocks);
  } catch (...) {
    index_.erase(seq);
    free_slots_.push_back(slot);
    throw;
  }
  if (has_hit) {
    s.table.share_full_blocks(pool_, hit->blocks);
    s.num_hashed_blocks = static_cast<int32_t>(hit->blocks.size());
    s.chain = prefix_cache_->link(hit->blocks.back());
  }
  s.table.append_slots(pool_, num_new_tokens, copies);  // cannot fail: blocks counted, no CoW
  return true;
}

// ------------------------------------------------------------------ queries
std::span<const BlockId> KVCacheManager::block_ids(SeqId seq) const { return get(seq).table.block_ids(); }

int32_t KVCacheManager::num_tokens(SeqId seq) const { return get(seq).table.num_tokens(); }

int64_t KVCacheManager::slot(SeqId seq, int32_t position) const { return get(seq).table.slot(position); }

void KVCacheManager::slots(SeqId seq, int32_t start, std::span<int64_t> out) const {
  const BlockTable& t = get(seq).table;
  const int64_t end = static_cast<int64_t>(start) + static_cast<int64_t>(out.size());
  PAGEDLLM_CHECK(start >= 0 && end <= t.num_tokens(), "positions [", start, ", ", end,
                 ") out of range [0, ", t.num_tokens(), ") of sequence ", seq);
  const auto blocks = t.block_ids();
  for (size_t i = 0; i < out.size(); ++i) {
    const int32_t pos = start + static_cast<int32_t>(i);
    out[i] = static_cast<int64_t>(blocks[pos / block_size_]) * block_size_ + pos % block_size_;
  }
}

KVCacheStats KVCacheManager::stats() const {
  KVCacheStats s;
  s.num_blocks = pool_.num_blocks();
  s.num_free_blocks = pool_.num_free_blocks();
  s.num_cached_blocks = prefix_cache_ ? prefix_cache_->num_cached_blocks() : 0;
  s.usage = 1.0 - static_cast<double>(s.num_free_blocks) / s.num_blocks;
  s.prefix_cache_queries = prefix_cache_queries_;
  s.prefix_cache_hits = prefix_cache_hits_;
  return s;
}

// ------------------------------------------------------------------ prefix caching
void KVCacheManager::cache_full_blocks(SeqId seq, std::span<const int32_t> token_ids,
                                       int32_t num_computed_tokens, uint64_t extra_key) {
  Sequence& s = get(seq);
  PAGEDLLM_CHECK(num_computed_tokens >= 0 && num_computed_tokens <= s.table.num_tokens(),
                 "num_computed_tokens ", num_computed_tokens, " out of range [0, ",
                 s.table.num_tokens(), "] for sequence ", seq);
  PAGEDLLM_CHECK(static_cast<int64_t>(token_ids.size()) >= num_computed_tokens, "token_ids holds ",
                 token_ids.size(), " ids, fewer than num_computed_tokens ", num_computed_tokens);
  if (!prefix_cache_) return;
  const int32_t num_full = num_computed_tokens / block_size_;
  const auto blocks = s.table.block_ids();
  for (int32_t i = s.num_hashed_blocks; i < num_full; ++i) {
    const auto block_tokens = token_ids.subspan(static_cast<size_t>(i) * block_size_, block_size_);
    const uint64_t h = PrefixCache::hash_block(s.chain.hash, block_tokens, extra_key);
    s.chain = prefix_cache_->insert(blocks[i], s.chain, h, block_tokens, extra_key);
  }
  s.num_hashed_blocks = std::max(s.num_hashed_blocks, num_full);
}

void KVCacheManager::reset_prefix_cache() {
  if (!prefix_cache_) return;
  for (BlockId b = 0; b < pool_.num_blocks(); ++b) {
    if (pool_.ref_count(b) == 0) prefix_cache_->evict(b);
  }
}

// ------------------------------------------------------------------ fork / free
void KVCacheManager::fork(SeqId parent, SeqId child) {
  PAGEDLLM_CHECK(!contains(child), "fork: child sequence id ", child, " is already live");
  (void)get(parent);  // throws on an unknown parent before anything changes
  const int32_t child_slot = new_sequence(child);  // may grow slots_: look the parent up after
  const Sequence& p = slots_[index_.find(parent)];
  Sequence& c = slots_[child_slot];
  try {
    p.table.fork_into(pool_, &c.table);
  } catch (...) {
    index_.erase(child);
    free_slots_.push_back(child_slot);
    throw;
  }
  c.num_hashed_blocks = p.num_hashed_blocks;
  c.chain = p.chain;
}

void KVCacheManager::fork_prefix(SeqId parent, SeqId child, int32_t num_tokens) {
  const int32_t parent_tokens = get(parent).table.num_tokens();
  PAGEDLLM_CHECK(num_tokens >= 0 && num_tokens <= parent_tokens, "fork_prefix: num_tokens ", num_tokens,
                 " outside [0, ", parent_tokens, "] of sequence ", parent);
  fork(parent, child);
  Sequence& c = get(child);
  c.num_hashed_blocks = 0;
  c.chain = ChainLink::root();
  c.table.truncate(pool_, num_tokens);
}

void KVCacheManager::truncate(SeqId seq, int32_t num_tokens) {
  Sequence& s = get(seq);
  PAGEDLLM_CHECK(num_tokens >= static_cast<int64_t>(s.num_hashed_blocks) * block_size_,
                 "truncate: sequence ", seq, " has ", s.num_hashed_blocks,
                 " blocks in the prefix cache; cannot keep only ", num_tokens, " tokens");
  s.table.truncate(pool_, num_tokens);
}

void KVCacheManager::free(SeqId seq) {
  const int32_t slot = index_.find(seq);
  PAGEDLLM_CHECK(slot >= 0, "free: unknown sequence id ", seq,
                 " (never allocated, or already freed: double free)");
  Sequence& s = slots_[slot];
  s.table.free(pool_);
  s.num_hashed_blocks = 0;
  s.chain = ChainLink::root();
  index_.erase(seq);
  free_slots_.push_back(slot);
}

}  // namespace pagedllm
