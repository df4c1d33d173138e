// cudasim's runtime (libcudart.so.13): a translation layer over cudasim's driver, as the
// real runtime is over the real driver. This header holds what every entry point shares:
// the thread's last error, its current device, implicit initialization of the primary
// context, and CUDASIM_LOG tracing.
//
// Thread safety: all state here is thread-local, except the one-time retain of each
// device's primary context (an atomic flag per device).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

extern "C" {
// Exported by cudasim's libcuda.so.1 for this runtime only.
const char* cudasim_internal_runtime_error_name(int value);
const char* cudasim_internal_runtime_error_string(int value);
void cudasim_internal_report_unsupported(const char* name);
int cudasim_internal_in_host_function(void);
int cudasim_internal_log_enabled(void);
void cudasim_internal_log(const char* line);
// Fault injection (src/sim/core/fault.h): a runtime call nests around the driver calls it
// makes, which are then not counted; the outermost runtime call is.
void cudasim_internal_runtime_enter(void);
void cudasim_internal_runtime_leave(void);
int cudasim_internal_runtime_fault(const char* entry_point);

// The driver's per-thread-default-stream entry points (declared by cuda.h only when a
// program is compiled for per-thread default streams).
CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void* src, size_t n);
CUresult cuMemcpyDtoH_v2_ptds(void* dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char value, size_t n);
}

namespace cudart {

// The thread's last error (cudaGetLastError / cudaPeekAtLastError).
cudaError_t& last_error();

// The driver's code as the runtime's: the two enumerations share their values.
inline cudaError_t from_driver(CUresult r) { return static_cast<cudaError_t>(r); }

// Initializes the driver and makes a context current for the calling thread: the one
// already current (set through the driver API), or the primary context of the thread's
// device (cudaSetDevice; device 0 by default).
cudaError_t ensure_context();

// The device the thread's runtime calls use.
int& thread_device();

// One runtime call: preconditions, a failure CUDASIM_FAIL asks for, the last error, and
// the CUDASIM_LOG line.
//   Api api(__func__);
//   if (!api.ok()) return api.status();
//   return api.ret(cuSomething(...));
class Api {
 public:
  enum Needs { kContext, kNothing };
  explicit Api(const char* name, Needs needs = kContext);
  ~Api() { cudasim_internal_runtime_leave(); }
  Api(const Api&) = delete;
  Api& operator=(const Api&) = delete;
  bool ok() const { return status_ == cudaSuccess; }
  cudaError_t status() const { return status_; }
  cudaError_t ret(cudaError_t e);
  cudaError_t ret(CUresult r) { return ret(from_driver(r)); }

 private:
  const char* name_;
  cudaError_t status_ = cudaSuccess;
};

// The stream a _ptsz entry point means: 0 there is the per-thread default stream.
inline CUstream per_thread(cudaStream_t s) { return s ? s : CU_STREAM_PER_THREAD; }

}  // namespace cudart
