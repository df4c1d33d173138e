// DevicePool's memory history and view (Note [Memory history] in src/pool/history.h): what
// a memory snapshot in torch's format is made of.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "pool_test_util.h"

namespace pool_test {
namespace {

using History = PoolTest;
using vramswap::pool::TraceEvent;
using Action = TraceEvent::Action;
using View = DevicePool::BlockView;

std::vector<Action> actions(const std::vector<TraceEvent>& trace) {
  std::vector<Action> out;
  for (const TraceEvent& e : trace) out.push_back(e.action);
  return out;
}

TEST_F(History, NothingIsRecordedUntilAsked) {
  deallocate(allocate(4 * kKiB));
  EXPECT_TRUE(pool().memory_view().trace.empty());
}

TEST_F(History, AllocAndFreeAreRecordedInOrderWithSizesAndStream) {
  pool().record_history(100);
  void* p = allocate(1000);  // rounded to 1024: the trace has the size asked for
  ASSERT_NE(nullptr, p);
  deallocate(p);
  const auto trace = pool().memory_view().trace;
  // The first allocation maps the granule under it.
  ASSERT_EQ((std::vector<Action>{Action::kSegmentMap, Action::kAlloc, Action::kFreeRequested, Action::kFreeCompleted}),
            actions(trace));
  EXPECT_EQ(address(p), trace[1].addr);
  EXPECT_EQ(1000u, trace[1].size);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(stream_.get()), trace[1].stream);
  EXPECT_EQ(1000u, trace[2].size) << "a free's size is its alloc's (torch's trace pairs them)";
  EXPECT_EQ(1000u, trace[3].size);
  EXPECT_EQ(address(p), trace[3].addr);
  EXPECT_LE(trace[0].time_us, trace[3].time_us);
  EXPECT_EQ(TraceEvent::Cause::kNone, trace[0].cause);
}

TEST_F(History, AFreeWaitingForAnotherStreamCompletesWhenItsWorkIsDone) {
  Stream other;
  void* p = allocate(64 * kKiB);
  ASSERT_NE(nullptr, p);
  pool().record_history(100);
  ASSERT_TRUE(pool().record_stream(p, other.get()).ok);
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(other.get()));  // work that uses p, not done yet
  deallocate(p);
  EXPECT_EQ(std::vector<Action>{Action::kFreeRequested}, actions(pool().memory_view().trace))
      << "the other stream's work is not done: the block is not reusable yet";
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(other.get()));
  deallocate(allocate(kMiB));  // an allocation polls the pending frees
  const auto trace = pool().memory_view().trace;
  ASSERT_GE(trace.size(), 2u);
  EXPECT_EQ(Action::kFreeCompleted, trace[1].action);
  EXPECT_EQ(address(p), trace[1].addr);
}

TEST_F(History, ABlockAllocatedBeforeRecordingIsFreedWithItsRoundedSize) {
  void* p = allocate(1000);
  ASSERT_NE(nullptr, p);
  pool().record_history(10);
  deallocate(p);
  const auto trace = pool().memory_view().trace;
  ASSERT_EQ(2u, trace.size());
  EXPECT_EQ(1024u, trace[0].size);
}

TEST_F(History, KeepsTheLastEntriesOnlyAndZeroStops) {
  pool().record_history(3);
  void* warm = allocate(kKiB);  // maps: one event more
  deallocate(warm);
  for (int i = 0; i < 5; ++i) deallocate(allocate(kKiB));
  auto trace = pool().memory_view().trace;
  ASSERT_EQ((std::vector<Action>{Action::kAlloc, Action::kFreeRequested, Action::kFreeCompleted}), actions(trace))
      << "the last three, oldest first";
  pool().record_history(0);
  deallocate(allocate(kKiB));
  EXPECT_TRUE(pool().memory_view().trace.empty());
}

TEST_F(History, ARefusedAllocationIsAnOom) {
  pool().record_history(10);
  std::string error;
  EXPECT_EQ(nullptr, pool().allocate(size_t(1) << 50, stream_.get(), &error));
  const auto trace = pool().memory_view().trace;
  ASSERT_EQ(std::vector<Action>{Action::kOom}, actions(trace));
  EXPECT_EQ(size_t(1) << 50, trace[0].size);
  EXPECT_EQ(stats().limit_bytes - stats().reserved_bytes, trace[0].device_free);
}

TEST_F(History, TheViewShowsMappedRangesAndEveryBlockInAddressOrder) {
  void* a = allocate(kMiB);
  void* b = allocate(3 * kMiB);
  ASSERT_NE(nullptr, a);
  ASSERT_NE(nullptr, b);
  deallocate(a);
  const auto v = pool().memory_view();
  ASSERT_FALSE(v.mapped.empty());
  uint64_t mapped = 0;
  for (auto [addr, bytes] : v.mapped) mapped += bytes;
  EXPECT_EQ(stats().mapped_bytes, mapped);
  uintptr_t next = v.blocks.front().addr;
  bool saw_b = false, saw_a = false;
  for (const View& w : v.blocks) {
    EXPECT_EQ(next, w.addr) << "the blocks tile the range";
    next = w.addr + w.size;
    if (w.addr == address(b)) {
      saw_b = true;
      EXPECT_EQ(View::State::kLive, w.state);
      EXPECT_EQ(3 * kMiB, w.size);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(stream_.get()), w.stream);
    }
    if (w.addr == address(a)) {
      saw_a = true;
      EXPECT_EQ(View::State::kFree, w.state);
    }
  }
  EXPECT_TRUE(saw_a);
  EXPECT_TRUE(saw_b);
  deallocate(b);
}

}  // namespace
}  // namespace pool_test
