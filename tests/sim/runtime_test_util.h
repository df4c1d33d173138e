// Helpers shared by the cudasim conformance tests that use the runtime API
// (libcudart.so.13): assertion macros that print error names, RAII owners of device
// memory, pinned memory, streams and events, and StreamGate, which holds a stream
// with a host function until the test lets it go.
//
// The owners synchronize the device before they free anything, so a test that fails
// half-way never frees memory that queued work still uses. A StreamGate opens when
// it is destroyed, so no stream is left blocked after a failed assertion; declare the
// gate after the buffers its stream uses so that it is destroyed (opened) first.
#ifndef CUDASIM_TESTS_RUNTIME_TEST_UTIL_H
#define CUDASIM_TESTS_RUNTIME_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <ostream>
#include <thread>
#include <vector>

#include "common/cuda_test_util.h"
#include "driver_test_util.h"

namespace cudasim_test {

// How long a test waits for something that must happen before it calls it a hang.
constexpr std::chrono::milliseconds kHangTimeout{5000};
// How long a test waits to see that something that must not happen does not.
constexpr std::chrono::milliseconds kSettleTime{20};

using cuda_test::PinnedBuffer;

// Polling waits that cannot hang a case (tests/common/cuda_test_util.h).
inline cudaError_t wait_for_stream(cudaStream_t stream, std::chrono::milliseconds timeout = kHangTimeout) {
  return cuda_test::wait_for_stream(stream, timeout);
}
inline cudaError_t wait_for_event(cudaEvent_t event, std::chrono::milliseconds timeout = kHangTimeout) {
  return cuda_test::wait_for_event(event, timeout);
}

// `n` bytes that differ with `seed`, and, repeating every 251 bytes, at any two offsets
// that are not 251 apart: data a copy or a file transfer moved to the wrong place fails.
inline std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) % 251);
  return v;
}

// Device memory from cudaMalloc, freed (after a device synchronization) on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size) : size_(size) {
    status_ = cudaMalloc(&ptr_, size);
    if (status_ != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) {
      cudaDeviceSynchronize();
      cudaFree(ptr_);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  cudaError_t status() const { return status_; }
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_;
  cudaError_t status_;
};

// Pinned host memory from cudaMallocHost, freed (after a device synchronization) on
// destruction.
// A stream owned by the test; destroyed on destruction.
class Stream {
 public:
  explicit Stream(unsigned int flags = cudaStreamDefault) {
    status_ = cudaStreamCreateWithFlags(&stream_, flags);
  }
  ~Stream() {
    if (status_ == cudaSuccess) cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaError_t status() const { return status_; }
  cudaStream_t get() const { return stream_; }
  operator cudaStream_t() const { return stream_; }  // NOLINT: used like the handle

 private:
  cudaStream_t stream_ = nullptr;
  cudaError_t status_;
};

// An event owned by the test; destroyed on destruction.
class Event {
 public:
  explicit Event(unsigned int flags = cudaEventDefault) {
    status_ = cudaEventCreateWithFlags(&event_, flags);
  }
  ~Event() {
    if (status_ == cudaSuccess) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaError_t status() const { return status_; }
  cudaEvent_t get() const { return event_; }
  operator cudaEvent_t() const { return event_; }  // NOLINT: used like the handle

 private:
  cudaEvent_t event_ = nullptr;
  cudaError_t status_;
};

// cuda_test::StreamGate (tests/common/cuda_test_util.h) with this suite's hang timeout.
class StreamGate : public cuda_test::StreamGate {
 public:
  StreamGate() : cuda_test::StreamGate(kHangTimeout) {}
};

// Opens a StreamGate if the test has not opened it within `timeout`, so that an
// implementation that wrongly blocks in an enqueue or destroy call fails the test
// instead of hanging it. Declare it after the gate it guards.
class Watchdog : public cuda_test::GateTimer {
 public:
  explicit Watchdog(StreamGate& gate, std::chrono::milliseconds timeout = kHangTimeout)
      : GateTimer(gate, timeout, OnStop::kLeaveClosed) {}
  // Stops the watchdog; afterwards fired() says whether it had to open the gate.
  void cancel() { stop(); }
};

}  // namespace cudasim_test

#endif  // CUDASIM_TESTS_RUNTIME_TEST_UTIL_H
