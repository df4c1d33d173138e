// Loading cudasim and libvramswap.so, and the function table. See library.h.
#include "library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

namespace stress {
namespace {

template <typename F>
void find(void* handle, F*& slot, const char* name, std::string* missing) {
  slot = reinterpret_cast<F*>(dlsym(handle, name));
  if (!slot) *missing += std::string(" ") + name;
}

}  // namespace

bool Library::load(const std::string& sim_dir, const std::string& vramswap_path, std::string* error) {
  // cudasim's libraries by path, into the global scope: libvramswap.so's dependencies on the
  // sonames libcudart.so.13 and libcuda.so.1 then resolve to them, whatever LD_LIBRARY_PATH
  // says, so NVIDIA's runtime is never picked by mistake.
  void* driver = dlopen((sim_dir + "/libcuda.so.1").c_str(), RTLD_NOW | RTLD_GLOBAL);
  void* runtime = driver ? dlopen((sim_dir + "/libcudart.so.13").c_str(), RTLD_NOW | RTLD_GLOBAL) : nullptr;
  if (!driver || !runtime) {
    *error = std::string("cannot load cudasim from ") + sim_dir + ": " + dlerror();
    return false;
  }
  void* vramswap = dlopen(vramswap_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!vramswap) {
    *error = std::string("dlopen(") + vramswap_path + "): " + dlerror();
    return false;
  }
  std::string missing;
  find(vramswap, malloc, "vramswap_malloc", &missing);
  find(vramswap, free, "vramswap_free", &missing);
  find(vramswap, record_stream, "vramswap_record_stream", &missing);
  find(vramswap, empty_cache, "vramswap_empty_cache", &missing);
  find(vramswap, configure, "vramswap_configure", &missing);
  find(vramswap, last_error, "vramswap_last_error", &missing);
  find(vramswap, stats_json, "vramswap_stats_json", &missing);
  find(vramswap, scope_push, "vramswap_scope_push", &missing);
  find(vramswap, scope_pop, "vramswap_scope_pop", &missing);
  find(vramswap, pack, "vramswap_pack", &missing);
  find(vramswap, graph_begin, "vramswap_graph_begin", &missing);
  find(vramswap, mark_cold, "vramswap_mark_cold", &missing);
  find(vramswap, unpack, "vramswap_unpack", &missing);
  find(vramswap, release, "vramswap_release", &missing);
  find(vramswap, prefetch, "vramswap_prefetch", &missing);
  find(vramswap, keep, "vramswap_keep", &missing);
  find(vramswap, use, "vramswap_use", &missing);
  find(vramswap, unkeep, "vramswap_unkeep", &missing);
  check_invariants = reinterpret_cast<int (*)(void)>(dlsym(vramswap, "vramswap_check_invariants"));
  find(runtime, set_device, "cudaSetDevice", &missing);
  find(runtime, stream_create, "cudaStreamCreateWithFlags", &missing);
  find(runtime, stream_destroy, "cudaStreamDestroy", &missing);
  find(runtime, stream_synchronize, "cudaStreamSynchronize", &missing);
  find(runtime, device_synchronize, "cudaDeviceSynchronize", &missing);
  find(runtime, event_create, "cudaEventCreateWithFlags", &missing);
  find(runtime, event_destroy, "cudaEventDestroy", &missing);
  find(runtime, event_record, "cudaEventRecord", &missing);
  find(runtime, stream_wait_event, "cudaStreamWaitEvent", &missing);
  find(runtime, memset_async, "cudaMemsetAsync", &missing);
  find(runtime, memcpy_async, "cudaMemcpyAsync", &missing);
  find(runtime, get_last_error, "cudaGetLastError", &missing);
  find(runtime, error_name, "cudaGetErrorName", &missing);
  find(driver, device_get_attribute, "cuDeviceGetAttribute", &missing);
  find(driver, get_counters, "cudasim_get_counters", &missing);
  find(driver, fail_configure, "cudasim_fail_configure", &missing);
  find(driver, failures_injected, "cudasim_failures_injected", &missing);
  if (!missing.empty()) {
    *error = "dlsym found no" + missing;
    return false;
  }
  return true;
}

bool Library::host_vmm() const {
  int supported = 0;
  return device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0) ==
             CUDA_SUCCESS &&
         supported != 0;
}

std::string Library::stats() const {
  const size_t n = stats_json(nullptr, 0);
  std::string buf(n + 4096, '\0');  // slack: the numbers may grow in between
  stats_json(buf.data(), buf.size());
  buf.resize(std::strlen(buf.c_str()));
  return buf;
}

long long stat_number(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\":";
  const size_t at = json.find(needle);
  if (at == std::string::npos) return -1;
  return std::strtoll(json.c_str() + at + needle.size(), nullptr, 10);
}

}  // namespace stress
