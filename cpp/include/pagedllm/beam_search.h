// pagedllm/beam_search.h — the per-request state and the selection step of beam search.
//
// A beam-search request (RequestParams::use_beam_search, beam width W = RequestParams::n) is one
// Request whose W sequences ("members") are the running beams. The KV side lives in the scheduler
// (scheduler.h, "Beam search"): members fork each other copy-on-write (PagedAttention, Kwon et
// al., SOSP 2023, section 4.4). This file is only the arithmetic of one step, so that it can be
// checked alone.
//
// Algorithm: Hugging Face transformers' GenerationMixin._beam_search (the vectorized version of
// transformers >= 4.50; do_sample=False, early_stopping=False, its default). Per step, with g
// tokens generated so far and running scores s_b (float32 sums of the beams' token logprobs;
// s = [0, -1e9, ...] before the first step, so that the W identical beams count once):
//   1. Candidates: every (b, t) with score s_b + logprob_b(t); the top beams_to_keep =
//      max(2, 1 + #eos ids) x W of them, descending. A candidate "hits" when t is an EOS id (unless
//      ignore_eos) or when g + 1 reaches max_tokens (or the model length).
//   2. Next running beams: the first W candidates that do not hit (their scores are the new s).
//   3. Finished hypotheses: a hitting candidate among the first W becomes one with score
//      (s_b + logprob) / (g + 1) ^ length_penalty, unless the early-stop heuristic was satisfied;
//      the W best hypotheses (earlier ones first on ties) are kept.
//   4. g + 1. Early-stop heuristic (sticky): once all W hypothesis slots are filled and the best
//      running score / g ^ length_penalty is not above the worst hypothesis, nothing can improve.
//   The search ends when that heuristic holds or every candidate of the step hit.
// The result is the kept hypotheses, best first: HF generate(num_beams=W, num_return_sequences=W)
// returns the same sequences and sequences_scores.
//
// Each running beam's logprob row must be the model's log_softmax over the vocabulary; only its
// top beams_to_keep entries are read (the global top beams_to_keep is among them).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "pagedllm/request.h"

namespace pagedllm {

/// A finished hypothesis: the tokens it generated (its EOS token included), the sum of their
/// logprobs, and score = cum_logprob / num_generated ^ length_penalty (HF's sequences_scores).
struct BeamHypothesis {
  std::vector<int32_t> token_ids;
  float cum_logprob = 0.0f;
  float score = 0.0f;
  FinishReason finish_reason = FinishReason::kNone;  ///< kStop (ended with EOS) or kLength
};

/// One next running beam: it continues running beam `parent` (an index in [0, W)) with `token`.
struct BeamChoice {
  int32_t parent;
  int32_t token;
};

class BeamSearch {
 public:
  /// beam_width W >= 1; num_eos_ids: how many EOS ids the request stops at (0 with ignore_eos).
  BeamSearch(int32_t beam_width, float length_penalty, int32_t num_eos_ids);

  int32_t beam_width() const { return width_; }
  /// Candidates read per running beam: max(2, 1 + num_eos_ids) x W.
  int32_t beams_to_keep() const { return keep_; }
  int32_t num_generated() const { return generated_; }
  /// Running score of beam b (the sum of its tokens' logprobs; -1e9 for beams 1.. before step 1).
  float running_score(int32_t b) const { return running_[static_cast<size_t>(b)]; }

  /// One step. cand_tokens / cand_logprobs: [W][stride] row-major, row b = running beam b's top
  /// tokens, descending, of which the first beams_to_keep() are read (stride >= that).
  /// is_eos(token) says whether a token hits; at_length: every candidate hits (g + 1 reaches the
  /// length limit). generated(b): beam b's generated tokens so far (for new hypotheses).
  /// Fills *choices with the W next running beams (in running-beam order: choice j becomes
  /// running beam j) and returns true when the search is over (then finished() is the result).
  template <typename IsEos, typename Generated>
  bool step(std::span<const int64_t> cand_tokens, std::span<const float> cand_logprobs,
            int32_t stride, bool at_length, IsEos&& is_eos, Generated&& generated,
            std::vector<BeamChoice>* choices);

  /// Give the running beams their places: choice j of the last step() becomes running beam
  /// place[j] (a permutation of [0, W)), so that a beam can stay where its sequence is.
  void place_running(std::span<const int32_t> place);

  /// Kept hypotheses, best first (at most W; W once the search is over).
  const std::vector<BeamHypothesis>& finished() const { return finished_; }
  std::vector<BeamHypothesis>& finished() { return finished_; }

 private:
  struct Candidate {
    float score;
    int32_t beam;
    int32_t rank;
    int32_t token;
  };
  /// Top keep_ candidates of the step into cands_ (descending; ties: lower beam, then rank).
  void top_candidates(std::span<const int64_t> cand_tokens, std::span<const float> cand_logprobs,
                      int32_t stride);
  /// HF's length normalisation g ^ length_penalty (float32, as its tensors).
  float length_norm(int32_t g) const;
  /// Insert a hypothesis, keeping the best W (an equal score does not displace an earlier one).
  void add_hypothesis(BeamHypothesis hyp);
  /// Steps 2 and 4 after the hypotheses were added; returns true when the search is over.
  bool advance(bool all_hit, std::vector<BeamChoice>* choices);

  int32_t width_;
  int32_t keep_;
  float length_penalty_;
  int32_t generated_ = 0;
  bool improvable_ = true;  ///< HF's is_early_stop_heuristic_unsatisfied
  std::vector<float> running_;
  std::vector<BeamHypothesis> finished_;
  std::vector<Candidate> cands_;
  std::vector<uint8_t> hits_;
};

template <typename IsEos, typename Generated>
bool BeamSearch::step(std::span<const int64_t> cand_tokens, std::span<const float> cand_logprobs,
                      int32_t stride, bool at_length, IsEos&& is_eos, Generated&& generated,
                      std::vector<BeamChoice>* choices) {
  top_candidates(cand_tokens, cand_logprobs, stride);
  const size_t n = cands_.size();
  hits_.assign(n, 0);
  bool all_hit = true;
  for (size_t i = 0; i < n; ++i) {
    hits_[i] = at_length || is_eos(cands_[i].token);
    all_hit = all_hit && hits_[i];
  }
  if (improvable_) {
    const float norm = length_norm(generated_ + 1);
    for (size_t i = 0; i < n && i < static_cast<size_t>(width_); ++i) {
      if (!hits_[i]) continue;
      const Candidate& c = cands_[i];
      BeamHypothesis hyp;
      std::span<const int32_t> prefix = generated(c.beam);
      hyp.token_ids.reserve(prefix.size() + 1);
      hyp.token_ids.assign(prefix.begin(), prefix.end());
      hyp.token_ids.push_back(c.token);
      hyp.cum_logprob = c.score;
      hyp.score = c.score / norm;
      hyp.finish_reason = at_length && !is_eos(c.token) ? FinishReason::kLength : FinishReason::kStop;
      add_hypothesis(std::move(hyp));
    }
  }
  return advance(all_hit, choices);
}

}  // namespace pagedllm
