// KVCacheManager: the contract's behaviours, and a randomized test of >= 100,000 operations that
// checks the invariants after every step against a simulated KV store (what each slot holds).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>

#include "pagedllm/kv_cache_manager.h"
#include "test_util.h"

using namespace pagedllm;
using pagedllm::test_util::error_of;

namespace {

std::vector<int32_t> iota_tokens(int n, int start = 1) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

}  // namespace

TEST(KVCacheManager, ValidatesConstructionNamingValues) {
  EXPECT_NE(error_of([] { KVCacheManager kv(0, 16, true); }).find("got 0"), std::string::npos);
  EXPECT_NE(error_of([] { KVCacheManager kv(10, 24, true); }).find("got 24"), std::string::npos);
  EXPECT_NE(error_of([] { KVCacheManager kv(10, 256, false); }).find("got 256"), std::string::npos);
  KVCacheManager kv(10, 128, false);
  EXPECT_EQ(kv.block_size(), 128);
  EXPECT_EQ(kv.num_blocks(), 10);
  EXPECT_EQ(kv.num_free_blocks(), 10);
  EXPECT_FALSE(kv.prefix_caching_enabled());
}

TEST(KVCacheManager, AllocateSlotMappingAndFree) {
  KVCacheManager kv(8, 16, false);
  EXPECT_EQ(kv.num_blocks_needed(1, 40), 3);
  ASSERT_TRUE(kv.allocate_slots(1, 40));
  EXPECT_TRUE(kv.contains(1));
  EXPECT_EQ(kv.num_tokens(1), 40);
  ASSERT_EQ(kv.block_ids(1).size(), 3u);
  const auto ids = kv.block_ids(1);
  for (int p = 0; p < 40; ++p) EXPECT_EQ(kv.slot(1, p), int64_t{ids[p / 16]} * 16 + p % 16);
  std::vector<int64_t> s(10);
  kv.slots(1, 30, s);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(s[i], kv.slot(1, 30 + i));
  EXPECT_NE(error_of([&] { (void)kv.slot(1, 40); }).find("position 40"), std::string::npos);
  EXPECT_NE(error_of([&] { kv.slots(1, 35, s); }).find("45"), std::string::npos);
  const KVCacheStats st = kv.stats();
  EXPECT_EQ(st.num_free_blocks, 5);
  EXPECT_DOUBLE_EQ(st.usage, 3.0 / 8.0);
  kv.free(1);
  EXPECT_FALSE(kv.contains(1));
  EXPECT_EQ(kv.stats().usage, 0.0);
  EXPECT_NE(error_of([&] { kv.free(1); }).find("unknown sequence id 1"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)kv.num_tokens(77); }).find("77"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(2, -3); }).find("-3"), std::string::npos);
  EXPECT_FALSE(kv.contains(2));
  EXPECT_EQ(kv.num_free_blocks(), 8);
}

TEST(KVCacheManager, AllOrNothing) {
  KVCacheManager kv(4, 8, true);
  ASSERT_TRUE(kv.allocate_slots(1, 20));  // 3 blocks
  EXPECT_FALSE(kv.allocate_slots(2, 9));  // needs 2, 1 free
  EXPECT_FALSE(kv.contains(2));
  EXPECT_FALSE(kv.allocate_slots(1, 13));  // needs 2 more
  EXPECT_EQ(kv.num_tokens(1), 20);
  EXPECT_EQ(kv.num_free_blocks(), 1);
  ASSERT_TRUE(kv.allocate_slots(1, 12));
  EXPECT_EQ(kv.num_free_blocks(), 0);
  kv.free(1);
  EXPECT_EQ(kv.num_free_blocks(), 4);
}

TEST(KVCacheManager, PrefixHitLeavesOneTokenAndCountsTokens) {
  constexpr int bs = 8;
  KVCacheManager kv(16, bs, true);
  auto prompt = iota_tokens(4 * bs);  // exactly 4 full blocks
  PrefixHit miss = kv.find_cached_prefix(prompt, 0);
  EXPECT_TRUE(miss.blocks.empty());
  ASSERT_TRUE(kv.allocate_slots(1, 4 * bs, &miss));
  kv.cache_full_blocks(1, prompt, 4 * bs, 0);
  EXPECT_EQ(kv.stats().num_cached_blocks, 4);
  const std::vector<BlockId> first(kv.block_ids(1).begin(), kv.block_ids(1).end());
  kv.free(1);
  EXPECT_EQ(kv.num_free_blocks(), 16);
  EXPECT_EQ(kv.stats().num_cached_blocks, 4);  // lazy eviction: hashes survive the free
  // A full-prompt hit still leaves the last token: 3 blocks, not 4.
  PrefixHit hit = kv.find_cached_prefix(prompt, 0);
  EXPECT_EQ(hit.num_tokens, 3 * bs);
  EXPECT_EQ(hit.blocks, std::vector<BlockId>(first.begin(), first.begin() + 3));
  // Another salt: no hit. record_stats=false leaves the counters alone.
  EXPECT_TRUE(kv.find_cached_prefix(prompt, 99).blocks.empty());
  (void)kv.find_cached_prefix(prompt, 0, false);
  KVCacheStats st = kv.stats();
  EXPECT_EQ(st.prefix_cache_queries, 3 * 4 * bs);
  EXPECT_EQ(st.prefix_cache_hits, 3 * bs);
  // Using the hit: 3 free cached blocks leave the free queue + 1 new block.
  EXPECT_EQ(kv.num_blocks_needed(2, bs, &hit), 4);
  ASSERT_TRUE(kv.allocate_slots(2, bs, &hit));
  EXPECT_EQ(kv.num_tokens(2), 4 * bs);
  EXPECT_EQ(kv.num_free_blocks(), 12);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(kv.block_ids(2)[i], first[i]);
  // A second sequence hitting blocks already held: they cost nothing.
  PrefixHit hit2 = kv.find_cached_prefix(prompt, 0);
  EXPECT_EQ(kv.num_blocks_needed(3, bs, &hit2), 1);
  ASSERT_TRUE(kv.allocate_slots(3, bs, &hit2));
  EXPECT_EQ(kv.pool().ref_count(first[0]), 2);
  // A hit for a live sequence is an error.
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(3, 1, &hit2); }).find("already exists"),
            std::string::npos);
  kv.free(2);
  kv.free(3);
  EXPECT_EQ(kv.num_free_blocks(), 16);
}

TEST(KVCacheManager, BadHitsAreRejectedBeforeAnyChange) {
  KVCacheManager kv(8, 8, true);
  PrefixHit forged{{1, 2}, 16};  // blocks that carry no hash
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(1, 1, &forged); }).find("no longer cached"),
            std::string::npos);
  PrefixHit wrong_count{{}, 8};
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(1, 1, &wrong_count); }).find("num_tokens 8"),
            std::string::npos);
  PrefixHit out_of_range{{42}, 8};
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(1, 1, &out_of_range); }).find("block id 42"),
            std::string::npos);
  auto prompt = iota_tokens(24);
  ASSERT_TRUE(kv.allocate_slots(5, 24));
  kv.cache_full_blocks(5, prompt, 24, 0);
  PrefixHit dup{{kv.block_ids(5)[0], kv.block_ids(5)[0]}, 16};
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(1, 1, &dup); }).find("twice"), std::string::npos);
  EXPECT_FALSE(kv.contains(1));
  EXPECT_EQ(kv.num_free_blocks(), 5);
  KVCacheManager off(8, 8, false);
  PrefixHit some{{0}, 8};
  EXPECT_NE(error_of([&] { (void)off.allocate_slots(1, 1, &some); }).find("prefix caching is off"),
            std::string::npos);
  EXPECT_TRUE(off.find_cached_prefix(prompt, 0).blocks.empty());
  EXPECT_THROW(off.cache_full_blocks(9, prompt, 0, 0), InvalidArgument);  // unknown seq
}

TEST(KVCacheManager, StaleHitIsRejected) {
  constexpr int bs = 8;
  KVCacheManager kv(4, bs, true);
  auto prompt = iota_tokens(2 * bs + 1);
  ASSERT_TRUE(kv.allocate_slots(1, 2 * bs + 1));
  kv.cache_full_blocks(1, prompt, 2 * bs + 1, 0);
  kv.free(1);
  PrefixHit hit = kv.find_cached_prefix(prompt, 0);
  ASSERT_EQ(hit.blocks.size(), 2u);
  // Another request takes every block: both cached blocks are evicted and reused.
  auto other = iota_tokens(4 * bs, 900);
  ASSERT_TRUE(kv.allocate_slots(2, 4 * bs));
  kv.cache_full_blocks(2, other, 4 * bs, 0);
  kv.free(2);
  EXPECT_NE(error_of([&] { (void)kv.num_blocks_needed(3, 1, &hit); }).find("stale prefix hit"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(3, 1, &hit); }).find("stale prefix hit"),
            std::string::npos);
  EXPECT_FALSE(kv.contains(3));
  EXPECT_EQ(kv.num_free_blocks(), 4);
  PrefixHit fresh = kv.find_cached_prefix(prompt, 0);
  EXPECT_TRUE(fresh.blocks.empty());
  EXPECT_TRUE(kv.allocate_slots(3, 1, &fresh));
  kv.free(3);
}

TEST(KVCacheManager, ForkAndCopyOnWrite) {
  constexpr int bs = 8;
  KVCacheManager kv(8, bs, true);
  ASSERT_TRUE(kv.allocate_slots(1, 12));  // block A full, B with 4 tokens
  kv.fork(1, 2);
  kv.fork(1, 3);
  const BlockId a = kv.block_ids(1)[0], b = kv.block_ids(1)[1];
  EXPECT_EQ(kv.pool().ref_count(b), 3);
  EXPECT_EQ(kv.num_free_blocks(), 6);
  EXPECT_NE(error_of([&] { kv.fork(1, 2); }).find("child sequence id 2"), std::string::npos);
  EXPECT_NE(error_of([&] { kv.fork(50, 51); }).find("unknown sequence id 50"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)kv.allocate_slots(2, 1); }).find("copy-on-write"), std::string::npos);
  EXPECT_EQ(kv.num_free_blocks(), 6);
  std::vector<CopyOrder> copies;
  EXPECT_EQ(kv.num_blocks_needed(2, 1), 1);
  ASSERT_TRUE(kv.allocate_slots(2, 1, nullptr, &copies));
  ASSERT_TRUE(kv.allocate_slots(3, 5, nullptr, &copies));
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].src, b);
  EXPECT_EQ(copies[1].src, b);
  EXPECT_EQ(kv.block_ids(2)[1], copies[0].dst);
  EXPECT_EQ(kv.block_ids(3)[1], copies[1].dst);
  EXPECT_EQ(kv.block_ids(2)[0], a);
  EXPECT_EQ(kv.pool().ref_count(b), 1);  // parent alone again: no copy for it
  copies.clear();
  ASSERT_TRUE(kv.allocate_slots(1, 1, nullptr, &copies));
  EXPECT_TRUE(copies.empty());
  kv.free(1);
  kv.free(3);
  kv.free(2);
  EXPECT_EQ(kv.num_free_blocks(), 8);
}

TEST(KVCacheManager, ChildInheritsChainStateAndCachesItsOwnBlocks) {
  constexpr int bs = 8;
  KVCacheManager kv(16, bs, true);
  auto prompt = iota_tokens(12);
  ASSERT_TRUE(kv.allocate_slots(1, 12));
  kv.cache_full_blocks(1, prompt, 12, 0);
  kv.fork(1, 2);
  std::vector<CopyOrder> copies;
  auto child_tokens = prompt;
  for (int i = 0; i < 6; ++i) child_tokens.push_back(1000 + i);  // 18 tokens: 2 full blocks
  ASSERT_TRUE(kv.allocate_slots(2, 6, nullptr, &copies));
  kv.cache_full_blocks(2, child_tokens, 18, 0);
  EXPECT_EQ(kv.stats().num_cached_blocks, 2);
  child_tokens.push_back(7);
  PrefixHit hit = kv.find_cached_prefix(child_tokens, 0);
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_EQ(hit.blocks[1], kv.block_ids(2)[1]);
  EXPECT_EQ(hit.blocks[1], copies.at(0).dst);
  kv.free(1);
  kv.free(2);
}

TEST(KVCacheManager, CacheFullBlocksValidatesAndIsIdempotent) {
  KVCacheManager kv(8, 8, true);
  auto t = iota_tokens(20);
  ASSERT_TRUE(kv.allocate_slots(1, 20));
  EXPECT_NE(error_of([&] { kv.cache_full_blocks(1, t, 21, 0); }).find("21"), std::string::npos);
  EXPECT_NE(error_of([&] { kv.cache_full_blocks(1, std::span(t).first(10), 16, 0); }).find("10"),
            std::string::npos);
  EXPECT_NE(error_of([&] { kv.cache_full_blocks(4, t, 1, 0); }).find("unknown sequence id 4"),
            std::string::npos);
  kv.cache_full_blocks(1, t, 7, 0);
  EXPECT_EQ(kv.stats().num_cached_blocks, 0);
  kv.cache_full_blocks(1, t, 16, 0);
  kv.cache_full_blocks(1, t, 16, 0);
  kv.cache_full_blocks(1, t, 20, 0);
  EXPECT_EQ(kv.stats().num_cached_blocks, 2);
  kv.free(1);
}

TEST(KVCacheManager, ResetPrefixCacheDropsOnlyUnheldBlocks) {
  KVCacheManager kv(8, 8, true);
  auto a = iota_tokens(17, 1), b = iota_tokens(17, 500);
  ASSERT_TRUE(kv.allocate_slots(1, 17));
  ASSERT_TRUE(kv.allocate_slots(2, 17));
  kv.cache_full_blocks(1, a, 17, 0);
  kv.cache_full_blocks(2, b, 17, 0);
  kv.free(1);
  EXPECT_EQ(kv.stats().num_cached_blocks, 4);
  kv.reset_prefix_cache();
  EXPECT_EQ(kv.stats().num_cached_blocks, 2);
  EXPECT_TRUE(kv.find_cached_prefix(a, 0).blocks.empty());
  EXPECT_EQ(kv.find_cached_prefix(b, 0).blocks.size(), 2u);
  kv.free(2);
}

TEST(KVCacheManager, EvictionIsLruAndTailFirst) {
  constexpr int bs = 8;
  KVCacheManager kv(6, bs, true);
  auto a = iota_tokens(3 * bs + 1, 1);
  ASSERT_TRUE(kv.allocate_slots(1, 3 * bs + 1));  // 4 blocks: 3 full + 1 partial
  kv.cache_full_blocks(1, a, 3 * bs + 1, 0);
  kv.free(1);
  // Two uncached free blocks + the partial block are used before any cached block.
  ASSERT_TRUE(kv.allocate_slots(2, 3 * bs));
  EXPECT_EQ(kv.stats().num_cached_blocks, 3);
  // One more block evicts the chain's tail (block 2 of a) first, so a's first 2 blocks still hit.
  ASSERT_TRUE(kv.allocate_slots(3, 1));
  EXPECT_EQ(kv.stats().num_cached_blocks, 2);
  EXPECT_EQ(kv.find_cached_prefix(a, 0).blocks.size(), 2u);
  kv.free(2);
  kv.free(3);
}

// ---------------------------------------------------------------- randomized invariants
namespace {

class Sim {
 public:
  Sim(int num_blocks, int bs, bool caching, uint64_t seed)
      : kv(num_blocks, bs, caching), bs_(bs), store_(static_cast<size_t>(num_blocks) * bs, -1), rng_(seed) {
    for (int i = 0; i < 6; ++i) {  // shared prompt templates so prefix hits happen
      std::vector<int32_t> t(rand(0, 6 * bs));
      for (auto& x : t) x = rand(0, 30);
      templates_.push_back(t);
    }
  }

  KVCacheManager kv;
  std::map<std::string, int64_t> counts;

  int rand(int lo, int hi) { return lo + static_cast<int>(rng_() % static_cast<uint64_t>(hi - lo + 1)); }

  void step() {
    const int r = rand(0, 99);
    if (seqs_.empty() || r < 12) new_seq();
    else if (r < 70) extend(pick());
    else if (r < 78) fork(pick());
    else if (r < 90) free_seq(pick());
    else if (r < 95) lookup_only();
    else if (r < 99) bad_input();
    else if (rand(0, 9) == 0) { kv.reset_prefix_cache(); ++counts["reset"]; }
  }

  // Every invariant of issue 2, plus content: every live sequence reads back its own tokens.
  void check() const {
    const BlockPool& pool = kv.pool();
    std::vector<int32_t> holders(pool.num_blocks(), 0);
    for (const auto& [id, s] : seqs_) {
      ASSERT_TRUE(kv.contains(id));
      ASSERT_EQ(kv.num_tokens(id), s.computed) << "seq " << id;
      auto ids = kv.block_ids(id);
      ASSERT_EQ(static_cast<int>(ids.size()), (s.computed + bs_ - 1) / bs_);
      std::set<BlockId> uniq(ids.begin(), ids.end());
      ASSERT_EQ(uniq.size(), ids.size()) << "a block twice in one table, seq " << id;
      for (BlockId b : ids) ++holders[b];
      for (int p = 0; p < s.computed; ++p) {
        ASSERT_EQ(store_[kv.slot(id, p)], value(s.tokens[p], s.extra))
            << "seq " << id << " position " << p << " reads another token's KV";
      }
    }
    ASSERT_EQ(kv.num_seqs(), static_cast<int>(seqs_.size()));
    int free_count = 0, cached = 0;
    for (BlockId b = 0; b < pool.num_blocks(); ++b) {
      ASSERT_EQ(pool.ref_count(b), holders[b]) << "block " << b;
      free_count += holders[b] == 0;
      const bool is_cached = kv.prefix_cache() && kv.prefix_cache()->is_cached(b);
      cached += is_cached;
      ASSERT_EQ(pool.is_reusable(b), is_cached) << "block " << b << ": pool mark != cache entry";
    }
    const auto fq = pool.free_queue();
    ASSERT_EQ(static_cast<int>(fq.size()), free_count);
    ASSERT_EQ(pool.num_free_blocks(), free_count);
    std::set<BlockId> fq_set(fq.begin(), fq.end());
    ASSERT_EQ(fq_set.size(), fq.size()) << "a block twice in the free queue";
    for (BlockId b : fq) ASSERT_EQ(holders[b], 0) << "block " << b << " both free and referenced";
    const KVCacheStats st = kv.stats();
    ASSERT_EQ(st.num_cached_blocks, cached);
    ASSERT_DOUBLE_EQ(st.usage, 1.0 - static_cast<double>(free_count) / pool.num_blocks());
    ASSERT_LE(st.prefix_cache_hits, st.prefix_cache_queries);
  }

  void free_all() {
    while (!seqs_.empty()) free_seq(seqs_.begin()->first);
  }

 private:
  struct Seq {
    std::vector<int32_t> tokens;  // all tokens known (prompt + generated)
    uint64_t extra = 0;
    int32_t computed = 0;         // == slots reserved == KV written
  };

  static int64_t value(int32_t token, uint64_t extra) { return int64_t{token} * 4 + static_cast<int64_t>(extra); }

  SeqId pick() {
    auto it = seqs_.begin();
    std::advance(it, rand(0, static_cast<int>(seqs_.size()) - 1));
    return it->first;
  }

  // Apply copy orders as copy_blocks would, after checking each goes from a block someone else
  // still holds to one the writer alone holds.
  void apply_copies(SeqId writer, const std::vector<CopyOrder>& copies) {
    auto ids = kv.block_ids(writer);
    for (const CopyOrder& c : copies) {
      ASSERT_GE(kv.pool().ref_count(c.src), 1) << "copy source " << c.src << " no longer held";
      ASSERT_EQ(std::count(ids.begin(), ids.end(), c.src), 0) << "writer still holds the source";
      ASSERT_EQ(kv.pool().ref_count(c.dst), 1) << "copy destination " << c.dst << " is shared";
      ASSERT_EQ(std::count(ids.begin(), ids.end(), c.dst), 1);
      std::copy_n(store_.begin() + int64_t{c.src} * bs_, bs_, store_.begin() + int64_t{c.dst} * bs_);
      ++counts["cow"];
    }
  }

  // The model writes the KV of positions [from, to): the slot's block must be the writer's alone.
  void write(SeqId id, const Seq& s, int from, int to) {
    for (int p = from; p < to; ++p) {
      const int64_t slot = kv.slot(id, p);
      ASSERT_EQ(kv.pool().ref_count(static_cast<BlockId>(slot / bs_)), 1)
          << "seq " << id << " writes position " << p << " into a shared block";
      store_[slot] = value(s.tokens[p], s.extra);
    }
  }

  void check_hit(const PrefixHit& hit, const std::vector<int32_t>& tokens, uint64_t extra) {
    ASSERT_EQ(hit.num_tokens, static_cast<int>(hit.blocks.size()) * bs_);
    ASSERT_LT(hit.num_tokens, static_cast<int>(tokens.size()) + (tokens.empty() ? 1 : 0));
    for (int p = 0; p < hit.num_tokens; ++p) {
      ASSERT_EQ(store_[int64_t{hit.blocks[p / bs_]} * bs_ + p % bs_], value(tokens[p], extra))
          << "prefix hit block " << hit.blocks[p / bs_] << " holds other content";
    }
    if (!hit.blocks.empty()) ++counts["hit"];
  }

  std::vector<int32_t> random_prompt(uint64_t* extra) {
    std::vector<int32_t> t = templates_[rand(0, static_cast<int>(templates_.size()) - 1)];
    const int suffix = rand(1, 3 * bs_);
    for (int i = 0; i < suffix; ++i) t.push_back(rand(0, 30));
    *extra = rand(0, 3) == 0 ? 1 : 0;
    return t;
  }

  void new_seq() {
    if (seqs_.size() >= 12) return;
    Seq s;
    s.tokens = random_prompt(&s.extra);
    const SeqId id = next_id_++;
    PrefixHit hit = kv.find_cached_prefix(s.tokens, s.extra);
    check_hit(hit, s.tokens, s.extra);
    const int remaining = static_cast<int>(s.tokens.size()) - hit.num_tokens;
    const int n = rand(0, 2) == 0 ? rand(1, remaining) : remaining;  // sometimes a prefill chunk
    const int needed = kv.num_blocks_needed(id, n, &hit);
    const int free_before = kv.num_free_blocks();
    if (!kv.allocate_slots(id, n, &hit)) {
      ASSERT_GT(needed, free_before);
      ASSERT_FALSE(kv.contains(id));
      ASSERT_EQ(kv.num_free_blocks(), free_before);
      ++counts["alloc_fail"];
      return;
    }
    ASSERT_LE(needed, free_before);
    ASSERT_EQ(kv.num_free_blocks(), free_before - needed);
    s.computed = hit.num_tokens + n;
    write(id, s, hit.num_tokens, s.computed);
    kv.cache_full_blocks(id, s.tokens, s.computed, s.extra);
    seqs_.emplace(id, std::move(s));
    ++counts["new"];
  }

  void extend(SeqId id) {
    Seq& s = seqs_.at(id);
    int n;
    if (s.computed < static_cast<int>(s.tokens.size())) {
      n = rand(1, static_cast<int>(s.tokens.size()) - s.computed);  // next prefill chunk
    } else {
      if (s.tokens.size() > 40u * bs_) return;
      n = rand(0, 9) == 0 ? rand(2, 5) : 1;  // decode (sometimes several tokens at once)
      for (int i = 0; i < n; ++i) s.tokens.push_back(rand(0, 30));
    }
    std::vector<CopyOrder> copies;
    const int needed = kv.num_blocks_needed(id, n);
    const int free_before = kv.num_free_blocks();
    if (!kv.allocate_slots(id, n, nullptr, &copies)) {
      ASSERT_GT(needed, free_before);
      ASSERT_EQ(kv.num_tokens(id), s.computed);
      ASSERT_EQ(kv.num_free_blocks(), free_before);
      ASSERT_TRUE(copies.empty());
      ++counts["alloc_fail"];
      free_seq(id);  // "preempt" it so the pool does not stay full
      return;
    }
    ASSERT_EQ(kv.num_free_blocks(), free_before - needed);
    apply_copies(id, copies);
    write(id, s, s.computed, s.computed + n);
    s.computed += n;
    if (rand(0, 4) != 0) kv.cache_full_blocks(id, s.tokens, s.computed, s.extra);
    ++counts["extend"];
  }

  void fork(SeqId parent) {
    if (seqs_.size() >= 12) return;
    const SeqId child = next_id_++;
    kv.fork(parent, child);
    Seq copy = seqs_.at(parent);
    if (copy.computed < static_cast<int>(copy.tokens.size())) copy.tokens.resize(copy.computed);
    seqs_.emplace(child, std::move(copy));
    ++counts["fork"];
  }

  void free_seq(SeqId id) {
    kv.free(id);
    seqs_.erase(id);
    ++counts["free"];
  }

  void lookup_only() {
    uint64_t extra;
    std::vector<int32_t> t = random_prompt(&extra);
    PrefixHit hit = kv.find_cached_prefix(t, extra, false);
    check_hit(hit, t, extra);
  }

  void bad_input() {
    const int free_before = kv.num_free_blocks();
    const int k = rand(0, 4);
    if (k == 0) {
      EXPECT_THROW(kv.free(next_id_ + 1000), InvalidArgument);
    } else if (k == 1) {
      EXPECT_THROW((void)kv.allocate_slots(pick(), -1), InvalidArgument);
    } else if (k == 2) {
      const SeqId id = pick();
      EXPECT_THROW((void)kv.slot(id, kv.num_tokens(id)), InvalidArgument);
    } else if (k == 3) {
      const SeqId id = pick();
      EXPECT_THROW(kv.fork(id, id), InvalidArgument);
    } else {
      PrefixHit bogus{{0}, bs_};
      const SeqId id = pick();
      EXPECT_THROW((void)kv.allocate_slots(id, 1, &bogus), InvalidArgument);
    }
    ASSERT_EQ(kv.num_free_blocks(), free_before);
    ++counts["bad_input"];
  }

  int bs_;
  std::vector<int64_t> store_;  // slot -> value(token, extra) written there; -1 = never
  std::mt19937_64 rng_;
  std::vector<std::vector<int32_t>> templates_;
  std::map<SeqId, Seq> seqs_;
  SeqId next_id_ = 1;
};

void run_random(int num_blocks, int bs, bool caching, uint64_t seed, int steps) {
  Sim sim(num_blocks, bs, caching, seed);
  for (int i = 0; i < steps; ++i) {
    sim.step();
    if (::testing::Test::HasFatalFailure() || ::testing::Test::HasFailure()) {
      FAIL() << "failed at step " << i;
    }
    sim.check();
    if (::testing::Test::HasFatalFailure()) FAIL() << "invariant broken after step " << i;
  }
  sim.free_all();
  sim.check();
  EXPECT_EQ(sim.kv.num_free_blocks(), num_blocks);
  EXPECT_EQ(sim.kv.stats().usage, 0.0);
  for (BlockId b = 0; b < num_blocks; ++b) ASSERT_EQ(sim.kv.pool().ref_count(b), 0);
  // The run must have exercised every feature, or it proves little.
  for (const char* key : {"new", "extend", "fork", "free", "cow", "alloc_fail", "bad_input"}) {
    EXPECT_GT(sim.counts[key], 0) << key;
  }
  if (caching) EXPECT_GT(sim.counts["hit"], 100);
  std::string summary;
  for (auto& [k, v] : sim.counts) summary += k + "=" + std::to_string(v) + " ";
  std::printf("[ random ] blocks=%d bs=%d caching=%d: %s\n", num_blocks, bs, caching, summary.c_str());
}

}  // namespace

TEST(KVCacheManagerRandom, HundredThousandOpsWithPrefixCaching) { run_random(40, 8, true, 1, 100000); }

TEST(KVCacheManagerRandom, OpsWithoutPrefixCachingLargerBlocks) { run_random(40, 16, false, 2, 30000); }

TEST(KVCacheManagerRandom, OpsWithPrefixCachingBlockSize32) { run_random(48, 32, true, 3, 30000); }

TEST(KVCacheManager, ManyLiveSequencesWithArbitraryIds) {
  // The sequence index (open addressing, grows, backward-shift deletion) against a std::map.
  KVCacheManager kv(4096, 8, false);
  std::mt19937_64 rng(5);
  std::map<SeqId, int32_t> model;  // id -> tokens
  for (int step = 0; step < 40000; ++step) {
    const bool add = model.size() < 50 || (model.size() < 3000 && rng() % 3 != 0);
    if (add) {
      SeqId id = static_cast<SeqId>(rng());  // any int64, negative ones included
      if (rng() % 4 == 0) id = static_cast<SeqId>(rng() % 64);  // small ids, often reused
      if (model.count(id)) {
        ASSERT_THROW(kv.fork(id, id), InvalidArgument);
        continue;
      }
      const int32_t n = 1 + static_cast<int32_t>(rng() % 9);
      if (!model.empty() && rng() % 4 == 0) {
        const SeqId parent = model.begin()->first;
        kv.fork(parent, id);
        model[id] = model[parent];
      } else if (kv.allocate_slots(id, n)) {
        model[id] = n;
      } else {
        ASSERT_FALSE(kv.contains(id));
      }
    } else {
      auto it = model.begin();
      std::advance(it, rng() % model.size());
      kv.free(it->first);
      ASSERT_FALSE(kv.contains(it->first));
      model.erase(it);
    }
    ASSERT_EQ(kv.num_seqs(), static_cast<int32_t>(model.size()));
    if (step % 500 == 0) {
      for (const auto& [id, n] : model) {
        ASSERT_TRUE(kv.contains(id)) << id;
        ASSERT_EQ(kv.num_tokens(id), n) << id;
      }
    }
  }
  for (const auto& [id, n] : model) kv.free(id);
  EXPECT_EQ(kv.num_seqs(), 0);
  EXPECT_EQ(kv.num_free_blocks(), 4096);
}

TEST(KVCacheManager, TruncateReleasesTrailingBlocksButNeverCachedOnes) {
  KVCacheManager kv(8, 16, true);
  ASSERT_TRUE(kv.allocate_slots(1, 20));  // 2 blocks
  kv.cache_full_blocks(1, iota_tokens(20), 20, 0);  // block 0 is in the prefix cache
  ASSERT_TRUE(kv.allocate_slots(1, 30));  // 50 slots: 4 blocks
  EXPECT_EQ(kv.num_free_blocks(), 4);
  kv.truncate(1, 33);  // 3 blocks
  EXPECT_EQ(kv.num_tokens(1), 33);
  EXPECT_EQ(kv.block_ids(1).size(), 3u);
  EXPECT_EQ(kv.num_free_blocks(), 5);
  kv.truncate(1, 33);  // idempotent
  EXPECT_EQ(kv.num_free_blocks(), 5);
  EXPECT_NE(error_of([&] { kv.truncate(1, 34); }).find("[0, 33]"), std::string::npos);
  EXPECT_NE(error_of([&] { kv.truncate(1, 15); }).find("prefix cache"), std::string::npos);
  EXPECT_EQ(kv.num_tokens(1), 33);
  kv.truncate(1, 16);
  EXPECT_EQ(kv.num_free_blocks(), 7);
  ASSERT_TRUE(kv.allocate_slots(1, 1));  // grows again from the truncated end
  EXPECT_EQ(kv.slot(1, 16), static_cast<int64_t>(kv.block_ids(1)[1]) * 16);
  kv.free(1);
  EXPECT_EQ(kv.num_free_blocks(), 8);
}

TEST(KVCacheManager, ForkPrefixSharesTheLeadingBlocksAndCopiesThePartialOne) {
  constexpr int bs = 8;
  KVCacheManager kv(12, bs, true);
  const auto leader = iota_tokens(30);  // 4 blocks: 3 full (cached), 1 with 6 tokens
  ASSERT_TRUE(kv.allocate_slots(1, 30));
  kv.cache_full_blocks(1, leader, 30, 0);
  const auto lb = std::vector<BlockId>(kv.block_ids(1).begin(), kv.block_ids(1).end());
  EXPECT_NE(error_of([&] { kv.fork_prefix(1, 2, 31); }).find("[0, 30]"), std::string::npos);
  EXPECT_FALSE(kv.contains(2));
  kv.fork_prefix(1, 2, 13);  // the child keeps block 0 and 5 tokens of the leader's (full, cached) block 1
  EXPECT_EQ(kv.num_tokens(2), 13);
  ASSERT_EQ(kv.block_ids(2).size(), 2u);
  EXPECT_EQ(kv.block_ids(2)[0], lb[0]);
  EXPECT_EQ(kv.block_ids(2)[1], lb[1]);
  EXPECT_EQ(kv.pool().ref_count(lb[1]), 2);
  EXPECT_EQ(kv.pool().ref_count(lb[2]), 1);  // past the prefix: not shared
  // its own tokens: block 0 registers again (same block, same hash), block 1 is copied on write
  auto child = std::vector<int32_t>(leader.begin(), leader.begin() + 13);
  kv.cache_full_blocks(2, child, 13, 0);
  std::vector<CopyOrder> copies;
  for (int i = 0; i < 5; ++i) child.push_back(500 + i);
  ASSERT_TRUE(kv.allocate_slots(2, 5, nullptr, &copies));
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, lb[1]);
  EXPECT_EQ(kv.block_ids(2)[1], copies[0].dst);
  kv.cache_full_blocks(2, child, 18, 0);
  EXPECT_EQ(kv.stats().num_cached_blocks, 4);  // the leader's 3 and the child's own block 1
  PrefixHit hit = kv.find_cached_prefix(std::vector<int32_t>(child.begin(), child.end()), 0);
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_EQ(hit.blocks[0], lb[0]);
  EXPECT_EQ(hit.blocks[1], copies[0].dst);
  kv.fork_prefix(1, 3, 0);  // an empty prefix: a live sequence with no block
  EXPECT_EQ(kv.num_tokens(3), 0);
  EXPECT_TRUE(kv.block_ids(3).empty());
  kv.free(1);
  kv.free(2);
  kv.free(3);
  EXPECT_EQ(kv.num_free_blocks(), 12);
}
