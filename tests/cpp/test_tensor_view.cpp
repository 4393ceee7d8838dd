#include <gtest/gtest.h>

#include "pagedllm/tensor_view.h"

using namespace pagedllm;

TEST(TensorView, ContiguousStridesAndNumel) {
  float buf[24];
  auto v = TensorView::contiguous(buf, DType::kFloat32, {2, 3, 4});
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.stride(0), 12);
  EXPECT_EQ(v.stride(1), 4);
  EXPECT_EQ(v.stride(-1), 1);
  EXPECT_TRUE(v.is_contiguous());
  v.strides[0] = 13;
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.describe(), "[2, 3, 4] float32 cpu");
}

TEST(TensorView, ParseDtypeNamesBadValue) {
  EXPECT_EQ(parse_dtype("torch.bfloat16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("half"), DType::kFloat16);
  try {
    parse_dtype("complex64");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("complex64"), std::string::npos);
  }
}
