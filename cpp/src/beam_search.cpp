#include "pagedllm/beam_search.h"

#include <algorithm>
#include <cmath>

#include "pagedllm/errors.h"

namespace pagedllm {

namespace {
constexpr float kMinusInf = -1.0e9f;  // HF's "impossible" score
}  // namespace

BeamSearch::BeamSearch(int32_t beam_width, float length_penalty, int32_t num_eos_ids)
    : width_(beam_width),
      keep_(std::max(2, 1 + num_eos_ids) * beam_width),
      length_penalty_(length_penalty) {
  PAGEDLLM_CHECK(beam_width >= 1, "beam_width must be >= 1, got ", beam_width);
  PAGEDLLM_CHECK(num_eos_ids >= 0, "num_eos_ids must be >= 0, got ", num_eos_ids);
  PAGEDLLM_CHECK(std::isfinite(length_penalty), "length_penalty must be finite, got ", length_penalty);
  running_.assign(static_cast<size_t>(beam_width), kMinusInf);
  running_[0] = 0.0f;
  finished_.reserve(static_cast<size_t>(beam_width) + 1);
  cands_.reserve(static_cast<size_t>(beam_width) * static_cast<size_t>(keep_));
}

float BeamSearch::length_norm(int32_t g) const {
  return static_cast<float>(std::pow(static_cast<double>(g), static_cast<double>(length_penalty_)));
}

void BeamSearch::top_candidates(std::span<const int64_t> cand_tokens,
                                std::span<const float> cand_logprobs, int32_t stride) {
  PAGEDLLM_CHECK(stride >= keep_, "beam search needs the top ", keep_, " logprobs of each beam, got ",
                 stride);
  const size_t need = static_cast<size_t>(width_) * static_cast<size_t>(stride);
  PAGEDLLM_CHECK(cand_tokens.size() >= need && cand_logprobs.size() >= need,
                 "beam search candidates: expected ", width_, " rows of ", stride, " entries");
  cands_.clear();
  for (int32_t b = 0; b < width_; ++b) {
    const int64_t* tok = cand_tokens.data() + static_cast<size_t>(b) * stride;
    const float* lp = cand_logprobs.data() + static_cast<size_t>(b) * stride;
    for (int32_t r = 0; r < keep_; ++r) {
      PAGEDLLM_CHECK(tok[r] >= 0 && tok[r] <= INT32_MAX, "beam search candidate token id ", tok[r],
                     " is not a token id");
      cands_.push_back({running_[static_cast<size_t>(b)] + lp[r], b, r, static_cast<int32_t>(tok[r])});
    }
  }
  const size_t k = std::min(cands_.size(), static_cast<size_t>(keep_));
  std::partial_sort(cands_.begin(), cands_.begin() + static_cast<std::ptrdiff_t>(k), cands_.end(),
                    [](const Candidate& a, const Candidate& b) {
                      if (a.score != b.score) return a.score > b.score;
                      if (a.beam != b.beam) return a.beam < b.beam;
                      return a.rank < b.rank;
                    });
  cands_.resize(k);
}

void BeamSearch::add_hypothesis(BeamHypothesis hyp) {
  auto pos = std::upper_bound(finished_.begin(), finished_.end(), hyp.score,
                              [](float s, const BeamHypothesis& h) { return s > h.score; });
  if (pos == finished_.end() && static_cast<int32_t>(finished_.size()) >= width_) return;
  finished_.insert(pos, std::move(hyp));
  if (static_cast<int32_t>(finished_.size()) > width_) finished_.pop_back();
}

bool BeamSearch::advance(bool all_hit, std::vector<BeamChoice>* choices) {
  choices->clear();
  std::vector<float> next;
  next.reserve(static_cast<size_t>(width_));
  for (size_t i = 0; i < cands_.size() && static_cast<int32_t>(choices->size()) < width_; ++i) {
    if (hits_[i]) continue;
    choices->push_back({cands_[i].beam, cands_[i].token});
    next.push_back(cands_[i].score);
  }
  // Fewer than W candidates that go on (only when nearly all hit): pad with the first beam's best,
  // at an impossible score, as HF's -1e9 penalty does; the search ends in this step or the next.
  while (static_cast<int32_t>(choices->size()) < width_ && !cands_.empty()) {
    choices->push_back({cands_[0].beam, cands_[0].token});
    next.push_back(cands_[0].score + kMinusInf);
  }
  running_.assign(next.begin(), next.end());
  ++generated_;
  if (improvable_ && static_cast<int32_t>(finished_.size()) >= width_ && !running_.empty()) {
    const float best_running = *std::max_element(running_.begin(), running_.end()) / length_norm(generated_);
    improvable_ = best_running > finished_.back().score;
  }
  return !improvable_ || all_hit;
}

void BeamSearch::place_running(std::span<const int32_t> place) {
  PAGEDLLM_CHECK(static_cast<int32_t>(place.size()) == width_ && running_.size() == place.size(),
                 "place_running: expected ", width_, " places");
  std::vector<float> placed(running_.size(), kMinusInf);
  for (size_t j = 0; j < place.size(); ++j) {
    PAGEDLLM_CHECK(place[j] >= 0 && place[j] < width_, "place_running: place ", place[j], " outside [0, ",
                   width_, ")");
    placed[static_cast<size_t>(place[j])] = running_[j];
  }
  running_.swap(placed);
}

}  // namespace pagedllm
