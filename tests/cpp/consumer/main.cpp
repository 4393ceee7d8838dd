// kv_consumer: links the installed libpagedllm (find_package(pagedllm), pagedllm::core),
// allocates, forks, triggers copy-on-write, hits the prefix cache, frees, and checks that the pool
// is whole again. Exit code 0 on success, 1 with a message on the first failed check.
#include <cstdio>
#include <numeric>
#include <vector>

#include "pagedllm/kv_cache_manager.h"

#define EXPECT(cond)                                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "kv_consumer: check failed: %s (line %d)\n", #cond, __LINE__); \
      return 1;                                                               \
    }                                                                         \
  } while (0)

int main() {
  using namespace pagedllm;
  constexpr int32_t kBlocks = 16, kBlockSize = 16;
  KVCacheManager kv(kBlocks, kBlockSize, /*enable_prefix_caching=*/true);

  std::vector<int32_t> prompt(40);
  std::iota(prompt.begin(), prompt.end(), 100);
  PrefixHit hit = kv.find_cached_prefix(prompt, 0);
  EXPECT(hit.blocks.empty());
  std::vector<CopyOrder> copies;
  EXPECT(kv.allocate_slots(1, 40, &hit, &copies));  // 2 full blocks + 8 tokens
  kv.cache_full_blocks(1, prompt, 40, 0);
  EXPECT(kv.block_ids(1).size() == 3);

  kv.fork(1, 2);  // shares all 3 blocks
  EXPECT(kv.pool().ref_count(kv.block_ids(1)[2]) == 2);
  EXPECT(kv.allocate_slots(2, 1, nullptr, &copies));  // copy-on-write of the partial block
  EXPECT(copies.size() == 1);
  EXPECT(copies[0].src == kv.block_ids(1)[2]);
  EXPECT(copies[0].dst == kv.block_ids(2)[2]);
  EXPECT(kv.block_ids(2)[0] == kv.block_ids(1)[0]);

  PrefixHit again = kv.find_cached_prefix(prompt, 0);
  EXPECT(again.num_tokens == 32);
  EXPECT(kv.allocate_slots(3, 8, &again, &copies));
  EXPECT(kv.pool().ref_count(again.blocks[0]) == 3);

  kv.free(2);
  kv.free(1);
  kv.free(3);
  bool threw = false;
  try {
    kv.free(3);  // double free: an exception naming the id, never an abort
  } catch (const InvalidArgument&) {
    threw = true;
  }
  EXPECT(threw);
  const KVCacheStats s = kv.stats();
  EXPECT(s.num_free_blocks == kBlocks);
  EXPECT(s.usage == 0.0);
  for (BlockId b = 0; b < kBlocks; ++b) EXPECT(kv.pool().ref_count(b) == 0);
  std::printf("kv_consumer: ok, pool whole again (%d/%d blocks free, %d cached)\n", s.num_free_blocks,
              s.num_blocks, s.num_cached_blocks);
  return 0;
}
