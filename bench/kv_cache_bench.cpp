// kv_cache_bench: speed of the native KV-cache core (issue 2's benchmark). Prints one JSON object
// and, when an output path is given, writes it there.
//
//   kv_cache_bench [--out PATH] [--commit SHA] [--machine NAME] [--quick]
//
// Figures (best and median of several repetitions, per operation):
//   pool_alloc_free_pairs_per_s: BlockPool allocate()+release() at 1e3 and 1e6 blocks, "hot"
//     (the same block cycles) and "churn" (half the pool held in random order; release the next
//     held block, allocate one in its place: every pair touches a block at a random address, so
//     at 1e6 blocks it measures cache misses), with and without the prefix cache's hooks;
//   seq_alloc_free_per_s: KVCacheManager allocate_slots(new seq, 16 tokens) + free(seq);
//   fork_cow_per_s: fork(parent, child) + allocate_slots(child, 1) copy-on-write + free(child);
//   prefix_lookup_us: find_cached_prefix of a 4,097-token prompt whose 256 blocks of 16 are
//     cached (the result is 256 hit blocks), hashing included; and hashing alone.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "pagedllm/kv_cache_manager.h"

using namespace pagedllm;
using Clock = std::chrono::steady_clock;

namespace {

volatile int64_t g_sink = 0;  // keeps results alive

struct Timing {
  double best;    // ns per op, fastest repetition (least disturbed by other processes)
  double median;  // ns per op, median repetition
};

template <typename F>
Timing time_ns_per_op(int reps, int64_t ops, F&& body) {
  std::vector<double> ns(reps);
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    body();
    ns[r] = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / static_cast<double>(ops);
  }
  std::sort(ns.begin(), ns.end());
  return {ns.front(), ns[ns.size() / 2]};
}

struct XorShift {
  uint64_t s = 0x2545F4914F6CDD1Dull;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
};

// allocate+release pairs on a pool of n blocks; churn keeps half the pool held at random.
Timing pool_pairs(int32_t n, bool churn, bool with_hooks, int64_t ops, int reps) {
  BlockPool pool(n);
  std::unique_ptr<PrefixCache> cache;  // attached: the prefix cache's reuse path is live
  if (with_hooks) cache = std::make_unique<PrefixCache>(n, 16, &pool);
  std::vector<BlockId> held;
  XorShift rng;
  if (churn) {
    held.resize(n / 2);
    for (auto& b : held) b = pool.allocate();
    for (size_t i = held.size() - 1; i > 0; --i) std::swap(held[i], held[rng.next() % (i + 1)]);
  }
  const Timing t = time_ns_per_op(reps, ops, [&] {
    int64_t sum = 0;
    if (!churn) {
      for (int64_t i = 0; i < ops; ++i) {
        const BlockId b = pool.allocate();
        sum += b;
        pool.release(b);
      }
    } else {
      const int64_t m = static_cast<int64_t>(held.size());
      for (int64_t i = 0, k = 0; i < ops; ++i, k = (k + 1 == m ? 0 : k + 1)) {
        pool.release(held[k]);
        held[k] = pool.allocate();
        sum += held[k];
      }
    }
    g_sink = g_sink + sum;
  });
  for (BlockId b : held) pool.release(b);
  if (pool.num_free_blocks() != n) std::fprintf(stderr, "pool not whole after the benchmark\n");
  return t;
}

Timing seq_alloc_free(int64_t ops, int reps) {
  KVCacheManager kv(1024, 16, true);
  return time_ns_per_op(reps, ops, [&] {
    for (int64_t i = 0; i < ops; ++i) {
      kv.allocate_slots(i, 16);
      kv.free(i);
    }
  });
}

Timing fork_cow(int64_t ops, int reps) {
  KVCacheManager kv(4096, 16, true);
  kv.allocate_slots(0, 1000);  // 62 full blocks + a partial one: every child's append copies it
  std::vector<CopyOrder> copies;
  copies.reserve(16);
  int64_t num_copies = 0;
  const Timing t = time_ns_per_op(reps, ops, [&] {
    for (int64_t i = 1; i <= ops; ++i) {
      kv.fork(0, i);
      copies.clear();
      kv.allocate_slots(i, 1, nullptr, &copies);
      num_copies += static_cast<int64_t>(copies.size());
      kv.free(i);
    }
  });
  if (num_copies != ops * reps) std::fprintf(stderr, "expected one copy-on-write per fork\n");
  kv.free(0);
  return t;
}

struct LookupFigures {
  Timing lookup, hash_only, miss;  // ns per lookup
  int32_t hit_blocks;
};

LookupFigures prefix_lookup(int reps, int reps_inner) {
  constexpr int bs = 16, blocks = 256;
  KVCacheManager kv(4096, bs, true);
  std::vector<int32_t> prompt(blocks * bs + 1);
  XorShift rng;
  for (auto& t : prompt) t = static_cast<int32_t>(rng.next() % 128000);
  kv.allocate_slots(1, static_cast<int32_t>(prompt.size()));
  kv.cache_full_blocks(1, prompt, static_cast<int32_t>(prompt.size()), 0);
  kv.free(1);
  PrefixHit hit;
  hit.blocks.reserve(blocks);
  LookupFigures f{};
  f.lookup = time_ns_per_op(reps, reps_inner, [&] {
    for (int i = 0; i < reps_inner; ++i) kv.find_cached_prefix(prompt, 0, &hit, false);
  });
  f.hit_blocks = static_cast<int32_t>(hit.blocks.size());
  f.hash_only = time_ns_per_op(reps, reps_inner, [&] {
    uint64_t h = kRootHash;
    for (int i = 0; i < reps_inner; ++i) {
      h = kRootHash + static_cast<uint64_t>(i);
      for (int b = 0; b < blocks; ++b) {
        h = PrefixCache::hash_block(h, std::span<const int32_t>(prompt).subspan(b * bs, bs), 0);
      }
    }
    g_sink = g_sink + static_cast<int64_t>(h);
  });
  std::vector<int32_t> other = prompt;
  other[0] ^= 1;
  f.miss = time_ns_per_op(reps, reps_inner, [&] {
    for (int i = 0; i < reps_inner; ++i) kv.find_cached_prefix(other, 0, &hit, false);
  });
  return f;
}

std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, commit = "unknown", machine = "unknown";
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--commit" && i + 1 < argc) commit = argv[++i];
    else if (a == "--machine" && i + 1 < argc) machine = argv[++i];
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "usage: kv_cache_bench [--out PATH] [--commit SHA] [--machine NAME] [--quick]\n");
      return 2;
    }
  }
  const int reps = quick ? 3 : 15;
  const int64_t ops = quick ? 200000 : 1000000;
  auto per_s = [](const Timing& t) { return "{\"best\": " + fmt(1e9 / t.best) + ", \"median\": " + fmt(1e9 / t.median) + "}"; };
  auto us = [](const Timing& t) { return "{\"best\": " + fmt(t.best / 1e3) + ", \"median\": " + fmt(t.median / 1e3) + "}"; };

  std::ostringstream js;
  js << "{\n  \"name\": \"kv_cache\",\n  \"commit\": \"" << commit << "\",\n  \"machine\": \"" << machine
     << "\",\n  \"quick\": " << (quick ? "true" : "false") << ",\n";
  {
    std::ifstream la("/proc/loadavg");
    double l1 = -1;
    if (la) la >> l1;
    js << "  \"load_average_1min_at_start\": " << fmt(l1) << ",\n";
  }
  js << "  \"note\": \"best and median of " << reps
     << " repetitions; best is the least disturbed by other processes on a shared machine\",\n";
  js << "  \"pool_alloc_free_pairs_per_s\": {\n";
  bool first = true;
  for (int32_t n : {1000, 1000000}) {
    for (bool churn : {false, true}) {
      for (bool hooks : {false, true}) {
        const Timing t = pool_pairs(n, churn, hooks, ops, reps);
        js << (first ? "" : ",\n") << "    \"blocks_" << n << (churn ? "_churn" : "_hot")
           << (hooks ? "_with_prefix_cache" : "") << "\": " << per_s(t);
        first = false;
      }
    }
  }
  js << "\n  },\n";
  const int64_t seq_ops = quick ? 50000 : 200000;
  js << "  \"seq_alloc_free_per_s\": " << per_s(seq_alloc_free(seq_ops, reps)) << ",\n";
  js << "  \"fork_cow_per_s\": " << per_s(fork_cow(seq_ops, reps)) << ",\n";
  const LookupFigures f = prefix_lookup(quick ? 9 : 41, quick ? 100 : 200);
  js << "  \"prefix_lookup\": {\"tokens\": 4097, \"block_size\": 16, \"hit_blocks\": " << f.hit_blocks
     << ",\n    \"lookup_us\": " << us(f.lookup) << ",\n    \"hash_only_us\": " << us(f.hash_only)
     << ",\n    \"miss_first_block_us\": " << us(f.miss) << "},\n";
  js << "  \"goals\": {\"pool_alloc_free_pairs_per_s_min\": 1e7, \"prefix_lookup_256_blocks_us_max\": 20}\n}\n";
  const std::string s = js.str();
  std::fputs(s.c_str(), stdout);
  if (!out_path.empty()) {
    std::ofstream f_out(out_path);
    f_out << s;
    if (!f_out) {
      std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
      return 1;
    }
  }
  return f.hit_blocks == 256 ? 0 : 1;
}
