// Device queries and the primary-context scope. See device.h.
#include "cuda/device.h"

#include <mutex>

#include "cuda/error.h"
#include "cuda/host_time.h"

namespace vramswap::cuda {
namespace {

CUcontext primary_context(int ordinal) {
  // One reference per device for the life of the process, as the runtime holds one.
  static std::mutex mu;
  static CUcontext contexts[64] = {};
  std::lock_guard lock(mu);
  if (ordinal < 0 || ordinal >= 64) throw CudaError("device ordinal " + std::to_string(ordinal) + " out of range", 101);
  if (!contexts[ordinal]) VRAMSWAP_CU(cuDevicePrimaryCtxRetain(&contexts[ordinal], ordinal));
  return contexts[ordinal];
}

}  // namespace

DeviceInfo device_info(int ordinal) {
  VRAMSWAP_CU(cuInit(0));
  DeviceInfo info;
  info.ordinal = ordinal;
  CUdevice dev;
  VRAMSWAP_CU(cuDeviceGet(&dev, ordinal));
  size_t total = 0;
  VRAMSWAP_CU(cuDeviceTotalMem(&total, dev));
  info.total_bytes = total;
  int vmm = 0;
  VRAMSWAP_CU(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  info.vmm_supported = vmm != 0;
  if (info.vmm_supported) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    size_t g = 0;
    VRAMSWAP_CU(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    info.granularity = g;
  }
  return info;
}

int device_count() {
  if (cuInit(0) != CUDA_SUCCESS) return 0;
  int n = 0;
  return cuDeviceGetCount(&n) == CUDA_SUCCESS ? n : 0;
}

int current_device() {
  int d = 0;
  VRAMSWAP_CUDART(cudaGetDevice(&d));
  return d;
}

bool synchronize_device(int ordinal) {
  try {
    ContextScope scope(ordinal);
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    cuThreadExchangeStreamCaptureMode(&mode);
    CUresult r;
    {
      TimedCall timed(HostTime::kWait);
      r = cuCtxSynchronize();
    }
    cuThreadExchangeStreamCaptureMode(&mode);
    return r == CUDA_SUCCESS;
  } catch (const CudaError&) {
    return false;
  }
}

void device_memory(int ordinal, size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = *total_bytes = 0;
  try {
    ContextScope scope(ordinal);
    if (cuMemGetInfo(free_bytes, total_bytes) != CUDA_SUCCESS) *free_bytes = *total_bytes = 0;
  } catch (const CudaError&) {
  }
}

ContextScope::ContextScope(int ordinal) {
  VRAMSWAP_CU(cuInit(0));
  CUcontext want = primary_context(ordinal);
  VRAMSWAP_CU(cuCtxGetCurrent(&previous_));
  if (previous_ != want) {
    VRAMSWAP_CU(cuCtxSetCurrent(want));
    switched_ = true;
  }
}

ContextScope::~ContextScope() {
  if (switched_) cuCtxSetCurrent(previous_);  // nothing to do if the driver is shutting down
}

}  // namespace vramswap::cuda
