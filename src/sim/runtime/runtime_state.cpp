// Runtime state shared by every entry point, and the runtime's error functions.
#include "runtime_state.h"

#include <atomic>
#include <cstdio>

namespace cudart {

cudaError_t& last_error() {
  thread_local cudaError_t e = cudaSuccess;
  return e;
}

int& thread_device() {
  thread_local int d = 0;
  return d;
}

cudaError_t ensure_context() {
  if (CUresult r = cuInit(0)) return from_driver(r);
  CUcontext ctx = nullptr;
  if (CUresult r = cuCtxGetCurrent(&ctx)) return from_driver(r);
  if (ctx) return cudaSuccess;
  int count = 0;
  cuDeviceGetCount(&count);
  if (count == 0) return cudaErrorNoDevice;
  if (thread_device() < 0 || thread_device() >= count) return cudaErrorInvalidDevice;
  // The runtime holds one reference on each primary context it uses, for the process.
  static std::atomic<bool> retained[64];
  CUcontext primary;
  if (CUresult r = cuDevicePrimaryCtxRetain(&primary, thread_device())) return from_driver(r);
  if (retained[thread_device()].exchange(true)) cuDevicePrimaryCtxRelease_v2(thread_device());
  return from_driver(cuCtxSetCurrent(primary));
}

Api::Api(const char* name, Needs needs) : name_(name) {
  cudasim_internal_runtime_enter();
  if (cudasim_internal_in_host_function()) status_ = cudaErrorNotPermitted;
  else if (needs == kContext) status_ = ensure_context();
  if (status_ == cudaSuccess) status_ = static_cast<cudaError_t>(cudasim_internal_runtime_fault(name));
  if (status_ != cudaSuccess) ret(status_);
}

cudaError_t Api::ret(cudaError_t e) {
  if (e != cudaSuccess) last_error() = e;
  if (cudasim_internal_log_enabled()) {
    char line[256];
    const char* n = cudasim_internal_runtime_error_name(int(e));
    std::snprintf(line, sizeof line, "%s -> %s", name_, n ? n : "?");
    cudasim_internal_log(line);
  }
  return e;
}

}  // namespace cudart

using namespace cudart;

extern "C" {

cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error();
  last_error() = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return last_error(); }

const char* cudaGetErrorName(cudaError_t e) {
  const char* n = cudasim_internal_runtime_error_name(int(e));
  return n ? n : "unrecognized error code";  // what CUDA answers for a code it does not know
}

const char* cudaGetErrorString(cudaError_t e) {
  const char* s = cudasim_internal_runtime_error_string(int(e));
  return s ? s : "unrecognized error code";
}

// Called by the generated weak stubs of runtime functions cudasim does not implement.
int cudasim_runtime_unsupported(const char* name) {
  cudasim_internal_report_unsupported(name);
  last_error() = cudaErrorNotSupported;
  return cudaErrorNotSupported;
}

}  // extern "C"
