#include "pagedllm/request.h"

#include <algorithm>

namespace pagedllm {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kNone: break;
  }
  return "";
}

FinishReason check_stop(const Sequence& seq, int32_t max_model_len, StopReason* stop_reason) {
  const RequestParams& p = seq.request->params;
  const int32_t num_outputs = seq.num_output_tokens();
  if (seq.num_tokens() >= max_model_len || (p.max_tokens >= 0 && num_outputs >= p.max_tokens))
    return FinishReason::kLength;
  if (num_outputs < p.min_tokens || num_outputs == 0) return FinishReason::kNone;
  const int32_t last = seq.token_ids.back();
  if (!p.ignore_eos &&
      std::find(p.eos_token_ids.begin(), p.eos_token_ids.end(), last) != p.eos_token_ids.end())
    return FinishReason::kStop;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), last) != p.stop_token_ids.end()) {
    if (stop_reason) *stop_reason = last;
    return FinishReason::kStop;
  }
  return FinishReason::kNone;
}

uint64_t cache_salt_key(const std::string& salt) {
  if (salt.empty()) return 0;
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64-bit offset basis
  for (unsigned char c : salt) {
    h ^= c;
    h *= 1099511628211ull;  // FNV prime
  }
  return h == 0 ? 1 : h;
}

}  // namespace pagedllm
