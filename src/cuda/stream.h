// Streams: an owning stream for vramswap's own work (the copy streams), and the stream
// operations the engine queues on any stream (copies, waits, the capture check).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/event.h"

namespace vramswap::cuda {

class Stream {
 public:
  Stream() = default;
  // A non-blocking stream (it does not synchronize with the legacy default stream) on
  // `device`, at the given priority (clamped by CUDA to the device's range; lower is more
  // urgent). Throws CudaError.
  static Stream create(int device, int priority = 0);
  ~Stream();
  Stream(Stream&& o) noexcept;
  Stream& operator=(Stream&& o) noexcept;

  cudaStream_t get() const { return stream_; }
  explicit operator bool() const { return stream_ != nullptr; }

 private:
  void reset() noexcept;
  cudaStream_t stream_ = nullptr;
};

// Queues a copy of `bytes` from `src` to `dst` on `stream` (any direction; unified
// addressing tells which). Throws CudaError.
void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream);

// Makes work queued on `stream` after this call wait for `event`. Throws CudaError.
void wait_event(cudaStream_t stream, const Event& event);

// True when `stream` is being captured into a CUDA graph. Throws CudaError.
bool is_capturing(cudaStream_t stream);

// True when `stream` is neither capturing a CUDA graph (a synchronization or a query would
// break the capture) nor unknown (the capture query failed): it may be waited on or asked.
// Never throws.
bool outside_capture(cudaStream_t stream);

// Waits until the work queued on `stream` has completed. False (nothing waited for) when
// the stream is capturing a CUDA graph or the call fails.
bool synchronize_stream(cudaStream_t stream);

// True when the work queued on `stream` has completed, without waiting; false while it has
// not, and when the stream is capturing a CUDA graph or the query fails.
bool stream_done(cudaStream_t stream);

// Puts the calling thread in the relaxed stream-capture mode for the scope's lifetime and
// restores its mode after. In the global mode (CUDA's default) a potentially unsafe call
// (mapping, pinned allocation, a synchronization) made while another thread captures a
// graph invalidates that capture; vramswap's own work must never do that.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() noexcept;
  ~RelaxedCaptureScope();
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool exchanged_ = false;
};

// The device's greatest (most urgent) stream priority.
int greatest_priority(int device);

}  // namespace vramswap::cuda
