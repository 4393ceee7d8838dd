// ShmCommunicator (pagedllm/cpu_comm.h) across real processes: rank 0 is the test, ranks 1.. are
// fork()ed children over one anonymous shared mapping. Each rank draws its data from its own seed,
// so every rank can build the float64 reference of all ranks.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <vector>

#include "cpu_vec.h"
#include "pagedllm/cpu_comm.h"

using namespace pagedllm;

namespace {

struct Region {
  void* ptr;
  std::size_t bytes;
  Region(int world, std::size_t buffer_bytes) : bytes(ShmCommunicator::region_bytes(world, buffer_bytes)) {
    ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) throw std::runtime_error("mmap failed");
  }
  ~Region() { munmap(ptr, bytes); }
};

std::vector<float> rank_data(int rank, std::int64_t n) {
  std::mt19937 gen(1234 + rank);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Runs body(rank) in world processes (rank 0 here); returns whether every child exited 0.
bool run_ranks(int world, const std::function<bool(int)>& body, bool& rank0_ok) {
  std::vector<pid_t> kids;
  for (int r = 1; r < world; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      bool ok = false;
      try {
        ok = body(r);
      } catch (...) {
        ok = false;
      }
      _exit(ok ? 0 : 1);
    }
    kids.push_back(pid);
  }
  rank0_ok = body(0);
  bool all = true;
  for (pid_t pid : kids) {
    int status = 0;
    waitpid(pid, &status, 0);
    all = all && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return all;
}

}  // namespace

class ShmAllReduce : public ::testing::TestWithParam<int> {};

TEST_P(ShmAllReduce, Float32SumsEveryRankInSeveralRounds) {
  const int world = GetParam();
  const std::size_t buffer = 256;  // 64 floats per round: n = 1000 takes 16 rounds
  const std::int64_t n = 1000;
  Region region(world, buffer);
  auto body = [&](int rank) {
    ShmCommunicator comm(region.ptr, region.bytes, rank, world, buffer);
    bool ok = true;
    for (int repeat = 0; repeat < 3; ++repeat) {  // the double buffers are reused across calls
      auto x = rank_data(rank + 10 * repeat, n);
      comm.all_reduce(TensorView::contiguous(x.data(), DType::kFloat32, {n}));
      for (std::int64_t i = 0; i < n; ++i) {
        double ref = 0;
        for (int r = 0; r < world; ++r) ref += rank_data(r + 10 * repeat, n)[i];
        ok = ok && std::fabs(x[i] - ref) <= 1e-5 * (1 + std::fabs(ref));
      }
    }
    return ok;
  };
  bool rank0 = false;
  EXPECT_TRUE(run_ranks(world, body, rank0));
  EXPECT_TRUE(rank0);
}

TEST_P(ShmAllReduce, BFloat16RoundsTheFloatSumOnceAndAgreesAcrossRanks) {
  const int world = GetParam();
  const std::size_t buffer = 128;
  const std::int64_t n = 333;
  Region region(world, buffer);
  // each rank writes its result into a shared results area after the region's own use
  auto* results = static_cast<std::uint16_t*>(
      mmap(nullptr, world * n * 2, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto body = [&](int rank) {
    ShmCommunicator comm(region.ptr, region.bytes, rank, world, buffer);
    std::vector<cpu::bf16> x(n);
    auto data = rank_data(rank, n);
    for (std::int64_t i = 0; i < n; ++i) x[i] = cpu::from_float<cpu::bf16>(data[i]);
    comm.all_reduce(TensorView::contiguous(x.data(), DType::kBFloat16, {n}));
    bool ok = true;
    for (std::int64_t i = 0; i < n; ++i) {
      float acc = 0;  // rank order, float32 accumulation of the bfloat16 inputs
      for (int r = 0; r < world; ++r) acc += cpu::to_float(cpu::from_float<cpu::bf16>(rank_data(r, n)[i]));
      ok = ok && x[i].bits == cpu::from_float<cpu::bf16>(acc).bits;
      results[rank * n + i] = x[i].bits;
    }
    return ok;
  };
  bool rank0 = false;
  EXPECT_TRUE(run_ranks(world, body, rank0));
  EXPECT_TRUE(rank0);
  for (int r = 1; r < world; ++r) EXPECT_EQ(std::memcmp(results, results + r * n, n * 2), 0) << "rank " << r;
  munmap(results, world * n * 2);
}

TEST_P(ShmAllReduce, AllGatherPutsEachRankInItsRow) {
  const int world = GetParam();
  const std::size_t buffer = 64;
  const std::int64_t n = 50;  // 200 bytes: 4 rounds
  Region region(world, buffer);
  auto body = [&](int rank) {
    ShmCommunicator comm(region.ptr, region.bytes, rank, world, buffer);
    std::vector<std::int32_t> in(n), out(world * n, -1);
    for (std::int64_t i = 0; i < n; ++i) in[i] = rank * 1000 + static_cast<std::int32_t>(i);
    comm.all_gather(TensorView::contiguous(out.data(), DType::kInt32, {world, n}),
                    TensorView::contiguous(in.data(), DType::kInt32, {n}));
    comm.barrier();
    bool ok = true;
    for (int r = 0; r < world; ++r)
      for (std::int64_t i = 0; i < n; ++i) ok = ok && out[r * n + i] == r * 1000 + i;
    return ok;
  };
  bool rank0 = false;
  EXPECT_TRUE(run_ranks(world, body, rank0));
  EXPECT_TRUE(rank0);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShmAllReduce, ::testing::Values(2, 3, 4));

TEST(ShmCommunicator, AbortWakesAWaitingRank) {
  const std::size_t buffer = 64;
  Region region(2, buffer);
  pid_t pid = fork();
  if (pid == 0) {  // the "other rank": never joins, aborts after a while instead
    usleep(100 * 1000);
    ShmCommunicator(region.ptr, region.bytes, 1, 2, buffer).abort();
    _exit(0);
  }
  ShmCommunicator comm(region.ptr, region.bytes, 0, 2, buffer);
  float x[4] = {1, 2, 3, 4};
  EXPECT_THROW(comm.all_reduce(TensorView::contiguous(x, DType::kFloat32, {4})), std::runtime_error);
  EXPECT_TRUE(comm.aborted());
  int status = 0;
  waitpid(pid, &status, 0);
}

TEST(ShmCommunicator, ACompletedCollectiveReturnsItsResultDespiteAnAbort) {
  // rank 1 publishes and waits; rank 0 aborts (as a rank that fails right after this collective
  // would), then joins: every contribution is there, so rank 0 gets the sum
  const std::size_t buffer = 64;
  Region region(2, buffer);
  pid_t pid = fork();
  if (pid == 0) {
    ShmCommunicator comm(region.ptr, region.bytes, 1, 2, buffer);
    float y[4] = {10, 20, 30, 40};
    try {
      comm.all_reduce(TensorView::contiguous(y, DType::kFloat32, {4}));
    } catch (const std::runtime_error&) {
    }
    _exit(0);
  }
  usleep(300 * 1000);  // rank 1 has published by now
  ShmCommunicator comm(region.ptr, region.bytes, 0, 2, buffer);
  comm.abort();
  float x[4] = {1, 2, 3, 4};
  comm.all_reduce(TensorView::contiguous(x, DType::kFloat32, {4}));
  EXPECT_EQ(x[0], 11.0f);
  EXPECT_EQ(x[3], 44.0f);
  int status = 0;
  waitpid(pid, &status, 0);
}

TEST(ShmCommunicator, BadArgumentsNameTheValue) {
  Region region(2, 64);
  try {
    ShmCommunicator(region.ptr, region.bytes, 2, 2, 64);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank=2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ShmCommunicator(region.ptr, region.bytes - 1, 0, 2, 64), InvalidArgument);
  EXPECT_THROW(ShmCommunicator(region.ptr, region.bytes, 0, 2, 100), InvalidArgument);
  ShmCommunicator comm(region.ptr, region.bytes, 0, 1, 64);  // world 1: a no-op
  std::int32_t ints[2] = {1, 2};
  try {
    comm.all_reduce(TensorView::contiguous(ints, DType::kInt32, {2}));
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("int32"), std::string::npos) << e.what();
  }
}
