// Driver API: initialization, devices and their attributes, contexts; cudasim's own
// exports (cudasim.h) and the internals its runtime uses.
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "address_space.h"
#include "api.h"
#include "cudasim.h"
#include "virtual_time.h"

namespace cudasim {

Registry<CUstream_st>& stream_handles() {
  static auto* r = new Registry<CUstream_st>;
  return *r;
}
Registry<CUevent_st>& event_handles() {
  static auto* r = new Registry<CUevent_st>;
  return *r;
}
Registry<CUgraph_st>& graph_handles() {
  static auto* r = new Registry<CUgraph_st>;
  return *r;
}
Registry<CUgraphExec_st>& graph_exec_handles() {
  static auto* r = new Registry<CUgraphExec_st>;
  return *r;
}

std::shared_ptr<Stream> resolve_stream(CUstream h, bool per_thread_default, CUresult* err) {
  *err = CUDA_SUCCESS;
  if (h == nullptr || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
    Device* dev = current_device();
    if (!dev) {
      *err = CUDA_ERROR_INVALID_CONTEXT;
      return nullptr;
    }
    bool per_thread = h == CU_STREAM_PER_THREAD || (h == nullptr && per_thread_default);
    return per_thread ? per_thread_stream(dev) : dev->legacy_stream_ptr();
  }
  if (!stream_handles().contains(h)) {
    if (stream_handles().was_destroyed(h)) destroyed_stream_used(h, "a CUDA call");
    *err = CUDA_ERROR_INVALID_HANDLE;
    return nullptr;
  }
  return h->stream;
}

void destroyed_stream_used(const void* h, const char* what) {
  std::fprintf(stderr,
               "cudasim: stream %p was used by %s after cudaStreamDestroy destroyed it: undefined behaviour on a "
               "GPU (the driver may crash, or find another stream at that address); stopping here\n",
               h, what);
  std::fflush(stderr);
  std::abort();
}

namespace {

// Attribute values of the emulated device: a Hopper-class card (compute capability 9.0)
// whose memory size is CUDASIM_DEVICE_MEMORY. Attributes not listed read 0.
bool attribute_value(CUdevice_attribute attr, int* value) {
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: *value = 1024; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *value = 1024; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *value = 64; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *value = 2147483647; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: *value = 65535; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *value = 65535; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *value = 48 * 1024; return true;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: *value = 64 * 1024; return true;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: *value = 2147483647; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = 65536; return true;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: *value = 512; return true;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; return true;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: *value = 1; return true;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *value = 1; return true;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = 5120; return true;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *value = 50 * 1024 * 1024; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *value = 2048; return true;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *value = 2; return true;  // one copy engine per direction
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *value = 1; return true;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; return true;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; return true;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: *value = 1; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *value = 228 * 1024; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: *value = 65536; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 227 * 1024; return true;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: *value = 32; return true;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = 1; return true;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *value = 1; return true;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: *value = 1; return true;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *value = 0x18; return true;
    // The host has one NUMA node, 0, and VMM memory can be placed on it unless
    // CUDASIM_HOST_VMM=0 (driver_vmm.cpp).
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: *value = 0; return true;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
      *value = settings().host_vmm ? 1 : 0;
      return true;
    default:
      if (int(attr) <= 0 || attr >= CU_DEVICE_ATTRIBUTE_MAX) return false;
      *value = 0;
      return true;
  }
}

thread_local std::vector<CUctx_st*> t_pushed_contexts;

bool is_primary_context(CUctx_st* ctx) {
  for (int i = 0; i < device_count(); ++i)
    if (device(i)->primary_context() == ctx) return true;
  return false;
}

}  // namespace
}  // namespace cudasim

using namespace cudasim;

extern "C" {

CUresult cuInit(unsigned int flags) {
  Call call(__func__, Call::kNoInit);
  if (!call.ok()) return call.status();  // an injected failure (fault.h)
  if (in_host_function()) return call.ret(CUDA_ERROR_NOT_PERMITTED);
  if (flags != 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  return call.ret(initialize());
}

CUresult cuDriverGetVersion(int* version) {
  Call call(__func__, Call::kNoInit);
  if (!version) return call.ret(CUDA_ERROR_INVALID_VALUE);
  *version = CUDA_VERSION;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDeviceGetCount(int* count) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!count) return call.ret(CUDA_ERROR_INVALID_VALUE);
  *count = device_count();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!dev) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (!device(ordinal)) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  *dev = ordinal;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!name || len <= 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (!device(dev)) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  std::snprintf(name, size_t(len), "cudasim emulated device %d", dev);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!uuid) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (!device(dev)) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  std::memset(uuid->bytes, 0, sizeof uuid->bytes);
  std::memcpy(uuid->bytes, "cudasim", 7);
  uuid->bytes[15] = char(dev);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!bytes) return call.ret(CUDA_ERROR_INVALID_VALUE);
  Device* d = device(dev);
  if (!d) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  *bytes = d->capacity();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attr, CUdevice dev) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("attr=%d dev=%d", int(attr), dev);
  if (!value) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (!device(dev)) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  if (!attribute_value(attr, value)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!pctx) return call.ret(CUDA_ERROR_INVALID_VALUE);
  Device* d = device(dev);
  if (!d) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  d->primary_context()->refcount.fetch_add(1);
  *pctx = d->primary_context();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  Device* d = device(dev);
  if (!d) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  int cur = d->primary_context()->refcount.load();
  do {
    if (cur <= 0) return call.ret(CUDA_ERROR_INVALID_CONTEXT);
  } while (!d->primary_context()->refcount.compare_exchange_weak(cur, cur - 1));
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!flags || !active) return call.ret(CUDA_ERROR_INVALID_VALUE);
  Device* d = device(dev);
  if (!d) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  *flags = d->primary_context()->flags.load();
  *active = d->primary_context()->refcount.load() > 0;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  Device* d = device(dev);
  if (!d) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  d->primary_context()->flags.store(flags);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  Device* d = device(dev);
  if (!d) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  d->synchronize();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext* pctx) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!pctx) return call.ret(CUDA_ERROR_INVALID_VALUE);
  *pctx = current_context();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (ctx && !is_primary_context(ctx)) return call.ret(CUDA_ERROR_INVALID_CONTEXT);
  current_context() = ctx;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!ctx || !is_primary_context(ctx)) return call.ret(CUDA_ERROR_INVALID_CONTEXT);
  t_pushed_contexts.push_back(current_context());
  current_context() = ctx;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxPopCurrent_v2(CUcontext* pctx) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!current_context()) return call.ret(CUDA_ERROR_INVALID_CONTEXT);
  if (pctx) *pctx = current_context();
  if (t_pushed_contexts.empty()) {
    current_context() = nullptr;
  } else {
    current_context() = t_pushed_contexts.back();
    t_pushed_contexts.pop_back();
  }
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxGetDevice(CUdevice* dev) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  if (!dev) return call.ret(CUDA_ERROR_INVALID_VALUE);
  *dev = current_device()->ordinal();
  return call.ret(CUDA_SUCCESS);
}

// Peer access: any two distinct devices may reach each other. It is recorded per context
// (the runtime enables it between primary contexts); what it governs in CUDA, kernels
// reading cuMemAlloc memory of the peer, cudasim has no kernels for. cuMemSetAccess grants
// VMM mappings to other devices separately (driver_vmm.cpp).
CUresult cuDeviceCanAccessPeer(int* can, CUdevice dev, CUdevice peer) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!can) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (!device(dev) || !device(peer)) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  *can = dev != peer ? 1 : 0;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  if (flags != 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  CUcontext mine = current_device()->primary_context();
  if (!peer || !peer->device) return call.ret(CUDA_ERROR_INVALID_CONTEXT);
  if (peer->device == mine->device) return call.ret(CUDA_ERROR_INVALID_DEVICE);
  const uint32_t bit = device_bit(peer->device->ordinal());
  if (mine->peers.fetch_or(bit) & bit) return call.ret(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxDisablePeerAccess(CUcontext peer) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  CUcontext mine = current_device()->primary_context();
  if (!peer || !peer->device) return call.ret(CUDA_ERROR_INVALID_CONTEXT);
  const uint32_t bit = device_bit(peer->device->ordinal());
  if (!(mine->peers.fetch_and(~bit) & bit)) return call.ret(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxSynchronize(void) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  if (CUresult r = check_unsafe_call()) return call.ret(r);
  if (CUresult r = check_device_sync(current_device())) return call.ret(r);
  current_device()->synchronize();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return call.ret(CUDA_SUCCESS);
}

// ---- cudasim.h ------------------------------------------------------------------------

int cudasim_get_counters(int dev, cudasim_counters* out) {
  Device* d = device(dev);
  if (!d || !out) return -1;
  d->fill_counters(out);
  return 0;
}

int cudasim_reset_counters(int dev) {
  Device* d = device(dev);
  if (!d) return -1;
  d->reset_counters();
  return 0;
}

int cudasim_is_emulated(void) { return 1; }

int cudasim_virtual_time(void) { return virtual_time() ? 1 : 0; }

uint64_t cudasim_now_ns(void) { return virtual_time() ? host_now_ns() : real_now_ns(); }

size_t cudasim_timeline(cudasim_timeline_entry* out, size_t capacity) { return timeline_copy(out, capacity); }

void cudasim_timeline_clear(void) { timeline_clear(); }

// Called by the generated weak stubs of driver functions cudasim does not implement.
int cudasim_driver_unsupported(const char* name) {
  report_unsupported_once(name);
  return CUDA_ERROR_NOT_SUPPORTED;
}

// ---- For cudasim's runtime only --------------------------------------------------------

void cudasim_internal_report_unsupported(const char* name) { report_unsupported_once(name); }
int cudasim_internal_in_host_function(void) { return in_host_function() ? 1 : 0; }
int cudasim_internal_log_enabled(void) { return log_enabled() ? 1 : 0; }
void cudasim_internal_log(const char* line) { log_line("%s", line); }

}  // extern "C"
