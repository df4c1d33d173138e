// The C ABI (include/vramswap/vramswap.h): thin noexcept shells over the Allocator.
//
// Each function clears the thread's last error, calls the Allocator inside a catch-all,
// and turns every failure into a return value plus the last error. The one exception is
// vramswap_torch_malloc, the alloc function for torch's CUDAPluggableAllocator: torch does
// not check the pointer an alloc function returns, so this one throws instead of returning
// NULL (see Note [vramswap_torch_malloc] below). This file is linked
// into both libvramswap.so and libvramswap_preload.so. The library is built with hidden
// visibility; the pragma below makes exactly the header's functions visible, and the
// version script (vramswap.map) names them again so the ABI is stated in one checked list.
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#pragma GCC visibility push(default)
#include "vramswap/vramswap.h"
#pragma GCC visibility pop

#include "runtime/allocator.h"
#include "last_error.h"
#include "stats/log.h"

namespace {

using vramswap::Allocator;

// The last error for an exception that escaped the Allocator: a CUDA call that failed
// (cuda::CudaError), std::bad_alloc, or a bug.
void set_internal_error(const char* function, const std::exception* e) noexcept {
  try {
    const std::string message = std::string(function) + " failed: " + (e ? e->what() : "unknown exception");
    vramswap::set_last_error(message);
    vramswap::stats::log(vramswap::stats::LogLevel::kError, "%s", message.c_str());
  } catch (...) {
    vramswap::set_last_error("vramswap: internal error (out of memory while reporting it)");
  }
}

// Runs `body`, turning anything it throws into the last error; `fallback` is returned then.
template <typename T, typename Body>
T guarded(const char* function, T fallback, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    set_internal_error(function, &e);
  } catch (...) {
    set_internal_error(function, nullptr);
  }
  return fallback;
}

// 0, or -1 with the status's message as the last error.
int reported(const vramswap::residency::Status& status) {
  if (status.ok) return 0;
  vramswap::set_last_error(status.message);
  return -1;
}

// An Allocator call that reports a refusal as `false` with *error set: 0, or -1 with the
// error as the last error (the last error cleared first; an exception is guarded()'s).
template <typename Call>
int refusal_reported(const char* function, Call&& call) noexcept {
  vramswap::clear_last_error();
  return guarded<int>(function, -1, [&] {
    std::string error;
    if (call(&error)) return 0;
    vramswap::set_last_error(error);
    return -1;
  });
}

Allocator& used_allocator() {
  Allocator& a = Allocator::instance();
  a.mark_used();
  return a;
}

// vramswap_malloc's work, shared with vramswap_torch_malloc: clears the last error, then a
// block, or nullptr with the last error set and *kind saying why (kNone when nothing failed,
// as for size 0, and for an exception that escaped the Allocator, whose message guarded()
// makes the last error).
void* allocate(const char* function, size_t size, int device, cudaStream_t stream,
               vramswap::AllocError::Kind* kind) noexcept {
  vramswap::clear_last_error();
  *kind = vramswap::AllocError::Kind::kNone;
  return guarded<void*>(function, nullptr, [&]() -> void* {
    vramswap::AllocError error;
    void* ptr = used_allocator().allocate(size, device, stream, &error);
    *kind = error.kind;
    if (!ptr && error.kind != vramswap::AllocError::Kind::kNone) vramswap::set_last_error(error.message);
    return ptr;
  });
}

// Note [vramswap_torch_malloc]
// torch's CUDAPluggableAllocator::malloc (torch/csrc/cuda/CUDAPluggableAllocator.cpp) calls
// its alloc function and records and returns whatever pointer comes back, NULL included, so
// a NULL from vramswap_malloc becomes a tensor at address 0 whose first kernel faults (a
// sticky CUDA error) far from the allocation. It does not catch what the alloc function
// throws: the exception leaves no record there and reaches torch's caller, and torch's
// Python bindings (HANDLE_TH_ERRORS, torch/csrc/Exceptions.h and Exceptions.cpp) turn any
// std::exception that is not one of c10's error types into a Python RuntimeError whose
// message is what(). A std::runtime_error is used, not std::bad_alloc: pybind11's own
// translation, which serves bindings torch does not wrap in HANDLE_TH_ERRORS, makes
// std::bad_alloc a MemoryError (which reads as host memory) but a std::runtime_error a
// RuntimeError, as HANDLE_TH_ERRORS does, so it reads the same on every path. torch.cuda.OutOfMemoryError is a RuntimeError too, so code that catches
// RuntimeError sees both install() paths alike.
std::string torch_malloc_message(size_t size, int device, vramswap::AllocError::Kind kind) {
  const std::string request = std::to_string(size) + " bytes on device " + std::to_string(device);
  const char* report = vramswap::last_error();
  const std::string why = report[0] != '\0' ? report : "(no message from vramswap)";
  if (kind == vramswap::AllocError::Kind::kOutOfMemory)
    return "vramswap: CUDA out of memory allocating " + request + ": " + why;
  return "vramswap: allocating " + request + " failed: " + why;
}

// A JSON document copied out under vramswap_stats_json's contract: its length returned;
// the document and a NUL written when `cap` is larger, else only "" (when cap > 0), so a
// truncated document is never seen.
size_t copy_document(const std::string& json, char* buf, size_t cap) {
  if (buf && json.size() < cap) {
    std::memcpy(buf, json.c_str(), json.size() + 1);
  } else if (buf && cap > 0) {
    buf[0] = '\0';
  }
  return json.size();
}

}  // namespace

extern "C" {

void* vramswap_malloc(size_t size, int device, struct CUstream_st* stream) noexcept {
  vramswap::AllocError::Kind kind;
  return allocate(__func__, size, device, stream, &kind);
}

// Not noexcept: see Note [vramswap_torch_malloc]. (Should building the message itself run
// out of host memory, the exception is that std::bad_alloc instead.)
void* vramswap_torch_malloc(size_t size, int device, struct CUstream_st* stream) {
  vramswap::AllocError::Kind kind;
  void* ptr = allocate(__func__, size, device, stream, &kind);
  if (ptr != nullptr || size == 0) return ptr;
  throw std::runtime_error(torch_malloc_message(size, device, kind));
}

void vramswap_free(void* ptr, size_t size, int device, struct CUstream_st* stream) noexcept {
  (void)size;  // the pool knows each block's size; torch's value is not needed
  vramswap::clear_last_error();
  if (!ptr) return;
  guarded<int>(__func__, 0, [&] {
    Allocator& a = used_allocator();
    std::string error;
    if (a.deallocate(ptr, device, stream, &error) != vramswap::FreeOutcome::kFreed) {
      a.report_invalid_free(error);
      vramswap::set_last_error(error);
    }
    return 0;
  });
}

void vramswap_record_stream(void* ptr, struct CUstream_st* stream) noexcept {
  vramswap::clear_last_error();
  guarded<int>(__func__, 0, [&] {
    std::string error;
    if (!used_allocator().record_stream(ptr, stream, &error)) vramswap::set_last_error(error);
    return 0;
  });
}

void vramswap_stream_destroyed(struct CUstream_st* stream) noexcept {
  vramswap::clear_last_error();
  guarded<int>(__func__, 0, [&] {
    std::string error;
    if (!used_allocator().stream_destroyed(stream, &error)) vramswap::set_last_error(error);
    return 0;
  });
}

int vramswap_capture_begin(int device) noexcept {
  return refusal_reported(__func__, [&](std::string* error) { return used_allocator().capture_began(device, error); });
}

int vramswap_capture_end(int device) noexcept {
  return refusal_reported(__func__, [&](std::string* error) { return used_allocator().capture_ended(device, error); });
}

int vramswap_enable_peer_access(int device, int peer) noexcept {
  return refusal_reported(__func__,
                          [&](std::string* error) { return used_allocator().enable_peer_access(device, peer, error); });
}

void vramswap_empty_cache(void) noexcept {
  vramswap::clear_last_error();
  guarded<int>(__func__, 0, [] {
    used_allocator().empty_cache();
    return 0;
  });
}

int vramswap_configure(const char* key, const char* value) noexcept {
  vramswap::clear_last_error();
  if (!key || !value) {
    vramswap::set_last_error("vramswap_configure: key and value must not be NULL (use \"\" for an empty value)");
    return -1;
  }
  return guarded<int>(__func__, -1, [&] {
    if (std::optional<std::string> error = used_allocator().configure(key, value)) {
      vramswap::set_last_error(*error);
      return -1;
    }
    return 0;
  });
}

const char* vramswap_last_error(void) noexcept { return vramswap::last_error(); }

size_t vramswap_stats_json(char* buf, size_t cap) noexcept {
  vramswap::clear_last_error();
  return guarded<size_t>(__func__, 0, [&] { return copy_document(used_allocator().stats_json(), buf, cap); });
}

void vramswap_record_history(size_t max_entries) noexcept {
  vramswap::clear_last_error();
  guarded<int>(__func__, 0, [&] {
    used_allocator().record_history(max_entries);
    return 0;
  });
}

size_t vramswap_snapshot_json(char* buf, size_t cap) noexcept {
  vramswap::clear_last_error();
  return guarded<size_t>(__func__, 0, [&] { return copy_document(used_allocator().snapshot_json(), buf, cap); });
}

void vramswap_reset_peak_stats(void) noexcept {
  vramswap::clear_last_error();
  guarded<int>(__func__, 0, [] {
    used_allocator().reset_peaks();
    return 0;
  });
}

int vramswap_check_invariants(void) noexcept {
  vramswap::clear_last_error();
  return guarded<int>(__func__, -1, [] {
    const std::string broken = used_allocator().check_invariants();
    if (broken.empty()) return 0;
    vramswap::set_last_error(broken);
    return -1;
  });
}

void vramswap_scope_push(void) noexcept {
  vramswap::clear_last_error();
  Allocator::scope_push();
}

void vramswap_scope_pop(void) noexcept {
  vramswap::clear_last_error();
  if (!Allocator::scope_pop())
    vramswap::set_last_error(
        "vramswap_scope_pop: this thread has no offload scope open (a pop without its vramswap_scope_push)");
}

uint64_t vramswap_pack(const void* ptr, struct CUstream_st* stream) noexcept {
  vramswap::clear_last_error();
  if (!ptr) return 0;
  return guarded<uint64_t>(__func__, 0, [&] { return used_allocator().pack(ptr, stream); });
}

void vramswap_graph_begin(void) noexcept {
  vramswap::clear_last_error();
  guarded<int>(__func__, 0, [] {
    used_allocator().graph_begin();
    return 0;
  });
}

int vramswap_mark_cold(uint64_t handle, struct CUstream_st* stream) noexcept {
  vramswap::clear_last_error();
  return guarded<int>(__func__, -1, [&] { return reported(used_allocator().mark_cold(handle, stream)); });
}

int vramswap_unpack(uint64_t handle, struct CUstream_st* stream) noexcept {
  vramswap::clear_last_error();
  return guarded<int>(__func__, -1, [&] {
    const vramswap::residency::Status status = used_allocator().unpack(handle, stream);
    const int rc = reported(status);
    return rc != 0 && status.out_of_memory ? -2 : rc;
  });
}

int vramswap_release(uint64_t handle) noexcept {
  vramswap::clear_last_error();
  return guarded<int>(__func__, -1, [&] { return reported(used_allocator().release(handle)); });
}

int vramswap_prefetch(uint64_t handle) noexcept {
  vramswap::clear_last_error();
  return guarded<int>(__func__, -1, [&] { return reported(used_allocator().prefetch(handle)); });
}

uint64_t vramswap_keep(const void* ptr, int frozen) noexcept {
  vramswap::clear_last_error();
  if (!ptr) return 0;
  return guarded<uint64_t>(__func__, 0, [&] { return used_allocator().keep(ptr, frozen != 0); });
}

int vramswap_use(uint64_t handle, struct CUstream_st* stream, int lane) noexcept {
  vramswap::clear_last_error();
  if (lane != VRAMSWAP_USE_FORWARD && lane != VRAMSWAP_USE_AFTER_BACKWARD) {
    vramswap::set_last_error("vramswap_use: lane " + std::to_string(lane) +
                             " is not VRAMSWAP_USE_FORWARD (0) or VRAMSWAP_USE_AFTER_BACKWARD (1)");
    return -1;
  }
  const auto which = lane == VRAMSWAP_USE_FORWARD ? vramswap::residency::Engine::UseLane::kForward
                                                  : vramswap::residency::Engine::UseLane::kAfterBackward;
  return guarded<int>(__func__, -1, [&] {
    const vramswap::residency::Status status = used_allocator().use(handle, stream, which);
    const int rc = reported(status);
    return rc != 0 && status.out_of_memory ? -2 : rc;
  });
}

int vramswap_unkeep(uint64_t handle) noexcept {
  vramswap::clear_last_error();
  return guarded<int>(__func__, -1, [&] { return reported(used_allocator().unkeep(handle)); });
}

void vramswap_set_cold_probe(vramswap_cold_probe_fn probe) noexcept {
  vramswap::clear_last_error();
  guarded<int>(__func__, 0, [&] {
    used_allocator().set_cold_probe(probe);
    return 0;
  });
}

}  // extern "C"
