// Helpers every CUDA-runtime test of the project shares (tests/sim, tests/pool, ...):
// assertion macros that print error names, polling waits that cannot hang a case, pinned
// host memory owned by the test, and StreamGate, which holds streams until the case lets
// them go.
//
// Thread safety: the functions are thread-safe; a PinnedBuffer is used by one thread
// (its bytes may be written by a stream: read them with at()); a StreamGate may be opened
// from any thread.
#ifndef VRAMSWAP_TESTS_COMMON_CUDA_TEST_UTIL_H
#define VRAMSWAP_TESTS_COMMON_CUDA_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
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

// Holds streams with host functions that block until open() is called (from any thread).
// The state is shared with every queued host function, so a gate destroyed before its
// function ran (after a failed assertion) leaves nothing dangling; it opens when destroyed,
// so declare it after the memory its streams use. `hang_timeout`: how long wait_entered()
// waits by default before it calls it a hang (each suite has its own).
class StreamGate {
 public:
  explicit StreamGate(std::chrono::milliseconds hang_timeout)
      : state_(std::make_shared<State>()), hang_timeout_(hang_timeout) {}
  ~StreamGate() { open(); }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;

  // Queues on `stream` a host function that blocks the stream until open().
  cudaError_t hold(cudaStream_t stream) {
    auto* ref = new std::shared_ptr<State>(state_);
    const cudaError_t status = cudaLaunchHostFunc(stream, &StreamGate::run, ref);
    if (status != cudaSuccess) delete ref;
    return status;
  }

  // Lets every held stream (and every later hold) go on.
  void open() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->open = true;
    state_->changed.notify_all();
  }

  bool is_open() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->open;
  }

  // Waits until `count` host functions of this gate have started; false on timeout.
  bool wait_entered(int count = 1) { return wait_entered(count, hang_timeout_); }
  bool wait_entered(int count, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(state_->mutex);
    return state_->changed.wait_for(lock, timeout, [&] { return state_->entered >= count; });
  }

  int entered() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->entered;
  }

 private:
  struct State {
    mutable std::mutex mutex;
    std::condition_variable changed;
    bool open = false;
    int entered = 0;
  };

  static void CUDART_CB run(void* user_data) {
    std::unique_ptr<std::shared_ptr<State>> ref(static_cast<std::shared_ptr<State>*>(user_data));
    State& state = **ref;
    std::unique_lock<std::mutex> lock(state.mutex);
    ++state.entered;
    state.changed.notify_all();
    state.changed.wait(lock, [&] { return state.open; });
  }

  std::shared_ptr<State> state_;
  std::chrono::milliseconds hang_timeout_;
};

// Opens a StreamGate from another thread once `delay` has passed (fired() then says so), and
// with OnStop::kOpen also when stop() comes first. Two uses: a watchdog (kLeaveClosed) frees
// a stream a wrong implementation blocks on, so that the case fails instead of hanging; a
// delayed release (kOpen) lets a call that must wait for the stream finish, while one that
// must not wait is held for `delay` at most. Declare it after the gate; stop() (or the
// destructor) joins the thread.
class GateTimer {
 public:
  enum class OnStop { kLeaveClosed, kOpen };
  GateTimer(StreamGate& gate, std::chrono::milliseconds delay, OnStop on_stop)
      : thread_([this, &gate, delay, on_stop] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!stop_.wait_for(lock, delay, [this] { return stopped_; })) fired_ = true;
          const bool open = fired_ || on_stop == OnStop::kOpen;
          lock.unlock();
          if (open) gate.open();
        }) {}
  ~GateTimer() { stop(); }
  GateTimer(const GateTimer&) = delete;
  GateTimer& operator=(const GateTimer&) = delete;

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
    }
    stop_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  bool fired() {
    std::lock_guard<std::mutex> lock(mutex_);
    return fired_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopped_ = false;
  bool fired_ = false;
  std::thread thread_;
};

// cudasim's clock, found at run time (the toolkit's libraries a test may link lack it):
// whether the host runs on cudasim's virtual clock (CUDASIM_TIME=virtual), and that clock's
// reading in ns (0 on real time or off cudasim). A test whose outcome follows a measured time
// asserts exact choices only in virtual time (DESIGN, cudasim).
inline bool virtual_time() {
  using Fn = int (*)();
  static const auto is = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "cudasim_virtual_time"));
  return is && is() != 0;
}
inline uint64_t virtual_now_ns() {
  using Fn = uint64_t (*)();
  static const auto now = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "cudasim_now_ns"));
  return now ? now() : 0;
}

}  // namespace cuda_test

#endif  // VRAMSWAP_TESTS_COMMON_CUDA_TEST_UTIL_H
