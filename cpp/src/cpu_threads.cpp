// Thread count of the CPU kernels (pagedllm/attention.h: set_num_threads / get_num_threads).
#include <omp.h>

#include <algorithm>
#include <atomic>

#include "pagedllm/attention.h"

namespace pagedllm {

namespace {
std::atomic<int> g_num_threads{0};  // 0 = default (all available cores)
}

void set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0); }

int get_num_threads() {
  const int n = g_num_threads.load();
  return n > 0 ? n : std::max(1, omp_get_max_threads());
}

}  // namespace pagedllm
