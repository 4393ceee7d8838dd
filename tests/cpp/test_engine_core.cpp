// EngineCore / Scheduler unit tests: token budget and chunked prefill, batch layout, preemption
// by recompute, n > 1 fork with copy-on-write, prompt-only and prompt-logprob requests, rejection
// messages, aborts, in-flight steps and cancellation. Every test ends with no KV block leaked.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "pagedllm/engine_core.h"
#include "pagedllm/errors.h"
#include "engine_test_util.h"

using namespace pagedllm;
using namespace pagedllm::test_util;

namespace {

void expect_slots_match_block_tables(const SchedulerOutput& out, int32_t bs) {
  for (int32_t row = 0; row < out.num_seqs; ++row) {
    const int32_t* bt = out.block_tables.data() + row * out.max_blocks_per_seq;
    for (int32_t t = out.query_start_loc[row]; t < out.query_start_loc[row + 1]; ++t) {
      const int64_t p = out.positions[t];
      EXPECT_EQ(out.slot_mapping[t], int64_t{bt[p / bs]} * bs + p % bs);
    }
    EXPECT_EQ(out.positions[out.query_start_loc[row + 1] - 1] + 1, out.seq_lens[row]);
  }
}


}  // namespace

TEST(EngineCore, ChunkedPrefillUnderTokenBudget) {
  EngineCore core(make_config(64, /*budget=*/16));
  const auto prompt = iota_tokens(40);
  core.add_request("a", prompt, params(2));
  std::vector<int32_t> chunks;
  for (int i = 0; i < 3; ++i) {
    SchedulerOutput& out = core.schedule();
    ASSERT_EQ(out.num_seqs, 1);
    chunks.push_back(out.num_tokens);
    expect_slots_match_block_tables(out, 16);
    for (int32_t t = 0; t < out.num_tokens; ++t)
      EXPECT_EQ(out.input_ids[t], prompt[out.positions[t]]);
    EXPECT_EQ(out.num_sampled, i == 2 ? 1 : 0);  // only the last chunk samples
    std::vector<int32_t> sampled(out.num_sampled, 5);
    core.update_from_output(out, sampled);
    core.release(out);
  }
  EXPECT_EQ(chunks, (std::vector<int32_t>{16, 16, 8}));
  EXPECT_EQ(core.stats().num_chunked_prefills, 2);
  auto r = step(core);
  ASSERT_EQ(r->finished.size(), 1u);
  EXPECT_EQ(r->finished[0].finish_reason, FinishReason::kLength);
  expect_idle_no_leak(core);
}

TEST(EngineCore, DecodesFirstThenPrefillsInOneStep) {
  EngineCore core(make_config(64, 64));
  core.add_request("a", iota_tokens(10), params(5));
  step(core);  // a's prompt
  core.add_request("b", iota_tokens(20), params(5));
  SchedulerOutput& out = core.schedule();
  EXPECT_EQ(out.num_seqs, 2);
  EXPECT_EQ(out.num_decode_seqs, 1);
  EXPECT_EQ(out.num_prefill_seqs, 1);
  EXPECT_EQ(out.num_tokens, 21);
  EXPECT_EQ(out.query_start_loc[1], 1);
  EXPECT_EQ(out.seq_lens[0], 11);
  EXPECT_EQ(out.seq_lens[1], 20);
  EXPECT_EQ(out.input_ids[0], 7);  // a's sampled token
  EXPECT_EQ(out.max_query_len, 20);
  ASSERT_EQ(out.num_sampled, 2);
  EXPECT_EQ(out.logits_indices[0], 0);
  EXPECT_EQ(out.logits_indices[1], 20);
  ASSERT_EQ(out.new_seqs.size(), 1u);
  EXPECT_EQ(out.new_seqs[0].request_id, "b");
  expect_slots_match_block_tables(out, 16);
  std::vector<int32_t> sampled{1, 2};
  auto r = core.update_from_output(out, sampled);
  core.release(out);
  EXPECT_EQ(r->token_ids, (std::vector<int32_t>{1, 2}));
  while (core.has_unfinished_requests()) step(core);
  expect_idle_no_leak(core);
}

TEST(EngineCore, PreemptionByRecomputeReplaysExactly) {
  // 4 blocks of 16 tokens; two requests of 30-token prompts grow until one must give way.
  EngineConfig cfg = make_config(4, 64);
  cfg.enable_prefix_caching = false;
  EngineCore core(cfg);
  RequestParams p = params(20);
  p.arrival_time = 1.0;
  core.add_request("early", iota_tokens(30), p);
  p.arrival_time = 2.0;
  const SeqId late = core.add_request("late", iota_tokens(30, 500), p);
  int step_no = 0;
  bool saw_replay = false;
  std::vector<int32_t> late_outputs;
  while (core.has_unfinished_requests()) {
    SchedulerOutput& out = core.schedule();
    ASSERT_GT(out.num_tokens, 0) << "no progress at step " << step_no;
    std::vector<int32_t> sampled(out.num_sampled);
    for (int32_t r = 0; r < out.num_sampled; ++r) sampled[r] = 1000 + step_no;
    for (int32_t row = 0; row < out.num_seqs; ++row) {
      if (out.seq_ids[row] != late || core.stats().num_preemptions == 0) continue;
      const int32_t q0 = out.query_start_loc[row], q1 = out.query_start_loc[row + 1];
      if (q1 - q0 > 30) {  // replay: prompt + the outputs generated before preemption
        saw_replay = true;
        EXPECT_EQ(out.positions[q0], 0);
        for (int32_t k = 0; k < static_cast<int32_t>(late_outputs.size()) && 30 + k < q1 - q0; ++k)
          EXPECT_EQ(out.input_ids[q0 + 30 + k], late_outputs[k]);
      }
    }
    auto res = core.update_from_output(out, sampled);
    for (size_t k = 0; k < res->seq_ids.size(); ++k)
      if (res->seq_ids[k] == late) late_outputs.push_back(res->token_ids[k]);
    core.release(out);
    ++step_no;
  }
  EXPECT_GE(core.stats().num_preemptions, 1);
  EXPECT_TRUE(saw_replay);
  EXPECT_GT(core.stats().num_recomputed_tokens, 30);
  EXPECT_EQ(late_outputs.size(), 20u);
  expect_idle_no_leak(core);
}

TEST(EngineCore, ForkNSharesPromptAndCopiesOnWrite) {
  EngineCore core(make_config(64, 64));
  core.add_request("r", iota_tokens(20), params(3, /*n=*/3));
  SchedulerOutput& out = core.schedule();
  EXPECT_EQ(out.num_seqs, 1);  // the prompt is computed once
  ASSERT_EQ(out.num_sampled, 3);
  EXPECT_EQ(out.logits_indices[0], 19);
  EXPECT_EQ(out.logits_indices[1], 19);
  EXPECT_EQ(out.logits_indices[2], 19);
  EXPECT_EQ(out.new_seqs.size(), 3u);
  std::vector<int32_t> sampled{1, 2, 3};
  core.update_from_output(out, sampled);
  core.release(out);
  SchedulerOutput& out2 = core.schedule();
  EXPECT_EQ(out2.num_seqs, 3);
  EXPECT_EQ(out2.num_decode_seqs, 3);
  // The prompt's second block (4 of 16 tokens used) is shared: two copy-on-write copies, the last
  // writer keeps the original. The first (full) block stays shared by all three.
  EXPECT_EQ(out2.num_copies(), 2);
  for (int32_t row = 1; row < 3; ++row)
    EXPECT_EQ(out2.block_tables[row * out2.max_blocks_per_seq], out2.block_tables[0]);
  std::vector<int32_t> ids(out2.input_ids.begin(), out2.input_ids.begin() + 3);
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 3}));
  expect_slots_match_block_tables(out2, 16);
  core.update_from_output(out2, std::vector<int32_t>{4, 4, 4});
  core.release(out2);
  auto r = step(core);
  EXPECT_EQ(r->finished.size(), 3u);
  ASSERT_EQ(r->request_finished.size(), 1u);
  EXPECT_EQ(core.stats().num_forks, 2);
  expect_idle_no_leak(core);
}

TEST(EngineCore, PromptOnlyRequestFinishesWithLength) {
  EngineCore core(make_config(64, 64));
  core.add_request("echo", iota_tokens(12), params(0));
  SchedulerOutput& out = core.schedule();
  EXPECT_EQ(out.num_tokens, 12);
  EXPECT_EQ(out.num_sampled, 0);
  auto r = core.update_from_output(out, std::vector<int32_t>{});
  core.release(out);
  ASSERT_EQ(r->finished.size(), 1u);
  EXPECT_EQ(r->finished[0].finish_reason, FinishReason::kLength);
  EXPECT_EQ(r->request_finished, (std::vector<std::string>{"echo"}));
  EXPECT_TRUE(r->token_ids.empty());
  expect_idle_no_leak(core);
}

TEST(EngineCore, PromptLogprobRequestsSkipPrefixHitsButCacheBlocks) {
  EngineCore core(make_config(64, 64));
  const auto prompt = iota_tokens(40);
  RequestParams lp = params(1);
  lp.prompt_logprobs = true;
  core.add_request("first", prompt, lp);  // computes and caches 2 full blocks
  SchedulerOutput& out = core.schedule();
  ASSERT_EQ(out.prompt_logprob_rows.size(), 1u);
  EXPECT_EQ(out.prompt_logprob_rows[0].first_row, 0);
  EXPECT_EQ(out.prompt_logprob_rows[0].num_rows, 39);
  EXPECT_EQ(out.prompt_logprob_rows[0].first_position, 0);
  core.update_from_output(out, std::vector<int32_t>{1});
  core.release(out);
  core.add_request("lp", prompt, lp);
  SchedulerOutput& out2 = core.schedule();
  EXPECT_EQ(out2.num_tokens, 40);  // no hit for a prompt-logprob request
  core.update_from_output(out2, std::vector<int32_t>{1});
  core.release(out2);
  core.add_request("plain", prompt, params(1));
  SchedulerOutput& out3 = core.schedule();
  EXPECT_EQ(out3.num_tokens, 8);  // 32 cached tokens skipped
  EXPECT_EQ(out3.positions[0], 32);
  EXPECT_TRUE(out3.prompt_logprob_rows.empty());
  core.update_from_output(out3, std::vector<int32_t>{1});
  core.release(out3);
  EXPECT_EQ(core.stats().prefix_cache_hits, 32);
  EXPECT_EQ(core.stats().prefix_cache_queries, 40);
  expect_idle_no_leak(core);
}

TEST(EngineCore, ChunkedPromptLogprobRowsCoverEachPositionOnce) {
  EngineCore core(make_config(64, 16));
  RequestParams lp = params(1);
  lp.prompt_logprobs = true;
  core.add_request("lp", iota_tokens(40), lp);
  std::vector<int32_t> covered;
  while (core.has_unfinished_requests()) {
    SchedulerOutput& out = core.schedule();
    for (const auto& rows : out.prompt_logprob_rows)
      for (int32_t i = 0; i < rows.num_rows; ++i) {
        EXPECT_EQ(out.positions[rows.first_row + i], rows.first_position + i);
        covered.push_back(rows.first_position + i);
      }
    core.update_from_output(out, std::vector<int32_t>(out.num_sampled, 1));
    core.release(out);
  }
  std::vector<int32_t> expected(39);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(covered, expected);
}

TEST(EngineCore, RejectsRequestsThatCanNeverRun) {
  EngineCore core(make_config(8, 64, 4, 256));
  auto expect_error = [&](const std::string& id, std::vector<int32_t> prompt, RequestParams p,
                          std::vector<std::string> parts) {
    try {
      core.add_request(id, prompt, p);
      ADD_FAILURE() << "expected InvalidArgument for " << id;
    } catch (const InvalidArgument& e) {
      for (const auto& part : parts)
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what() << " lacks " << part;
    }
  };
  expect_error("long", iota_tokens(256), params(1), {"256", "max_model_len"});
  expect_error("sum", iota_tokens(200), params(57), {"200", "57", "257", "max_model_len (256)"});
  expect_error("pool", iota_tokens(100), params(100), {"200 tokens", "13 KV blocks", "num_blocks = 8"});
  expect_error("unbounded", iota_tokens(10), params(-1), {"256", "num_blocks = 8"});
  expect_error("n", iota_tokens(10), params(5, 5), {"n must be", "5"});
  expect_error("neg", {1, -3}, params(5), {"-3"});
  expect_error("empty", {}, params(5), {"empty"});
  RequestParams bad = params(3);
  bad.min_tokens = 4;
  expect_error("min", iota_tokens(10), bad, {"min_tokens (4)", "max_tokens (3)"});
  core.add_request("ok", iota_tokens(10), params(5));
  expect_error("ok", iota_tokens(10), params(5), {"already in use"});
  EXPECT_EQ(core.stats().num_unfinished_requests, 1);
  EXPECT_TRUE(core.abort_request("ok"));
  expect_idle_no_leak(core);
  EXPECT_THROW(EngineCore(make_config(0)), InvalidArgument);
  EngineConfig nochunk = make_config(8, 64, 4, 256);
  nochunk.enable_chunked_prefill = false;
  EXPECT_THROW({ EngineCore c(nochunk); }, InvalidArgument);
  EngineConfig badpolicy = make_config(8);
  badpolicy.scheduling_policy = "random";
  EXPECT_THROW({ EngineCore c(badpolicy); }, InvalidArgument);
}

TEST(EngineCore, AbortFreesBlocksAndIgnoresInFlightRows) {
  EngineCore core(make_config(64, 64));
  core.add_request("a", iota_tokens(20), params(10));
  core.add_request("b", iota_tokens(20, 300), params(2));
  SchedulerOutput& out = core.schedule();
  ASSERT_EQ(out.num_sampled, 2);
  EXPECT_TRUE(core.abort_request("a"));  // while its step is in flight
  EXPECT_FALSE(core.abort_request("a"));
  auto r = core.update_from_output(out, std::vector<int32_t>{1, 2});
  core.release(out);
  ASSERT_EQ(r->token_ids.size(), 1u);  // a's row ignored
  EXPECT_EQ(r->token_ids[0], 2);
  step(core);
  EXPECT_EQ(core.stats().num_aborted_requests, 1);
  expect_idle_no_leak(core);
}

TEST(EngineCore, SecondStepSkipsInFlightSequencesAndPoolIsBounded) {
  EngineCore core(make_config(64, 64));
  core.add_request("a", iota_tokens(20), params(3));
  SchedulerOutput& s1 = core.schedule();
  core.add_request("b", iota_tokens(20, 400), params(3));
  SchedulerOutput& s2 = core.schedule();  // a is in flight: only b
  EXPECT_NE(&s1, &s2);
  ASSERT_EQ(s2.num_seqs, 1);
  EXPECT_NE(s2.seq_ids[0], s1.seq_ids[0]);
  SchedulerOutput& s3 = core.schedule();  // nothing left to run
  EXPECT_EQ(s3.num_tokens, 0);
  EXPECT_EQ(core.num_outputs_held(), 3);
  EXPECT_THROW(core.update_from_output(s1, std::vector<int32_t>{1, 2}), InvalidArgument);
  core.update_from_output(s1, std::vector<int32_t>{1});
  EXPECT_THROW(core.update_from_output(s1, std::vector<int32_t>{1}), InvalidArgument);
  core.update_from_output(s2, std::vector<int32_t>{1});
  core.release(s1);
  core.release(s2);
  core.release(s3);
  while (core.has_unfinished_requests()) step(core);
  expect_idle_no_leak(core);
  std::vector<SchedulerOutput*> held;
  EXPECT_THROW(
      {
        for (int i = 0; i < 100; ++i) held.push_back(&core.schedule());
      },
      std::runtime_error);
  for (auto* o : held) core.release(*o);
}

TEST(EngineCore, MaxStepSeqsSplitsSequencesOverStepsInFlight) {
  // pipeline parallelism: each step in flight takes its share; the shares are disjoint, and a
  // sequence is scheduled again once its step is updated
  EngineCore core(make_config(64, 256));
  for (int i = 0; i < 5; ++i) core.add_request(std::string(1, static_cast<char>('a' + i)), iota_tokens(8, 100 * i), params(3));
  EXPECT_EQ(core.num_waiting_seqs(), 5);
  SchedulerOutput& s1 = core.schedule(2);
  SchedulerOutput& s2 = core.schedule(2);
  SchedulerOutput& s3 = core.schedule(2);
  ASSERT_EQ(s1.num_seqs, 2);
  ASSERT_EQ(s2.num_seqs, 2);
  ASSERT_EQ(s3.num_seqs, 1);
  EXPECT_EQ(core.num_running_seqs(), 5);
  std::vector<int64_t> seen;
  for (auto* s : {&s1, &s2, &s3})
    for (int32_t r = 0; r < s->num_seqs; ++r) seen.push_back(s->seq_ids[r]);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()) - seen.begin(), 5);
  EXPECT_THROW(core.schedule(-1), InvalidArgument);
  core.update_from_output(s1, std::vector<int32_t>{1, 1});
  core.release(s1);
  SchedulerOutput& s4 = core.schedule(2);  // s1's sequences, decoding
  ASSERT_EQ(s4.num_seqs, 2);
  EXPECT_EQ(s4.num_tokens, 2);
  for (auto* s : {&s2, &s3, &s4}) {
    core.update_from_output(*s, std::vector<int32_t>(s->num_sampled, 1));
    core.release(*s);
  }
  while (core.has_unfinished_requests()) step(core);
  expect_idle_no_leak(core);
}

TEST(EngineCore, ReleaseWithoutUpdateRecomputesLater) {
  EngineCore core(make_config(64, 64));
  core.add_request("a", iota_tokens(20), params(2));
  step(core);  // prompt done, 1 token
  SchedulerOutput& out = core.schedule();
  EXPECT_EQ(out.num_tokens, 1);
  core.release(out);  // the model failed: the step is cancelled
  EXPECT_EQ(core.stats().num_waiting, 1);
  SchedulerOutput& again = core.schedule();
  EXPECT_EQ(again.num_tokens, 5);  // prompt hit (16 tokens cached): positions 16..20 incl. the output
  EXPECT_EQ(again.positions[again.num_tokens - 1], 20);
  auto r = core.update_from_output(again, std::vector<int32_t>{9});
  core.release(again);
  ASSERT_EQ(r->finished.size(), 1u);
  expect_idle_no_leak(core);
}

TEST(EngineCore, MaxNumSeqsCountsReservedForkSlots) {
  EngineCore core(make_config(256, 512, /*max_num_seqs=*/4));
  core.add_request("n3", iota_tokens(10), params(4, 3));
  core.add_request("x", iota_tokens(10, 200), params(4));
  core.add_request("y", iota_tokens(10, 300), params(4));
  SchedulerOutput& out = core.schedule();
  EXPECT_EQ(out.num_seqs, 2);  // n3 holds 3 slots, x the 4th; y waits
  EXPECT_EQ(out.num_sampled, 4);
  core.update_from_output(out, std::vector<int32_t>(4, 1));
  core.release(out);
  while (core.has_unfinished_requests()) {
    SchedulerOutput& o = core.schedule();
    EXPECT_LE(o.num_seqs, 4);
    EXPECT_LE(core.stats().num_running, 4);
    core.update_from_output(o, std::vector<int32_t>(o.num_sampled, 1));
    core.release(o);
  }
  expect_idle_no_leak(core);
}

TEST(EngineCore, PriorityPolicyPreemptsLeastUrgent) {
  EngineConfig cfg = make_config(4, 64);
  cfg.scheduling_policy = "priority";
  cfg.enable_prefix_caching = false;
  EngineCore core(cfg);
  RequestParams urgent = params(30);
  urgent.priority = 0;
  urgent.arrival_time = 5.0;
  RequestParams lazy = params(30);
  lazy.priority = 1;
  lazy.arrival_time = 0.0;
  const SeqId lazy_id = core.add_request("lazy", iota_tokens(30), lazy);
  core.add_request("urgent", iota_tokens(30, 700), urgent);
  SeqId first_victim = -1;
  while (core.has_unfinished_requests()) {
    const int64_t before = core.stats().num_preemptions;
    SchedulerOutput& o = core.schedule();
    if (before == 0 && core.stats().num_preemptions > 0) {
      // the lazy one is no longer among the running rows
      for (int32_t row = 0; row < o.num_seqs; ++row) EXPECT_NE(o.seq_ids[row], lazy_id);
      first_victim = lazy_id;
    }
    core.update_from_output(o, std::vector<int32_t>(o.num_sampled, 1));
    core.release(o);
  }
  EXPECT_EQ(first_victim, lazy_id);
  expect_idle_no_leak(core);
}

TEST(EngineCore, StopTokenAndEosAndFinishSequence) {
  EngineCore core(make_config(64, 64));
  RequestParams p = params(10);
  p.eos_token_ids = {2};
  p.stop_token_ids = {9};
  core.add_request("eos", iota_tokens(5), p);
  core.add_request("stop", iota_tokens(5, 50), p);
  const SeqId s3 = core.add_request("str", iota_tokens(5, 90), p);
  SchedulerOutput& out = core.schedule();
  ASSERT_EQ(out.num_sampled, 3);
  auto r = core.update_from_output(out, std::vector<int32_t>{2, 9, 4});
  core.release(out);
  ASSERT_EQ(r->finished.size(), 2u);
  EXPECT_EQ(r->finished[0].request_id, "eos");
  EXPECT_EQ(r->finished[0].finish_reason, FinishReason::kStop);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(r->finished[0].stop_reason));
  EXPECT_EQ(r->finished[1].request_id, "stop");
  EXPECT_EQ(std::get<int32_t>(r->finished[1].stop_reason), 9);
  EXPECT_EQ(r->token_ids, (std::vector<int32_t>{2, 9, 4}));  // stop tokens are kept
  EXPECT_TRUE(core.finish_sequence(s3, std::string("</s>")));
  EXPECT_THROW(core.finish_sequence(s3, std::monostate{}), InvalidArgument);
  EXPECT_EQ(core.stats().num_finished_requests, 3);
  expect_idle_no_leak(core);
}

TEST(EngineCore, RunningDecodesComeBeforeRunningPromptChunks) {
  EngineCore core(make_config(64, /*budget=*/16));
  core.add_request("long", iota_tokens(40), params(2));
  SchedulerOutput& s1 = core.schedule();  // long: first 16-token chunk
  ASSERT_EQ(s1.num_tokens, 16);
  core.add_request("short", iota_tokens(8, 500), params(3));
  SchedulerOutput& s2 = core.schedule();  // long is in flight: short's whole prompt
  ASSERT_EQ(s2.num_tokens, 8);
  core.update_from_output(s1, std::vector<int32_t>{});
  core.update_from_output(s2, std::vector<int32_t>{1});
  core.release(s1);
  core.release(s2);
  // running order is [long, short]; short's decode still goes first and long gets the rest.
  SchedulerOutput& s3 = core.schedule();
  ASSERT_EQ(s3.num_seqs, 2);
  EXPECT_EQ(s3.num_decode_seqs, 1);
  EXPECT_EQ(s3.seq_lens[0], 9);
  EXPECT_EQ(s3.num_tokens, 16);
  EXPECT_EQ(s3.seq_lens[1], 31);
  core.update_from_output(s3, std::vector<int32_t>{1});
  core.release(s3);
  while (core.has_unfinished_requests()) step(core);
  expect_idle_no_leak(core);
}
