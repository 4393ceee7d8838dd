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

void Sequence::bind(Request* req) {
  request = req;
  const RequestParams& p = req->params;
  prompt_tokens = req->prompt_len();
  max_tokens = p.max_tokens;
  min_tokens = p.min_tokens;
  ignore_eos = p.ignore_eos;
  prompt_done = req->forked;
  wants_prompt_logprobs = p.prompt_logprobs;
  allow_speculation = p.allow_speculation;
  const size_t total = p.eos_token_ids.size() + p.stop_token_ids.size();
  stop_ids_spill = total > static_cast<size_t>(kInlineStopIds);
  num_eos = num_stop = 0;
  if (!stop_ids_spill) {
    for (int32_t id : p.eos_token_ids) stop_ids[num_eos++] = id;
    for (int32_t id : p.stop_token_ids) stop_ids[num_eos + num_stop++] = id;
  }
}

FinishReason check_stop(const Sequence& seq, int32_t max_model_len, StopReason* stop_reason) {
  const int32_t num_outputs = seq.num_output_tokens();
  if (seq.num_tokens() >= max_model_len || (seq.max_tokens >= 0 && num_outputs >= seq.max_tokens))
    return FinishReason::kLength;
  if (num_outputs < seq.min_tokens || num_outputs == 0) return FinishReason::kNone;
  const int32_t last = seq.token_ids.back();
  bool is_eos, is_stop;
  if (!seq.stop_ids_spill) {
    const int32_t* eos = seq.stop_ids;
    is_eos = std::find(eos, eos + seq.num_eos, last) != eos + seq.num_eos;
    const int32_t* stop = eos + seq.num_eos;
    is_stop = std::find(stop, stop + seq.num_stop, last) != stop + seq.num_stop;
  } else {
    const RequestParams& p = seq.request->params;
    is_eos = std::find(p.eos_token_ids.begin(), p.eos_token_ids.end(), last) != p.eos_token_ids.end();
    is_stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), last) != p.stop_token_ids.end();
  }
  if (!seq.ignore_eos && is_eos) return FinishReason::kStop;
  if (is_stop) {
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
