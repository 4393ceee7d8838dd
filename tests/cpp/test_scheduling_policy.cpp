// Unit tests for the stop rules (request.h) and the fcfs / priority policies (scheduling_policy.h).
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "pagedllm/errors.h"
#include "pagedllm/request.h"
#include "pagedllm/scheduling_policy.h"

using namespace pagedllm;

namespace {

struct Fixture {
  std::vector<std::unique_ptr<Request>> reqs;
  std::vector<std::unique_ptr<Sequence>> seqs;
  Sequence* make(int32_t priority, double arrival, SeqId id) {
    auto r = std::make_unique<Request>();
    r->params.priority = priority;
    r->params.arrival_time = arrival;
    r->prompt_token_ids = {1, 2, 3};
    auto s = std::make_unique<Sequence>();
    s->seq_id = id;
    s->bind(r.get());
    s->token_ids = r->prompt_token_ids;
    reqs.push_back(std::move(r));
    seqs.push_back(std::move(s));
    return seqs.back().get();
  }
};

}  // namespace

TEST(StopRules, MinTokensEosStopTokenMaxTokensMaxModelLen) {
  Fixture f;
  Sequence* s = f.make(0, 0, 0);
  RequestParams& p = s->request->params;
  p.eos_token_ids = {2};
  p.stop_token_ids = {9};
  p.min_tokens = 2;
  p.max_tokens = 5;
  s->bind(s->request);
  StopReason reason;
  s->token_ids.push_back(2);  // EOS as 1st output: below min_tokens
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kNone);
  s->token_ids.push_back(2);  // 2nd output: EOS counts now
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kStop);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(reason));
  p.ignore_eos = true;
  s->bind(s->request);
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kNone);
  s->token_ids.back() = 9;  // stop token: stop_reason is the id
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kStop);
  ASSERT_TRUE(std::holds_alternative<int32_t>(reason));
  EXPECT_EQ(std::get<int32_t>(reason), 9);
  s->token_ids.back() = 4;
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kNone);
  s->token_ids.insert(s->token_ids.end(), {4, 4, 9});  // 5 outputs = max_tokens: length first
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kLength);
  s->token_ids.resize(5);  // 2 outputs, total 5 tokens = max_model_len
  EXPECT_EQ(check_stop(*s, 5, &reason), FinishReason::kLength);
  p.max_tokens = -1;  // no max: only max_model_len limits
  s->bind(s->request);
  s->token_ids.back() = 4;
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kNone);
}

TEST(StopRules, ManyStopIdsSpillToTheRequestLists) {
  Fixture f;
  Sequence* s = f.make(0, 0, 0);
  RequestParams& p = s->request->params;
  p.eos_token_ids = {2, 3, 4};
  p.stop_token_ids = {10, 11, 12, 13, 14};  // 8 ids > the 6 kept inline
  s->bind(s->request);
  EXPECT_TRUE(s->stop_ids_spill);
  StopReason reason;
  s->token_ids.push_back(14);
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kStop);
  EXPECT_EQ(std::get<int32_t>(reason), 14);
  s->token_ids.back() = 4;
  reason = std::monostate{};
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kStop);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(reason));
  s->token_ids.back() = 9;
  EXPECT_EQ(check_stop(*s, 100, &reason), FinishReason::kNone);
}

TEST(StopRules, CacheSaltKeyStableAndNonZero) {
  EXPECT_EQ(cache_salt_key(""), 0u);
  EXPECT_NE(cache_salt_key("a"), 0u);
  EXPECT_EQ(cache_salt_key("salt"), cache_salt_key("salt"));
  EXPECT_NE(cache_salt_key("salt1"), cache_salt_key("salt2"));
  EXPECT_STREQ(finish_reason_name(FinishReason::kStop), "stop");
  EXPECT_STREQ(finish_reason_name(FinishReason::kLength), "length");
  EXPECT_STREQ(finish_reason_name(FinishReason::kAbort), "abort");
}

TEST(SchedulingPolicy, ParseNamesBadValue) {
  EXPECT_EQ(parse_scheduling_policy("fcfs"), SchedulingPolicy::kFcfs);
  EXPECT_EQ(parse_scheduling_policy("priority"), SchedulingPolicy::kPriority);
  try {
    parse_scheduling_policy("lifo");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("lifo"), std::string::npos);
  }
}

TEST(SchedulingPolicy, FcfsQueueOrderAndPreemptedToFront) {
  Fixture f;
  WaitingQueue q(SchedulingPolicy::kFcfs);
  Sequence* a = f.make(5, 1.0, 0);
  Sequence* b = f.make(0, 2.0, 1);
  Sequence* c = f.make(9, 3.0, 2);
  q.push_back(a);
  q.push_back(b);
  q.push_back(c);
  EXPECT_EQ(q.front(), a);  // priority ignored
  q.pop_front();
  q.push_front(a);  // preempted: first again
  EXPECT_EQ(q.front(), a);
  EXPECT_TRUE(q.remove(b));
  EXPECT_FALSE(q.remove(b));
  EXPECT_EQ(q.size(), 2u);
  q.pop_front();
  EXPECT_EQ(q.front(), c);
}

TEST(SchedulingPolicy, PriorityQueueOrdersByPriorityThenArrivalThenId) {
  Fixture f;
  WaitingQueue q(SchedulingPolicy::kPriority);
  Sequence* late_urgent = f.make(-1, 9.0, 0);
  Sequence* early = f.make(0, 1.0, 1);
  Sequence* same_arrival_hi_id = f.make(0, 1.0, 7);
  Sequence* lazy = f.make(3, 0.0, 2);
  for (Sequence* s : {lazy, same_arrival_hi_id, early, late_urgent}) q.push_back(s);
  std::vector<Sequence*> order;
  while (!q.empty()) {
    order.push_back(q.front());
    q.pop_front();
  }
  EXPECT_EQ(order, (std::vector<Sequence*>{late_urgent, early, same_arrival_hi_id, lazy}));
}

TEST(SchedulingPolicy, VictimIsScheduledLast) {
  Fixture f;
  Sequence* a = f.make(0, 1.0, 0);
  Sequence* b = f.make(5, 0.5, 1);  // low priority, early
  Sequence* c = f.make(0, 2.0, 2);  // latest arrival
  std::vector<Sequence*> running{a, b, c};
  EXPECT_EQ(select_victim(SchedulingPolicy::kFcfs, running), c);
  EXPECT_EQ(select_victim(SchedulingPolicy::kPriority, running), b);
  Sequence* twin = f.make(0, 2.0, 3);  // same arrival: larger seq id goes first
  running.push_back(twin);
  EXPECT_EQ(select_victim(SchedulingPolicy::kFcfs, running), twin);
  EXPECT_THROW(select_victim(SchedulingPolicy::kFcfs, std::span<Sequence* const>{}), InvalidArgument);
}
