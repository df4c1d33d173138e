// cudasim conformance: correctly synchronized multi-stream programs give the right
// answer. Registered three times: plainly and under CUDASIM_CHAOS with two seeds, where
// cudasim delays operations at random; a missing synchronization in cudasim (or in a
// program) then shows up as a wrong result.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "runtime_test_util.h"

namespace {

using cudasim_test::DeviceBuffer;
using cudasim_test::Event;
using cudasim_test::PinnedBuffer;
using cudasim_test::Stream;

constexpr size_t kSize = 32 * 1024;
constexpr int kRounds = 24;

unsigned char value_for(int round, size_t i) { return static_cast<unsigned char>(round * 37 + i % 251); }

// Producer stream: H2D into a staging buffer, memset its head, record an event.
// Consumer stream: wait for the event, D2D into the result buffer, D2H into the output.
// The host reuses the input buffer only after the producer's event says it is consumed.
TEST(Chaos, ProducerEventConsumerPipeline) {
  ASSERT_CUDA_OK(cudaSetDevice(0));
  Stream producer(cudaStreamNonBlocking), consumer(cudaStreamNonBlocking);
  Event produced(cudaEventDisableTiming), consumed(cudaEventDisableTiming);
  DeviceBuffer staging(kSize), result(kSize);
  PinnedBuffer input(kSize), output(kSize);
  ASSERT_CUDA_OK(staging.status());
  ASSERT_CUDA_OK(result.status());
  ASSERT_CUDA_OK(input.status());
  ASSERT_CUDA_OK(output.status());
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < kSize; ++i) input.get()[i] = value_for(round, i);
    // The staging buffer is reused: the producer must not overwrite it before the
    // consumer of the previous round has read it.
    ASSERT_CUDA_OK(cudaStreamWaitEvent(producer, consumed, 0));
    ASSERT_CUDA_OK(cudaMemcpyAsync(staging.get(), input.get(), kSize, cudaMemcpyHostToDevice, producer));
    ASSERT_CUDA_OK(cudaMemsetAsync(staging.get(), round, 64, producer));
    ASSERT_CUDA_OK(cudaEventRecord(produced, producer));
    ASSERT_CUDA_OK(cudaStreamWaitEvent(consumer, produced, 0));
    ASSERT_CUDA_OK(cudaMemcpyAsync(result.get(), staging.get(), kSize, cudaMemcpyDeviceToDevice, consumer));
    ASSERT_CUDA_OK(cudaEventRecord(consumed, consumer));
    ASSERT_CUDA_OK(cudaMemcpyAsync(output.get(), result.get(), kSize, cudaMemcpyDeviceToHost, consumer));
    ASSERT_CUDA_OK(cudaStreamSynchronize(consumer));
    for (size_t i = 0; i < kSize; ++i) {
      const unsigned char expected = i < 64 ? static_cast<unsigned char>(round) : value_for(round, i);
      ASSERT_EQ(expected, output.at(i)) << "round " << round << ", byte " << i;
    }
  }
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

// Fan out from one stream to three, each transforming its own slice, then fan in with
// events; host functions check on the way that the data they depend on is there.
TEST(Chaos, FanOutFanInWithHostFunctions) {
  ASSERT_CUDA_OK(cudaSetDevice(0));
  constexpr int kWorkers = 3;
  constexpr size_t kSlice = kSize / kWorkers;
  Stream root(cudaStreamNonBlocking);
  Stream workers[kWorkers];
  Event forked(cudaEventDisableTiming);
  Event joined[kWorkers];
  DeviceBuffer d(kSize);
  PinnedBuffer host(kSize, 0), out(kSize, 0);
  ASSERT_CUDA_OK(d.status());
  struct Check {
    const PinnedBuffer* buffer;
    unsigned char expected;
    std::atomic<int> failures{0};
  };
  for (int round = 0; round < kRounds / 2; ++round) {
    const unsigned char base = static_cast<unsigned char>(round * 5 + 1);
    Check seen{&host, base};
    std::memset(host.get(), 0, kSize);
    ASSERT_CUDA_OK(cudaMemsetAsync(d.get(), base, kSize, root));
    ASSERT_CUDA_OK(cudaMemcpyAsync(host.get(), d.get(), kSize, cudaMemcpyDeviceToHost, root));
    ASSERT_CUDA_OK(cudaEventRecord(forked, root));
    for (int w = 0; w < kWorkers; ++w) {
      ASSERT_CUDA_OK(cudaStreamWaitEvent(workers[w], forked, 0));
      // The root's D2H copy must be complete when this runs.
      ASSERT_CUDA_OK(cudaLaunchHostFunc(
          workers[w],
          [](void* p) {
            auto* check = static_cast<Check*>(p);
            if (!check->buffer->all_equal(check->expected)) check->failures.fetch_add(1);
          },
          &seen));
      ASSERT_CUDA_OK(cudaMemsetAsync(d.get() + w * kSlice, base + w + 1, kSlice, workers[w]));
      ASSERT_CUDA_OK(cudaEventRecord(joined[w], workers[w]));
      ASSERT_CUDA_OK(cudaStreamWaitEvent(root, joined[w], 0));
    }
    ASSERT_CUDA_OK(cudaMemcpyAsync(out.get(), d.get(), kSize, cudaMemcpyDeviceToHost, root));
    ASSERT_CUDA_OK(cudaStreamSynchronize(root));
    EXPECT_EQ(0, seen.failures.load()) << "a worker ran before the root's copy completed";
    for (size_t i = 0; i < kSize; ++i) {
      const size_t w = i / kSlice;
      const unsigned char expected =
          w < kWorkers ? static_cast<unsigned char>(base + w + 1) : base;
      ASSERT_EQ(expected, out.at(i)) << "round " << round << ", byte " << i;
    }
    ASSERT_CUDA_OK(cudaDeviceSynchronize());  // `seen` goes out of scope
  }
}

}  // namespace
