// The attention / cache-op launchers: validation errors name the bad value, and the CPU path
// runs (exact small cases; the float64-reference tests are in tests/python).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "pagedllm/attention.h"
#include "pagedllm/cache_ops.h"
#include "test_util.h"

using namespace pagedllm;
using pagedllm::test_util::error_of;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

struct DecodeFixture {
  static constexpr int64_t kBlocks = 4, kHkv = 2, kBs = 16, kD = 64, kHq = 4;
  std::vector<float> kc = std::vector<float>(kBlocks * kHkv * kBs * kD, 0.0f);
  std::vector<float> vc = kc;
  std::vector<float> q = std::vector<float>(kHq * kD, 0.5f);
  std::vector<float> out = std::vector<float>(kHq * kD, NAN);
  std::vector<int32_t> tables = {2, 0};
  std::vector<int32_t> lens = {1};
  TensorView kcv = TensorView::contiguous(kc.data(), DType::kFloat32, {kBlocks, kHkv, kBs, kD});
  TensorView vcv = TensorView::contiguous(vc.data(), DType::kFloat32, {kBlocks, kHkv, kBs, kD});
  TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {1, kHq, kD});
  TensorView ov = TensorView::contiguous(out.data(), DType::kFloat32, {1, kHq, kD});
  TensorView tv = TensorView::contiguous(tables.data(), DType::kInt32, {1, 2});
  TensorView lv = TensorView::contiguous(lens.data(), DType::kInt32, {1});
  void run(AttentionOptions o = {}) { paged_attention(ov, qv, kcv, vcv, tv, lv, 0.125, o); }
};

}  // namespace

TEST(KernelLaunchers, SingleTokenContextReturnsItsValueRow) {
  DecodeFixture f;
  // Block 2, kv head h, row 0 holds value (h + 1) * (d + 1).
  for (int64_t h = 0; h < f.kHkv; ++h)
    for (int64_t d = 0; d < f.kD; ++d) f.vc[((2 * f.kHkv + h) * f.kBs) * f.kD + d] = float((h + 1) * (d + 1));
  for (int split : {0, 1, 3}) {
    f.run(AttentionOptions{0, 0.0f, split});
    for (int64_t h = 0; h < f.kHq; ++h)
      for (int64_t d = 0; d < f.kD; ++d)
        ASSERT_FLOAT_EQ(f.out[h * f.kD + d], float((h / 2 + 1) * (d + 1))) << "split " << split;
  }
}

TEST(KernelLaunchers, Fp16OnCpuListsSupportedDtypes) {
  std::vector<uint16_t> buf(4 * 2 * 16 * 64);
  auto c = TensorView::contiguous(buf.data(), DType::kFloat16, {4, 2, 16, 64});
  std::string e = error_of([&] {
    std::vector<uint16_t> kv(2 * 64);
    auto k = TensorView::contiguous(kv.data(), DType::kFloat16, {1, 2, 64});
    int64_t slot = 0;
    reshape_and_cache(k, k, c, c, TensorView::contiguous(&slot, DType::kInt64, {1}));
  });
  EXPECT_TRUE(contains(e, "float16")) << e;
  EXPECT_TRUE(contains(e, "float32, bfloat16")) << e;
}

TEST(KernelLaunchers, BadSizesAndValuesAreNamed) {
  DecodeFixture f;
  std::string e = error_of([&] { kv_cache_shape(8, 24, 2, 64); });
  EXPECT_TRUE(contains(e, "block size 24") && contains(e, "16, 32")) << e;
  e = error_of([&] { kv_cache_shape(8, 16, 2, 72); });
  EXPECT_TRUE(contains(e, "head size 72") && contains(e, "32, 64, 80, 96, 128, 256")) << e;
  f.lens[0] = 40;  // > 2 blocks x 16
  e = error_of([&] { f.run(); });
  EXPECT_TRUE(contains(e, "seq_lens[0] = 40") && contains(e, "[0, 32]")) << e;
  f.lens[0] = 20;
  f.tables[1] = 7;
  e = error_of([&] { f.run(); });
  EXPECT_TRUE(contains(e, "block_tables[0][1] = 7") && contains(e, "[0, 4)")) << e;
  f.tables[1] = 0;
  e = error_of([&] { f.run(AttentionOptions{0, -1.0f, -1}); });
  EXPECT_TRUE(contains(e, "soft_cap") && contains(e, "-1")) << e;
  EXPECT_TRUE(std::isnan(f.out[0]));  // every rejected call left out untouched
  f.run();
  EXPECT_FALSE(std::isnan(f.out[0]));
}

TEST(KernelLaunchers, DeviceMismatchIsNamed) {
  DecodeFixture f;
  f.qv.device = DeviceType::kCUDA;
  std::string e = error_of([&] { f.run(); });
  EXPECT_TRUE(contains(e, "query is on cuda:0 but key_cache is on cpu")) << e;
}

TEST(KernelLaunchers, CopyBlocksAndSlotRangeChecks) {
  std::vector<float> kc(4 * 1 * 16 * 64), vc(kc.size());
  for (size_t i = 0; i < kc.size(); ++i) kc[i] = float(i);
  auto k = TensorView::contiguous(kc.data(), DType::kFloat32, {4, 1, 16, 64});
  auto v = TensorView::contiguous(vc.data(), DType::kFloat32, {4, 1, 16, 64});
  std::vector<int64_t> map = {1, 3};
  copy_blocks({k}, {v}, TensorView::contiguous(map.data(), DType::kInt64, {1, 2}));
  for (int64_t i = 0; i < 16 * 64; ++i) ASSERT_EQ(kc[3 * 16 * 64 + i], kc[1 * 16 * 64 + i]);
  map[1] = 4;
  std::string e = error_of([&] { copy_blocks({k}, {v}, TensorView::contiguous(map.data(), DType::kInt64, {1, 2})); });
  EXPECT_TRUE(contains(e, "block_mapping[0][1] (dst block) = 4")) << e;
  std::vector<float> key(64);
  int64_t slot = 64;  // 4 blocks x 16 slots
  e = error_of([&] {
    auto kv = TensorView::contiguous(key.data(), DType::kFloat32, {1, 1, 64});
    reshape_and_cache(kv, kv, k, v, TensorView::contiguous(&slot, DType::kInt64, {1}));
  });
  EXPECT_TRUE(contains(e, "slot_mapping[0] = 64")) << e;
}
