// Helpers every CUDA-runtime test of the project shares (tests/sim, tests/pool, ...):
// assertion macros that print error names, polling waits that cannot hang a case, and
// pinned host memory owned by the test.
//
// Thread safety: the functions are thread-safe; a PinnedBuffer is used by one thread
// (its bytes may be written by a stream: read them with at()).
#ifndef VRAMSWAP_TESTS_COMMON_CUDA_TEST_UTIL_H
#define VRAMSWAP_TESTS_COMMON_CUDA_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <ostream>
#include <thread>

// GoogleTest finds PrintTo by argument-dependent lookup: cudaError is a global enum.
inline void PrintTo(cudaError error, std::ostream* os) {
  *os << static_cast<int>(error) << " (" << cudaGetErrorName(error) << ")";
}

#define ASSERT_CUDA_OK(call) ASSERT_EQ(cudaSuccess, (call)) << "in " #call
#define EXPECT_CUDA_OK(call) EXPECT_EQ(cudaSuccess, (call)) << "in " #call

namespace cuda_test {

// Polls `query` (cudaStreamQuery, cudaEventQuery) until it answers anything but
// cudaErrorNotReady or `timeout` passes; returns the last answer. Unlike a
// synchronization it cannot hang the case when something is wrongly held.
template <class Query>
cudaError_t poll_until_ready(Query query, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  cudaError_t status = query();
  while (status == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    status = query();
  }
  return status;
}

inline cudaError_t wait_for_stream(cudaStream_t stream, std::chrono::milliseconds timeout) {
  return poll_until_ready([stream] { return cudaStreamQuery(stream); }, timeout);
}

inline cudaError_t wait_for_event(cudaEvent_t event, std::chrono::milliseconds timeout) {
  return poll_until_ready([event] { return cudaEventQuery(event); }, timeout);
}

// Pinned host memory, filled with `fill`, freed (after a device synchronization, so no
// queued copy still uses it) on destruction.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t size, unsigned char fill = 0) : size_(size) {
    status_ = cudaMallocHost(&ptr_, size);
    if (status_ != cudaSuccess) ptr_ = nullptr;
    else std::memset(ptr_, fill, size);
  }
  ~PinnedBuffer() {
    if (ptr_ != nullptr) {
      cudaDeviceSynchronize();
      cudaFreeHost(ptr_);
    }
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  cudaError_t status() const { return status_; }
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }
  size_t size() const { return size_; }
  // Reads one byte through a volatile access: a stream may write it.
  unsigned char at(size_t i) const { return static_cast<volatile unsigned char*>(ptr_)[i]; }
  // True when every byte equals `value`.
  bool all_equal(unsigned char value) const {
    for (size_t i = 0; i < size_; ++i)
      if (at(i) != value) return false;
    return true;
  }

 private:
  void* ptr_ = nullptr;
  size_t size_;
  cudaError_t status_;
};

}  // namespace cuda_test

#endif  // VRAMSWAP_TESTS_COMMON_CUDA_TEST_UTIL_H
