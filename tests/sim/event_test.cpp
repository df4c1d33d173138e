// cudasim conformance: events. An event captures the work queued on a stream when it is
// recorded; queries, synchronization and elapsed time follow the CUDA 13 documentation.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "runtime_test_util.h"

namespace {

using cudasim_test::Event;
using cudasim_test::kSettleTime;
using cudasim_test::Stream;
using cudasim_test::StreamGate;
using cudasim_test::wait_for_event;
using cudasim_test::Watchdog;

class Events : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(stream_.status());
  }
  Stream stream_{cudaStreamNonBlocking};
};

TEST_F(Events, QueryIsNotReadyUntilTheCapturedWorkCompletes) {
  Event event;
  ASSERT_CUDA_OK(event.status());
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(stream_));
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  // cudaEventQuery: "Returns cudaSuccess if all captured work has been completed, or
  // cudaErrorNotReady if any captured work is incomplete."
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(event));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(event));
  gate.open();
  ASSERT_CUDA_OK(cudaEventSynchronize(event));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(event));
}

// cudaEventRecord: "Before the first call to cudaEventRecord(), an event represents an
// empty set of work, so for example cudaEventQuery() would return cudaSuccess."
TEST_F(Events, NeverRecordedEventIsComplete) {
  Event event;
  ASSERT_CUDA_OK(event.status());
  EXPECT_EQ(cudaSuccess, cudaEventQuery(event));
  EXPECT_EQ(cudaSuccess, cudaEventSynchronize(event));
  Stream waiter;
  ASSERT_CUDA_OK(cudaStreamWaitEvent(waiter, event, 0));
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(waiter));
}

TEST_F(Events, SynchronizeWaitsForTheHostFunctionBeforeIt) {
  Event event(cudaEventBlockingSync);
  ASSERT_CUDA_OK(event.status());
  std::atomic<bool> done{false};
  ASSERT_CUDA_OK(cudaLaunchHostFunc(
      stream_,
      [](void* p) {
        std::this_thread::sleep_for(std::chrono::milliseconds(15));
        static_cast<std::atomic<bool>*>(p)->store(true);
      },
      &done));
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  ASSERT_CUDA_OK(cudaEventSynchronize(event));
  EXPECT_TRUE(done.load());
  EXPECT_EQ(cudaSuccess, cudaEventQuery(event));
}

// cudaEventRecord "can be called multiple times on the same event and will overwrite the
// previously captured state."
TEST_F(Events, ReRecordingCapturesTheNewWork) {
  Event event;
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  ASSERT_CUDA_OK(cudaEventSynchronize(event));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(event));
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(stream_));
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(event)) << "the event still shows the old record";
  gate.open();
  ASSERT_CUDA_OK(cudaEventSynchronize(event));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(event));
  // And recorded on another stream it follows that stream.
  Stream other(cudaStreamNonBlocking);
  StreamGate gate2;
  ASSERT_CUDA_OK(gate2.hold(other));
  ASSERT_CUDA_OK(cudaEventRecord(event, other));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(event));
  gate2.open();
  EXPECT_EQ(cudaSuccess, wait_for_event(event));
}

TEST_F(Events, ElapsedTimeCoversTheTimeTheStreamWasHeld) {
  constexpr auto kHold = std::chrono::milliseconds(25);
  Event start, stop;
  ASSERT_CUDA_OK(start.status());
  ASSERT_CUDA_OK(stop.status());
  StreamGate gate;
  ASSERT_CUDA_OK(cudaEventRecord(start, stream_));
  ASSERT_CUDA_OK(gate.hold(stream_));
  ASSERT_CUDA_OK(cudaEventRecord(stop, stream_));
  ASSERT_TRUE(gate.wait_entered());  // start has completed by now
  const auto held_from = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(kHold);
  const double held_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - held_from).count();
  gate.open();
  ASSERT_CUDA_OK(cudaEventSynchronize(stop));
  float ms = -1.0f;
  ASSERT_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  // "in milliseconds with a resolution of around 0.5 microseconds"
  EXPECT_GE(ms, held_ms - 0.5) << "the stream was held for " << held_ms << " ms";
  EXPECT_LT(ms, held_ms + 2000.0);
}

// cudaEventElapsedTime: "If either event was created with the cudaEventDisableTiming
// flag, then this function will return cudaErrorInvalidResourceHandle."
TEST_F(Events, ElapsedTimeWithDisableTimingIsInvalidResourceHandle) {
  Event timed, untimed(cudaEventDisableTiming);
  ASSERT_CUDA_OK(untimed.status());
  ASSERT_CUDA_OK(cudaEventRecord(timed, stream_));
  ASSERT_CUDA_OK(cudaEventRecord(untimed, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  float ms = 0.0f;
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventElapsedTime(&ms, timed, untimed));
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventElapsedTime(&ms, untimed, timed));
  cudaGetLastError();
}

// cudaEventElapsedTime: "If cudaEventRecord() has not been called on either event, then
// cudaErrorInvalidResourceHandle is returned."
TEST_F(Events, ElapsedTimeOfUnrecordedEventIsInvalidResourceHandle) {
  Event recorded, unrecorded;
  ASSERT_CUDA_OK(cudaEventRecord(recorded, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  float ms = 0.0f;
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventElapsedTime(&ms, recorded, unrecorded));
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventElapsedTime(&ms, unrecorded, recorded));
  cudaGetLastError();
}

// cudaEventElapsedTime: "If cudaEventRecord() has been called on both events but one or
// both of them has not yet been completed ... cudaErrorNotReady is returned."
TEST_F(Events, ElapsedTimeOfIncompleteEventIsNotReady) {
  Event start, stop;
  ASSERT_CUDA_OK(cudaEventRecord(start, stream_));
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(stream_));
  ASSERT_CUDA_OK(cudaEventRecord(stop, stream_));
  float ms = 0.0f;
  EXPECT_EQ(cudaErrorNotReady, cudaEventElapsedTime(&ms, start, stop));
  gate.open();
  ASSERT_CUDA_OK(cudaEventSynchronize(stop));
  EXPECT_EQ(cudaSuccess, cudaEventElapsedTime(&ms, start, stop));
  EXPECT_GE(ms, 0.0f);
  cudaGetLastError();
}

// cudaEventDestroy: "An event may be destroyed before it is complete ... In this case,
// the call does not block on completion of the event".
TEST_F(Events, DestroyingAnIncompleteEventDoesNotBlock) {
  cudaEvent_t event = nullptr;
  ASSERT_CUDA_OK(cudaEventCreate(&event));
  StreamGate gate;
  Watchdog watchdog(gate);
  ASSERT_CUDA_OK(gate.hold(stream_));
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  ASSERT_CUDA_OK(cudaEventDestroy(event));
  watchdog.cancel();
  EXPECT_FALSE(watchdog.fired()) << "cudaEventDestroy waited for the event";
  gate.open();
  EXPECT_CUDA_OK(cudaStreamSynchronize(stream_));
}

TEST_F(Events, RecordOnLegacyStreamCapturesEarlierBlockingWork) {
  Stream blocking;
  Event event;
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(blocking));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(cudaEventRecord(event, 0));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(event))
      << "an event on the legacy stream includes work of blocking streams before it";
  gate.open();
  EXPECT_CUDA_OK(cudaEventSynchronize(event));
}

}  // namespace
