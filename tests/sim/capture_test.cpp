// cudasim conformance: stream capture. Work queued on a capturing stream is recorded
// into a graph instead of running; it runs when the instantiated graph is launched.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>

#include "runtime_test_util.h"

namespace {

using cudasim_test::counters;
using cudasim_test::DeviceBuffer;
using cudasim_test::kSettleTime;
using cudasim_test::PinnedBuffer;
using cudasim_test::Stream;

constexpr size_t kSize = 16 * 1024;

class Capture : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(stream_.status());
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    cudaGetLastError();
  }
  void TearDown() override {
    // Never leave a capture open (a failed assertion may have skipped EndCapture).
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusNone) {
      cudaGraph_t graph = nullptr;
      cudaStreamEndCapture(stream_, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
    }
    cudaGetLastError();
  }
  cudaStreamCaptureStatus capture_status() {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusInvalidated;
    EXPECT_CUDA_OK(cudaStreamIsCapturing(stream_, &status));
    return status;
  }

  Stream stream_{cudaStreamNonBlocking};
};

// cudaErrorCapturedEvent (907): "The operation is not permitted on an event which was last
// recorded in a capturing stream." A query or synchronization of such an event gets that
// code, during the capture and after it, until the event is recorded outside a capture.
TEST_F(Capture, AnEventLastRecordedInACaptureCannotBeQueriedOrAwaited) {
  cudaEvent_t event = nullptr;
  ASSERT_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  EXPECT_EQ(cudaErrorCapturedEvent, cudaEventQuery(event));
  EXPECT_EQ(cudaErrorCapturedEvent, cudaEventSynchronize(event));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  EXPECT_EQ(cudaErrorCapturedEvent, cudaEventQuery(event)) << "still last recorded in a capture";
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  EXPECT_CUDA_OK(cudaEventSynchronize(event));
  EXPECT_CUDA_OK(cudaEventQuery(event));
  EXPECT_CUDA_OK(cudaGraphDestroy(graph));
  EXPECT_CUDA_OK(cudaEventDestroy(event));
}

// A stream waiting on an event recorded during a capture joins that capture while it lasts
// (a fork). Once the capture has ended there is nothing to join: the event is still "last
// recorded in a capturing stream" (cudaErrorCapturedEvent), and the waiting stream stays out
// of any capture.
TEST_F(Capture, WaitingOnAnEventOfAnEndedCaptureIsACapturedEventError) {
  cudaEvent_t event = nullptr;
  ASSERT_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  ASSERT_CUDA_OK(cudaEventRecord(event, stream_));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  Stream other{cudaStreamNonBlocking};
  EXPECT_EQ(cudaErrorCapturedEvent, cudaStreamWaitEvent(other, event, 0));
  cudaGetLastError();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  ASSERT_CUDA_OK(cudaStreamIsCapturing(other, &status));
  EXPECT_EQ(cudaStreamCaptureStatusNone, status) << "joined a capture that had ended";
  EXPECT_CUDA_OK(cudaStreamSynchronize(other));
  EXPECT_CUDA_OK(cudaGraphDestroy(graph));
  EXPECT_CUDA_OK(cudaEventDestroy(event));
}

TEST_F(Capture, IsCapturingIsActiveBetweenBeginAndEnd) {
  EXPECT_EQ(cudaStreamCaptureStatusNone, capture_status());
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  EXPECT_EQ(cudaStreamCaptureStatusActive, capture_status());
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  EXPECT_NE(nullptr, graph);
  EXPECT_EQ(cudaStreamCaptureStatusNone, capture_status());
  EXPECT_CUDA_OK(cudaGraphDestroy(graph));
}

// cudaStreamBeginCapture: "When a stream is in capture mode, all operations pushed into
// the stream will not be executed, but will instead be captured into a graph".
TEST_F(Capture, CapturedWorkRunsOnlyWhenTheGraphIsLaunched) {
  DeviceBuffer d(kSize);
  PinnedBuffer src(kSize, 0x01), dst(kSize, 0);
  ASSERT_CUDA_OK(d.status());
  ASSERT_CUDA_OK(cudaMemset(d.get(), 0, kSize));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto before = counters();

  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  ASSERT_CUDA_OK(cudaMemcpyAsync(d.get(), src.get(), kSize, cudaMemcpyHostToDevice, stream_));
  ASSERT_CUDA_OK(cudaMemsetAsync(d.get(), 0x7F, 16, stream_));
  ASSERT_CUDA_OK(cudaMemcpyAsync(dst.get(), d.get(), kSize, cudaMemcpyDeviceToHost, stream_));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_NE(nullptr, graph);
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_TRUE(dst.all_equal(0)) << "captured work ran during capture";
  EXPECT_EQ(before.bytes_h2d, counters().bytes_h2d);
  EXPECT_EQ(before.bytes_memset, counters().bytes_memset);

  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_TRUE(dst.all_equal(0)) << "instantiation ran the graph";

  for (unsigned char value : {0x01, 0x02}) {
    std::memset(src.get(), value, kSize);
    ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream_));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    for (size_t i = 0; i < kSize; ++i) {
      ASSERT_EQ(i < 16 ? 0x7F : value, dst.at(i)) << "launch with " << int(value) << ", byte " << i;
    }
  }
  EXPECT_EQ(before.bytes_h2d + 2 * kSize, counters().bytes_h2d);
  EXPECT_CUDA_OK(cudaGraphExecDestroy(exec));
  EXPECT_CUDA_OK(cudaGraphDestroy(graph));
}

TEST_F(Capture, CapturedHostFunctionRunsOncePerLaunch) {
  std::atomic<int> calls{0};
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  ASSERT_CUDA_OK(cudaLaunchHostFunc(
      stream_, [](void* p) { static_cast<std::atomic<int>*>(p)->fetch_add(1); }, &calls));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_EQ(0, calls.load());
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(3, calls.load());
  EXPECT_CUDA_OK(cudaGraphExecDestroy(exec));
  EXPECT_CUDA_OK(cudaGraphDestroy(graph));
}

// cudaErrorStreamCaptureUnsupported: "The operation is not permitted when the stream is
// capturing." Synchronizing a capturing stream is such an operation.
TEST_F(Capture, SynchronizingACapturingStreamIsUnsupported) {
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  EXPECT_EQ(cudaErrorStreamCaptureUnsupported, cudaStreamSynchronize(stream_));
  // cudaStreamEndCapture: "If capture was invalidated, due to a violation of the rules of
  // stream capture, then a NULL graph will be returned."
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream_, &graph);
  EXPECT_EQ(nullptr, graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  EXPECT_EQ(cudaStreamCaptureStatusNone, capture_status());
  cudaGetLastError();
  EXPECT_CUDA_OK(cudaStreamSynchronize(stream_)) << "the stream is usable after the capture";
}

// cudaThreadExchangeStreamCaptureMode: in cudaStreamCaptureModeGlobal "this thread is
// prohibited from potentially unsafe API calls", cudaMalloc being the example given.
TEST_F(Capture, MallocDuringGlobalCaptureIsUnsupported) {
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  void* p = nullptr;
  EXPECT_EQ(cudaErrorStreamCaptureUnsupported, cudaMalloc(&p, 4096));
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream_, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
  ASSERT_CUDA_OK(cudaMalloc(&p, 4096)) << "allowed again once capture ended";
  EXPECT_CUDA_OK(cudaFree(p));
}

// cudaStreamCaptureModeRelaxed: "The local thread is not prohibited from potentially
// unsafe API calls."
TEST_F(Capture, MallocDuringRelaxedCaptureIsAllowed) {
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
  void* p = nullptr;
  EXPECT_CUDA_OK(cudaMalloc(&p, 4096));
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  EXPECT_NE(nullptr, graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (p != nullptr) {
    EXPECT_CUDA_OK(cudaFree(p));
  }
}

// Querying or awaiting an event is a potentially unsafe call (pytorch#104555: an event query
// on its NCCL watchdog thread broke a global-mode capture). On the capturing thread, in the
// global mode, it fails with cudaErrorStreamCaptureUnsupported and invalidates the capture.
TEST_F(Capture, EventQueryAndSynchronizeDuringAGlobalCaptureAreUnsupported) {
  Stream other{cudaStreamNonBlocking};
  cudaEvent_t event = nullptr;
  ASSERT_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  ASSERT_CUDA_OK(cudaEventRecord(event, other));  // outside any capture
  for (bool query : {true, false}) {
    ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
    EXPECT_EQ(cudaErrorStreamCaptureUnsupported, query ? cudaEventQuery(event) : cudaEventSynchronize(event));
    EXPECT_EQ(cudaStreamCaptureStatusInvalidated, capture_status());
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream_, &graph);
    EXPECT_EQ(nullptr, graph) << (query ? "query" : "synchronize");
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
  }
  EXPECT_CUDA_OK(cudaEventSynchronize(event)) << "allowed again once the capture ended";
  EXPECT_CUDA_OK(cudaEventQuery(event));
  EXPECT_CUDA_OK(cudaEventDestroy(event));
}

// From another thread: a global-mode capture prohibits the unsafe calls of every thread in
// the global mode; a thread-local one only the capturing thread's; a thread in the relaxed
// mode is never prohibited (how PyTorch's allocator queries its events, pytorch#158352).
TEST_F(Capture, AnotherThreadsEventQueryFollowsTheModes) {
  Stream other{cudaStreamNonBlocking};
  cudaEvent_t event = nullptr;
  ASSERT_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  ASSERT_CUDA_OK(cudaEventRecord(event, other));
  // Complete before any capture: the queries below test the modes, not the event's progress
  // (the stream's thread may not have reached the record yet: CUDASIM_CHAOS=7 delays it).
  ASSERT_CUDA_OK(cudaEventSynchronize(event));
  struct Case {
    cudaStreamCaptureMode capture;
    cudaStreamCaptureMode thread;
    bool allowed;
  };
  for (const Case& c : {Case{cudaStreamCaptureModeGlobal, cudaStreamCaptureModeGlobal, false},
                        Case{cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, true},
                        Case{cudaStreamCaptureModeGlobal, cudaStreamCaptureModeRelaxed, true},
                        Case{cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeGlobal, true},
                        Case{cudaStreamCaptureModeRelaxed, cudaStreamCaptureModeGlobal, true}}) {
    ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, c.capture));
    cudaError_t got = cudaErrorUnknown;
    std::thread([&] {
      cudaStreamCaptureMode mode = c.thread;
      cudaThreadExchangeStreamCaptureMode(&mode);
      got = cudaEventQuery(event);
    }).join();
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    const std::string what = "capture mode " + std::to_string(int(c.capture)) + ", thread mode " +
                             std::to_string(int(c.thread));
    if (c.allowed) {
      EXPECT_EQ(cudaSuccess, got) << what;
      EXPECT_EQ(cudaSuccess, ended) << what;
      EXPECT_NE(nullptr, graph) << what;
    } else {
      EXPECT_EQ(cudaErrorStreamCaptureUnsupported, got) << what;
      EXPECT_EQ(nullptr, graph) << what;
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
  }
  EXPECT_CUDA_OK(cudaEventDestroy(event));
}

// "It is also invalid to query the execution status of or synchronize a broader handle which
// encompasses an active stream capture, such as a device or context handle when any
// associated stream is in capture mode" (CUDA C++ Programming Guide, stream capture,
// prohibited operations): in every mode, the relaxed one included.
TEST_F(Capture, DeviceSynchronizationDuringACaptureIsUnsupportedInEveryMode) {
  for (cudaStreamCaptureMode mode :
       {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed}) {
    ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, mode));
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&relaxed);
    EXPECT_EQ(cudaErrorStreamCaptureUnsupported, cudaDeviceSynchronize()) << "mode " << int(mode);
    cudaThreadExchangeStreamCaptureMode(&relaxed);
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream_, &graph);
    EXPECT_EQ(nullptr, graph) << "mode " << int(mode);
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
  }
  EXPECT_CUDA_OK(cudaDeviceSynchronize()) << "allowed again once the capture ended";
}

// cudaFree synchronizes the device: the same rule. The block is not freed, and can be once
// the capture has ended.
TEST_F(Capture, FreeDuringACaptureIsUnsupportedInEveryModeAndLosesNothing) {
  void* p = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&p, 4096));
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
  cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&relaxed);
  EXPECT_EQ(cudaErrorStreamCaptureUnsupported, cudaFree(p));
  cudaThreadExchangeStreamCaptureMode(&relaxed);
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream_, &graph);
  EXPECT_EQ(nullptr, graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
  EXPECT_CUDA_OK(cudaMemset(p, 1, 4096)) << "still allocated";
  EXPECT_CUDA_OK(cudaFree(p));
}

// cudaStreamBeginCapture: "Capture may not be initiated if stream is cudaStreamLegacy."
TEST_F(Capture, LegacyStreamCannotCapture) {
  EXPECT_NE(cudaSuccess, cudaStreamBeginCapture(cudaStreamLegacy, cudaStreamCaptureModeGlobal));
  cudaGetLastError();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  ASSERT_CUDA_OK(cudaStreamIsCapturing(cudaStreamLegacy, &status));
  EXPECT_EQ(cudaStreamCaptureStatusNone, status);
}

// cudaStreamBeginCapture: capture "may only be initiated if the stream is not already in
// capture mode."
TEST_F(Capture, BeginningTwiceFails) {
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  EXPECT_NE(cudaSuccess, cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream_, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
}

}  // namespace

namespace {

// cudaStreamIsCapturing: "if this is called on cudaStreamLegacy (the "null stream") while a
// blocking stream on the same device is capturing, it will return
// cudaErrorStreamCaptureImplicit ... The blocking stream capture is not invalidated."
TEST(CaptureLegacy, AskingTheLegacyStreamDoesNotInvalidateABlockingCapture) {
  ASSERT_CUDA_OK(cudaSetDevice(0));
  cudasim_test::Stream blocking{cudaStreamDefault};
  ASSERT_CUDA_OK(blocking.status());
  ASSERT_CUDA_OK(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  EXPECT_EQ(cudaErrorStreamCaptureImplicit, cudaStreamIsCapturing(cudaStreamLegacy, &status));
  cudaGetLastError();
  ASSERT_CUDA_OK(cudaStreamIsCapturing(blocking, &status));
  EXPECT_EQ(cudaStreamCaptureStatusActive, status);
  cudaGraph_t graph = nullptr;
  EXPECT_CUDA_OK(cudaStreamEndCapture(blocking, &graph));
  ASSERT_NE(nullptr, graph);
  EXPECT_CUDA_OK(cudaGraphDestroy(graph));
}

}  // namespace
