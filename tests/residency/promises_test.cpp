// What the engine promises its callers where an earlier version broke the promise: each
// case is the reproduction of a defect, named after the promise it checks.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "cuda/event.h"
#include "cuda/host_time.h"
#include "engine_test_util.h"

namespace engine_test {
namespace {

using Promises = EngineFixture;

// The statistics' host_wait_ns (cuda/host_time.h): a thread that waits for the device in
// vramswap has that time counted (and no more than the call took).
TEST_F(Promises, WaitingForTheDeviceIsCountedAsHostWaitTime) {
  start(64 * kMiB);
  cuda_test::StreamGate gate(std::chrono::seconds(30));
  ASSERT_CUDA_OK(gate.hold(stream_));
  vramswap::cuda::Event done = vramswap::cuda::Event::create();
  done.record(stream_);
  const uint64_t before = vramswap::cuda::host_times().wait_ns;
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate.open();
  });
  const auto called = std::chrono::steady_clock::now();
  done.synchronize();  // returns only once the gate is open
  const auto call = std::chrono::steady_clock::now() - called;
  opener.join();
  const uint64_t counted = vramswap::cuda::host_times().wait_ns - before;
  EXPECT_GT(counted, 0u);
  EXPECT_LE(counted, uint64_t(std::chrono::nanoseconds(call).count()));
}

// vramswap.h: after unpack(h, s) the block's contents are valid for all work queued on s.
// A block marked cold on one stream and unpacked on another without ever leaving the
// device must still order the second stream after the first's last writes.
TEST_F(Promises, UnpackOnAnotherStreamSeesTheWritesBeforeMarkCold) {
  start(64 * kMiB);
  engine_->graph_begin();
  void* a = tagged(1);
  cuda_test::StreamGate gate(std::chrono::seconds(30));
  ASSERT_CUDA_OK(gate.hold(stream_));
  ASSERT_CUDA_OK(cudaMemsetAsync(a, 0x5a, kBlock, stream_));  // the forward's last write, held back
  const uint64_t h = pack_cold(a);
  cudaStream_t other;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  ASSERT_TRUE(engine_->unpack(h, other).ok);
  uint8_t* back = nullptr;  // pinned: a copy into pageable memory would make the host wait
  ASSERT_CUDA_OK(cudaMallocHost(reinterpret_cast<void**>(&back), kBlock));
  std::fill(back, back + kBlock, uint8_t{0});
  ASSERT_CUDA_OK(cudaMemcpyAsync(back, a, kBlock, cudaMemcpyDeviceToHost, other));
  // Give a read that is not ordered after the write the time to run, then let the write go.
  for (int i = 0; i < 100 && cudaStreamQuery(other) == cudaErrorNotReady; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  cudaGetLastError();
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(other));
  size_t stale = 0;
  for (size_t i = 0; i < kBlock; ++i) stale += back[i] != 0x5a;
  EXPECT_EQ(0u, stale) << "bytes read on the unpacking stream before the marking stream's write";
  cudaFreeHost(back);
  ASSERT_TRUE(engine_->release(h).ok);
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  cudaStreamDestroy(other);
}

// VRAMSWAP_VERIFY checks what came back, not what the program wrote after it came back:
// unpack, a write (legal after unpack), release and free report no verify failure.
TEST_F(Promises, VerifyChecksTheRestoredBlockNotTheProgramsLaterWrites) {
  EngineOptions options;
  options.verify = true;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = pack_cold(a);
  void* b = tagged(2);
  void* c = tagged(3);  // a goes to the host to make room
  ASSERT_NE(nullptr, c);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
  ASSERT_GT(stats().bytes_prefetched_total, 0u) << "the case needs a block that came back";
  EXPECT_TRUE(holds(a, 1));
  ASSERT_CUDA_OK(cudaMemsetAsync(a, 0x33, kBlock, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  ASSERT_TRUE(engine_->release(ha).ok);
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  EXPECT_EQ(0u, stats().num_verify_failures);
}

// vramswap.h: a prefetch is a hint that never evicts to make room: with no free memory it
// is refused, and the blocks on the device (a clean one here) stay as they were.
TEST_F(Promises, APrefetchNeverEvictsToMakeRoom) {
  start_soft(12 * kMiB, 4 * kMiB, /*horizon=*/0);
  engine_->graph_begin();
  Saved saved = save_cold(2, 1);  // past the soft limit: copied to the host, still mapped
  void* c = tagged(3);
  void* d = tagged(4);            // the furthest-needed clean block (the first saved) makes room
  ASSERT_NE(nullptr, d);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const EngineStats before = stats();
  ASSERT_GT(before.evicted_bytes, 0u) << "the case needs an evicted block";
  ASSERT_GT(before.clean_bytes, 0u) << "the case needs a clean block";
  EXPECT_FALSE(engine_->prefetch(saved.handles[0]).ok);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const EngineStats after = stats();
  EXPECT_EQ(before.clean_bytes, after.clean_bytes) << "a clean block was given up for a prefetch";
  EXPECT_EQ(before.evicted_bytes, after.evicted_bytes);
  EXPECT_EQ(before.bytes_evicted_total, after.bytes_evicted_total) << "a prefetch started an eviction";
  for (int i = 1; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(saved.handles[size_t(i)], stream_).ok);
    EXPECT_TRUE(holds(saved.blocks[size_t(i)], uint8_t(1 + i)));
    ASSERT_TRUE(engine_->release(saved.handles[size_t(i)]).ok);
    ASSERT_TRUE(engine_->free_tagged(saved.blocks[size_t(i)], stream_).ok);
    if (i == 1) {
      ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
      ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
    }
  }
}

}  // namespace
}  // namespace engine_test
