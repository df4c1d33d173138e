// Shared by the driver's entry points: the call scope (preconditions and CUDASIM_LOG),
// handle registries, and the resolution of stream handles.
#pragma once

#include <cuda.h>

#include <cstdarg>
#include <memory>
#include <string_view>
#include <mutex>
#include <unordered_set>

#include "device.h"
#include "env.h"
#include "fault.h"
#include "stream.h"

namespace cudasim {

// Names of error codes (from the generated tables); nullptr for an unknown code.
const char* driver_error_name(CUresult r);
const char* runtime_error_name(int value);
// The value of a CUresult or cudaError_t name (CUDA_ERROR_OUT_OF_MEMORY,
// cudaErrorMemoryAllocation); false for a name neither table has.
bool error_code_by_name(std::string_view name, int* code);

// One driver call: checks the preconditions every entry point shares, fails on purpose
// when a CUDASIM_FAIL rule says so (fault.h), and logs the outcome when CUDASIM_LOG=1.
//   Call call(__func__, Call::kNeedsContext);
//   if (!call.ok()) return call.status();
//   ...
//   return call.ret(CUDA_SUCCESS);
class Call {
 public:
  enum Needs { kInit = 0, kNeedsContext = 1, kNoInit = 2 };
  Call(const char* name, Needs needs = kInit) : name_(name) {
    if (needs != kNoInit && in_host_function()) status_ = CUDA_ERROR_NOT_PERMITTED;
    else if (needs != kNoInit && !driver()) status_ = CUDA_ERROR_NOT_INITIALIZED;
    else if (needs == kNeedsContext && !current_context()) status_ = CUDA_ERROR_INVALID_CONTEXT;
    else if (!in_host_function() && DriverCallDepth::outermost()) status_ = CUresult(injected_failure(name));
    if (status_ != CUDA_SUCCESS) ret(status_);
  }
  bool ok() const { return status_ == CUDA_SUCCESS; }
  CUresult status() const { return status_; }
  // Adds a detail to the log line ("size=%zu -> %p").
  void note(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (!log_enabled()) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail_, sizeof detail_, fmt, ap);
    va_end(ap);
  }
  CUresult ret(CUresult r) {
    if (log_enabled()) {
      const char* n = driver_error_name(r);
      log_line("%s(%s) -> %s", name_, detail_, n ? n : "?");
    }
    return r;
  }

 private:
  DriverCallDepth depth_;  // first: the constructor's body runs inside it
  const char* name_;
  CUresult status_ = CUDA_SUCCESS;
  char detail_[200] = "";
};

// Live handles of one kind: a handle not in the set is invalid (destroyed or foreign). It
// also remembers the handles destroyed since (until a new one takes the same address), so
// that a use after destruction can be told from a foreign pointer.
template <class T>
class Registry {
 public:
  void add(T* h) {
    std::lock_guard lock(mu_);
    live_.insert(h);
    gone_.erase(h);
  }
  bool remove(T* h) {
    std::lock_guard lock(mu_);
    if (live_.erase(h) != 1) return false;
    gone_.insert(h);
    return true;
  }
  bool contains(T* h) {
    std::lock_guard lock(mu_);
    return live_.count(h) == 1;
  }
  bool was_destroyed(T* h) {
    std::lock_guard lock(mu_);
    return gone_.count(h) == 1;
  }

 private:
  std::mutex mu_;
  std::unordered_set<T*> live_;
  std::unordered_set<T*> gone_;
};

// A stream handle used after cudaStreamDestroy: undefined behaviour on a GPU (the driver may
// crash, or find another stream at that address), so cudasim stops the program there, naming
// the call, instead of answering an error code that a caller could come to rely on. Does
// not return.
[[noreturn]] void destroyed_stream_used(const void* h, const char* what);

Registry<CUstream_st>& stream_handles();
Registry<CUevent_st>& event_handles();
Registry<CUgraph_st>& graph_handles();
Registry<CUgraphExec_st>& graph_exec_handles();

// The stream a handle names. 0 is the legacy default stream, or the per-thread default
// stream for the _ptsz/_ptds entry points; CU_STREAM_LEGACY and CU_STREAM_PER_THREAD
// name those explicitly and use the current context's device. Sets *err and returns null
// for an unknown handle (CUDA_ERROR_INVALID_HANDLE) or no current context.
std::shared_ptr<Stream> resolve_stream(CUstream h, bool per_thread_default, CUresult* err);

}  // namespace cudasim
