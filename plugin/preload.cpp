// libvramswap_preload.so: puts vramswap under an unchanged CUDA program.
//
// Note [The interposer]
// ---------------------
// With LD_PRELOAD=libvramswap_preload.so, the functions below are found before
// libcudart's: a program built against the CUDA runtime asks for
// cudaMalloc@libcudart.so.13, and glibc gives a versioned reference only a definition of
// the same version (or an unversioned one, which a library with a version script cannot
// have), so these are defined in a version node named libcudart.so.13
// (vramswap_preload.map). Every other CUDA function is not defined here and the real
// libcudart serves it.
//
//   cudaMalloc            vramswap's pool, on the current device: memory every stream may use
//                         at once (pool::any_stream()), never a block a stream freed with
//                         cudaFreeAsync while its queued work may still touch it. Size 0 gives
//                         nullptr and cudaSuccess, as CUDA does.
//   cudaMallocAsync(_ptsz) vramswap's pool, on the stream's device, for that stream.
//   cudaFree              a vramswap pointer: the device is synchronized first, as the real
//                         cudaFree does (a program may rely on it), then the block goes back
//                         to the pool for every stream. Any other pointer (nullptr included)
//                         goes to the real cudaFree.
//   cudaFreeAsync(_ptsz)  a vramswap pointer goes back to the pool in the stream's order;
//                         any other goes to the real function. A free on the per-thread
//                         default stream first synchronizes it: the pool tags blocks by
//                         stream handle, and cudaStreamPerThread is one handle for many
//                         threads' streams, so its stream order cannot be told apart.
//   cudaStreamDestroy     tells vramswap's pools first (Allocator::stream_destroyed): none
//                         names the stream to CUDA again, where a destroyed handle is
//                         undefined behaviour (a block allocated on it, freed later, used to
//                         record an event there); then the real function destroys it. So
//                         every stream a pool names is alive, and under pressure the pools
//                         synchronize the streams whose cached blocks they retire, never the
//                         device, which would invalidate any capture on it
//                         (Allocator::streams_are_reported). A stream destroyed with the
//                         driver's cuStreamDestroy directly is not seen.
//   cudaDeviceEnablePeerAccess  the real function, then vramswap grants the current device
//                         access to every mapping of the peer's pool, now and later
//                         (Allocator::enable_peer_access): peer access does not cover CUDA
//                         VMM mappings, which must each grant a device access. Disabling
//                         peer access leaves the grants.
//   cudaMemGetInfo        total = the device's vramswap limit; free = what vramswap could
//                         still hand out: min(limit - allocated, the device's free memory +
//                         the pool's cached bytes). With no limit and no pool it is the
//                         real answer.
// A double free or an interior pointer of vramswap's is refused with cudaErrorInvalidValue,
// a warning and vramswap_last_error(), like the C ABI.
//
// Offloading: this library exports the C ABI too, so a program (or a layer under it) that
// finds vramswap_scope_push & co. in the process opens offload scopes on its threads; the
// interposed cudaMalloc and cudaMallocAsync then give tagged blocks exactly as
// vramswap_malloc does (Allocator::allocate routes both), and cudaFree/cudaFreeAsync of a
// tagged block, evicted or not, goes back through the engine.
//
// Recursion: vramswap's own CUDA calls (src/cuda, src/pool) use the VMM driver API and
// events, never these functions; should one ever reach an interposed function from inside
// vramswap (t_inside is set), it goes straight to the real one, never back into the pool.
//
// At load (the constructor, before the program's first allocation) the VRAMSWAP_*
// environment is validated: a refused value is printed and the process exits with status
// 2; unknown VRAMSWAP_* keys are warnings. Nothing touches CUDA until the first call.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>

#include "runtime/allocator.h"
#include "last_error.h"
#include "stats/log.h"

#define VRAMSWAP_INTERPOSED extern "C" __attribute__((visibility("default")))

// Not declared by cuda_runtime_api.h unless the per-thread default stream is selected.
VRAMSWAP_INTERPOSED cudaError_t cudaMallocAsync_ptsz(void** ptr, size_t size, cudaStream_t stream);
VRAMSWAP_INTERPOSED cudaError_t cudaFreeAsync_ptsz(void* ptr, cudaStream_t stream);

namespace vramswap {
namespace {

using config::LogLevel;

// The real libcudart's functions, found after this library in the lookup order.
struct RealRuntime {
  cudaError_t (*malloc)(void**, size_t) = nullptr;
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*malloc_async)(void**, size_t, cudaStream_t) = nullptr;
  cudaError_t (*malloc_async_ptsz)(void**, size_t, cudaStream_t) = nullptr;
  cudaError_t (*free_async)(void*, cudaStream_t) = nullptr;
  cudaError_t (*free_async_ptsz)(void*, cudaStream_t) = nullptr;
  cudaError_t (*mem_get_info)(size_t*, size_t*) = nullptr;
  cudaError_t (*stream_destroy)(cudaStream_t) = nullptr;
  cudaError_t (*enable_peer_access)(int, unsigned) = nullptr;
};

template <typename F>
void resolve(F*& slot, const char* name) {
  void* f = dlvsym(RTLD_NEXT, name, "libcudart.so.13");
  if (!f) f = dlsym(RTLD_NEXT, name);
  slot = reinterpret_cast<F*>(f);
  if (!slot) stats::log_always(LogLevel::kError, ("libvramswap_preload.so: the real " + std::string(name) +
                                                  " was not found; calls that need it fail").c_str());
}

const RealRuntime& real() {
  static const RealRuntime runtime = [] {
    RealRuntime r;
    resolve(r.malloc, "cudaMalloc");
    resolve(r.free, "cudaFree");
    resolve(r.malloc_async, "cudaMallocAsync");
    resolve(r.malloc_async_ptsz, "cudaMallocAsync_ptsz");
    resolve(r.free_async, "cudaFreeAsync");
    resolve(r.free_async_ptsz, "cudaFreeAsync_ptsz");
    resolve(r.mem_get_info, "cudaMemGetInfo");
    resolve(r.stream_destroy, "cudaStreamDestroy");
    resolve(r.enable_peer_access, "cudaDeviceEnablePeerAccess");
    return r;
  }();
  return runtime;
}

// Calls a real function, or says the runtime cannot be reached.
template <typename F, typename... Args>
cudaError_t call_real(F* f, Args... args) {
  return f ? f(args...) : cudaErrorInitializationError;
}

// Set while the calling thread is inside an interposed function (see the Note).
thread_local bool t_inside = false;

class Inside {
 public:
  Inside() { t_inside = true; }
  ~Inside() { t_inside = false; }
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;
};

cudaError_t internal_error(const char* function, const std::exception* e) {
  std::string message = std::string(function) + " failed in vramswap: " + (e ? e->what() : "unknown exception");
  set_last_error(message);
  stats::log(LogLevel::kError, "%s", message.c_str());
  return cudaErrorUnknown;
}

// cudaStreamLegacy is the legacy default stream, as nullptr is: one tag for both.
cudaStream_t normalized(cudaStream_t stream) { return stream == cudaStreamLegacy ? nullptr : stream; }

cudaError_t allocate(void** ptr, size_t size, int device, cudaStream_t stream) {
  Allocator& a = Allocator::instance();
  a.mark_used();
  AllocError error;
  *ptr = a.allocate(size, device, stream, &error);
  if (*ptr) return cudaSuccess;
  set_last_error(error.message);
  switch (error.kind) {
    case AllocError::Kind::kOutOfMemory: return cudaErrorMemoryAllocation;
    case AllocError::Kind::kInvalidDevice: return cudaErrorInvalidDevice;
    case AllocError::Kind::kConfig: return cudaErrorInvalidValue;
    case AllocError::Kind::kCuda: return static_cast<cudaError_t>(error.code ? error.code : cudaErrorUnknown);
    case AllocError::Kind::kNone: break;
  }
  return cudaErrorUnknown;
}

cudaError_t malloc_async(void** ptr, size_t size, cudaStream_t stream) {
  if (!ptr || size == 0) return cudaErrorInvalidValue;  // as cudaMallocAsync
  int device = 0;
  if (cudaError_t e = cudaStreamGetDevice(stream, &device); e != cudaSuccess) return e;
  return allocate(ptr, size, device, normalized(stream));
}

// Returns a vramswap block: kFreed -> cudaSuccess, refused -> cudaErrorInvalidValue.
cudaError_t free_owned(Allocator& a, void* ptr, int owner, cudaStream_t stream) {
  std::string error;
  if (a.deallocate(ptr, owner, stream, &error) == FreeOutcome::kFreed) return cudaSuccess;
  a.report_invalid_free(error);
  set_last_error(error);
  return cudaErrorInvalidValue;
}

cudaError_t free_async(void* ptr, cudaStream_t stream, int owner) {
  Allocator& a = Allocator::instance();
  a.mark_used();
  return free_owned(a, ptr, owner, normalized(stream));  // cudaStreamPerThread: see Allocator::deallocate
}

}  // namespace
}  // namespace vramswap

using vramswap::Inside;
using vramswap::real;
using vramswap::t_inside;

VRAMSWAP_INTERPOSED cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (t_inside) return vramswap::call_real(real().malloc, ptr, size);
  Inside inside;
  vramswap::clear_last_error();
  try {
    if (!ptr) return cudaErrorInvalidValue;
    if (size == 0) {
      *ptr = nullptr;
      return cudaSuccess;
    }
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    // Memory every stream may use at once, as the real cudaMalloc's: never a block some
    // stream freed with cudaFreeAsync while its queued work may still touch it.
    return vramswap::allocate(ptr, size, device, vramswap::pool::any_stream());
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
}

VRAMSWAP_INTERPOSED cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  if (t_inside) return vramswap::call_real(real().malloc_async, ptr, size, stream);
  Inside inside;
  vramswap::clear_last_error();
  try {
    return vramswap::malloc_async(ptr, size, stream);
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
}

VRAMSWAP_INTERPOSED cudaError_t cudaMallocAsync_ptsz(void** ptr, size_t size, cudaStream_t stream) {
  if (t_inside) return vramswap::call_real(real().malloc_async_ptsz, ptr, size, stream);
  Inside inside;
  vramswap::clear_last_error();
  try {
    return vramswap::malloc_async(ptr, size, stream ? stream : cudaStreamPerThread);
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
}

VRAMSWAP_INTERPOSED cudaError_t cudaFree(void* ptr) {
  if (t_inside || !ptr) return vramswap::call_real(real().free, ptr);
  Inside inside;
  vramswap::clear_last_error();
  try {
    vramswap::Allocator& a = vramswap::Allocator::instance();
    const int owner = a.owner_of(ptr);
    if (owner < 0) return vramswap::call_real(real().free, ptr);
    a.mark_used();
    // The real cudaFree synchronizes the device; so does this one, on the block's device.
    int current = 0;
    if (cudaError_t e = cudaGetDevice(&current); e != cudaSuccess) return e;
    if (current != owner && cudaSetDevice(owner) != cudaSuccess) return cudaErrorInvalidDevice;
    const cudaError_t synced = cudaDeviceSynchronize();
    if (current != owner) cudaSetDevice(current);
    // After the synchronization nothing queued touches the block: reusable by every stream.
    const cudaError_t freed = vramswap::free_owned(a, ptr, owner, vramswap::pool::any_stream());
    return synced != cudaSuccess ? synced : freed;
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
}

VRAMSWAP_INTERPOSED cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!t_inside) {
    Inside inside;
    try {
      std::string error;
      if (!vramswap::Allocator::instance().stream_destroyed(stream, &error))
        vramswap::stats::log(vramswap::config::LogLevel::kWarn, "cudaStreamDestroy(%p): %s", static_cast<void*>(stream),
                             error.c_str());
    } catch (const std::exception& e) {
      vramswap::stats::log(vramswap::config::LogLevel::kWarn, "cudaStreamDestroy(%p): %s", static_cast<void*>(stream),
                           e.what());
    } catch (...) {
    }
  }
  return vramswap::call_real(real().stream_destroy, stream);
}

VRAMSWAP_INTERPOSED cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  const cudaError_t enabled = vramswap::call_real(real().enable_peer_access, peer, flags);
  if (t_inside || (enabled != cudaSuccess && enabled != cudaErrorPeerAccessAlreadyEnabled)) return enabled;
  Inside inside;
  try {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return enabled;
    std::string error;
    if (!vramswap::Allocator::instance().enable_peer_access(device, peer, &error)) {
      vramswap::set_last_error(error);
      vramswap::stats::log(vramswap::config::LogLevel::kWarn, "cudaDeviceEnablePeerAccess(%d): %s", peer,
                           error.c_str());
      return cudaErrorUnknown;
    }
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
  return enabled;
}

VRAMSWAP_INTERPOSED cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (t_inside || !ptr) return vramswap::call_real(real().free_async, ptr, stream);
  Inside inside;
  vramswap::clear_last_error();
  try {
    const int owner = vramswap::Allocator::instance().owner_of(ptr);
    if (owner < 0) return vramswap::call_real(real().free_async, ptr, stream);
    return vramswap::free_async(ptr, stream, owner);
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
}

VRAMSWAP_INTERPOSED cudaError_t cudaFreeAsync_ptsz(void* ptr, cudaStream_t stream) {
  if (t_inside || !ptr) return vramswap::call_real(real().free_async_ptsz, ptr, stream);
  Inside inside;
  vramswap::clear_last_error();
  try {
    const int owner = vramswap::Allocator::instance().owner_of(ptr);
    if (owner < 0) return vramswap::call_real(real().free_async_ptsz, ptr, stream);
    return vramswap::free_async(ptr, stream ? stream : cudaStreamPerThread, owner);
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
}

VRAMSWAP_INTERPOSED cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (t_inside) return vramswap::call_real(real().mem_get_info, free_bytes, total_bytes);
  Inside inside;
  vramswap::clear_last_error();
  try {
    if (!free_bytes || !total_bytes) return vramswap::call_real(real().mem_get_info, free_bytes, total_bytes);
    size_t device_free = 0, device_total = 0;
    if (cudaError_t e = vramswap::call_real(real().mem_get_info, &device_free, &device_total); e != cudaSuccess)
      return e;
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    vramswap::Allocator& a = vramswap::Allocator::instance();
    a.mark_used();
    const vramswap::Allocator::DeviceMemory m = a.device_memory(device, device_total);
    const uint64_t headroom = m.limit_bytes > m.allocated_bytes ? m.limit_bytes - m.allocated_bytes : 0;
    const uint64_t cached = m.reserved_bytes > m.allocated_bytes ? m.reserved_bytes - m.allocated_bytes : 0;
    *total_bytes = m.limit_bytes;
    *free_bytes = std::min<uint64_t>(headroom, device_free + cached);
    return cudaSuccess;
  } catch (const std::exception& e) {
    return vramswap::internal_error(__func__, &e);
  } catch (...) {
    return vramswap::internal_error(__func__, nullptr);
  }
}

namespace {

// Validates the configuration before the program runs (see the Note).
__attribute__((constructor)) void validate_configuration_at_load() {
  Inside inside;
  try {
    vramswap::Allocator& a = vramswap::Allocator::instance();
    if (!a.environment_errors().empty()) {
      for (const std::string& error : a.environment_errors())
        vramswap::stats::log_always(vramswap::config::LogLevel::kError, error.c_str());
      vramswap::stats::log_always(vramswap::config::LogLevel::kError,
                                  "libvramswap_preload.so stops the program (exit status 2): fix the "
                                  "VRAMSWAP_* value above, or unset it for the default");
      ::_exit(2);
    }
    real();  // resolve now, not in the middle of the program's first allocation
    a.streams_are_reported();  // cudaStreamDestroy is interposed: every stream named is alive
    vramswap::stats::log(vramswap::config::LogLevel::kInfo,
                         "libvramswap_preload.so loaded: cudaMalloc, cudaMallocAsync, cudaFree, cudaFreeAsync "
                         "and cudaMemGetInfo go through vramswap");
  } catch (const std::exception& e) {
    vramswap::stats::log_always(vramswap::config::LogLevel::kError,
                                (std::string("libvramswap_preload.so cannot start: ") + e.what()).c_str());
    ::_exit(2);
  }
}

}  // namespace
