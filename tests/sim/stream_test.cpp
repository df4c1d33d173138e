// cudasim conformance: streams. Work on one stream runs in order and asynchronously to
// the host; streams run concurrently unless events or the legacy default stream order
// them; host functions hold their stream while they run.
//
// A StreamGate (a host function that blocks until the test opens it) stands in for a
// long kernel: work queued behind it must not have happened until the gate opens.
// Checks that something must *not* wait use polling with a deadline, so a wrong
// implementation fails instead of hanging.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime_test_util.h"

namespace {

using cudasim_test::DeviceBuffer;
using cudasim_test::kSettleTime;
using cudasim_test::PinnedBuffer;
using cudasim_test::Stream;
using cudasim_test::StreamGate;
using cudasim_test::Event;
using cudasim_test::wait_for_stream;
using cudasim_test::Watchdog;

constexpr size_t kSize = 64 * 1024;
constexpr unsigned char kDeviceValue = 0x5A;

class Streams : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(device_.status());
    ASSERT_CUDA_OK(host_.status());
    ASSERT_CUDA_OK(cudaMemset(device_.get(), kDeviceValue, kSize));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    cudaGetLastError();  // queries that answered cudaErrorNotReady may have set it
  }
  // Queues on `stream` a copy of the device buffer (all kDeviceValue) into the pinned
  // host buffer (all 0), which the test can watch.
  cudaError_t queue_copy(cudaStream_t stream) {
    return cudaMemcpyAsync(host_.get(), device_.get(), kSize, cudaMemcpyDeviceToHost, stream);
  }
  bool copy_done() const { return host_.all_equal(kDeviceValue); }
  bool copy_not_started() const { return host_.all_equal(0); }

  DeviceBuffer device_{kSize};
  PinnedBuffer host_{kSize, 0};
};

TEST_F(Streams, IdleStreamQueriesSuccess) {
  Stream stream;
  ASSERT_CUDA_OK(stream.status());
  EXPECT_EQ(cudaSuccess, cudaStreamQuery(stream));
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  unsigned int flags = 0xFF;
  ASSERT_CUDA_OK(cudaStreamGetFlags(stream, &flags));
  EXPECT_EQ(static_cast<unsigned int>(cudaStreamDefault), flags);
  Stream nonblocking(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(cudaStreamGetFlags(nonblocking, &flags));
  EXPECT_EQ(static_cast<unsigned int>(cudaStreamNonBlocking), flags);
}

// The final contents depend on the order of every step, so any reordering shows.
TEST_F(Streams, WorkOnOneStreamRunsInOrder) {
  constexpr size_t n = 4096;
  Stream stream(cudaStreamNonBlocking);
  DeviceBuffer d(n);
  PinnedBuffer src(n, 0x22), out(n, 0);
  ASSERT_CUDA_OK(d.status());
  for (int round = 0; round < 10; ++round) {
    StreamGate gate;  // everything is queued before anything runs
    ASSERT_CUDA_OK(gate.hold(stream));
    ASSERT_CUDA_OK(cudaMemsetAsync(d.get(), 0x11, n, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), src.get(), n / 2, cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA_OK(cudaMemsetAsync(d.get() + n / 4, 0x33, n / 8, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(d.get() + 3 * n / 4, d.get(), n / 4, cudaMemcpyDeviceToDevice, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(out.get(), d.get(), n, cudaMemcpyDeviceToHost, stream));
    gate.open();
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < n; ++i) {
      unsigned char expected = 0x22;
      if (i >= n / 4 && i < n / 4 + n / 8) expected = 0x33;
      else if (i >= n / 2 && i < 3 * n / 4) expected = 0x11;
      ASSERT_EQ(expected, out.at(i)) << "round " << round << ", byte " << i;
    }
    std::memset(out.get(), 0, n);
  }
}

TEST_F(Streams, HostFunctionsRunInOrder) {
  Stream stream;
  struct Log {
    std::mutex mutex;
    std::vector<int> order;
  } log;
  struct Call {
    Log* log;
    int index;
  };
  std::vector<Call> calls;
  for (int i = 0; i < 64; ++i) calls.push_back({&log, i});
  for (auto& call : calls) {
    ASSERT_CUDA_OK(cudaLaunchHostFunc(
        stream,
        [](void* p) {
          auto* c = static_cast<Call*>(p);
          std::lock_guard<std::mutex> lock(c->log->mutex);
          c->log->order.push_back(c->index);
        },
        &call));
  }
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<int> expected;
  for (int i = 0; i < 64; ++i) expected.push_back(i);
  EXPECT_EQ(expected, log.order);
}

// cudaLaunchHostFunc: "The function will be called after currently enqueued work and
// will block work added after it."
TEST_F(Streams, HostFunctionHoldsTheStreamAndWorkBehindIt) {
  Stream stream(cudaStreamNonBlocking);
  StreamGate gate;
  Watchdog watchdog(gate);
  ASSERT_CUDA_OK(gate.hold(stream));
  ASSERT_CUDA_OK(queue_copy(stream));
  ASSERT_TRUE(gate.wait_entered());
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(stream));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_TRUE(copy_not_started()) << "the copy ran while the host function held the stream";
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(stream));
  watchdog.cancel();
  EXPECT_FALSE(watchdog.fired()) << "cudaMemcpyAsync waited for the stream";
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(copy_done());
  EXPECT_EQ(cudaSuccess, cudaStreamQuery(stream));
}

// Two streams created with cudaStreamCreate do not wait for each other.
TEST_F(Streams, BlockedStreamDoesNotBlockAnotherStream) {
  Stream held, free_stream;
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(held));
  ASSERT_CUDA_OK(queue_copy(free_stream));
  EXPECT_EQ(cudaSuccess, wait_for_stream(free_stream)) << "the copy waited for another stream";
  EXPECT_TRUE(copy_done());
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(held));
  gate.open();
  EXPECT_CUDA_OK(cudaStreamSynchronize(held));
}

// cudaStreamWaitEvent: "Makes all future work submitted to stream wait for all work
// captured in event."
TEST_F(Streams, StreamWaitEventOrdersAcrossStreams) {
  Stream producer(cudaStreamNonBlocking), consumer(cudaStreamNonBlocking);
  Event ready(cudaEventDisableTiming);
  DeviceBuffer staged(kSize);
  PinnedBuffer src(kSize, 0x7C);
  StreamGate gate;
  ASSERT_CUDA_OK(cudaMemset(staged.get(), 0, kSize));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_CUDA_OK(gate.hold(producer));
  ASSERT_CUDA_OK(cudaMemcpyAsync(staged.get(), src.get(), kSize, cudaMemcpyHostToDevice, producer));
  ASSERT_CUDA_OK(cudaEventRecord(ready, producer));
  ASSERT_CUDA_OK(cudaStreamWaitEvent(consumer, ready, 0));
  ASSERT_CUDA_OK(cudaMemcpyAsync(host_.get(), staged.get(), kSize, cudaMemcpyDeviceToHost, consumer));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(consumer));
  EXPECT_TRUE(copy_not_started()) << "the consumer did not wait for the event";
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(consumer));
  EXPECT_TRUE(host_.all_equal(0x7C)) << "the consumer ran before the producer's copy";
}

// cudaEventRecord: "Other APIs such as cudaStreamWaitEvent() use the most recently
// captured state at the time of the API call, and are not affected by later calls to
// cudaEventRecord()."
TEST_F(Streams, StreamWaitEventUsesTheRecordAtTheTimeOfTheCall) {
  Stream first(cudaStreamNonBlocking), waiter(cudaStreamNonBlocking), idle(cudaStreamNonBlocking);
  Event event(cudaEventDisableTiming);
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(first));
  ASSERT_CUDA_OK(cudaEventRecord(event, first));
  ASSERT_CUDA_OK(cudaStreamWaitEvent(waiter, event, 0));
  ASSERT_CUDA_OK(queue_copy(waiter));
  ASSERT_CUDA_OK(cudaEventRecord(event, idle));  // re-recorded on an idle stream
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(idle));
  EXPECT_EQ(cudaSuccess, cudaEventSynchronize(event));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(waiter));
  EXPECT_TRUE(copy_not_started()) << "the wait followed the later record";
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(waiter));
  EXPECT_TRUE(copy_done());
}

// cudaStreamCreate makes a blocking stream: the legacy default stream waits for it.
TEST_F(Streams, LegacyDefaultStreamWaitsForBlockingStreams) {
  Stream blocking;  // cudaStreamDefault
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(blocking));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(queue_copy(0));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(0));
  EXPECT_TRUE(copy_not_started()) << "legacy stream work overtook a blocking stream";
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(0));
  EXPECT_TRUE(copy_done());
}

TEST_F(Streams, BlockingStreamWaitsForLegacyDefaultStream) {
  Stream blocking;
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(cudaStreamLegacy));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(queue_copy(blocking));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(blocking));
  EXPECT_TRUE(copy_not_started()) << "blocking stream work overtook the legacy stream";
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(blocking));
  EXPECT_TRUE(copy_done());
}

// cudaStreamNonBlocking: "Stream does not synchronize with stream 0 (the NULL stream)".
TEST_F(Streams, LegacyDefaultStreamDoesNotWaitForNonBlockingStreams) {
  Stream nonblocking(cudaStreamNonBlocking);
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(nonblocking));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(queue_copy(0));
  EXPECT_EQ(cudaSuccess, wait_for_stream(0)) << "the legacy stream waited for a non-blocking one";
  EXPECT_TRUE(copy_done());
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(nonblocking));
  gate.open();
  EXPECT_CUDA_OK(cudaStreamSynchronize(nonblocking));
}

TEST_F(Streams, NonBlockingStreamDoesNotWaitForLegacyDefaultStream) {
  Stream nonblocking(cudaStreamNonBlocking);
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(0));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(queue_copy(nonblocking));
  EXPECT_EQ(cudaSuccess, wait_for_stream(nonblocking))
      << "a non-blocking stream waited for the legacy stream";
  EXPECT_TRUE(copy_done());
  gate.open();
  EXPECT_CUDA_OK(cudaStreamSynchronize(0));
}

// cudaStreamPerThread: each host thread has its own default stream; a held per-thread
// stream in one thread does not hold another thread's.
TEST_F(Streams, PerThreadDefaultStreamIsDistinctPerThread) {
  StreamGate gate;
  std::thread holder([&gate] {
    EXPECT_CUDA_OK(cudaSetDevice(0));
    EXPECT_CUDA_OK(gate.hold(cudaStreamPerThread));
    EXPECT_TRUE(gate.wait_entered());
    // Waits here, in its own thread, for the gate to open.
    EXPECT_CUDA_OK(cudaStreamSynchronize(cudaStreamPerThread));
  });
  ASSERT_TRUE(gate.wait_entered());
  EXPECT_EQ(cudaSuccess, cudaStreamQuery(cudaStreamPerThread)) << "this thread's stream is idle";
  ASSERT_CUDA_OK(queue_copy(cudaStreamPerThread));
  EXPECT_EQ(cudaSuccess, wait_for_stream(cudaStreamPerThread))
      << "this thread's per-thread stream waited for another thread's";
  EXPECT_TRUE(copy_done());
  gate.open();
  holder.join();
}

TEST_F(Streams, PriorityRangeAndClamping) {
  int least = 1, greatest = 1;
  ASSERT_CUDA_OK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  // "Stream priorities follow a convention where lower numbers imply greater priorities."
  EXPECT_LE(greatest, least);
  EXPECT_LE(greatest, 0);
  EXPECT_GE(least, 0);
  const struct {
    int requested;
    int expected;
  } rows[] = {{greatest, greatest}, {least, least}, {greatest - 100, greatest}, {least + 100, least}};
  for (const auto& row : rows) {
    cudaStream_t stream = nullptr;
    ASSERT_CUDA_OK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, row.requested));
    int priority = 12345;
    ASSERT_CUDA_OK(cudaStreamGetPriority(stream, &priority));
    EXPECT_EQ(row.expected, priority) << "requested " << row.requested;
    unsigned int flags = 0;
    ASSERT_CUDA_OK(cudaStreamGetFlags(stream, &flags));
    EXPECT_EQ(static_cast<unsigned int>(cudaStreamNonBlocking), flags);
    EXPECT_CUDA_OK(cudaStreamDestroy(stream));
  }
  Stream plain;
  int priority = 12345;
  ASSERT_CUDA_OK(cudaStreamGetPriority(plain, &priority));
  EXPECT_EQ(0, priority) << "'0' represents default priority";
}

// cudaStreamDestroy: "In case the device is still doing work in the stream stream when
// cudaStreamDestroy() is called, the function will return immediately and the resources
// associated with stream will be released automatically once the device has completed
// all work in stream."
TEST_F(Streams, DestroyWithPendingWorkReturnsAndTheWorkCompletes) {
  StreamGate gate;
  Watchdog watchdog(gate);
  std::atomic<bool> last_ran{false};
  cudaStream_t stream = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ASSERT_CUDA_OK(gate.hold(stream));
  ASSERT_CUDA_OK(queue_copy(stream));
  ASSERT_CUDA_OK(cudaLaunchHostFunc(
      stream, [](void* p) { static_cast<std::atomic<bool>*>(p)->store(true); }, &last_ran));
  ASSERT_CUDA_OK(cudaStreamDestroy(stream));
  watchdog.cancel();
  EXPECT_FALSE(watchdog.fired()) << "cudaStreamDestroy waited for the stream's work";
  EXPECT_TRUE(copy_not_started());
  gate.open();
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(copy_done()) << "work of a destroyed stream was dropped";
  EXPECT_TRUE(last_ran.load());
}

// A destroyed stream's handle is undefined behaviour on a GPU (the driver may crash, or find
// another stream at that address): cudasim stops the program at its first use, so that code
// relying on an error code for it (vramswap once skipped destroyed streams that way) is found
// here and not on a GPU. A pointer that never was a stream stays an error code.
TEST(StreamsDeathTest, ADestroyedStreamUsedAgainStopsTheProgram) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* kMessage = "after cudaStreamDestroy destroyed it";
  auto destroyed = [] {
    cudaStream_t s = nullptr;
    if (cudaStreamCreate(&s) != cudaSuccess || cudaStreamDestroy(s) != cudaSuccess) std::exit(0);
    return s;
  };
  EXPECT_DEATH(cudaStreamQuery(destroyed()), kMessage);
  EXPECT_DEATH(cudaStreamSynchronize(destroyed()), kMessage);
  EXPECT_DEATH(
      {
        cudaStreamCaptureStatus status;
        cudaStreamIsCapturing(destroyed(), &status);
      },
      kMessage);
  EXPECT_DEATH(
      {
        cudaEvent_t e = nullptr;
        if (cudaEventCreate(&e) != cudaSuccess) std::exit(0);
        cudaEventRecord(e, destroyed());
      },
      kMessage);
  EXPECT_DEATH(cudaStreamDestroy(destroyed()), "a second destruction");
  int foreign = 0;
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaStreamQuery(reinterpret_cast<cudaStream_t>(&foreign)));
  cudaGetLastError();
}

TEST_F(Streams, DeviceSynchronizeWaitsForEveryStream) {
  Stream blocking, nonblocking(cudaStreamNonBlocking);
  PinnedBuffer out1(kSize, 0), out2(kSize, 0), out3(kSize, 0);
  std::atomic<int> ran{0};
  auto slow = [](void* p) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    static_cast<std::atomic<int>*>(p)->fetch_add(1);
  };
  const cudaStream_t streams[] = {blocking, nonblocking, cudaStreamPerThread};
  PinnedBuffer* outs[] = {&out1, &out2, &out3};
  for (int i = 0; i < 3; ++i) {
    ASSERT_CUDA_OK(cudaLaunchHostFunc(streams[i], slow, &ran));
    ASSERT_CUDA_OK(cudaMemcpyAsync(outs[i]->get(), device_.get(), kSize, cudaMemcpyDeviceToHost, streams[i]));
  }
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(3, ran.load());
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(outs[i]->all_equal(kDeviceValue)) << "stream " << i;
  for (cudaStream_t s : streams) EXPECT_EQ(cudaSuccess, cudaStreamQuery(s));
}

// cudaLaunchHostFunc: "The host function must not make any CUDA API calls. Attempting to
// use a CUDA API may result in cudaErrorNotPermitted".
TEST_F(Streams, CudaCallFromHostFunctionIsNotPermitted) {
  struct Result {
    cudaError_t malloc_status = cudaSuccess;
    void* ptr = nullptr;
    cudaError_t stream_status = cudaSuccess;
    cudaStream_t stream = nullptr;
  } result;
  Stream stream;
  ASSERT_CUDA_OK(cudaLaunchHostFunc(
      stream,
      [](void* p) {
        auto* r = static_cast<Result*>(p);
        r->malloc_status = cudaMalloc(&r->ptr, 4096);
        r->stream_status = cudaStreamCreate(&r->stream);
      },
      &result));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(cudaErrorNotPermitted, result.malloc_status);
  EXPECT_EQ(cudaErrorNotPermitted, result.stream_status);
  if (result.malloc_status == cudaSuccess) cudaFree(result.ptr);
  if (result.stream_status == cudaSuccess) cudaStreamDestroy(result.stream);
  // The host function's error does not leak into this thread.
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}

TEST_F(Streams, StreamCallbackGetsStreamAndSuccess) {
  Stream stream;
  struct Seen {
    cudaStream_t stream = nullptr;
    cudaError_t status = cudaErrorUnknown;
  } seen;
  ASSERT_CUDA_OK(cudaStreamAddCallback(
      stream,
      [](cudaStream_t s, cudaError_t status, void* p) {
        auto* seen = static_cast<Seen*>(p);
        seen->stream = s;
        seen->status = status;
      },
      &seen, 0));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(stream.get(), seen.stream);
  EXPECT_EQ(cudaSuccess, seen.status);
}

}  // namespace
