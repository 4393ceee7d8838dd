#include "pagedllm/spec_decode.h"

#include <algorithm>

#include "pagedllm/errors.h"

namespace pagedllm {

void SpeculativeConfig::validate() const {
  PAGEDLLM_CHECK(num_speculative_tokens >= 0 && num_speculative_tokens <= 64,
                 "num_speculative_tokens must be in [0, 64], got ", num_speculative_tokens);
  if (!enabled()) return;
  PAGEDLLM_CHECK(prompt_lookup_min >= 1 && prompt_lookup_min <= prompt_lookup_max,
                 "need 1 <= prompt_lookup_min <= prompt_lookup_max, got prompt_lookup_min=",
                 prompt_lookup_min, " and prompt_lookup_max=", prompt_lookup_max);
  PAGEDLLM_CHECK(disable_by_batch_size >= 0, "disable_by_batch_size must be >= 0 (0: never), got ",
                 disable_by_batch_size);
}

void propose_ngram(std::span<const int32_t> t, int32_t min_n, int32_t max_n, int32_t max_k,
                   std::vector<int32_t>* out) {
  out->clear();
  const int64_t L = static_cast<int64_t>(t.size());
  if (max_k <= 0) return;
  for (int64_t n = std::min<int64_t>(max_n, L - 1); n >= min_n; --n) {
    const int32_t* suffix = t.data() + (L - n);
    // earlier starts i in [0, L - n): the suffix itself (i = L - n) excluded
    for (int64_t i = 0; i + n < L; ++i) {
      if (t[i] != suffix[0] || !std::equal(suffix, suffix + n, t.data() + i)) continue;
      const int64_t from = i + n;
      const int64_t to = std::min<int64_t>(L, from + max_k);
      out->assign(t.data() + from, t.data() + to);
      return;
    }
  }
}

}  // namespace pagedllm
