// pagedllm/scheduling_policy.h — the order in which sequences are scheduled and preempted.
//
// Two policies, as vLLM's `scheduling_policy`:
//   "fcfs"     first come, first served: the waiting queue is in arrival (add) order, a
//              preempted sequence goes back to its FRONT; the preemption victim is the running
//              sequence that arrived last (largest (arrival_time, seq_id)).
//   "priority" the waiting queue is ordered by (priority, arrival_time, seq_id), lower first
//              (lower priority value = more urgent, as vLLM); the victim is the running sequence
//              with the largest such key (lowest priority, latest arrival).
// Source: vLLM v1 scheduler (vllm/v1/core/sched/scheduler.py, request_queue.py).
#pragma once

#include <cstddef>
#include <deque>
#include <set>
#include <span>
#include <string>

#include "pagedllm/request.h"

namespace pagedllm {

enum class SchedulingPolicy : int8_t { kFcfs, kPriority };

/// "fcfs" or "priority"; throws InvalidArgument naming any other value.
SchedulingPolicy parse_scheduling_policy(const std::string& name);
const char* scheduling_policy_name(SchedulingPolicy policy);

/// True when `a` is scheduled before (is more urgent than) `b` under `policy`.
bool schedules_before(SchedulingPolicy policy, const Sequence& a, const Sequence& b);

/// The preemption victim among `candidates` (non-empty): the one scheduled last.
Sequence* select_victim(SchedulingPolicy policy, std::span<Sequence* const> candidates);

/// The waiting queue. fcfs: a deque (push_back on arrival, push_front on preemption).
/// priority: kept sorted by schedules_before (both pushes insert by key). O(log n) or O(1)
/// push/pop; remove() is O(n) for fcfs (aborts only).
class WaitingQueue {
 public:
  explicit WaitingQueue(SchedulingPolicy policy);

  void push_back(Sequence* seq);   ///< a new arrival
  void push_front(Sequence* seq);  ///< a preempted sequence: first in line (fcfs)
  Sequence* front() const;         ///< requires !empty()
  void pop_front();
  bool remove(Sequence* seq);  ///< false when absent
  std::size_t size() const;
  bool empty() const { return size() == 0; }
  SchedulingPolicy policy() const { return policy_; }

 private:
  struct Less {
    SchedulingPolicy policy;
    bool operator()(const Sequence* a, const Sequence* b) const {
      return schedules_before(policy, *a, *b);
    }
  };
  SchedulingPolicy policy_;
  std::deque<Sequence*> fifo_;
  std::set<Sequence*, Less> sorted_;
};

}  // namespace pagedllm
