// Async scheduling (EngineConfig::async_scheduling, pagedllm/scheduler.h): a sequence sampled in
// step N and still in flight gets a placeholder decode in step N + 1, whose token id the runner
// takes from step N's sampled row (prev_sample_rows). Checked here: the placeholder rows (ids,
// positions, slots, sampled rows), the token lists against synchronous scheduling, the length
// rule (no placeholder for a token that ends the sequence), a stop token in step N (the row of
// N + 1 is ignored and its blocks are freed), prompt chunks while the previous chunk is in flight,
// forks, cancellation of both in-flight steps, the step-order check, and that off means off.
// Every test ends with no KV block leaked.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "pagedllm/engine_core.h"
#include "pagedllm/errors.h"
#include "engine_test_util.h"
#include "test_util.h"

using namespace pagedllm;
using namespace pagedllm::test_util;

namespace {

/// test_util::make_config with async scheduling on (or off).
EngineConfig async_config(int32_t num_blocks, bool async = true, int32_t budget = 64) {
  EngineConfig c = make_config(num_blocks, budget);
  c.async_scheduling = async;
  return c;
}

/// The token a deterministic "model" samples for a sequence that has seen `len` tokens.
int32_t model_token(SeqId seq, int32_t len) { return 1000 + static_cast<int32_t>(seq) * 37 + len; }

/// The tokens the "model" samples for a step's sampled rows.
std::vector<int32_t> sample(const SchedulerOutput& out) {
  std::vector<int32_t> sampled(out.num_sampled);
  for (int32_t r = 0; r < out.num_sampled; ++r)
    sampled[r] = model_token(out.sample_seq_ids[r], static_cast<int32_t>(out.positions[out.logits_indices[r]]) + 1);
  return sampled;
}

/// Drives the core as the Python engine does under async scheduling (schedule N + 1, then update
/// N), checking each placeholder against the previous step's samples; returns the tokens
/// appended to each sequence. A sampled token depends only on the sequence and its length.
std::map<SeqId, std::vector<int32_t>> run_async(EngineCore& core, int* placeholders_seen) {
  std::map<SeqId, std::vector<int32_t>> known;  // the host's view: prompt + applied tokens
  SchedulerOutput* prev = nullptr;
  std::vector<int32_t> prev_sampled;
  for (int guard = 0; guard < 1000; ++guard) {
    SchedulerOutput& out = core.schedule();
    if (out.num_placeholders > 0) {
      EXPECT_NE(prev, nullptr);
      EXPECT_EQ(prev->step_id, out.step_id - 1);
      *placeholders_seen += out.num_placeholders;
      for (int32_t t = 0; t < out.num_tokens; ++t) {
        const int32_t r = out.prev_sample_rows[t];
        if (r < 0) continue;
        EXPECT_EQ(out.input_ids[t], 0);
        EXPECT_LT(r, static_cast<int32_t>(prev_sampled.size()));
        // the placeholder is the token the previous step sampled for this very sequence
        int32_t row = 0;
        while (out.query_start_loc[row + 1] <= t) ++row;
        EXPECT_EQ(prev->sample_seq_ids[r], out.seq_ids[row]);
      }
    }
    std::vector<int32_t> sampled = out.num_tokens > 0 ? sample(out) : std::vector<int32_t>{};
    if (prev != nullptr) {
      auto res = core.update_from_output(*prev, prev_sampled);
      for (size_t k = 0; k < res->seq_ids.size(); ++k) known[res->seq_ids[k]].push_back(res->token_ids[k]);
      core.release(*prev);
      prev = nullptr;
    }
    if (out.num_tokens > 0) {
      prev = &out;
      prev_sampled = sampled;
    } else {
      core.release(out);
      if (!core.has_unfinished_requests()) break;
    }
  }
  return known;
}

std::map<SeqId, std::vector<int32_t>> run_sync(EngineCore& core) {
  std::map<SeqId, std::vector<int32_t>> known;
  while (core.has_unfinished_requests()) {
    SchedulerOutput& out = core.schedule();
    EXPECT_EQ(out.num_placeholders, 0);
    auto res = core.update_from_output(out, sample(out));
    for (size_t k = 0; k < res->seq_ids.size(); ++k) known[res->seq_ids[k]].push_back(res->token_ids[k]);
    core.release(out);
  }
  return known;
}

void add_workload(EngineCore& core) {
  core.add_request("a", iota_tokens(20), params(9));
  core.add_request("b", iota_tokens(33, 300), params(17));
  core.add_request("c", iota_tokens(5, 600), params(1));   // one token: never a placeholder
  core.add_request("d", iota_tokens(70, 700), params(6));  // chunked prefill (budget 64)
  core.add_request("e", iota_tokens(12, 900), params(5, 2));  // forked
}

}  // namespace

TEST(AsyncScheduling, SameTokensAsSynchronousWithPlaceholders) {
  EngineCore sync_core(async_config(64, false));
  add_workload(sync_core);
  const auto expected = run_sync(sync_core);
  expect_idle_no_leak(sync_core);

  EngineCore core(async_config(64, true));
  add_workload(core);
  int placeholders = 0;
  const auto got = run_async(core, &placeholders);
  EXPECT_EQ(got, expected);
  EXPECT_GT(placeholders, 20);
  EXPECT_EQ(core.stats().num_generation_tokens, sync_core.stats().num_generation_tokens);
  expect_idle_no_leak(core);
}

TEST(AsyncScheduling, PlaceholderRowLayout) {
  EngineCore core(async_config(64));
  core.add_request("a", iota_tokens(16), params(4));
  SchedulerOutput& s0 = core.schedule();  // prefill, samples row 0
  ASSERT_EQ(s0.num_sampled, 1);
  EXPECT_EQ(s0.num_placeholders, 0);
  for (int32_t t = 0; t < s0.num_tokens; ++t) EXPECT_EQ(s0.prev_sample_rows[t], -1);
  SchedulerOutput& s1 = core.schedule();  // a is in flight: a placeholder decode at position 16
  ASSERT_EQ(s1.num_tokens, 1);
  EXPECT_EQ(s1.num_placeholders, 1);
  EXPECT_EQ(s1.step_id, s0.step_id + 1);
  EXPECT_EQ(s1.input_ids[0], 0);
  EXPECT_EQ(s1.prev_sample_rows[0], 0);
  EXPECT_EQ(s1.positions[0], 16);
  EXPECT_EQ(s1.seq_lens[0], 17);
  EXPECT_EQ(s1.num_sampled, 1);  // it samples the token after the placeholder
  const int32_t* bt = s1.block_tables.data();
  EXPECT_EQ(s1.slot_mapping[0], int64_t{bt[1]} * 16);  // a new block for position 16
  // update N + 1 before N: refused, nothing changed
  EXPECT_NE(test_util::error_of([&] { core.update_from_output(s1, std::vector<int32_t>{5}); })
                .find("was not updated yet"), std::string::npos);
  SchedulerOutput& s2 = core.schedule();  // a is in two steps: nothing more
  EXPECT_EQ(s2.num_tokens, 0);
  core.release(s2);
  core.update_from_output(s0, std::vector<int32_t>{41});
  core.release(s0);
  core.update_from_output(s1, std::vector<int32_t>{42});
  core.release(s1);
  SchedulerOutput& s3 = core.schedule();  // synchronous again: the known token 42 at position 17
  ASSERT_EQ(s3.num_tokens, 1);
  EXPECT_EQ(s3.num_placeholders, 0);
  EXPECT_EQ(s3.input_ids[0], 42);
  EXPECT_EQ(s3.positions[0], 17);
  core.update_from_output(s3, std::vector<int32_t>{43});
  core.release(s3);
  while (core.has_unfinished_requests()) step(core, 9);
  expect_idle_no_leak(core);
}

TEST(AsyncScheduling, NoPlaceholderForATokenThatEndsTheSequence) {
  EngineCore core(async_config(64));
  core.add_request("a", iota_tokens(16), params(2));
  SchedulerOutput& s0 = core.schedule();  // samples output 1
  SchedulerOutput& s1 = core.schedule();  // output 1 as a placeholder, samples output 2 (the last)
  EXPECT_EQ(s1.num_placeholders, 1);
  core.update_from_output(s0, std::vector<int32_t>{41});
  core.release(s0);
  SchedulerOutput& s2 = core.schedule();  // output 2 would end it by length: no placeholder
  EXPECT_EQ(s2.num_tokens, 0);
  core.release(s2);
  auto r = core.update_from_output(s1, std::vector<int32_t>{42});
  core.release(s1);
  ASSERT_EQ(r->finished.size(), 1u);
  EXPECT_EQ(r->finished[0].finish_reason, FinishReason::kLength);
  expect_idle_no_leak(core);

  // the same at max_model_len (256): a prompt of 254 gets one placeholder, for position 254
  core.add_request("b", iota_tokens(254), params(-1));
  SchedulerOutput& t0 = core.schedule();  // chunk 1 of 4 (budget 64)
  core.update_from_output(t0, {});
  core.release(t0);
  for (int i = 0; i < 3; ++i) {
    SchedulerOutput& t = core.schedule();
    core.update_from_output(t, std::vector<int32_t>(t.num_sampled, 5));
    core.release(t);
  }
  SchedulerOutput& u0 = core.schedule();  // position 254 (the token sampled at 253)
  ASSERT_EQ(u0.num_tokens, 1);
  SchedulerOutput& u1 = core.schedule();  // 256 tokens would reach max_model_len: none
  EXPECT_EQ(u1.num_tokens, 0);
  core.release(u1);
  core.update_from_output(u0, std::vector<int32_t>{6});
  core.release(u0);
  expect_idle_no_leak(core);
}

TEST(AsyncScheduling, StopTokenInStepNDropsTheRowOfStepNPlus1) {
  EngineCore core(async_config(64));
  RequestParams p = params(50);
  p.stop_token_ids = {77};
  core.add_request("a", iota_tokens(31), p);
  core.add_request("b", iota_tokens(20, 500), params(3));
  SchedulerOutput& s0 = core.schedule();
  SchedulerOutput& s1 = core.schedule();  // placeholders for a and b (a's at position 31, block 1)
  ASSERT_EQ(s1.num_placeholders, 2);
  const int32_t free_before = core.stats().num_free_blocks;
  auto r0 = core.update_from_output(s0, std::vector<int32_t>{77, 5});  // a stops on 77
  core.release(s0);
  ASSERT_EQ(r0->finished.size(), 1u);
  EXPECT_EQ(r0->finished[0].request_id, "a");
  EXPECT_GT(core.stats().num_free_blocks, free_before);  // a's blocks, the placeholder's included
  auto r1 = core.update_from_output(s1, std::vector<int32_t>{12, 6});  // a's row ignored
  core.release(s1);
  ASSERT_EQ(r1->token_ids.size(), 1u);
  EXPECT_EQ(r1->token_ids[0], 6);
  while (core.has_unfinished_requests()) step(core, 9);
  expect_idle_no_leak(core);
}

TEST(AsyncScheduling, CancellingBothInFlightStepsLeaksNothing) {
  EngineCore core(async_config(64));
  core.add_request("a", iota_tokens(20), params(30));
  core.add_request("b", iota_tokens(24, 400), params(30, 2));
  SchedulerOutput& s0 = core.schedule();
  core.update_from_output(s0, std::vector<int32_t>(s0.num_sampled, 3));
  core.release(s0);
  SchedulerOutput& s1 = core.schedule();  // decodes of a, b and b's child
  SchedulerOutput& s2 = core.schedule();  // placeholders for the sequences sampled in s1
  EXPECT_GT(s2.num_placeholders, 0);
  core.release(s2);  // the model failed on s2, and s1 is given up too
  core.release(s1);
  EXPECT_EQ(core.stats().num_running, 0);
  // every sequence recomputes from its known tokens and finishes
  int placeholders = 0;
  run_async(core, &placeholders);
  expect_idle_no_leak(core);
}

TEST(AsyncScheduling, AbortBetweenTheTwoSteps) {
  EngineCore core(async_config(64));
  core.add_request("a", iota_tokens(20), params(10));
  core.add_request("b", iota_tokens(20, 300), params(10));
  SchedulerOutput& s0 = core.schedule();
  SchedulerOutput& s1 = core.schedule();
  ASSERT_EQ(s1.num_placeholders, 2);
  EXPECT_TRUE(core.abort_request("a"));
  auto r0 = core.update_from_output(s0, std::vector<int32_t>{1, 2});
  core.release(s0);
  EXPECT_EQ(r0->token_ids.size(), 1u);
  auto r1 = core.update_from_output(s1, std::vector<int32_t>{1, 2});
  core.release(s1);
  EXPECT_EQ(r1->token_ids.size(), 1u);
  int placeholders = 0;
  run_async(core, &placeholders);
  expect_idle_no_leak(core);
}

TEST(AsyncScheduling, OffMeansNoPlaceholders) {
  EngineCore core(async_config(64, false));
  core.add_request("a", iota_tokens(20), params(5));
  SchedulerOutput& s0 = core.schedule();
  SchedulerOutput& s1 = core.schedule();
  EXPECT_EQ(s1.num_tokens, 0);
  core.release(s1);
  core.update_from_output(s0, std::vector<int32_t>{1});
  core.release(s0);
  while (core.has_unfinished_requests()) {
    SchedulerOutput& out = core.schedule();
    EXPECT_EQ(out.num_placeholders, 0);
    core.update_from_output(out, std::vector<int32_t>(out.num_sampled, 2));
    core.release(out);
  }
  expect_idle_no_leak(core);
}

TEST(AsyncScheduling, ChunkedPrefillContinuesWhileItsChunkIsInFlight) {
  EngineCore core(async_config(64, true, /*budget=*/16));
  core.add_request("a", iota_tokens(40), params(3));
  SchedulerOutput& s0 = core.schedule();  // positions 0..15
  ASSERT_EQ(s0.num_tokens, 16);
  EXPECT_EQ(s0.num_sampled, 0);
  SchedulerOutput& s1 = core.schedule();  // 16..31 while s0 is in flight: known tokens, no placeholder
  ASSERT_EQ(s1.num_tokens, 16);
  EXPECT_EQ(s1.num_placeholders, 0);
  EXPECT_EQ(s1.positions[0], 16);
  EXPECT_EQ(s1.input_ids[0], 116);
  SchedulerOutput& s2 = core.schedule();  // in two steps now: nothing
  EXPECT_EQ(s2.num_tokens, 0);
  core.release(s2);
  core.update_from_output(s0, {});
  core.release(s0);
  SchedulerOutput& s3 = core.schedule();  // the last chunk 32..39, which samples
  ASSERT_EQ(s3.num_tokens, 8);
  EXPECT_EQ(s3.positions[0], 32);
  EXPECT_EQ(s3.num_sampled, 1);
  core.update_from_output(s1, {});
  core.release(s1);
  SchedulerOutput& s4 = core.schedule();  // the first output token as a placeholder at 40
  ASSERT_EQ(s4.num_placeholders, 1);
  EXPECT_EQ(s4.positions[0], 40);
  core.update_from_output(s3, std::vector<int32_t>{7});
  core.release(s3);
  core.update_from_output(s4, std::vector<int32_t>{8});
  core.release(s4);
  while (core.has_unfinished_requests()) step(core, 9);
  expect_idle_no_leak(core);
}
