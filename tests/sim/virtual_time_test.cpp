// cudasim's virtual time (CUDASIM_TIME=virtual), its timeline and unbacked memory.
//
// Registered per suite with the environment each needs (tests/sim/CMakeLists.txt):
//   VirtualTime          CUDASIM_TIME=virtual, PCIe 50 GB/s, HBM 1000 GB/s, full duplex;
//                        again under CUDASIM_CHAOS=7, where every time must be the same
//   VirtualTimeShared    the same with CUDASIM_PCIE_DUPLEX=shared
//   VirtualTimeUnbacked  CUDASIM_UNBACKED=1 on an 80 GiB card, default rates (55 GB/s)
//   VirtualTimeHostCosts CUDASIM_HOST_COSTS=h100,unmap=30
//   RealTime             the default environment
//   RealTimeTimeline     CUDASIM_TIMELINE=1
//   VirtualTimeSettingsDeathTest  bad values (each sets its variable in the child)
// A suite run without its environment skips, saying which it needs.
//
// The rates make times easy to check: at 50 GB/s a copy of 5,000,000 bytes takes
// 100,000 ns; at 1000 GB/s a d2d copy or memset of the same takes 5,000 ns.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "runtime_test_util.h"
#include "timeline_test_util.h"

namespace {

using cudasim_test::DeviceBuffer;
using cudasim_test::Event;
using cudasim_test::kMiB;
using cudasim_test::only;
using cudasim_test::PinnedBuffer;
using cudasim_test::Stream;
using cudasim_test::timeline;

constexpr uint64_t kBytes = 5'000'000;   // a copy's size
constexpr uint64_t kCopyNs = 100'000;    // kBytes at 50 GB/s
constexpr uint64_t kDeviceNs = 5'000;    // kBytes at 1000 GB/s

enum Kind : uint32_t { kKernel = 0, kH2D = 1, kD2H = 2, kD2D = 3, kMemset = 4, kOther = 5 };


uint64_t handle_of(cudaStream_t s) { return reinterpret_cast<uint64_t>(s); }

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// Virtual time with the rates above; the timeline starts empty and t0_ is the host clock.
class VirtualTime : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cudasim_virtual_time() || !env_is("CUDASIM_PCIE_GBPS", "50") || !env_is("CUDASIM_HBM_GBPS", "1000"))
      GTEST_SKIP() << "needs CUDASIM_TIME=virtual CUDASIM_PCIE_GBPS=50 CUDASIM_HBM_GBPS=1000 (ctest sets them)";
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    cudasim_timeline_clear();
    t0_ = cudasim_now_ns();
  }
  void TearDown() override { cudaDeviceSynchronize(); }

  // One kBytes copy each way, queued together on two streams, and waited for.
  void copy_both_ways_at_once() {
    Stream up(cudaStreamNonBlocking), down(cudaStreamNonBlocking);
    DeviceBuffer d1(kBytes), d2(kBytes);
    PinnedBuffer h1(kBytes), h2(kBytes);
    ASSERT_CUDA_OK(cudaMemcpyAsync(d1.get(), h1.get(), kBytes, cudaMemcpyHostToDevice, up));
    ASSERT_CUDA_OK(cudaMemcpyAsync(h2.get(), d2.get(), kBytes, cudaMemcpyDeviceToHost, down));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
  }

  uint64_t t0_ = 0;
};


TEST_F(VirtualTime, ReportsVirtualTimeAndStartsAtTheHostClock) {
  EXPECT_EQ(1, cudasim_virtual_time());
  EXPECT_EQ(0u, timeline().size());
  // API calls take no virtual time, and the host clock does not run by itself.
  Stream s(cudaStreamNonBlocking);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(t0_, cudasim_now_ns());
}

TEST_F(VirtualTime, CopyOfNBytesTakesNOverTheRate) {
  Stream s(cudaStreamNonBlocking);
  DeviceBuffer d(kBytes);
  PinnedBuffer h(kBytes);
  ASSERT_CUDA_OK(d.status());
  ASSERT_CUDA_OK(h.status());
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), h.get(), kBytes, cudaMemcpyHostToDevice, s));
  EXPECT_EQ(t0_, cudasim_now_ns()) << "an async copy does not move the host clock";
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_EQ(t0_ + kCopyNs, cudasim_now_ns());
  const auto e = only(kH2D);
  EXPECT_EQ(kBytes, e.bytes);
  EXPECT_EQ(0, e.device);
  EXPECT_EQ(handle_of(s), e.stream);
  EXPECT_EQ(t0_, e.enqueue_ns);
  EXPECT_EQ(t0_, e.start_ns);
  EXPECT_EQ(t0_ + kCopyNs, e.end_ns);
  EXPECT_EQ(0u, e.stall_ns);
  EXPECT_STREQ("memcpy HtoD", e.label);
}

TEST_F(VirtualTime, DeviceCopiesAndMemsetsRunAtTheHbmRate) {
  Stream s(cudaStreamNonBlocking);
  DeviceBuffer a(kBytes), b(kBytes);
  ASSERT_CUDA_OK(cudaMemsetAsync(a.get(), 1, kBytes, s));
  ASSERT_CUDA_OK(cudaMemcpyAsync(b.get(), a.get(), kBytes, cudaMemcpyDeviceToDevice, s));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  const auto m = only(kMemset), c = only(kD2D);
  EXPECT_EQ(t0_ + kDeviceNs, m.end_ns);
  EXPECT_EQ(m.end_ns, c.start_ns);
  EXPECT_EQ(t0_ + 2 * kDeviceNs, c.end_ns);
  EXPECT_EQ(t0_ + 2 * kDeviceNs, cudasim_now_ns());
}

TEST_F(VirtualTime, SynchronousCopyMovesTheHostClockToItsEnd) {
  DeviceBuffer d(kBytes);
  std::vector<unsigned char> pageable(kBytes, 7);
  ASSERT_CUDA_OK(cudaMemcpy(d.get(), pageable.data(), kBytes, cudaMemcpyHostToDevice));
  EXPECT_EQ(t0_ + kCopyNs, cudasim_now_ns());
  ASSERT_CUDA_OK(cudaMemcpy(pageable.data(), d.get(), kBytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(t0_ + 2 * kCopyNs, cudasim_now_ns());
  // The data is real (backed memory).
  EXPECT_EQ(7, pageable[kBytes - 1]);
}

TEST_F(VirtualTime, HostToDeviceAndDeviceToHostOverlapInFullDuplex) {
  ASSERT_NO_FATAL_FAILURE(copy_both_ways_at_once());
  const auto in = only(kH2D), out = only(kD2H);
  EXPECT_EQ(t0_, in.start_ns);
  EXPECT_EQ(t0_, out.start_ns);
  EXPECT_EQ(t0_ + kCopyNs, in.end_ns);
  EXPECT_EQ(t0_ + kCopyNs, out.end_ns);
  EXPECT_EQ(t0_ + kCopyNs, cudasim_now_ns());
}

TEST_F(VirtualTime, CopiesInOneDirectionTakeTurnsOnItsEngine) {
  Stream a(cudaStreamNonBlocking), b(cudaStreamNonBlocking);
  DeviceBuffer d1(kBytes), d2(kBytes);
  PinnedBuffer h(kBytes);
  ASSERT_CUDA_OK(cudaMemcpyAsync(d1.get(), h.get(), kBytes, cudaMemcpyHostToDevice, a));
  ASSERT_CUDA_OK(cudaMemcpyAsync(d2.get(), h.get(), kBytes, cudaMemcpyHostToDevice, b));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto tl = timeline();
  ASSERT_EQ(2u, tl.size());
  EXPECT_EQ(t0_ + kCopyNs, tl[0].end_ns);
  EXPECT_EQ(tl[0].end_ns, tl[1].start_ns) << "FIFO in enqueue order on the H2D engine";
  EXPECT_EQ(t0_ + 2 * kCopyNs, tl[1].end_ns);
  EXPECT_EQ(0u, tl[1].stall_ns) << "waiting for an engine is not stall";
}

TEST_F(VirtualTime, KernelsOfAllStreamsShareTheComputeEngine) {
  Stream a(cudaStreamNonBlocking), b(cudaStreamNonBlocking);
  ASSERT_EQ(0, cudasim_kernel(a, 30'000, "a"));
  ASSERT_EQ(0, cudasim_kernel(b, 20'000, "b"));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto tl = timeline();
  ASSERT_EQ(2u, tl.size());
  EXPECT_EQ(kKernel, tl[0].kind);
  EXPECT_EQ(0u, tl[0].bytes);
  EXPECT_STREQ("a", tl[0].label);
  EXPECT_EQ(t0_ + 30'000, tl[0].end_ns);
  EXPECT_EQ(t0_ + 30'000, tl[1].start_ns);
  EXPECT_EQ(t0_ + 50'000, tl[1].end_ns);
  EXPECT_EQ(t0_ + 50'000, cudasim_now_ns());
}

// The eviction engine's pattern: a fetch on a copy stream, an event, the compute stream
// waits for it. The kernel after the wait starts when the copy ends; the time it waited
// beyond what the compute stream and engine imposed anyway is its stall.
TEST_F(VirtualTime, KernelWaitingOnAFetchStartsAtTheCopyEndAndCountsTheStall) {
  Stream compute(cudaStreamNonBlocking), copy(cudaStreamNonBlocking);
  Event fetched(cudaEventDisableTiming);
  DeviceBuffer d(kBytes);
  PinnedBuffer h(kBytes);
  ASSERT_EQ(0, cudasim_kernel(compute, 10'000, "before"));
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), h.get(), kBytes, cudaMemcpyHostToDevice, copy));
  ASSERT_CUDA_OK(cudaEventRecord(fetched, copy));
  ASSERT_CUDA_OK(cudaStreamWaitEvent(compute, fetched, 0));
  ASSERT_EQ(0, cudasim_kernel(compute, 5'000, "needs the fetch"));
  ASSERT_EQ(0, cudasim_kernel(compute, 5'000, "after"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(compute));
  const auto tl = timeline();
  ASSERT_EQ(4u, tl.size());
  EXPECT_EQ(0u, tl[0].stall_ns);
  EXPECT_EQ(kH2D, tl[1].kind);
  EXPECT_STREQ("needs the fetch", tl[2].label);
  EXPECT_EQ(tl[1].end_ns, tl[2].start_ns);
  EXPECT_EQ(kCopyNs - 10'000, tl[2].stall_ns) << "it could have started when 'before' ended";
  EXPECT_EQ(tl[2].end_ns, tl[3].start_ns);
  EXPECT_EQ(0u, tl[3].stall_ns) << "a stall is charged once, to the first kernel after the wait";
  EXPECT_EQ(t0_ + kCopyNs + 10'000, cudasim_now_ns());
}

TEST_F(VirtualTime, AWaitHiddenBehindABusyComputeEngineIsNoStall) {
  Stream compute(cudaStreamNonBlocking), other(cudaStreamNonBlocking), copy(cudaStreamNonBlocking);
  Event fetched(cudaEventDisableTiming);
  DeviceBuffer d(kBytes);
  PinnedBuffer h(kBytes);
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), h.get(), kBytes, cudaMemcpyHostToDevice, copy));
  ASSERT_CUDA_OK(cudaEventRecord(fetched, copy));
  ASSERT_EQ(0, cudasim_kernel(other, 2 * kCopyNs, "long, on another stream"));
  ASSERT_CUDA_OK(cudaStreamWaitEvent(compute, fetched, 0));
  // Host work between the wait and the kernel does not hide the stall either.
  ASSERT_CUDA_OK(cudaLaunchHostFunc(compute, [](void*) {}, nullptr));
  ASSERT_EQ(0, cudasim_kernel(compute, 1'000, "k"));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto tl = timeline();
  ASSERT_EQ(4u, tl.size());
  EXPECT_EQ(kOther, tl[2].kind);
  EXPECT_EQ(tl[0].end_ns, tl[2].start_ns) << "the host function runs when the fetch ends";
  EXPECT_EQ(tl[2].start_ns, tl[2].end_ns) << "host functions take no virtual time";
  EXPECT_EQ(t0_ + 2 * kCopyNs, tl[3].start_ns);
  EXPECT_EQ(0u, tl[3].stall_ns) << "the compute engine was busy until after the fetch anyway";
}

TEST_F(VirtualTime, EventQueryAnswersFromTheHostClockOnly) {
  Stream copy(cudaStreamNonBlocking), compute(cudaStreamNonBlocking);
  Event done(cudaEventDisableTiming);
  DeviceBuffer d(kBytes);
  PinnedBuffer h(kBytes);
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), h.get(), kBytes, cudaMemcpyHostToDevice, copy));
  ASSERT_CUDA_OK(cudaEventRecord(done, copy));
  // The worker has long finished in real time; virtually the copy has not.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(done));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(copy));
  // A host wait on something that ends earlier does not make it complete ...
  ASSERT_EQ(0, cudasim_kernel(compute, kCopyNs / 2, "short"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(compute));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(done));
  // ... a host wait on something that ends later does, with no wait on the copy itself.
  ASSERT_EQ(0, cudasim_kernel(compute, kCopyNs, "long"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(compute));
  EXPECT_EQ(t0_ + kCopyNs * 3 / 2, cudasim_now_ns());
  EXPECT_EQ(cudaSuccess, cudaEventQuery(done));
  EXPECT_EQ(cudaSuccess, cudaStreamQuery(copy));
}

TEST_F(VirtualTime, EventSynchronizeMovesTheHostClockToTheEvent) {
  Stream copy(cudaStreamNonBlocking);
  Event done(cudaEventDisableTiming);
  DeviceBuffer d(kBytes);
  PinnedBuffer h(kBytes);
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), h.get(), kBytes, cudaMemcpyHostToDevice, copy));
  ASSERT_CUDA_OK(cudaEventRecord(done, copy));
  ASSERT_CUDA_OK(cudaMemcpyAsync(h.get(), d.get(), kBytes, cudaMemcpyDeviceToHost, copy));
  ASSERT_CUDA_OK(cudaEventSynchronize(done));
  EXPECT_EQ(t0_ + kCopyNs, cudasim_now_ns()) << "up to the event, not the work after it";
  EXPECT_EQ(cudaSuccess, cudaEventQuery(done));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(copy));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(t0_ + 2 * kCopyNs, cudasim_now_ns());
}

TEST_F(VirtualTime, AnEventOnAnIdleStreamCompletesAtTheHostClock) {
  Stream s(cudaStreamNonBlocking), other(cudaStreamNonBlocking);
  Event e(cudaEventDisableTiming);
  ASSERT_EQ(0, cudasim_kernel(s, 1'000, "k"));
  ASSERT_EQ(0, cudasim_kernel(other, 50'000, "k2"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(other));  // host at t0 + 51,000
  ASSERT_CUDA_OK(cudaEventRecord(e, s));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(e));
  ASSERT_CUDA_OK(cudaStreamWaitEvent(other, e, 0));
  ASSERT_EQ(0, cudasim_kernel(other, 1'000, "k3"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(other));
  EXPECT_EQ(t0_ + 52'000, cudasim_now_ns());
  EXPECT_EQ(0u, timeline().back().stall_ns);
}

TEST_F(VirtualTime, ElapsedTimeIsVirtual) {
  Stream s(cudaStreamNonBlocking);
  Event start, stop;
  ASSERT_CUDA_OK(cudaEventRecord(start, s));
  ASSERT_EQ(0, cudasim_kernel(s, 2'500'000, "k"));
  ASSERT_CUDA_OK(cudaEventRecord(stop, s));
  float ms = -1;
  EXPECT_EQ(cudaErrorNotReady, cudaEventElapsedTime(&ms, start, stop));
  ASSERT_CUDA_OK(cudaEventSynchronize(stop));
  ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  EXPECT_FLOAT_EQ(2.5f, ms);
}

TEST_F(VirtualTime, LegacyStreamWaitsForBlockingStreamsOnly) {
  Stream blocking(cudaStreamDefault), non_blocking(cudaStreamNonBlocking), other(cudaStreamNonBlocking);
  DeviceBuffer d(kBytes);
  PinnedBuffer h(kBytes);
  ASSERT_EQ(0, cudasim_kernel(blocking, 10'000, "blocking"));
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), h.get(), kBytes, cudaMemcpyHostToDevice, non_blocking));
  ASSERT_EQ(0, cudasim_kernel(nullptr, 1'000, "legacy"));
  ASSERT_EQ(0, cudasim_kernel(blocking, 1'000, "blocking after legacy"));
  ASSERT_CUDA_OK(cudaMemcpyAsync(h.get(), d.get(), kBytes, cudaMemcpyDeviceToHost, other));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto tl = timeline();
  ASSERT_EQ(5u, tl.size());
  EXPECT_EQ(0u, tl[2].stream) << "the legacy stream is 0";
  EXPECT_EQ(t0_ + 10'000, tl[2].start_ns) << "after the blocking stream, not after the non-blocking copy";
  EXPECT_EQ(0u, tl[2].stall_ns) << "implicit synchronization is not an event wait";
  EXPECT_EQ(t0_ + 11'000, tl[3].start_ns) << "a blocking stream waits for the legacy stream";
  EXPECT_EQ(t0_, tl[4].start_ns) << "a non-blocking stream does not";
  EXPECT_EQ(t0_ + kCopyNs, cudasim_now_ns());
}

TEST_F(VirtualTime, PerThreadDefaultStreamIsNamedByItsHandle) {
  ASSERT_EQ(0, cudasim_kernel(cudaStreamPerThread, 1'000, nullptr));
  ASSERT_CUDA_OK(cudaStreamSynchronize(cudaStreamPerThread));
  const auto tl = timeline();
  ASSERT_EQ(1u, tl.size());
  EXPECT_EQ(handle_of(cudaStreamPerThread), tl[0].stream);
  EXPECT_STREQ("kernel", tl[0].label) << "a NULL label";
  EXPECT_EQ(t0_ + 1'000, cudasim_now_ns());
}

TEST_F(VirtualTime, KernelLabelIsCopiedAndTruncated) {
  Stream s(cudaStreamNonBlocking);
  std::string label(100, 'x');
  label[0] = 'L';
  ASSERT_EQ(0, cudasim_kernel(s, 1, label.c_str()));
  label.assign("overwritten");
  const auto tl = timeline();
  ASSERT_EQ(1u, tl.size());
  EXPECT_EQ("L" + std::string(46, 'x'), std::string(tl[0].label));
}

TEST_F(VirtualTime, KernelOnAnUnknownStreamIsInvalidResourceHandle) {
  int bogus = 0;
  EXPECT_EQ(int(cudaErrorInvalidResourceHandle), cudasim_kernel(&bogus, 1'000, "k"));
  EXPECT_EQ(0u, timeline().size());
}

// A destroyed stream's handle is undefined behaviour on a GPU, not an error code to rely on:
// cudasim stops the program where it is used (stream_test.cpp has the other calls).
TEST(VirtualTimeDeathTest, KernelOnADestroyedStreamStopsTheProgram) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        cudaStream_t destroyed = nullptr;
        if (cudaStreamCreate(&destroyed) != cudaSuccess || cudaStreamDestroy(destroyed) != cudaSuccess) std::exit(0);
        cudasim_kernel(destroyed, 1'000, "k");
      },
      "was used by a CUDA call after cudaStreamDestroy destroyed it");
}

TEST_F(VirtualTime, KernelCapturedIntoAGraphIsTimedAtLaunch) {
  Stream s(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  ASSERT_EQ(0, cudasim_kernel(s, 7'000, "captured"));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(s, &graph));
  EXPECT_EQ(0u, timeline().size()) << "nothing ran while capturing";
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA_OK(cudaGraphLaunch(exec, s));
  ASSERT_CUDA_OK(cudaGraphLaunch(exec, s));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  const auto tl = timeline();
  ASSERT_EQ(2u, tl.size());
  EXPECT_STREQ("captured", tl[1].label);
  EXPECT_EQ(t0_ + 14'000, cudasim_now_ns());
  EXPECT_CUDA_OK(cudaGraphExecDestroy(exec));
  EXPECT_CUDA_OK(cudaGraphDestroy(graph));
}

TEST_F(VirtualTime, TimelineCopiesAsManyAsAskedAndClears) {
  Stream s(cudaStreamNonBlocking);
  for (int i = 0; i < 5; ++i) ASSERT_EQ(0, cudasim_kernel(s, 10, std::to_string(i).c_str()));
  EXPECT_EQ(5u, cudasim_timeline(nullptr, 0));
  cudasim_timeline_entry two[2];
  EXPECT_EQ(5u, cudasim_timeline(two, 2));
  EXPECT_STREQ("0", two[0].label);
  EXPECT_STREQ("1", two[1].label);
  cudasim_timeline_clear();
  EXPECT_EQ(0u, cudasim_timeline(nullptr, 0));
}

// A program in the shape of the eviction engine's traffic: kernels, evictions on a D2H
// stream after the compute stream's event, fetches on an H2D stream, waits, queries that
// poll, host waits. Returns everything the host observed, with times relative to the
// start and streams numbered in order of first appearance.
struct Observed {
  std::vector<std::tuple<uint32_t, int, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, std::string>> entries;
  std::vector<int> queries;
  uint64_t elapsed = 0;
  bool operator==(const Observed&) const = default;
};

Observed run_pipeline() {
  Observed seen;
  EXPECT_CUDA_OK(cudaDeviceSynchronize());
  cudasim_timeline_clear();
  const uint64_t start = cudasim_now_ns();
  {
    Stream compute(cudaStreamNonBlocking), d2h(cudaStreamNonBlocking), h2d(cudaStreamNonBlocking);
    Event used(cudaEventDisableTiming), evicted(cudaEventDisableTiming), fetched(cudaEventDisableTiming);
    DeviceBuffer act(4 * kMiB);
    PinnedBuffer host(4 * kMiB);
    for (int step = 0; step < 6; ++step) {
      EXPECT_EQ(0, cudasim_kernel(compute, 20'000 + step * 3'000, "forward"));
      EXPECT_CUDA_OK(cudaEventRecord(used, compute));
      EXPECT_CUDA_OK(cudaStreamWaitEvent(d2h, used, 0));
      EXPECT_CUDA_OK(cudaMemcpyAsync(host.get(), act.get(), 4 * kMiB, cudaMemcpyDeviceToHost, d2h));
      EXPECT_CUDA_OK(cudaEventRecord(evicted, d2h));
      seen.queries.push_back(int(cudaEventQuery(evicted)));
      EXPECT_EQ(0, cudasim_kernel(compute, 40'000, "more forward"));
      seen.queries.push_back(int(cudaEventQuery(used)));
      EXPECT_CUDA_OK(cudaStreamWaitEvent(h2d, evicted, 0));
      EXPECT_CUDA_OK(cudaMemcpyAsync(act.get(), host.get(), 4 * kMiB, cudaMemcpyHostToDevice, h2d));
      EXPECT_CUDA_OK(cudaEventRecord(fetched, h2d));
      EXPECT_CUDA_OK(cudaStreamWaitEvent(compute, fetched, 0));
      EXPECT_EQ(0, cudasim_kernel(compute, 10'000, "backward"));
      EXPECT_CUDA_OK(cudaMemsetAsync(act.get(), 0, kMiB, nullptr));
      if (step % 2) {
        EXPECT_CUDA_OK(cudaEventSynchronize(fetched));
      }
      if (step % 3 == 2) {
        EXPECT_CUDA_OK(cudaStreamSynchronize(compute));
      }
      seen.queries.push_back(int(cudaStreamQuery(d2h)));
      seen.queries.push_back(int(cudaEventQuery(fetched)));
    }
    EXPECT_CUDA_OK(cudaDeviceSynchronize());
    seen.elapsed = cudasim_now_ns() - start;
  }
  std::map<uint64_t, int> streams;
  for (const auto& e : timeline()) {
    auto [it, added] = streams.emplace(e.stream, int(streams.size()));
    (void)added;
    seen.entries.emplace_back(e.kind, it->second, e.bytes, e.enqueue_ns - start, e.start_ns - start, e.end_ns - start,
                              e.stall_ns, e.label);
  }
  return seen;
}

TEST_F(VirtualTime, TheSameCallsGiveTheSameTimelineRunAfterRun) {
  const Observed first = run_pipeline();
  const Observed second = run_pipeline();
  ASSERT_EQ(6u * 6, first.entries.size());
  EXPECT_TRUE(first == second) << "the timeline or a query's answer changed between two identical runs";
  uint64_t stall = 0;
  for (const auto& e : first.entries) stall += std::get<6>(e);
  EXPECT_GT(stall, 0u) << "the pipeline stalls on its fetches";
  EXPECT_GT(first.elapsed, 0u);
}

// ---- Shared duplex ------------------------------------------------------------------

class VirtualTimeShared : public VirtualTime {
 protected:
  void SetUp() override {
    if (!env_is("CUDASIM_PCIE_DUPLEX", "shared")) GTEST_SKIP() << "needs CUDASIM_PCIE_DUPLEX=shared";
    VirtualTime::SetUp();
  }
};

// CUDASIM_HOST_COSTS=h100,unmap=30 (env.h): VMM calls and pinning move the host clock by
// H100's measured costs, per call or per mapping covered, and a named figure replaces
// h100's; work queued afterwards starts no earlier.
class VirtualTimeHostCosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cudasim_virtual_time() || !env_is("CUDASIM_HOST_COSTS", "h100,unmap=30"))
      GTEST_SKIP() << "needs CUDASIM_TIME=virtual CUDASIM_HOST_COSTS=h100,unmap=30 (ctest sets them)";
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(cudaFree(nullptr));
  }
};

TEST_F(VirtualTimeHostCosts, VmmCallsAndPinningTakeHostTime) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  constexpr size_t kGranule = 2 * kMiB;
  CUdeviceptr base = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAddressReserve(&base, 2 * kGranule, 0, 0, 0));
  CUmemGenericAllocationHandle h[2] = {0, 0};
  uint64_t t = cudasim_now_ns();
  auto took = [&t] {
    const uint64_t now = cudasim_now_ns();
    const uint64_t d = now - t;
    t = now;
    return d;
  };
  for (auto& handle : h) ASSERT_EQ(CUDA_SUCCESS, cuMemCreate(&handle, kGranule, &prop, 0));
  EXPECT_EQ(took(), 2 * 15000u) << "cuMemCreate: 15 us a call";
  for (int i = 0; i < 2; ++i) ASSERT_EQ(CUDA_SUCCESS, cuMemMap(base + i * kGranule, kGranule, 0, h[i], 0));
  EXPECT_EQ(took(), 2 * 4000u) << "cuMemMap: 4 us a call";
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(CUDA_SUCCESS, cuMemSetAccess(base, 2 * kGranule, &access, 1));
  EXPECT_EQ(took(), 2 * 35000u) << "cuMemSetAccess: 35 us per mapping, in one call as in two";
  ASSERT_EQ(CUDA_SUCCESS, cuMemUnmap(base, 2 * kGranule));
  EXPECT_EQ(took(), 2 * 30000u) << "cuMemUnmap: unmap=30 replaces h100's 24 us per mapping";
  for (auto handle : h) ASSERT_EQ(CUDA_SUCCESS, cuMemRelease(handle));
  EXPECT_EQ(took(), 2 * 18000u) << "cuMemRelease: 18 us a call";
  ASSERT_EQ(CUDA_SUCCESS, cuMemAddressFree(base, 2 * kGranule));
  EXPECT_EQ(took(), 0u) << "address reservations cost nothing";
  void* pinned = nullptr;
  ASSERT_CUDA_OK(cudaHostAlloc(&pinned, 4 * kMiB, cudaHostAllocDefault));
  EXPECT_EQ(took(), 4 * 650000u) << "pinning: 650 us per MiB";
  ASSERT_CUDA_OK(cudaFreeHost(pinned));
  EXPECT_GE(took(), 4 * 130000u) << "unpinning: 130 us per MiB (after the device synchronization it makes)";

  // Work queued after the host's time starts no earlier than the host clock.
  Stream s(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  const uint64_t before = cudasim_now_ns();
  ASSERT_CUDA_OK(cudaHostAlloc(&pinned, kMiB, cudaHostAllocDefault));
  ASSERT_EQ(cudaSuccess, cudasim_kernel(s, 1000, "after pinning"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_EQ(cudasim_now_ns(), before + 650000u + 1000u);
  ASSERT_CUDA_OK(cudaFreeHost(pinned));
}

TEST_F(VirtualTimeShared, HostToDeviceAndDeviceToHostTakeTurns) {
  ASSERT_NO_FATAL_FAILURE(copy_both_ways_at_once());
  const auto in = only(kH2D), out = only(kD2H);
  EXPECT_EQ(t0_ + kCopyNs, in.end_ns);
  EXPECT_EQ(in.end_ns, out.start_ns);
  EXPECT_EQ(t0_ + 2 * kCopyNs, out.end_ns);
  EXPECT_EQ(t0_ + 2 * kCopyNs, cudasim_now_ns());
}

// ---- Unbacked memory ----------------------------------------------------------------

constexpr uint64_t kGiB = uint64_t{1} << 30;

uint64_t resident_bytes() {
  unsigned long size = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return n == 2 ? uint64_t(resident) * uint64_t(sysconf(_SC_PAGESIZE)) : 0;
}

class VirtualTimeUnbacked : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cudasim_virtual_time() || !env_is("CUDASIM_UNBACKED", "1") || !env_is("CUDASIM_DEVICE_MEMORY", "80GiB"))
      GTEST_SKIP() << "needs CUDASIM_TIME=virtual CUDASIM_UNBACKED=1 CUDASIM_DEVICE_MEMORY=80GiB";
    ASSERT_CUDA_OK(cudaSetDevice(0));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = 0;
  }

  friend void copy_after_unmap(VirtualTimeUnbacked& t);

  // Reserves, creates and maps `size` bytes read-write; returns the VA.
  CUdeviceptr map(uint64_t size, CUmemGenericAllocationHandle* handle) {
    CUdeviceptr va = 0;
    EXPECT_CU_OK(cuMemAddressReserve(&va, size, 0, 0, 0));
    EXPECT_CU_OK(cuMemCreate(handle, size, &prop_, 0));
    EXPECT_CU_OK(cuMemMap(va, size, 0, *handle, 0));
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    EXPECT_CU_OK(cuMemSetAccess(va, size, &access, 1));
    return va;
  }
  void unmap(CUdeviceptr va, uint64_t size, CUmemGenericAllocationHandle handle) {
    EXPECT_CU_OK(cuMemUnmap(va, size));
    EXPECT_CU_OK(cuMemRelease(handle));
    EXPECT_CU_OK(cuMemAddressFree(va, size));
  }

  CUmemAllocationProp prop_{};
};

TEST_F(VirtualTimeUnbacked, AnEightyGiBCardAndTensOfGiBOfPinnedMemoryTakeNoRam) {
  size_t free_bytes = 0, total = 0;
  ASSERT_CUDA_OK(cudaMemGetInfo(&free_bytes, &total));
  EXPECT_EQ(80 * kGiB, total);
  const uint64_t before = resident_bytes();
  constexpr uint64_t kDevice = 64 * kGiB, kHost = 32 * kGiB;
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map(kDevice, &handle);
  ASSERT_NE(0u, va);
  void* host = nullptr;
  ASSERT_CUDA_OK(cudaHostAlloc(&host, kHost, cudaHostAllocDefault));
  void* more_host = nullptr;
  ASSERT_CUDA_OK(cudaMallocHost(&more_host, 8 * kGiB));
  void* block = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&block, 8 * kGiB));

  Stream up(cudaStreamNonBlocking), down(cudaStreamNonBlocking);
  cudasim_timeline_clear();
  const uint64_t t0 = cudasim_now_ns();
  auto* dev = reinterpret_cast<unsigned char*>(va);
  ASSERT_CUDA_OK(cudaMemcpyAsync(dev, host, kHost, cudaMemcpyHostToDevice, up));
  ASSERT_CUDA_OK(cudaMemcpyAsync(host, dev + kHost, kHost, cudaMemcpyDeviceToHost, down));
  ASSERT_CUDA_OK(cudaMemcpyAsync(block, more_host, 8 * kGiB, cudaMemcpyHostToDevice, down));
  ASSERT_CUDA_OK(cudaMemsetAsync(dev, 0, kDevice, up));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  // The default rates: 55 GB/s per direction, 2000 GB/s on the device.
  const uint64_t copy_ns = (kHost + 54) / 55;
  const auto tl = timeline();
  ASSERT_EQ(4u, tl.size());
  EXPECT_EQ(t0 + copy_ns, tl[0].end_ns);
  EXPECT_EQ(t0 + copy_ns, tl[1].end_ns) << "full duplex by default";
  EXPECT_EQ(t0 + copy_ns + (8 * kGiB + 54) / 55, tl[2].end_ns);
  EXPECT_EQ(t0 + copy_ns + (kDevice + 1999) / 2000, tl[3].end_ns);
  const auto c = cudasim_test::counters();
  EXPECT_EQ(kHost + 8 * kGiB, c.bytes_h2d);
  EXPECT_EQ(kHost, c.bytes_d2h);
  EXPECT_EQ(kDevice, c.bytes_memset);

  const uint64_t after = resident_bytes();
  EXPECT_LT(after, before + 64 * kMiB) << "resident " << before << " -> " << after << " bytes";
  unmap(va, kDevice, handle);
  EXPECT_CUDA_OK(cudaFreeHost(host));
  EXPECT_CUDA_OK(cudaFreeHost(more_host));
  EXPECT_CUDA_OK(cudaFree(block));
}

using VirtualTimeUnbackedDeathTest = VirtualTimeUnbacked;

// Queues a D2H copy of a mapped range behind a host function, unmaps the range, then lets
// the copy run: it must fault.
void copy_after_unmap(VirtualTimeUnbacked& t) {
  struct rlimit none = {0, 0};
  setrlimit(RLIMIT_CORE, &none);  // a death-test child should not write a core file
  static std::atomic<bool> open{false};
  CUmemGenericAllocationHandle handle = 0;
  const uint64_t size = 2 * kMiB;
  const CUdeviceptr va = t.map(size, &handle);
  void* out = nullptr;  // pinned: a copy into pageable memory would block this thread
  cudaMallocHost(&out, size);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaLaunchHostFunc(
      s,
      [](void*) {
        while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      },
      nullptr);
  cudaMemcpyAsync(out, reinterpret_cast<void*>(va), size, cudaMemcpyDeviceToHost, s);
  cuMemUnmap(va, size);
  open.store(true);
  cudaStreamSynchronize(s);
}

// Unbacked copies touch no data, but a range unmapped before the copy runs still faults
// when it runs, as on a GPU.
TEST_F(VirtualTimeUnbackedDeathTest, CopyFromARangeUnmappedBeforeItRunsFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(copy_after_unmap(*this), ::testing::KilledBySignal(SIGSEGV), "illegal address");
}

// ---- Real time ------------------------------------------------------------------------

class RealTime : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cudasim_virtual_time()) GTEST_SKIP() << "needs real-time mode (no CUDASIM_TIME=virtual)";
    ASSERT_CUDA_OK(cudaSetDevice(0));
  }
};

TEST_F(RealTime, NowIsAMonotonicClockSinceStart) {
  EXPECT_EQ(0, cudasim_virtual_time());
  const uint64_t a = cudasim_now_ns();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const uint64_t b = cudasim_now_ns();
  EXPECT_GE(b - a, 5'000'000u);
  EXPECT_LT(b - a, 5'000'000'000u);
}

TEST_F(RealTime, KernelSleepsItsDurationUpToTheCap) {
  Stream s(cudaStreamNonBlocking);
  auto t = std::chrono::steady_clock::now();
  ASSERT_EQ(0, cudasim_kernel(s, 3'000'000, "3 ms"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_GE(std::chrono::steady_clock::now() - t, std::chrono::milliseconds(3));
  t = std::chrono::steady_clock::now();
  ASSERT_EQ(0, cudasim_kernel(s, 60'000'000'000, "a minute, capped at 10 ms"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_LT(std::chrono::steady_clock::now() - t, std::chrono::seconds(2));
  int bogus = 0;
  EXPECT_EQ(int(cudaErrorInvalidResourceHandle), cudasim_kernel(&bogus, 1, "k"));
}

TEST_F(RealTime, NothingIsRecordedWithoutCudasimTimeline) {
  if (env_is("CUDASIM_TIMELINE", "1")) GTEST_SKIP() << "CUDASIM_TIMELINE=1 here";
  Stream s(cudaStreamNonBlocking);
  ASSERT_EQ(0, cudasim_kernel(s, 1'000, "k"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_EQ(0u, cudasim_timeline(nullptr, 0));
}

class RealTimeTimeline : public RealTime {
 protected:
  void SetUp() override {
    if (!env_is("CUDASIM_TIMELINE", "1")) GTEST_SKIP() << "needs CUDASIM_TIMELINE=1";
    RealTime::SetUp();
  }
};

TEST_F(RealTimeTimeline, EntriesGetRealTimesWhenTheyRun) {
  Stream s(cudaStreamNonBlocking);
  DeviceBuffer d(kMiB);
  PinnedBuffer h(kMiB);
  cudasim_timeline_clear();
  const uint64_t before = cudasim_now_ns();
  ASSERT_EQ(0, cudasim_kernel(s, 2'000'000, "k"));
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), h.get(), kMiB, cudaMemcpyHostToDevice, s));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  const uint64_t after = cudasim_now_ns();
  const auto tl = timeline();
  ASSERT_EQ(2u, tl.size());
  EXPECT_EQ(kKernel, tl[0].kind);
  EXPECT_EQ(kH2D, tl[1].kind);
  EXPECT_EQ(kMiB, tl[1].bytes);
  for (const auto& e : tl) {
    EXPECT_LE(before, e.enqueue_ns);
    EXPECT_LE(e.enqueue_ns, e.start_ns);
    EXPECT_LE(e.start_ns, e.end_ns);
    EXPECT_LE(e.end_ns, after);
    EXPECT_EQ(0u, e.stall_ns);
  }
  EXPECT_GE(tl[0].end_ns - tl[0].start_ns, 2'000'000u);
  EXPECT_LE(tl[0].end_ns, tl[1].start_ns);
}

// ---- Settings -------------------------------------------------------------------------

// Each case sets a bad value in a death-test child, which reads the settings first.
struct BadSetting {
  const char* name;
  const char* value;
  const char* message;
};

void PrintTo(const BadSetting& bad, std::ostream* os) { *os << bad.name << "='" << bad.value << "'"; }

class VirtualTimeSettingsDeathTest : public ::testing::TestWithParam<BadSetting> {};

TEST_P(VirtualTimeSettingsDeathTest, BadValueExitsWithStatus2NamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const BadSetting bad = GetParam();
  EXPECT_EXIT(
      {
        setenv(bad.name, bad.value, 1);
        cudasim_virtual_time();
      },
      ::testing::ExitedWithCode(2), bad.message);
}

INSTANTIATE_TEST_SUITE_P(
    Values, VirtualTimeSettingsDeathTest,
    ::testing::Values(BadSetting{"CUDASIM_TIME", "fast", "CUDASIM_TIME='fast' is not valid; accepted: real or virtual"},
                      BadSetting{"CUDASIM_PCIE_GBPS", "0", "CUDASIM_PCIE_GBPS='0' is not valid; accepted: a decimal"},
                      BadSetting{"CUDASIM_PCIE_GBPS", "55GB", "CUDASIM_PCIE_GBPS='55GB' is not valid"},
                      BadSetting{"CUDASIM_PCIE_GBPS", "-3", "CUDASIM_PCIE_GBPS='-3' is not valid"},
                      BadSetting{"CUDASIM_HBM_GBPS", "nan", "CUDASIM_HBM_GBPS='nan' is not valid"},
                      BadSetting{"CUDASIM_DISK_GBPS", "0", "CUDASIM_DISK_GBPS='0' is not valid; accepted: a decimal"},
                      BadSetting{"CUDASIM_DISK_GBPS", "fast", "CUDASIM_DISK_GBPS='fast' is not valid"},
                      BadSetting{"CUDASIM_PCIE_DUPLEX", "half",
                                 "CUDASIM_PCIE_DUPLEX='half' is not valid; accepted: full or shared"},
                      BadSetting{"CUDASIM_UNBACKED", "yes", "CUDASIM_UNBACKED='yes' is not valid; accepted: 0 or 1"},
                      BadSetting{"CUDASIM_TIMELINE", "2", "CUDASIM_TIMELINE='2' is not valid; accepted: 0 or 1"},
                      BadSetting{"CUDASIM_HOST_COSTS", "a100",
                                 "CUDASIM_HOST_COSTS='a100' is not valid; accepted: none, h100, or either followed"},
                      BadSetting{"CUDASIM_HOST_COSTS", "h100,map=fast", "CUDASIM_HOST_COSTS='h100,map=fast' is not valid"},
                      BadSetting{"CUDASIM_HOST_COSTS", "h100,remap=3", "CUDASIM_HOST_COSTS='h100,remap=3' is not valid"},
                      BadSetting{"CUDASIM_HOST_PINNED_LIMIT", "lots",
                                 "CUDASIM_HOST_PINNED_LIMIT='lots' is not valid; accepted: a size up to 1PiB"}),
    [](const ::testing::TestParamInfo<BadSetting>& info) {
      return std::string(info.param.name + std::strlen("CUDASIM_")) + "_" + std::to_string(info.index);
    });

}  // namespace
