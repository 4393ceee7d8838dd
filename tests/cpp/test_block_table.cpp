// BlockTable: slot mapping, appends, fork, copy-on-write, all-or-nothing, tail-first free.
#include <gtest/gtest.h>

#include <string>

#include "pagedllm/block_table.h"
#include "test_util.h"

using namespace pagedllm;
using pagedllm::test_util::error_of;

TEST(BlockTable, AcceptsPowersOfTwoFrom8To128Only) {
  for (int bs : {8, 16, 32, 64, 128}) EXPECT_NO_THROW(BlockTable t(bs)) << bs;
  for (int bs : {0, 1, 4, 7, 12, 24, 100, 256, -16}) {
    const std::string msg = error_of([&] { BlockTable t(bs); });
    EXPECT_NE(msg.find("got " + std::to_string(bs)), std::string::npos) << msg;
  }
}

TEST(BlockTable, AppendsAndMapsSlots) {
  BlockPool pool(10);
  BlockTable t(8);
  std::vector<CopyOrder> copies;
  EXPECT_EQ(t.num_blocks_needed(pool, 0), 0);
  EXPECT_EQ(t.num_blocks_needed(pool, 1), 1);
  EXPECT_EQ(t.num_blocks_needed(pool, 17), 3);
  ASSERT_TRUE(t.append_slots(pool, 5, &copies));
  ASSERT_TRUE(t.append_slots(pool, 3, &copies));  // fills block 0 exactly
  EXPECT_EQ(t.num_blocks(), 1);
  ASSERT_TRUE(t.append_slots(pool, 9, &copies));
  EXPECT_EQ(t.num_tokens(), 17);
  EXPECT_EQ(t.num_blocks(), 3);
  EXPECT_TRUE(copies.empty());
  const auto ids = t.block_ids();
  for (int p = 0; p < 17; ++p) EXPECT_EQ(t.slot(p), int64_t{ids[p / 8]} * 8 + p % 8);
  EXPECT_NE(error_of([&] { (void)t.slot(17); }).find("position 17"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)t.slot(-1); }).find("position -1"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)t.append_slots(pool, -2, &copies); }).find("-2"), std::string::npos);
  t.free(pool);
  EXPECT_EQ(pool.num_free_blocks(), 10);
  EXPECT_EQ(t.num_tokens(), 0);
}

TEST(BlockTable, AllOrNothingWhenThePoolIsShort) {
  BlockPool pool(3);
  BlockTable a(8), b(8);
  std::vector<CopyOrder> copies;
  ASSERT_TRUE(a.append_slots(pool, 9, &copies));  // 2 blocks
  EXPECT_FALSE(b.append_slots(pool, 9, &copies));  // needs 2, 1 free
  EXPECT_EQ(b.num_tokens(), 0);
  EXPECT_EQ(b.num_blocks(), 0);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_TRUE(b.append_slots(pool, 8, &copies));
  EXPECT_FALSE(a.append_slots(pool, 8, &copies));
  EXPECT_EQ(a.num_tokens(), 9);
  a.free(pool);
  b.free(pool);
  EXPECT_EQ(pool.num_free_blocks(), 3);
}

TEST(BlockTable, ForkSharesAndCopyOnWriteSplitsThePartialBlock) {
  BlockPool pool(8);
  BlockTable parent(8);
  std::vector<CopyOrder> copies;
  ASSERT_TRUE(parent.append_slots(pool, 12, &copies));  // block A full, block B holds 4
  const BlockId a = parent.block_ids()[0], b = parent.block_ids()[1];
  BlockTable child = parent.fork(pool);
  EXPECT_EQ(child.num_tokens(), 12);
  EXPECT_EQ(pool.ref_count(a), 2);
  EXPECT_EQ(pool.ref_count(b), 2);
  // Without a copy list the due CoW is an error and changes nothing.
  EXPECT_NE(error_of([&] { (void)child.append_slots(pool, 1, nullptr); }).find("copy-on-write"),
            std::string::npos);
  EXPECT_EQ(child.num_tokens(), 12);
  EXPECT_EQ(pool.num_free_blocks(), 6);
  // The child's append copies B into a block it alone owns.
  EXPECT_EQ(child.num_blocks_needed(pool, 1), 1);
  ASSERT_TRUE(child.append_slots(pool, 1, &copies));
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, b);
  EXPECT_NE(copies[0].dst, b);
  EXPECT_EQ(child.block_ids()[1], copies[0].dst);
  EXPECT_EQ(child.block_ids()[0], a);  // the full shared block is never copied
  EXPECT_EQ(pool.ref_count(b), 1);
  EXPECT_EQ(pool.ref_count(copies[0].dst), 1);
  // The parent now owns B alone: appends in place.
  copies.clear();
  ASSERT_TRUE(parent.append_slots(pool, 4, &copies));
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(parent.block_ids()[1], b);
  child.free(pool);
  parent.free(pool);
  EXPECT_EQ(pool.num_free_blocks(), 8);
}

TEST(BlockTable, FullSharedLastBlockNeedsNoCopy) {
  BlockPool pool(4);
  BlockTable parent(8);
  std::vector<CopyOrder> copies;
  ASSERT_TRUE(parent.append_slots(pool, 8, &copies));
  BlockTable child = parent.fork(pool);
  EXPECT_EQ(child.num_blocks_needed(pool, 1), 1);
  ASSERT_TRUE(child.append_slots(pool, 1, nullptr));  // no CoW due: null copies is fine
  EXPECT_EQ(child.block_ids()[0], parent.block_ids()[0]);
  child.free(pool);
  parent.free(pool);
  EXPECT_EQ(pool.num_free_blocks(), 4);
}

TEST(BlockTable, CopyOnWriteNeedsAFreeBlock) {
  BlockPool pool(1);
  BlockTable parent(8);
  std::vector<CopyOrder> copies;
  ASSERT_TRUE(parent.append_slots(pool, 3, &copies));
  BlockTable child = parent.fork(pool);
  EXPECT_EQ(child.num_blocks_needed(pool, 1), 1);
  EXPECT_FALSE(child.append_slots(pool, 1, &copies));
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(pool.ref_count(0), 2);
  child.free(pool);
  parent.free(pool);
}

TEST(BlockTable, FreesTailFirstAndSharesFullBlocks) {
  BlockPool pool(6);
  BlockTable t(8);
  std::vector<CopyOrder> copies;
  ASSERT_TRUE(t.append_slots(pool, 24, &copies));  // blocks 0, 1, 2
  // Mark them as cached so freed blocks join the tail in release order.
  for (BlockId b : t.block_ids()) pool.set_reusable(b, true);
  t.free(pool);
  EXPECT_EQ(pool.free_queue(), (std::vector<BlockId>{3, 4, 5, 2, 1, 0}));
  BlockTable s(8);
  const std::vector<BlockId> hit{0, 1};
  s.share_full_blocks(pool, hit);
  EXPECT_EQ(s.num_tokens(), 16);
  EXPECT_EQ(pool.free_queue(), (std::vector<BlockId>{3, 4, 5, 2}));
  EXPECT_NE(error_of([&] { s.share_full_blocks(pool, hit); }).find("empty table"), std::string::npos);
  BlockTable bad(8);
  const std::vector<BlockId> bad_hit{2, 9};
  EXPECT_NE(error_of([&] { bad.share_full_blocks(pool, bad_hit); }).find("block id 9"), std::string::npos);
  EXPECT_EQ(pool.ref_count(2), 0);  // checked before any reference was taken
  s.free(pool);
  EXPECT_EQ(pool.num_free_blocks(), 6);
}
