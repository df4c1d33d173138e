// Runtime API: memory allocation, copies, memsets and pointer attributes, each the
// matching driver call after the runtime's own argument rules (sizes of 0, copy kinds).
#include "runtime_state.h"

using namespace cudart;

namespace {

CUdeviceptr dptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

bool valid_kind(cudaMemcpyKind kind) { return kind >= cudaMemcpyHostToHost && kind <= cudaMemcpyDefault; }

// The synchronous copy of a kind: the driver call that checks the device side(s).
CUresult sync_copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind, bool ptds) {
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return ptds ? cuMemcpyHtoD_v2_ptds(dptr(dst), src, n) : cuMemcpyHtoD_v2(dptr(dst), src, n);
    case cudaMemcpyDeviceToHost:
      return ptds ? cuMemcpyDtoH_v2_ptds(dst, dptr(src), n) : cuMemcpyDtoH_v2(dst, dptr(src), n);
    case cudaMemcpyDeviceToDevice:
      return ptds ? cuMemcpyDtoD_v2_ptds(dptr(dst), dptr(src), n) : cuMemcpyDtoD_v2(dptr(dst), dptr(src), n);
    default:  // host to host and default: the driver infers the direction (unified addressing)
      return ptds ? cuMemcpy_ptds(dptr(dst), dptr(src), n) : cuMemcpy(dptr(dst), dptr(src), n);
  }
}

CUresult async_copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind, CUstream s) {
  switch (kind) {
    case cudaMemcpyHostToDevice: return cuMemcpyHtoDAsync_v2(dptr(dst), src, n, s);
    case cudaMemcpyDeviceToHost: return cuMemcpyDtoHAsync_v2(dst, dptr(src), n, s);
    case cudaMemcpyDeviceToDevice: return cuMemcpyDtoDAsync_v2(dptr(dst), dptr(src), n, s);
    default: return cuMemcpyAsync(dptr(dst), dptr(src), n, s);
  }
}

cudaError_t memcpy_async(Api& api, void* dst, const void* src, size_t n, cudaMemcpyKind kind, CUstream s) {
  if (!api.ok()) return api.status();
  if (!valid_kind(kind)) return api.ret(cudaErrorInvalidMemcpyDirection);
  return api.ret(async_copy(dst, src, n, kind, s));
}

cudaError_t memcpy_sync(Api& api, void* dst, const void* src, size_t n, cudaMemcpyKind kind, bool ptds) {
  if (!api.ok()) return api.status();
  if (!valid_kind(kind)) return api.ret(cudaErrorInvalidMemcpyDirection);
  return api.ret(sync_copy(dst, src, n, kind, ptds));
}

}  // namespace

extern "C" {

cudaError_t cudaMalloc(void** p, size_t size) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  if (!p) return api.ret(cudaErrorInvalidValue);
  if (size == 0) {  // the runtime answers a request for nothing with a null pointer
    *p = nullptr;
    return api.ret(cudaSuccess);
  }
  CUdeviceptr d = 0;
  CUresult r = cuMemAlloc_v2(&d, size);
  *p = r == CUDA_SUCCESS ? reinterpret_cast<void*>(d) : nullptr;
  return api.ret(r);
}

cudaError_t cudaFree(void* p) {
  Api api(__func__);  // cudaFree(nullptr) initializes the context: a common idiom
  if (!api.ok()) return api.status();
  return api.ret(cuMemFree_v2(dptr(p)));
}

cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t s) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  if (!p) return api.ret(cudaErrorInvalidValue);
  CUdeviceptr d = 0;
  CUresult r = cuMemAllocAsync(&d, size, s);
  *p = r == CUDA_SUCCESS ? reinterpret_cast<void*>(d) : nullptr;
  return api.ret(r);
}

cudaError_t cudaMallocAsync_ptsz(void** p, size_t size, cudaStream_t s) {
  return cudaMallocAsync(p, size, per_thread(s));
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemFreeAsync(dptr(p), s));
}

cudaError_t cudaFreeAsync_ptsz(void* p, cudaStream_t s) { return cudaFreeAsync(p, per_thread(s)); }

cudaError_t cudaHostAlloc(void** p, size_t size, unsigned int flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  // cudaHostAllocPortable/Mapped/WriteCombined have the driver's CU_MEMHOSTALLOC_* values.
  return api.ret(cuMemHostAlloc(p, size, flags));
}

cudaError_t cudaMallocHost(void** p, size_t size) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemHostAlloc(p, size, 0));
}

cudaError_t cudaFreeHost(void* p) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemFreeHost(p));
}

cudaError_t cudaHostRegister(void* p, size_t size, unsigned int flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemHostRegister_v2(p, size, flags));
}

cudaError_t cudaHostUnregister(void* p) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemHostUnregister(p));
}

cudaError_t cudaHostGetDevicePointer(void** pdev, void* host, unsigned int flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  if (!pdev) return api.ret(cudaErrorInvalidValue);
  CUdeviceptr d;
  CUresult r = cuMemHostGetDevicePointer_v2(&d, host, flags);
  if (r == CUDA_SUCCESS) *pdev = reinterpret_cast<void*>(d);
  return api.ret(r);
}

cudaError_t cudaHostGetFlags(unsigned int* flags, void* host) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemHostGetFlags(flags, host));
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  Api api(__func__);
  return memcpy_sync(api, dst, src, n, kind, false);
}

cudaError_t cudaMemcpy_ptds(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  Api api(__func__);
  return memcpy_sync(api, dst, src, n, kind, true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  Api api(__func__);
  return memcpy_async(api, dst, src, n, kind, s);
}

cudaError_t cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  Api api(__func__);
  return memcpy_async(api, dst, src, n, kind, per_thread(s));
}

cudaError_t cudaMemset(void* p, int value, size_t n) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemsetD8_v2(dptr(p), static_cast<unsigned char>(value), n));
}

cudaError_t cudaMemset_ptds(void* p, int value, size_t n) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemsetD8_v2_ptds(dptr(p), static_cast<unsigned char>(value), n));
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t s) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuMemsetD8Async(dptr(p), static_cast<unsigned char>(value), n, s));
}

cudaError_t cudaMemsetAsync_ptsz(void* p, int value, size_t n, cudaStream_t s) {
  return cudaMemsetAsync(p, value, n, per_thread(s));
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  if (!attr) return api.ret(cudaErrorInvalidValue);
  unsigned type = 0;
  if (cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dptr(p)) != CUDA_SUCCESS) {
    // Memory CUDA does not know: plain host memory, not an error since CUDA 11.
    attr->type = cudaMemoryTypeUnregistered;
    attr->device = -2;
    attr->devicePointer = nullptr;
    attr->hostPointer = nullptr;
    return api.ret(cudaSuccess);
  }
  int device = 0;
  cuPointerGetAttribute(&device, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dptr(p));
  attr->device = device;
  attr->devicePointer = const_cast<void*>(p);
  if (type == CU_MEMORYTYPE_DEVICE) {
    attr->type = cudaMemoryTypeDevice;
    attr->hostPointer = nullptr;
  } else {
    attr->type = cudaMemoryTypeHost;
    attr->hostPointer = const_cast<void*>(p);
  }
  return api.ret(cudaSuccess);
}

}  // extern "C"
