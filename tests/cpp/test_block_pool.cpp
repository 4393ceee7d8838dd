// BlockPool: ref counts, O(1) free queue with middle removal, LRU/tail-first order, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <random>
#include <set>
#include <string>

#include "pagedllm/block_pool.h"
#include "test_util.h"

using namespace pagedllm;
using pagedllm::test_util::error_of;

namespace {

// Records reuse notifications (the pool calls it only for blocks marked reusable).
class FakeHooks : public BlockPool::CacheHooks {
 public:
  void on_reuse(BlockId b) override { reused.push_back(b); }
  std::vector<BlockId> reused;
};

}  // namespace

TEST(BlockPool, AllocatesInIdOrderUntilExhausted) {
  BlockPool pool(4);
  EXPECT_EQ(pool.num_blocks(), 4);
  EXPECT_EQ(pool.num_free_blocks(), 4);
  for (BlockId want = 0; want < 4; ++want) {
    EXPECT_EQ(pool.allocate(), want);
    EXPECT_EQ(pool.ref_count(want), 1);
  }
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_EQ(pool.allocate(), kNoBlock);
  EXPECT_EQ(pool.num_free_blocks(), 0);
}

TEST(BlockPool, RejectsBadSizesAndIdsNamingTheValue) {
  EXPECT_NE(error_of([] { BlockPool p(0); }).find("0"), std::string::npos);
  EXPECT_NE(error_of([] { BlockPool p(-5); }).find("-5"), std::string::npos);
  BlockPool pool(3);
  EXPECT_NE(error_of([&] { pool.incref(3); }).find("block id 3"), std::string::npos);
  EXPECT_NE(error_of([&] { pool.release(-1); }).find("block id -1"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)pool.ref_count(7); }).find("7"), std::string::npos);
  // Double free: a free block cannot be released; the pool is unchanged.
  EXPECT_NE(error_of([&] { pool.release(1); }).find("block 1 is already free"), std::string::npos);
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_EQ(pool.free_queue(), (std::vector<BlockId>{0, 1, 2}));
}

TEST(BlockPool, IncrefOfFreeBlockRemovesItFromTheMiddle) {
  BlockPool pool(5);
  pool.incref(2);  // a prefix hit on a free block
  EXPECT_EQ(pool.ref_count(2), 1);
  EXPECT_EQ(pool.free_queue(), (std::vector<BlockId>{0, 1, 3, 4}));
  pool.incref(2);
  EXPECT_EQ(pool.ref_count(2), 2);
  EXPECT_EQ(pool.num_free_blocks(), 4);
  pool.release(2);
  EXPECT_EQ(pool.num_free_blocks(), 4);
  pool.release(2);
  EXPECT_EQ(pool.num_free_blocks(), 5);
}

TEST(BlockPool, CachedBlocksJoinTheTailUncachedTheHead) {
  BlockPool pool(6);
  FakeHooks hooks;
  pool.set_cache_hooks(&hooks);
  std::vector<BlockId> held;
  for (int i = 0; i < 6; ++i) held.push_back(pool.allocate());
  EXPECT_TRUE(hooks.reused.empty());  // unmarked blocks: no notification
  for (BlockId b : {1, 2, 3}) pool.set_reusable(b, true);
  // A sequence [1, 2, 3] freed tail-first: 3, 2, 1 -> LRU tail order 3, 2, 1 (3 evicted first).
  pool.release(3);
  pool.release(2);
  pool.release(1);
  pool.release(0);  // unmarked: head
  pool.release(5);  // unmarked: head
  EXPECT_EQ(pool.free_queue(), (std::vector<BlockId>{5, 0, 3, 2, 1}));
  // Unmarked blocks are reused before any cached one is evicted.
  EXPECT_EQ(pool.allocate(), 5);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_TRUE(hooks.reused.empty());
  EXPECT_TRUE(pool.is_reusable(3));
  EXPECT_EQ(pool.allocate(), 3);  // lazy eviction happens here
  EXPECT_FALSE(pool.is_reusable(3));
  EXPECT_EQ(hooks.reused, (std::vector<BlockId>{3}));
  // A hit on a free marked block keeps its mark (no eviction) and pulls it out of the middle.
  pool.incref(1);
  EXPECT_TRUE(pool.is_reusable(1));
  EXPECT_EQ(pool.free_queue(), (std::vector<BlockId>{2}));
  EXPECT_THROW(pool.set_reusable(6, true), InvalidArgument);
  pool.set_cache_hooks(nullptr);
}

// The free queue against a std::list model over random operations: exact order, O(1) paths.
TEST(BlockPool, RandomOpsMatchAListModel) {
  constexpr int kN = 97;
  BlockPool pool(kN);
  FakeHooks hooks;
  pool.set_cache_hooks(&hooks);
  std::list<BlockId> model;
  for (int b = 0; b < kN; ++b) model.push_back(b);
  std::vector<int> ref(kN, 0);
  std::mt19937 rng(1234);
  for (int step = 0; step < 20000; ++step) {
    const int op = rng() % 4;
    if (op == 0) {
      const BlockId got = pool.allocate();
      if (model.empty()) {
        ASSERT_EQ(got, kNoBlock);
      } else {
        ASSERT_EQ(got, model.front());
        model.pop_front();
        ref[got] = 1;
        ASSERT_FALSE(pool.is_reusable(got));
      }
    } else if (op == 1) {
      const BlockId b = rng() % kN;
      if (ref[b] == 0) model.remove(b);
      ++ref[b];
      pool.incref(b);
    } else {
      const BlockId b = rng() % kN;
      if (ref[b] == 0) {
        ASSERT_THROW(pool.release(b), InvalidArgument);
        continue;
      }
      const bool cached = (rng() % 2) == 0;
      pool.set_reusable(b, cached);
      pool.release(b);
      if (--ref[b] == 0) {
        if (cached) model.push_back(b); else model.push_front(b);
      }
    }
    ASSERT_EQ(pool.num_free_blocks(), static_cast<int>(model.size()));
    for (int b = 0; b < kN; ++b) ASSERT_EQ(pool.ref_count(b), ref[b]) << "block " << b;
    if (step % 16 == 0) {
      ASSERT_EQ(pool.free_queue(), std::vector<BlockId>(model.begin(), model.end()));
    }
  }
  pool.set_cache_hooks(nullptr);
}
