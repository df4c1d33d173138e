// Events and their pool. See event.h.
#include "cuda/event.h"

#include <utility>

#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/host_time.h"
#include "cuda/stream.h"

namespace vramswap::cuda {

Event Event::create() {
  Event e;
  VRAMSWAP_CUDART(cudaEventCreateWithFlags(&e.event_, cudaEventDisableTiming));
  return e;
}
Event Event::create_timed() {
  Event e;
  VRAMSWAP_CUDART(cudaEventCreateWithFlags(&e.event_, cudaEventDefault));
  return e;
}
Event::~Event() { reset(); }
Event::Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    reset();
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}
void Event::reset() noexcept {
  if (event_) cudaEventDestroy(event_);
  event_ = nullptr;
}

void Event::record(cudaStream_t stream) { VRAMSWAP_CUDART(cudaEventRecord(event_, stream)); }

// Queries and waits are made in the relaxed capture mode: in the global mode (CUDA's default)
// an event query or synchronization while any thread captures in the global mode fails and
// invalidates that capture (pytorch#104555); PyTorch's allocator queries its events the same
// way (pytorch#158352).
bool Event::query() const {
  RelaxedCaptureScope relaxed;
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) throw_runtime_error(e, "cudaEventQuery(event_)", __FILE__, __LINE__);
  return true;
}

void Event::synchronize() const {
  RelaxedCaptureScope relaxed;
  TimedCall timed(HostTime::kWait);
  VRAMSWAP_CUDART(cudaEventSynchronize(event_));
}

uint64_t elapsed_ns(const Event& start, const Event& end) {
  float ms = 0;
  VRAMSWAP_CUDART(cudaEventElapsedTime(&ms, start.get(), end.get()));
  return ms > 0 ? uint64_t(double(ms) * 1e6) : 0;
}

void synchronize_events(const std::vector<cudaEvent_t>& events) {
  RelaxedCaptureScope relaxed;
  TimedCall timed(HostTime::kWait);
  for (cudaEvent_t e : events) cudaEventSynchronize(e);
}

Event EventPool::acquire() {
  {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      Event e = std::move(free_.back());
      free_.pop_back();
      return e;
    }
  }
  ContextScope scope(device_);
  return timed_ ? Event::create_timed() : Event::create();
}

void EventPool::release(Event e) {
  std::lock_guard lock(mu_);
  free_.push_back(std::move(e));
}

}  // namespace vramswap::cuda
