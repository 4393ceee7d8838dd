#include "pagedllm/scheduling_policy.h"

#include <algorithm>
#include <tuple>

#include "pagedllm/errors.h"

namespace pagedllm {

SchedulingPolicy parse_scheduling_policy(const std::string& name) {
  if (name == "fcfs") return SchedulingPolicy::kFcfs;
  if (name == "priority") return SchedulingPolicy::kPriority;
  PAGEDLLM_CHECK(false, "scheduling_policy must be \"fcfs\" or \"priority\", got \"", name, "\"");
  return SchedulingPolicy::kFcfs;
}

const char* scheduling_policy_name(SchedulingPolicy policy) {
  return policy == SchedulingPolicy::kFcfs ? "fcfs" : "priority";
}

bool schedules_before(SchedulingPolicy policy, const Sequence& a, const Sequence& b) {
  const RequestParams& pa = a.request->params;
  const RequestParams& pb = b.request->params;
  if (policy == SchedulingPolicy::kPriority && pa.priority != pb.priority)
    return pa.priority < pb.priority;
  return std::tie(pa.arrival_time, a.seq_id) < std::tie(pb.arrival_time, b.seq_id);
}

Sequence* select_victim(SchedulingPolicy policy, std::span<Sequence* const> candidates) {
  PAGEDLLM_CHECK(!candidates.empty(), "select_victim: no candidates");
  Sequence* victim = candidates[0];
  for (Sequence* s : candidates.subspan(1))
    if (schedules_before(policy, *victim, *s)) victim = s;
  return victim;
}

WaitingQueue::WaitingQueue(SchedulingPolicy policy) : policy_(policy), sorted_(Less{policy}) {}

void WaitingQueue::push_back(Sequence* seq) {
  if (policy_ == SchedulingPolicy::kFcfs) fifo_.push_back(seq);
  else sorted_.insert(seq);
}

void WaitingQueue::push_front(Sequence* seq) {
  if (policy_ == SchedulingPolicy::kFcfs) fifo_.push_front(seq);
  else sorted_.insert(seq);
}

Sequence* WaitingQueue::front() const {
  return policy_ == SchedulingPolicy::kFcfs ? fifo_.front() : *sorted_.begin();
}

void WaitingQueue::pop_front() {
  if (policy_ == SchedulingPolicy::kFcfs) fifo_.pop_front();
  else sorted_.erase(sorted_.begin());
}

bool WaitingQueue::remove(Sequence* seq) {
  if (policy_ == SchedulingPolicy::kFcfs) {
    auto it = std::find(fifo_.begin(), fifo_.end(), seq);
    if (it == fifo_.end()) return false;
    fifo_.erase(it);
    return true;
  }
  return sorted_.erase(seq) > 0;
}

std::size_t WaitingQueue::size() const {
  return policy_ == SchedulingPolicy::kFcfs ? fifo_.size() : sorted_.size();
}

}  // namespace pagedllm
