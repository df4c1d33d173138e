// Events and the per-device event pool. Creating an event costs a driver round trip, so
// the pool recycles them (as PyTorch's caching allocator does). Events are created with
// timing disabled (they only order work), except *timed* ones, which keep the time they
// completed at (the step recorder's clock, policy/step_recorder.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace vramswap::cuda {

class Event {
 public:
  Event() = default;
  // Creates an event on the current device. Throws CudaError.
  static Event create();
  // Creates a timed event on the current device (for elapsed_ns). Throws CudaError.
  static Event create_timed();
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;

  // Records the event on `stream` now. Throws CudaError.
  void record(cudaStream_t stream);
  // True once the work recorded before it has completed. Throws CudaError. Asked in the
  // relaxed capture mode (so another thread's capture is never invalidated by it).
  bool query() const;
  // Blocks the calling thread until it has completed. Throws CudaError. Relaxed, as query().
  void synchronize() const;
  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }

 private:
  void reset() noexcept;
  cudaEvent_t event_ = nullptr;
};

// Nanoseconds from `start` to `end` (0 when `end` completed first), both timed events that
// have completed. Throws CudaError.
uint64_t elapsed_ns(const Event& start, const Event& end);

// Blocks until every event in `events` has completed. Errors are left for the events'
// next query to report. Never throws. Relaxed, as Event::query().
void synchronize_events(const std::vector<cudaEvent_t>& events);

// Recycled events of one device. Thread-safe (its own mutex, never held across a CUDA call).
class EventPool {
 public:
  explicit EventPool(int device, bool timed = false) : device_(device), timed_(timed) {}
  // An event, recycled or new (created on this pool's device). Throws CudaError.
  Event acquire();
  // Gives an event back for reuse.
  void release(Event e);

 private:
  int device_;
  bool timed_;
  std::mutex mu_;
  std::vector<Event> free_;
};

}  // namespace vramswap::cuda
