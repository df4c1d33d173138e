// Streams and stream operations. See stream.h.
#include "cuda/stream.h"

#include <utility>

#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/host_time.h"

namespace vramswap::cuda {

Stream Stream::create(int device, int priority) {
  ContextScope scope(device);
  Stream s;
  VRAMSWAP_CUDART(cudaStreamCreateWithPriority(&s.stream_, cudaStreamNonBlocking, priority));
  return s;
}
Stream::~Stream() { reset(); }
Stream::Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    reset();
    stream_ = std::exchange(o.stream_, nullptr);
  }
  return *this;
}
void Stream::reset() noexcept {
  if (stream_) cudaStreamDestroy(stream_);  // queued work still completes
  stream_ = nullptr;
}

void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  VRAMSWAP_CUDART(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}

void wait_event(cudaStream_t stream, const Event& event) {
  VRAMSWAP_CUDART(cudaStreamWaitEvent(stream, event.get(), 0));
}

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &status);
  if (e == cudaErrorStreamCaptureImplicit) {  // the legacy stream, while a blocking stream captures
    cudaGetLastError();
    return true;
  }
  if (e != cudaSuccess) throw_runtime_error(e, "cudaStreamIsCapturing(stream, &status)", __FILE__, __LINE__);
  return status != cudaStreamCaptureStatusNone;
}

RelaxedCaptureScope::RelaxedCaptureScope() noexcept {
  exchanged_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess;
  if (!exchanged_) cudaGetLastError();
}
RelaxedCaptureScope::~RelaxedCaptureScope() {
  if (exchanged_) cudaThreadExchangeStreamCaptureMode(&mode_);
}

bool outside_capture(cudaStream_t stream) {
  try {
    return !is_capturing(stream);
  } catch (const CudaError&) {
    return false;
  }
}

bool synchronize_stream(cudaStream_t stream) {
  if (!outside_capture(stream)) return false;
  // Relaxed, as for a device synchronization: in the global mode a synchronization while
  // another thread captures would invalidate that capture.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t status;
  {
    TimedCall timed(HostTime::kWait);
    status = cudaStreamSynchronize(stream);
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (status == cudaSuccess) return true;
  cudaGetLastError();
  return false;
}

bool stream_done(cudaStream_t stream) {
  if (!outside_capture(stream)) return false;
  const cudaError_t status = cudaStreamQuery(stream);
  if (status == cudaSuccess) return true;
  if (status != cudaErrorNotReady) cudaGetLastError();
  return false;
}

int greatest_priority(int device) {
  ContextScope scope(device);
  int least = 0, greatest = 0;
  VRAMSWAP_CUDART(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return greatest;
}

}  // namespace vramswap::cuda
