// tests/cpp/engine_test_util.h — EngineCore helpers shared by test_engine_core.cpp and
// test_async_scheduling.cpp: a small engine config, prompts, request params, one synchronous
// step, and the end-of-test check that nothing is left running or held.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <vector>

#include "pagedllm/engine_core.h"

namespace pagedllm::test_util {

/// num_blocks of block_size tokens, a budget of `budget` tokens per step.
inline EngineConfig make_config(int32_t num_blocks, int32_t budget = 64, int32_t max_num_seqs = 8,
                                int32_t max_model_len = 256, int32_t block_size = 16) {
  EngineConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = max_num_seqs;
  c.max_model_len = max_model_len;
  return c;
}

/// n consecutive token ids from `first`.
inline std::vector<int32_t> iota_tokens(int32_t n, int32_t first = 100) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

inline RequestParams params(int32_t max_tokens, int32_t n = 1) {
  RequestParams p;
  p.max_tokens = max_tokens;
  p.n = n;
  return p;
}

/// One synchronous step with every sampled token = `token`; returns the result.
inline std::shared_ptr<UpdateResult> step(EngineCore& core, int32_t token = 7) {
  SchedulerOutput& out = core.schedule();
  std::vector<int32_t> sampled(out.num_sampled, token);
  auto r = core.update_from_output(out, sampled);
  core.release(out);
  return r;
}

/// Nothing running, waiting or held, and every KV block free.
inline void expect_idle_no_leak(const EngineCore& core) {
  EngineStats s = core.stats();
  EXPECT_FALSE(core.has_unfinished_requests());
  EXPECT_EQ(s.num_running, 0);
  EXPECT_EQ(s.num_waiting, 0);
  EXPECT_EQ(s.num_free_blocks, s.num_blocks);
  EXPECT_EQ(s.kv_usage, 0.0);
  EXPECT_EQ(core.kv_cache().num_seqs(), 0);
  EXPECT_EQ(core.num_outputs_held(), 0);
}

}  // namespace pagedllm::test_util
