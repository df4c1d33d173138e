// The libraries the stress driver runs: cudasim's libcuda.so.1 and libcudart.so.13, loaded
// first by path (RTLD_GLOBAL) so that the real libvramswap.so, loaded next with dlopen as
// torch and ctypes load it, binds to them; and every function the driver calls, found with
// dlsym. The driver links no CUDA library: what it calls is what vramswap's users call.
//
// vramswap_check_invariants is optional: the library may not have it yet (its absence is
// reported once, and the checks that would use it are skipped).
//
// Thread safety: load() once, before any thread starts; the table is read-only afterwards.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cudasim.h"
#include "vramswap/vramswap.h"

namespace stress {

struct Library {
  // libvramswap.so (include/vramswap/vramswap.h).
  decltype(&vramswap_malloc) malloc = nullptr;
  decltype(&vramswap_free) free = nullptr;
  decltype(&vramswap_record_stream) record_stream = nullptr;
  decltype(&vramswap_empty_cache) empty_cache = nullptr;
  decltype(&vramswap_configure) configure = nullptr;
  decltype(&vramswap_last_error) last_error = nullptr;
  decltype(&vramswap_stats_json) stats_json = nullptr;
  decltype(&vramswap_scope_push) scope_push = nullptr;
  decltype(&vramswap_scope_pop) scope_pop = nullptr;
  decltype(&vramswap_pack) pack = nullptr;
  decltype(&vramswap_graph_begin) graph_begin = nullptr;
  decltype(&vramswap_mark_cold) mark_cold = nullptr;
  decltype(&vramswap_unpack) unpack = nullptr;
  decltype(&vramswap_release) release = nullptr;
  decltype(&vramswap_prefetch) prefetch = nullptr;
  decltype(&vramswap_keep) keep = nullptr;
  decltype(&vramswap_use) use = nullptr;
  decltype(&vramswap_unkeep) unkeep = nullptr;
  int (*check_invariants)(void) = nullptr;  // optional: 0, or -1 with the last error

  // The CUDA runtime (cudasim's).
  decltype(&cudaSetDevice) set_device = nullptr;
  decltype(&cudaStreamCreateWithFlags) stream_create = nullptr;
  decltype(&cudaStreamDestroy) stream_destroy = nullptr;
  decltype(&cudaStreamSynchronize) stream_synchronize = nullptr;
  decltype(&cudaDeviceSynchronize) device_synchronize = nullptr;
  decltype(&cudaEventCreateWithFlags) event_create = nullptr;
  decltype(&cudaEventDestroy) event_destroy = nullptr;
  decltype(&cudaEventRecord) event_record = nullptr;
  decltype(&cudaStreamWaitEvent) stream_wait_event = nullptr;
  decltype(&cudaMemsetAsync) memset_async = nullptr;
  decltype(&cudaMemcpyAsync) memcpy_async = nullptr;
  decltype(&cudaGetLastError) get_last_error = nullptr;
  decltype(&cudaGetErrorName) error_name = nullptr;

  // The driver API (cudasim's), for what the device can do.
  decltype(&cuDeviceGetAttribute) device_get_attribute = nullptr;
  // Whether device 0's driver has host VMM: an evicted kept block's address then stays
  // readable (false when it cannot be asked).
  bool host_vmm() const;

  // cudasim.h.
  decltype(&cudasim_get_counters) get_counters = nullptr;
  decltype(&cudasim_fail_configure) fail_configure = nullptr;
  decltype(&cudasim_failures_injected) failures_injected = nullptr;

  // Loads cudasim from `sim_dir` and then `vramswap_path`; false with *error set when a
  // library or a required function is missing.
  bool load(const std::string& sim_dir, const std::string& vramswap_path, std::string* error);

  // vramswap_stats_json as a string ("" on failure).
  std::string stats() const;
};

// The first "key":<integer> of a stats object (the totals come before "devices"); -1 when
// the key is missing.
long long stat_number(const std::string& json, const std::string& key);

}  // namespace stress
