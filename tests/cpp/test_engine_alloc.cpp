// The engine's hot path allocates no heap memory once warm: a decode step that crosses no block
// boundary (so the KV manager takes no new block) runs schedule() + update_from_output() +
// release() without a single operator new. Counted with a replacement global operator new that
// counts only while g_counting is set.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <numeric>
#include <vector>

#include "pagedllm/engine_core.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using namespace pagedllm;

TEST(EngineHotPath, DecodeStepsAllocateNothing) {
  EngineConfig cfg;
  cfg.num_blocks = 1024;
  cfg.block_size = 16;
  cfg.max_num_seqs = 64;
  cfg.max_model_len = 256;
  EngineCore core(cfg);
  RequestParams p;
  p.max_tokens = 100;
  p.ignore_eos = true;
  std::vector<int32_t> prompt(17);
  std::iota(prompt.begin(), prompt.end(), 3);
  for (int i = 0; i < 64; ++i) core.add_request("r" + std::to_string(i), prompt, p);
  std::vector<int32_t> sampled(64, 5);
  auto run_step = [&] {
    SchedulerOutput& out = core.schedule();
    EXPECT_EQ(out.num_sampled, 64);
    auto result = core.update_from_output(out, std::span<const int32_t>(sampled.data(), out.num_sampled));
    EXPECT_EQ(result->token_ids.size(), 64u);
    result.reset();
    core.release(out);
  };
  run_step();  // prefill: positions 0..16
  run_step();  // warm-up decode at position 17 (result pool, scratch vectors reach their size)
  g_allocations = 0;
  g_counting = true;
  for (int k = 0; k < 10; ++k) run_step();  // positions 18..27: inside the second block
  g_counting = false;
  EXPECT_EQ(g_allocations.load(), 0);
  EXPECT_EQ(core.stats().num_running, 64);
}
