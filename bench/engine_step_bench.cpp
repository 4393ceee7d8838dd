// engine_step_bench: C++-only cost of one engine step (schedule + update_from_output + release)
// for N running decode sequences, without Python. With --cold, 32 MiB are swept between steps so
// the engine starts each step with cold CPU caches (as after a model forward on the host).
// Prints one JSON document.   build/dev/engine_step_bench [--cold] [--steps 300]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "pagedllm/engine_core.h"

using namespace pagedllm;
using Clock = std::chrono::steady_clock;

static double percentile(std::vector<double> v, double q) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

int main(int argc, char** argv) {
  bool cold = false;
  int steps = 300;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cold")) cold = true;
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
  }
  std::vector<char> sweep(cold ? (32u << 20) : 0);
  std::printf("{\"benchmark\": \"engine_step_bench\", \"cold_caches\": %s, \"results\": [",
              cold ? "true" : "false");
  const int sizes[] = {64, 256, 1024};
  for (int si = 0; si < 3; ++si) {
    const int n = sizes[si];
    EngineConfig cfg;
    cfg.block_size = 16;
    cfg.max_num_seqs = n;
    cfg.max_num_batched_tokens = 8192;
    cfg.max_model_len = 4096;
    cfg.num_blocks = n * ((128 + steps + 64) / 16 + 2);
    EngineCore core(cfg);
    RequestParams p;
    p.max_tokens = steps + 64;
    p.ignore_eos = true;
    std::vector<int32_t> prompt(128);
    std::iota(prompt.begin(), prompt.end(), 0);
    for (int i = 0; i < n; ++i) core.add_request("r" + std::to_string(i), prompt, p);
    std::vector<int32_t> sampled(n, 11);
    std::vector<double> sched_us, update_us, total_us;
    for (int k = 0; k < steps + 40; ++k) {
      if (cold)
        for (size_t b = 0; b < sweep.size(); b += 64) sweep[b] = static_cast<char>(sweep[b] + 1);
      auto t0 = Clock::now();
      SchedulerOutput& out = core.schedule();
      auto t1 = Clock::now();
      const bool all_decoding = out.num_decode_seqs == n;
      auto r = core.update_from_output(out, std::span<const int32_t>(sampled.data(), out.num_sampled));
      r.reset();
      core.release(out);
      auto t2 = Clock::now();
      if (k >= 40 && all_decoding) {
        sched_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        update_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
        total_us.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
      }
    }
    std::printf("%s\n  {\"running_decodes\": %d, \"steps\": %zu, \"schedule_median_us\": %.2f, "
                "\"update_median_us\": %.2f, \"median_us\": %.2f, \"p99_us\": %.2f}",
                si ? "," : "", n, total_us.size(), percentile(sched_us, 0.5),
                percentile(update_us, 0.5), percentile(total_us, 0.5), percentile(total_us, 0.99));
  }
  std::printf("\n]}\n");
  return 0;
}
