// PrefixCache: chained block hashes, verified lookups, lazy eviction (see pagedllm/prefix_cache.h).
#include "pagedllm/prefix_cache.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "pagedllm/block_table.h"  // check_block_size

namespace pagedllm {
namespace {

// wyhash's multiply-mix (Wang Yi, wyhash final version 4, public domain): the 128-bit product of
// a and b, folded to 64 bits.
inline uint64_t mum(uint64_t a, uint64_t b) {
  const __uint128_t r = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
}
inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
constexpr uint64_t kP0 = 0xa0761d6478bd642full;
constexpr uint64_t kP1 = 0xe7037ed1a0b428dbull;
constexpr uint64_t kP2 = 0x8ebc6af09c88c6e3ull;
constexpr uint64_t kP3 = 0x589965cc75374cc3ull;

}  // namespace

uint64_t PrefixCache::hash_block(uint64_t parent_hash, std::span<const int32_t> tokens,
                                 uint64_t extra_key) {
  const auto* p = reinterpret_cast<const unsigned char*>(tokens.data());
  const size_t len = tokens.size_bytes();
  uint64_t seed = mum(parent_hash ^ kP0, extra_key ^ kP1) ^ parent_hash;
  size_t i = 0;
  if (len >= 32) {  // two independent lanes, 32 bytes per round (as wyhash's wide loop)
    uint64_t seed2 = seed ^ kP3;
    for (; i + 32 <= len; i += 32) {
      seed = mum(load64(p + i) ^ kP1, load64(p + i + 8) ^ seed);
      seed2 = mum(load64(p + i + 16) ^ kP2, load64(p + i + 24) ^ seed2);
    }
    seed ^= seed2;
  }
  for (; i + 16 <= len; i += 16) seed = mum(load64(p + i) ^ kP1, load64(p + i + 8) ^ seed);
  if (i < len) {  // 4, 8 or 12 bytes left (token ids are 4 bytes)
    unsigned char tail[16] = {};
    std::memcpy(tail, p + i, len - i);
    seed = mum(load64(tail) ^ kP1, load64(tail + 8) ^ seed);
  }
  return mum(kP1 ^ static_cast<uint64_t>(len), mum(seed ^ kP2, kP3));
}

PrefixCache::PrefixCache(int32_t num_blocks, int32_t block_size, BlockPool* pool)
    : num_blocks_(num_blocks), block_size_(block_size), pool_(pool) {
  PAGEDLLM_CHECK(num_blocks >= 1, "num_blocks must be >= 1, got ", num_blocks);
  check_block_size(block_size);
  PAGEDLLM_CHECK(pool == nullptr || pool->num_blocks() == num_blocks, "prefix cache for ",
                 num_blocks, " blocks attached to a pool of ", pool ? pool->num_blocks() : 0);
  cached_.assign(num_blocks, 0);
  generation_.assign(num_blocks, 0);
  hash_.assign(num_blocks, 0);
  extra_key_.assign(num_blocks, 0);
  parent_.assign(num_blocks, ChainLink{});
  tokens_.assign(static_cast<size_t>(num_blocks) * block_size, 0);
  const uint64_t capacity = std::bit_ceil(std::max<uint64_t>(16, 2 * static_cast<uint64_t>(num_blocks)));
  table_mask_ = capacity - 1;
  table_hash_.assign(capacity, 0);
  table_block_.assign(capacity, kNoBlock);
  if (pool_ != nullptr) pool_->set_cache_hooks(this);
}

PrefixCache::~PrefixCache() {
  if (pool_ == nullptr) return;
  pool_->set_cache_hooks(nullptr);
  for (BlockId b = 0; b < num_blocks_; ++b) {
    if (cached_[b]) pool_->set_reusable(b, false);
  }
}

// ------------------------------------------------------------------ open-addressing table
int64_t PrefixCache::find_slot(uint64_t hash) const {
  for (uint64_t i = hash & table_mask_;; i = (i + 1) & table_mask_) {
    if (table_block_[i] == kNoBlock) return -1;
    if (table_hash_[i] == hash) return static_cast<int64_t>(i);
  }
}

void PrefixCache::table_insert(uint64_t hash, BlockId block) {
  uint64_t i = hash & table_mask_;
  while (table_block_[i] != kNoBlock) i = (i + 1) & table_mask_;
  table_hash_[i] = hash;
  table_block_[i] = block;
}

void PrefixCache::table_erase(uint64_t hash) {
  const int64_t found = find_slot(hash);
  if (found < 0) return;
  // Backward-shift deletion (Knuth, TAOCP vol. 3, 6.4 algorithm R): pull later entries of the
  // probe run into the hole unless their home slot lies cyclically in (hole, j].
  uint64_t hole = static_cast<uint64_t>(found);
  for (uint64_t j = (hole + 1) & table_mask_; table_block_[j] != kNoBlock; j = (j + 1) & table_mask_) {
    const uint64_t home = table_hash_[j] & table_mask_;
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!stays) {
      table_hash_[hole] = table_hash_[j];
      table_block_[hole] = table_block_[j];
      hole = j;
    }
  }
  table_block_[hole] = kNoBlock;
}

// ------------------------------------------------------------------ entries
bool PrefixCache::is_cached(BlockId block) const {
  PAGEDLLM_CHECK(block >= 0 && block < num_blocks_, "block id ", block, " out of range [0, ",
                 num_blocks_, ")");
  return cached_[block] != 0;
}

ChainLink PrefixCache::link(BlockId block) const {
  PAGEDLLM_CHECK(is_cached(block), "block ", block, " has no prefix-cache entry");
  return {hash_[block], block, generation_[block]};
}

bool PrefixCache::link_is_live(const ChainLink& link) const {
  if (link.block == kNoBlock) return link.generation == 0;  // root is live, dead is not
  return cached_[link.block] != 0 && generation_[link.block] == link.generation;
}

bool PrefixCache::entry_matches(BlockId block, const ChainLink& parent,
                                std::span<const int32_t> tokens, uint64_t extra_key) const {
  const ChainLink& p = parent_[block];
  return cached_[block] != 0 && extra_key_[block] == extra_key && p.block == parent.block &&
         p.generation == parent.generation &&
         std::memcmp(&tokens_[static_cast<size_t>(block) * block_size_], tokens.data(),
                     static_cast<size_t>(block_size_) * sizeof(int32_t)) == 0;
}

BlockId PrefixCache::lookup(const ChainLink& parent, uint64_t hash, std::span<const int32_t> tokens,
                            uint64_t extra_key) const {
  PAGEDLLM_CHECK(static_cast<int32_t>(tokens.size()) == block_size_, "a block holds ", block_size_,
                 " tokens, got ", tokens.size());
  const int64_t slot = find_slot(hash);
  if (slot < 0) return kNoBlock;
  const BlockId block = table_block_[slot];
  return entry_matches(block, parent, tokens, extra_key) ? block : kNoBlock;
}

ChainLink PrefixCache::match_prefix(std::span<const int32_t> tokens, uint64_t extra_key,
                                    int32_t max_blocks, std::vector<BlockId>* out) const {
  out->clear();
  ChainLink link = ChainLink::root();
  const int64_t n = std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / block_size_);
  for (int64_t i = 0; i < n; ++i) {
    const auto block_tokens = tokens.subspan(static_cast<size_t>(i) * block_size_, block_size_);
    const uint64_t h = hash_block(link.hash, block_tokens, extra_key);
    const BlockId b = lookup(link, h, block_tokens, extra_key);
    if (b == kNoBlock) break;
    out->push_back(b);
    link = {h, b, generation_[b]};
  }
  return link;
}

ChainLink PrefixCache::insert(BlockId block, const ChainLink& parent, uint64_t hash,
                              std::span<const int32_t> tokens, uint64_t extra_key) {
  PAGEDLLM_CHECK(block >= 0 && block < num_blocks_, "block id ", block, " out of range [0, ",
                 num_blocks_, ")");
  PAGEDLLM_CHECK(static_cast<int32_t>(tokens.size()) == block_size_, "a block holds ", block_size_,
                 " tokens, got ", tokens.size());
  if (cached_[block]) {
    if (hash_[block] == hash && entry_matches(block, parent, tokens, extra_key)) return link(block);
    return ChainLink::dead(hash);  // the block already caches other content
  }
  if (!link_is_live(parent)) return ChainLink::dead(hash);  // unreachable: do not store
  const int64_t slot = find_slot(hash);
  if (slot >= 0) {
    const BlockId other = table_block_[slot];
    if (entry_matches(other, parent, tokens, extra_key)) return link(other);  // duplicate content
    if (link_is_live(parent_[other])) return ChainLink::dead(hash);         // 64-bit collision
    evict(other);  // stale: its parent entry is gone, so no lookup can reach it
  }
  cached_[block] = 1;
  ++generation_[block];
  hash_[block] = hash;
  extra_key_[block] = extra_key;
  parent_[block] = parent;
  std::memcpy(&tokens_[static_cast<size_t>(block) * block_size_], tokens.data(),
              static_cast<size_t>(block_size_) * sizeof(int32_t));
  table_insert(hash, block);
  ++num_cached_;
  if (pool_ != nullptr) pool_->set_reusable(block, true);
  return {hash, block, generation_[block]};
}

void PrefixCache::evict(BlockId block) {
  if (!is_cached(block)) return;
  const int64_t slot = find_slot(hash_[block]);
  if (slot >= 0 && table_block_[slot] == block) table_erase(hash_[block]);
  cached_[block] = 0;
  ++generation_[block];
  --num_cached_;
  ++num_evictions_;
  if (pool_ != nullptr) pool_->set_reusable(block, false);
}

}  // namespace pagedllm
