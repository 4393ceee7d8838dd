// pagedllm/cpu_comm.h — collectives among the processes of one host through shared memory: the
// all-reduce and all-gather of CPU tensor parallelism (each rank a process holding a model shard).
//
// Why not gloo: gloo's TCP all-reduce of one decode row measured 2.5-12 ms on the 2-core dev VM
// (sockets and worker-thread hand-offs), against a few microseconds here (bench/tp_comm.py).
//
// Region (region_bytes(world_size, buffer_bytes) bytes, zero-filled when created, mapped by every
// rank at any address):
//   [0, 64)                       header: int64 abort flag (nonzero: every wait for a missing rank throws)
//   per rank r, 64 + r * 64       int64 generation flag: the last round whose data rank r wrote
//   then per rank r, two buffers of buffer_bytes (round parity)
//
// Protocol ("one-shot": every rank reads every rank's data): round g (g = 1, 2, ... per
// communicator, the same sequence on every rank, as collectives must be called in the same order)
// copies this rank's chunk into its buffer g % 2, publishes g in its flag (release), waits until
// every flag is >= g (acquire), then reads. A buffer is rewritten in round g + 2 only after the
// writer saw every flag reach g + 1, i.e. after every rank finished reading round g: two buffers
// need no second barrier. Messages longer than buffer_bytes go in several rounds.
//
// Results are bit-identical on every rank: all_reduce sums the ranks in rank order (float32
// accumulation, one rounding for bfloat16).
//
// Waiting spins (pause), then yields the core (sched_yield), so more ranks than cores still
// progress. abort() (any process mapping the region) makes every current and later wait for a
// missing contribution throw std::runtime_error: the way out when a rank died. A collective whose
// contributions have all arrived returns its result even after an abort. Not thread-safe: one thread per rank calls.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

class ShmCommunicator {
 public:
  /// Bytes of the region for `world_size` ranks and buffers of `buffer_bytes` (a multiple of 64).
  static std::size_t region_bytes(int world_size, std::size_t buffer_bytes);

  /// `region`: region_bytes(world_size, buffer_bytes) bytes of shared memory, zero when the first
  /// rank attached (and not used by another communicator since). rank in [0, world_size),
  /// world_size in [1, 64], buffer_bytes >= 64 and a multiple of 64. Throws InvalidArgument.
  ShmCommunicator(void* region, std::size_t region_bytes, int rank, int world_size, std::size_t buffer_bytes);

  /// x (CPU, contiguous, float32 / bfloat16; InvalidArgument otherwise) <- the sum over ranks of x, in place.
  void all_reduce(const TensorView& x);

  /// out [world_size, *in.shape] (CPU, contiguous, in's dtype) <- every rank's `in` (contiguous):
  /// out[r] = rank r's in. Any dtype (bytes are copied).
  void all_gather(const TensorView& out, const TensorView& in);

  /// Returns once every rank has called barrier() as many times.
  void barrier();

  /// Make every wait on this region throw (from any rank or process mapping it).
  void abort();
  bool aborted() const;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::size_t buffer_bytes() const { return buffer_bytes_; }

 private:
  std::int64_t* flag(int r) const;
  unsigned char* buffer(int r, std::int64_t round) const;
  /// Publish round `round` (after this rank's data is in its buffer) and wait for every rank.
  void publish_and_wait(std::int64_t round);

  unsigned char* region_;
  int rank_;
  int world_size_;
  std::size_t buffer_bytes_;
  std::int64_t round_ = 0;
};

}  // namespace pagedllm
