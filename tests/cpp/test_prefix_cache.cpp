// PrefixCache: chained hash, verified lookups (collisions only miss), duplicates, stale entries.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "pagedllm/prefix_cache.h"

using namespace pagedllm;

namespace {
std::vector<int32_t> iota_tokens(int n, int start) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}
std::span<const int32_t> block(const std::vector<int32_t>& t, int i, int bs) {
  return std::span<const int32_t>(t).subspan(static_cast<size_t>(i) * bs, bs);
}
}  // namespace

TEST(PrefixCache, HashIsDeterministicAndSensitiveToEveryInput) {
  auto t = iota_tokens(16, 100);
  const uint64_t h = PrefixCache::hash_block(kRootHash, t, 0);
  EXPECT_EQ(h, PrefixCache::hash_block(kRootHash, t, 0));
  EXPECT_NE(h, PrefixCache::hash_block(kRootHash + 1, t, 0));
  EXPECT_NE(h, PrefixCache::hash_block(kRootHash, t, 1));
  auto swapped = t;
  std::swap(swapped[3], swapped[4]);
  EXPECT_NE(h, PrefixCache::hash_block(kRootHash, swapped, 0));
  auto last = t;
  last.back() ^= 1;
  EXPECT_NE(h, PrefixCache::hash_block(kRootHash, last, 0));
  // Every single-token change of many random blocks gives a new value (no trivial collisions).
  std::mt19937 rng(7);
  std::set<uint64_t> seen;
  for (int i = 0; i < 20000; ++i) {
    std::vector<int32_t> v(16);
    for (auto& x : v) x = static_cast<int32_t>(rng() % 50000);
    seen.insert(PrefixCache::hash_block(kRootHash, v, 0));
  }
  EXPECT_EQ(seen.size(), 20000u);
}

TEST(PrefixCache, InsertThenMatchTheLongestChain) {
  constexpr int bs = 8;
  PrefixCache cache(16, bs);
  auto t = iota_tokens(4 * bs, 1);
  ChainLink link = ChainLink::root();
  for (int i = 0; i < 3; ++i) {  // cache blocks 0..2 in pool blocks 10, 11, 12
    const uint64_t h = PrefixCache::hash_block(link.hash, block(t, i, bs), 0);
    link = cache.insert(10 + i, link, h, block(t, i, bs), 0);
    EXPECT_EQ(link.block, 10 + i);
  }
  EXPECT_EQ(cache.num_cached_blocks(), 3);
  std::vector<BlockId> out;
  ChainLink end = cache.match_prefix(t, 0, 100, &out);
  EXPECT_EQ(out, (std::vector<BlockId>{10, 11, 12}));
  EXPECT_EQ(end, cache.link(12));
  cache.match_prefix(t, 0, 2, &out);  // max_blocks caps
  EXPECT_EQ(out, (std::vector<BlockId>{10, 11}));
  cache.match_prefix(t, 5, 100, &out);  // another extra key: no hit
  EXPECT_TRUE(out.empty());
  auto diverged = t;
  diverged[bs + 3] = -7;  // differs inside block 1
  cache.match_prefix(diverged, 0, 100, &out);
  EXPECT_EQ(out, (std::vector<BlockId>{10}));
  // Evicting the middle block cuts the chain there and makes block 12 unreachable.
  cache.evict(11);
  EXPECT_FALSE(cache.is_cached(11));
  cache.match_prefix(t, 0, 100, &out);
  EXPECT_EQ(out, (std::vector<BlockId>{10}));
  EXPECT_EQ(cache.num_cached_blocks(), 2);
}

TEST(PrefixCache, ForcedHashCollisionOnlyMisses) {
  constexpr int bs = 8;
  PrefixCache cache(8, bs);
  auto a = iota_tokens(bs, 1), b = iota_tokens(bs, 500);
  const uint64_t fake = 42;  // both contents claim the same hash value
  ChainLink la = cache.insert(0, ChainLink::root(), fake, a, 0);
  EXPECT_EQ(la.block, 0);
  // Same hash, other tokens: never a hit for b.
  EXPECT_EQ(cache.lookup(ChainLink::root(), fake, b, 0), kNoBlock);
  EXPECT_EQ(cache.lookup(ChainLink::root(), fake, a, 0), 0);
  // Inserting b under the colliding hash cannot cache it: a dead link comes back.
  ChainLink lb = cache.insert(1, ChainLink::root(), fake, b, 0);
  EXPECT_EQ(lb, ChainLink::dead(fake));
  EXPECT_FALSE(cache.is_cached(1));
  // Same tokens, same hash, but another parent entry: also a miss.
  ChainLink other_parent{7, 3, 1};
  EXPECT_EQ(cache.lookup(other_parent, fake, a, 0), kNoBlock);
  // Same tokens and parent, other extra key: a miss.
  EXPECT_EQ(cache.lookup(ChainLink::root(), fake, a, 9), kNoBlock);
}

TEST(PrefixCache, DuplicateContentReturnsTheExistingEntry) {
  constexpr int bs = 8;
  PrefixCache cache(8, bs);
  auto t = iota_tokens(bs, 3);
  const uint64_t h = PrefixCache::hash_block(kRootHash, t, 0);
  ChainLink first = cache.insert(2, ChainLink::root(), h, t, 0);
  ChainLink dup = cache.insert(5, ChainLink::root(), h, t, 0);
  EXPECT_EQ(dup, first);
  EXPECT_FALSE(cache.is_cached(5));
  // Idempotent on the same block.
  EXPECT_EQ(cache.insert(2, ChainLink::root(), h, t, 0), first);
  EXPECT_EQ(cache.num_cached_blocks(), 1);
}

TEST(PrefixCache, StaleEntriesAreReplacedAndGenerationsNeverRepeat) {
  constexpr int bs = 8;
  PrefixCache cache(8, bs);
  auto t = iota_tokens(2 * bs, 1);
  const uint64_t h0 = PrefixCache::hash_block(kRootHash, block(t, 0, bs), 0);
  ChainLink l0 = cache.insert(0, ChainLink::root(), h0, block(t, 0, bs), 0);
  const uint64_t h1 = PrefixCache::hash_block(h0, block(t, 1, bs), 0);
  ChainLink l1 = cache.insert(1, l0, h1, block(t, 1, bs), 0);
  EXPECT_EQ(l1.block, 1);
  // Block 0 is reused (evicted) and block 3 recomputes the same first block.
  cache.evict(0);
  ChainLink l0b = cache.insert(3, ChainLink::root(), h0, block(t, 0, bs), 0);
  EXPECT_EQ(l0b.block, 3);
  // Block 1's entry names the dead (0, old generation): unreachable, so it is replaced.
  std::vector<BlockId> out;
  cache.match_prefix(t, 0, 10, &out);
  EXPECT_EQ(out, (std::vector<BlockId>{3}));
  ChainLink l1b = cache.insert(4, l0b, h1, block(t, 1, bs), 0);
  EXPECT_EQ(l1b.block, 4);
  EXPECT_FALSE(cache.is_cached(1));
  cache.match_prefix(t, 0, 10, &out);
  EXPECT_EQ(out, (std::vector<BlockId>{3, 4}));
  // Re-caching block 0 with the same content gets a new generation: old links stay dead.
  cache.evict(3);
  ChainLink again = cache.insert(0, ChainLink::root(), h0, block(t, 0, bs), 0);
  EXPECT_EQ(again.block, 0);
  EXPECT_NE(again.generation, l0.generation);
  // Children of a dead link are not stored.
  EXPECT_EQ(cache.insert(6, ChainLink::dead(h0), h1, block(t, 1, bs), 0), ChainLink::dead(h1));
  EXPECT_FALSE(cache.is_cached(6));
}

TEST(PrefixCache, TableSurvivesHeavyChurn) {
  // Many inserts/evicts through the open-addressing table (backward-shift deletion) against a
  // std::map model of what must be findable.
  constexpr int bs = 8, kN = 64;
  PrefixCache cache(kN, bs);
  std::mt19937 rng(99);
  std::vector<std::vector<int32_t>> content(kN);
  for (int step = 0; step < 50000; ++step) {
    const BlockId b = rng() % kN;
    if (cache.is_cached(b)) {
      cache.evict(b);
    } else {
      std::vector<int32_t> v(bs);
      for (auto& x : v) x = static_cast<int32_t>(rng() % 4);  // few values: duplicates happen
      const uint64_t h = PrefixCache::hash_block(kRootHash, v, 0);
      ChainLink l = cache.insert(b, ChainLink::root(), h, v, 0);
      if (l.block == b) content[b] = v;
    }
    if (step % 64 == 0) {
      int cached = 0;
      for (BlockId x = 0; x < kN; ++x) {
        if (!cache.is_cached(x)) continue;
        ++cached;
        const uint64_t h = PrefixCache::hash_block(kRootHash, content[x], 0);
        ASSERT_EQ(cache.lookup(ChainLink::root(), h, content[x], 0), x) << "step " << step;
      }
      ASSERT_EQ(cached, cache.num_cached_blocks());
    }
  }
}

TEST(PrefixCache, RejectsBadArguments) {
  EXPECT_THROW(PrefixCache(0, 16), InvalidArgument);
  EXPECT_THROW(PrefixCache(4, 48), InvalidArgument);
  PrefixCache cache(4, 8);
  auto t = iota_tokens(7, 0);
  EXPECT_THROW(cache.insert(0, ChainLink::root(), 1, t, 0), InvalidArgument);
  auto full = iota_tokens(8, 0);
  EXPECT_THROW(cache.insert(4, ChainLink::root(), 1, full, 0), InvalidArgument);
  EXPECT_THROW(cache.link(1), InvalidArgument);
  EXPECT_THROW(cache.evict(-1), InvalidArgument);
}
