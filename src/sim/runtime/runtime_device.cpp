// Runtime API: devices, versions, properties, device-wide synchronization.
#include <cstring>
#include <functional>

#include "runtime_state.h"

using namespace cudart;

namespace {

// cuCtxEnablePeerAccess or cuCtxDisablePeerAccess from the current device's primary context
// to `peer`'s, as the runtime's peer-access calls do.
cudaError_t with_peer_context(Api& api, int peer, const std::function<CUresult(CUcontext)>& call) {
  int count = 0;
  cuDeviceGetCount(&count);
  if (peer < 0 || peer >= count) return api.ret(cudaErrorInvalidDevice);
  CUcontext ctx = nullptr;
  if (CUresult r = cuDevicePrimaryCtxRetain(&ctx, peer)) return api.ret(r);
  const CUresult r = call(ctx);
  cuDevicePrimaryCtxRelease_v2(peer);
  return api.ret(r);
}

}  // namespace

extern "C" {

cudaError_t cudaDriverGetVersion(int* version) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (!version) return api.ret(cudaErrorInvalidValue);
  return api.ret(cuDriverGetVersion(version));
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (!version) return api.ret(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return api.ret(cudaSuccess);
}

cudaError_t cudaGetDeviceCount(int* count) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (!count) return api.ret(cudaErrorInvalidValue);
  if (CUresult r = cuInit(0)) return api.ret(r);
  return api.ret(cuDeviceGetCount(count));
}

cudaError_t cudaSetDevice(int device) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (CUresult r = cuInit(0)) return api.ret(r);
  int count = 0;
  cuDeviceGetCount(&count);
  if (device < 0 || device >= count) return api.ret(cudaErrorInvalidDevice);
  thread_device() = device;
  // The device's primary context becomes the thread's current context.
  if (CUresult r = cuCtxSetCurrent(nullptr)) return api.ret(r);
  return api.ret(ensure_context());
}

cudaError_t cudaInitDevice(int device, unsigned int deviceFlags, unsigned int flags) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (flags != 0) return api.ret(cudaErrorInvalidValue);
  if (CUresult r = cuInit(0)) return api.ret(r);
  int count = 0;
  cuDeviceGetCount(&count);
  if (device < 0 || device >= count) return api.ret(cudaErrorInvalidDevice);
  if (deviceFlags) cuDevicePrimaryCtxSetFlags_v2(device, deviceFlags);
  CUcontext primary;
  if (CUresult r = cuDevicePrimaryCtxRetain(&primary, device)) return api.ret(r);
  return api.ret(cudaSuccess);
}

cudaError_t cudaGetDevice(int* device) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  if (!device) return api.ret(cudaErrorInvalidValue);
  CUdevice d;
  if (CUresult r = cuCtxGetDevice(&d)) return api.ret(r);
  *device = d;
  return api.ret(cudaSuccess);
}

cudaError_t cudaSetDeviceFlags(unsigned int flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  CUdevice d;
  cuCtxGetDevice(&d);
  return api.ret(cuDevicePrimaryCtxSetFlags_v2(d, flags));
}

cudaError_t cudaGetDeviceFlags(unsigned int* flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  if (!flags) return api.ret(cudaErrorInvalidValue);
  CUdevice d;
  cuCtxGetDevice(&d);
  int active;
  return api.ret(cuDevicePrimaryCtxGetState(d, flags, &active));
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (CUresult r = cuInit(0)) return api.ret(r);
  // cudaDeviceAttr and CUdevice_attribute share their values.
  return api.ret(cuDeviceGetAttribute(value, static_cast<CUdevice_attribute>(attr), device));
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuCtxGetStreamPriorityRange(least, greatest));
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (!prop) return api.ret(cudaErrorInvalidValue);
  if (CUresult r = cuInit(0)) return api.ret(r);
  int count = 0;
  cuDeviceGetCount(&count);
  if (device < 0 || device >= count) return api.ret(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof *prop);
  cuDeviceGetName(prop->name, sizeof prop->name, device);
  CUuuid uuid;
  cuDeviceGetUuid_v2(&uuid, device);
  std::memcpy(&prop->uuid, &uuid, sizeof uuid);
  cuDeviceTotalMem_v2(&prop->totalGlobalMem, device);
  auto attr = [device](CUdevice_attribute a) {
    int v = 0;
    cuDeviceGetAttribute(&v, a, device);
    return v;
  };
  prop->sharedMemPerBlock = size_t(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK));
  prop->regsPerBlock = attr(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK);
  prop->warpSize = attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE);
  prop->memPitch = size_t(attr(CU_DEVICE_ATTRIBUTE_MAX_PITCH));
  prop->maxThreadsPerBlock = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  prop->maxThreadsDim[0] = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X);
  prop->maxThreadsDim[1] = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y);
  prop->maxThreadsDim[2] = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z);
  prop->maxGridSize[0] = attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X);
  prop->maxGridSize[1] = attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y);
  prop->maxGridSize[2] = attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z);
  prop->totalConstMem = size_t(attr(CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY));
  prop->major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  prop->minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  prop->textureAlignment = size_t(attr(CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT));
  prop->multiProcessorCount = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  prop->canMapHostMemory = attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY);
  prop->concurrentKernels = attr(CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS);
  prop->pciBusID = attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
  prop->asyncEngineCount = attr(CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT);
  prop->unifiedAddressing = attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
  prop->memoryBusWidth = attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
  prop->l2CacheSize = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  prop->maxThreadsPerMultiProcessor = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
  prop->streamPrioritiesSupported = attr(CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED);
  prop->sharedMemPerMultiprocessor = size_t(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR));
  prop->regsPerMultiprocessor = attr(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR);
  prop->sharedMemPerBlockOptin = size_t(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN));
  prop->maxBlocksPerMultiProcessor = attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR);
  prop->hostRegisterSupported = attr(CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED);
  prop->memoryPoolsSupported = attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
  prop->hostNumaId = -1;
  return api.ret(cudaSuccess);
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemGetInfo_v2(free_bytes, total));
}

cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  Api api(__func__, Api::kNothing);
  if (!api.ok()) return api.status();
  if (CUresult r = cuInit(0)) return api.ret(r);
  return api.ret(cuDeviceCanAccessPeer(can, device, peer));
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return with_peer_context(api, peer, [flags](CUcontext ctx) { return cuCtxEnablePeerAccess(ctx, flags); });
}

cudaError_t cudaDeviceDisablePeerAccess(int peer) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return with_peer_context(api, peer, [](CUcontext ctx) { return cuCtxDisablePeerAccess(ctx); });
}

cudaError_t cudaDeviceSynchronize(void) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuCtxSynchronize());
}

}  // extern "C"
