// Driver API: device and host memory, copies, memsets, pointer attributes.
//
// Copies follow CUDA's documented host synchronization (API synchronization behavior):
//   * asynchronous copies return at once, except that a copy from pageable host memory is
//     staged (the source is read during the call) and a copy into pageable host memory,
//     or between two host buffers, returns only once it has completed;
//   * synchronous copies (cuMemcpy*, cudaMemcpy) return once the copy completed, except
//     device to device, which is asynchronous;
//   * synchronous memsets of device memory are asynchronous with respect to the host.
// cuMemFree / cuMemFreeHost wait for the device's streams (as cudaFree synchronizes),
// so no queued work can touch memory after it is unmapped. Every such wait is a host
// wait of virtual time (it moves the host clock; see virtual_time.h).
//
// CUDASIM_UNBACKED=1: copies and memsets move no bytes (they are only timed and
// counted), so device and pinned memory that nothing else writes never gets RAM; the
// data is garbage. A device range that is unmapped, or mapped without the access the
// operation needs, still faults when the operation runs, as it would on a GPU.
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "address_space.h"
#include "api.h"
#include "config/units.h"
#include "virtual_time.h"

namespace cudasim {
namespace {

constexpr uint64_t kPage = 4096;
using vramswap::round_up;

void synchronize_all_devices() {
  for (int i = 0; i < device_count(); ++i) device(i)->synchronize();
}

// Unbacked: what the copy would have touched, touched only where that faults. The access
// is made to the first address the operation may not touch, so the fault report names it.
void fault_if_inaccessible(const void* p, uint64_t n, bool write) {
  uintptr_t bad = first_inaccessible(p, n, write);
  if (!bad) return;
  volatile unsigned char* q = reinterpret_cast<volatile unsigned char*>(bad);
  unsigned char v = *q;  // faults on a range without access
  if (write) *q = v;     // faults on a read-only range
}

// A copy or memset run on a stream of `device` touching another device's mapping, or a
// mapping of host-located memory, that `device` was not granted (cuMemSetAccess): an illegal
// address on a GPU. The process stops, saying so. Nothing is checked with one device: then
// the host's view of every mapping (address_space.h, view_of) is that device's grant, and a
// copy touching memory without it faults.
void fault_unless_granted(int device, const void* p, uint64_t n, bool write, const char* what) {
  if (device_count() < 2) return;
  const uintptr_t bad = first_inaccessible_to(device, p, n, write);
  if (!bad) return;
  std::fprintf(stderr,
               "cudasim: illegal address 0x%lx during %s on a stream of device %d: device %d has no access to "
               "that mapping of another device or of host-located memory (cuMemSetAccess grants access per "
               "device)\n",
               (unsigned long)bad, what, device, device);
  std::abort();
}

// Maps anonymous host-accessible memory for a device block or a pinned host buffer;
// `resident`: with every page in memory at once (MAP_POPULATE: a fresh mapping is made
// resident here on any kernel, where make_resident's fallback for kernels without
// MADV_POPULATE_WRITE, reading every page, would map only the shared zero page).
void* map_anonymous(uint64_t bytes, bool resident = false) {
  void* p = ::mmap(nullptr, round_up(std::max<uint64_t>(bytes, 1), kPage), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (resident ? MAP_POPULATE : 0), -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// Note [Pinned pages are resident]
// Page-locked memory is in RAM from the moment it is pinned: the driver faults every page in
// as cudaHostAlloc or cudaHostRegister runs (that is much of why pinning is slow), and a
// copy into it never faults. Memory cudasim pins is made resident the same way, unless
// CUDASIM_UNBACKED (where pinned memory must take no RAM). Left to fault on first touch, the
// first copy into a buffer paid a page fault per 4 KiB on the copy's worker (8 MiB in 24-30
// ms on a VM, against 0.5 ms once resident), and the copy rate a program measured on its
// first copies was 50 times a GPU's.
void make_resident(void* p, uint64_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (::madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
  // An older kernel, or a mapping that cannot be written: read a byte of every page.
  const auto* c = static_cast<const volatile unsigned char*>(p);
  for (uint64_t off = 0; off < bytes; off += kPage) (void)c[off];
}

CUresult alloc_device(Device* dev, uint64_t bytes, CUdeviceptr* out) {
  uint64_t charged = round_up(bytes, kPage);
  if (!dev->charge(charged)) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = map_anonymous(bytes);
  if (!p) {
    dev->uncharge(charged);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Region r;
  r.base = reinterpret_cast<uintptr_t>(p);
  r.size = bytes;
  r.map_size = round_up(bytes, kPage);
  r.kind = RegionKind::kDevice;
  r.device = dev->ordinal();
  r.charged = charged;
  {
    AddressSpace& as = address_space();
    std::unique_lock lock(as.mu);
    as.regions[r.base] = r;
  }
  *out = r.base;
  return CUDA_SUCCESS;
}

// Removes a device block's region (caller checked it) and returns its memory.
void release_device_block(uintptr_t base) {
  Region r;
  {
    AddressSpace& as = address_space();
    std::unique_lock lock(as.mu);
    auto it = as.regions.find(base);
    if (it == as.regions.end()) return;
    r = it->second;
    as.regions.erase(it);
  }
  ::munmap(reinterpret_cast<void*>(r.base), r.map_size);
  device(r.device)->uncharge(r.charged);
}

bool is_device(const PointerInfo& p) {
  return p.type == PointerInfo::Type::kDevice || p.type == PointerInfo::Type::kUnmappedDevice;
}

}  // namespace

// The copy engine behind every cuMemcpy* entry point and cudaMemcpy*. `need_dst_device` /
// `need_src_device`: 1 when that side must be device memory, -1 when either will do.
CUresult copy(void* dst, const void* src, size_t n, CUstream h, bool per_thread, bool sync_call,
              int need_dst_device, int need_src_device) {
  CUresult err;
  auto stream = resolve_stream(h, per_thread, &err);
  if (!stream) return err;
  if (n == 0) return CUDA_SUCCESS;
  if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
  PointerInfo d = classify(dst, n), s = classify(src, n);
  if ((is_device(d) && !d.range_ok) || (is_device(s) && !s.range_ok)) return CUDA_ERROR_INVALID_VALUE;
  if (need_dst_device == 1 && !is_device(d)) return CUDA_ERROR_INVALID_VALUE;
  if (need_src_device == 1 && !is_device(s)) return CUDA_ERROR_INVALID_VALUE;
  if (sync_call)
    if (CUresult r = check_unsafe_call()) return r;

  // Device addresses (checked for access, synchronized as device memory) ...
  const bool dst_dev = is_device(d), src_dev = is_device(s);
  // ... and where the bytes are: host-located VMM memory is a device address whose bytes
  // cross the link, so the copy counts and is timed as one to or from the host.
  const bool dst_on_dev = dst_dev && !d.host_located, src_on_dev = src_dev && !s.host_located;
  Counters& counters = stream->device()->counters();
  std::atomic<uint64_t>* counter = dst_on_dev ? (src_on_dev ? &counters.bytes_d2d : &counters.bytes_h2d)
                                              : (src_on_dev ? &counters.bytes_d2h : &counters.bytes_h2h);
  const char* what = dst_on_dev ? (src_on_dev ? "memcpy DtoD" : "memcpy HtoD")
                                : (src_on_dev ? "memcpy DtoH" : "memcpy HtoH");

  Operation op;
  op.what = what;
  op.timing.kind = dst_on_dev ? (src_on_dev ? OpKind::kCopyD2D : OpKind::kCopyH2D)
                              : (src_on_dev ? OpKind::kCopyD2H : OpKind::kOther);
  op.timing.bytes = n;
  const int on = stream->device()->ordinal();
  // Another device's mappings need a grant to the stream's device (checked when it runs).
  auto granted = [on, dst, src, n, dst_dev, src_dev, what] {
    if (src_dev) fault_unless_granted(on, src, n, false, what);
    if (dst_dev) fault_unless_granted(on, dst, n, true, what);
  };
  if (settings().unbacked) {
    op.run = [dst, src, n, counter, dst_dev, src_dev, granted] {
      granted();
      if (src_dev) fault_if_inaccessible(src, n, false);
      if (dst_dev) fault_if_inaccessible(dst, n, true);
      counter->fetch_add(n, std::memory_order_relaxed);
    };
  } else if (!src_dev && s.type == PointerInfo::Type::kPageableHost && !sync_call) {
    // Pageable source: staged now, as the driver stages it into its own pinned buffer.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + n);
    op.run = [dst, staged, n, counter, granted] {
      granted();
      std::memcpy(dst, staged->data(), n);
      counter->fetch_add(n, std::memory_order_relaxed);
    };
  } else {
    op.run = [dst, src, n, counter, granted] {
      granted();
      std::memcpy(dst, src, n);
      counter->fetch_add(n, std::memory_order_relaxed);
    };
  }
  StreamPoint done = stream->enqueue(std::move(op));
  bool host_waits;
  if (sync_call) host_waits = !(dst_dev && src_dev);
  else host_waits = (!dst_dev && (src_dev ? d.type == PointerInfo::Type::kPageableHost : true));
  if (host_waits) done.host_wait();
  return CUDA_SUCCESS;
}

// The engine behind cuMemsetD8/D16/D32 (and cudaMemset): `count` elements of `elem` bytes.
CUresult memset_elements(void* dst, uint32_t value, size_t elem, size_t count, CUstream h, bool per_thread,
                         bool sync_call) {
  CUresult err;
  auto stream = resolve_stream(h, per_thread, &err);
  if (!stream) return err;
  if (count == 0) return CUDA_SUCCESS;
  if (!dst) return CUDA_ERROR_INVALID_VALUE;
  if (elem > 1 && reinterpret_cast<uintptr_t>(dst) % elem) return CUDA_ERROR_INVALID_VALUE;
  const size_t bytes = elem * count;
  PointerInfo d = classify(dst, bytes);
  if (!is_device(d) && d.type != PointerInfo::Type::kPinnedHost) return CUDA_ERROR_INVALID_VALUE;
  if (!d.range_ok) return CUDA_ERROR_INVALID_VALUE;
  if (sync_call)
    if (CUresult r = check_unsafe_call()) return r;
  Counters& counters = stream->device()->counters();
  Operation op;
  op.what = "memset";
  op.timing.kind = OpKind::kMemset;
  op.timing.bytes = bytes;
  const int on = stream->device()->ordinal();
  const bool dst_dev = is_device(d);
  if (settings().unbacked) {
    op.run = [dst, bytes, dst_dev, on, &counters] {
      if (dst_dev) fault_unless_granted(on, dst, bytes, true, "memset");
      if (dst_dev) fault_if_inaccessible(dst, bytes, true);
      counters.bytes_memset.fetch_add(bytes, std::memory_order_relaxed);
    };
  } else {
    op.run = [dst, value, elem, count, bytes, dst_dev, on, &counters] {
      if (dst_dev) fault_unless_granted(on, dst, bytes, true, "memset");
      if (elem == 1) {
        std::memset(dst, int(value & 0xff), count);
      } else if (elem == 2) {
        auto* p = static_cast<uint16_t*>(dst);
        for (size_t i = 0; i < count; ++i) p[i] = uint16_t(value);
      } else {
        auto* p = static_cast<uint32_t*>(dst);
        for (size_t i = 0; i < count; ++i) p[i] = value;
      }
      counters.bytes_memset.fetch_add(bytes, std::memory_order_relaxed);
    };
  }
  StreamPoint done = stream->enqueue(std::move(op));
  if (sync_call && d.type == PointerInfo::Type::kPinnedHost) done.host_wait();
  return CUDA_SUCCESS;
}

}  // namespace cudasim

using namespace cudasim;

extern "C" {

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  if (!free_bytes || !total) return call.ret(CUDA_ERROR_INVALID_VALUE);
  Device* dev = current_device();
  *total = dev->capacity();
  *free_bytes = dev->capacity() - dev->used_bytes();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  if (!dptr || bytes == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (CUresult r = check_unsafe_call()) return call.ret(r);
  CUresult r = alloc_device(current_device(), bytes, dptr);
  call.note("%zu bytes -> 0x%llx", bytes, r == CUDA_SUCCESS ? (unsigned long long)*dptr : 0ull);
  return call.ret(r);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("0x%llx", (unsigned long long)dptr);
  if (dptr == 0) return call.ret(CUDA_SUCCESS);
  if (CUresult r = check_unsafe_call()) return call.ret(r);
  {
    AddressSpace& as = address_space();
    std::shared_lock lock(as.mu);
    auto it = as.regions.find(uintptr_t(dptr));
    if (it == as.regions.end() || it->second.kind != RegionKind::kDevice || it->second.free_pending)
      return call.ret(CUDA_ERROR_INVALID_VALUE);
  }
  if (CUresult r = check_device_sync(nullptr)) return call.ret(r);  // it synchronizes every device
  synchronize_all_devices();
  release_device_block(uintptr_t(dptr));
  return call.ret(CUDA_SUCCESS);
}

static CUresult alloc_async(Call& call, CUdeviceptr* dptr, size_t bytes, CUstream h, bool per_thread) {
  if (!call.ok()) return call.status();
  if (!dptr || bytes == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  CUresult err;
  auto stream = resolve_stream(h, per_thread, &err);
  if (!stream) return call.ret(err);
  if (stream->capture()) {
    report_unsupported_once("cuMemAllocAsync during stream capture");
    return call.ret(CUDA_ERROR_NOT_SUPPORTED);
  }
  CUresult r = alloc_device(stream->device(), bytes, dptr);
  call.note("%zu bytes -> 0x%llx", bytes, r == CUDA_SUCCESS ? (unsigned long long)*dptr : 0ull);
  return call.ret(r);
}

static CUresult free_async(Call& call, CUdeviceptr dptr, CUstream h, bool per_thread) {
  if (!call.ok()) return call.status();
  call.note("0x%llx", (unsigned long long)dptr);
  CUresult err;
  auto stream = resolve_stream(h, per_thread, &err);
  if (!stream) return call.ret(err);
  if (stream->capture()) {
    report_unsupported_once("cuMemFreeAsync during stream capture");
    return call.ret(CUDA_ERROR_NOT_SUPPORTED);
  }
  {
    AddressSpace& as = address_space();
    std::unique_lock lock(as.mu);
    auto it = as.regions.find(uintptr_t(dptr));
    if (it == as.regions.end() || it->second.kind != RegionKind::kDevice || it->second.free_pending)
      return call.ret(CUDA_ERROR_INVALID_VALUE);
    it->second.free_pending = true;
  }
  Operation op;
  op.what = "free (stream-ordered)";
  op.run = [base = uintptr_t(dptr)] { release_device_block(base); };
  stream->enqueue(std::move(op));
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytes, CUstream h) {
  Call call(__func__);
  return alloc_async(call, dptr, bytes, h, false);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytes, CUstream h) {
  Call call(__func__);
  return alloc_async(call, dptr, bytes, h, true);
}
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream h) {
  Call call(__func__);
  return free_async(call, dptr, h, false);
}
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream h) {
  Call call(__func__);
  return free_async(call, dptr, h, true);
}

CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned int flags) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  const unsigned known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
  if (!pp || (flags & ~known)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (CUresult r = check_unsafe_call()) return call.ret(r);
  if (!lock_host_pages(pinned_host_bytes(), bytes)) {
    call.note("%zu bytes: past CUDASIM_HOST_PINNED_LIMIT", bytes);
    return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
  }
  void* p = map_anonymous(bytes, /*resident=*/!settings().unbacked);  // Note [Pinned pages are resident]
  if (!p) {
    pinned_host_bytes().fetch_sub(bytes);
    return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
  }
  Region r;
  r.base = reinterpret_cast<uintptr_t>(p);
  r.size = bytes;
  r.map_size = round_up(std::max<uint64_t>(bytes, 1), kPage);
  r.kind = RegionKind::kPinnedHost;
  r.device = current_device()->ordinal();
  r.flags = flags;
  {
    AddressSpace& as = address_space();
    std::unique_lock lock(as.mu);
    as.regions[r.base] = r;
  }
  charge_host(settings().host_costs.host_alloc_ns_per_mib * bytes / (1u << 20));
  *pp = p;
  call.note("%zu bytes -> %p", bytes, p);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemAllocHost_v2(void** pp, size_t bytes) { return cuMemHostAlloc(pp, bytes, 0); }

CUresult cuMemFreeHost(void* p) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("%p", p);
  if (!p) return call.ret(CUDA_SUCCESS);
  if (CUresult r = check_unsafe_call()) return call.ret(r);
  uint64_t map_size, size;
  {
    AddressSpace& as = address_space();
    std::shared_lock lock(as.mu);
    auto it = as.regions.find(reinterpret_cast<uintptr_t>(p));
    if (it == as.regions.end() || it->second.kind != RegionKind::kPinnedHost)
      return call.ret(CUDA_ERROR_INVALID_VALUE);
    map_size = it->second.map_size;
    size = it->second.size;
  }
  if (CUresult r = check_device_sync(nullptr)) return call.ret(r);  // it synchronizes every device
  synchronize_all_devices();
  {
    AddressSpace& as = address_space();
    std::unique_lock lock(as.mu);
    if (as.regions.erase(reinterpret_cast<uintptr_t>(p)) == 0)  // freed by another thread meanwhile
      return call.ret(CUDA_ERROR_INVALID_VALUE);
  }
  ::munmap(p, map_size);
  pinned_host_bytes().fetch_sub(size);
  charge_host(settings().host_costs.host_free_ns_per_mib * size / (1u << 20));
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned int flags) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  call.note("%p %zu bytes", p, bytes);
  if (!p || bytes == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  AddressSpace& as = address_space();
  std::unique_lock lock(as.mu);
  if (as.overlaps(reinterpret_cast<uintptr_t>(p), bytes)) return call.ret(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  if (!lock_host_pages(registered_host_bytes(), bytes)) {
    call.note("past CUDASIM_HOST_PINNED_LIMIT");
    return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
  }
  Region r;
  r.base = reinterpret_cast<uintptr_t>(p);
  r.size = bytes;
  r.map_size = 0;
  r.kind = RegionKind::kRegisteredHost;
  r.device = current_device()->ordinal();
  r.flags = flags;
  as.regions[r.base] = r;
  lock.unlock();
  if (!settings().unbacked) {  // Note [Pinned pages are resident]
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(kPage - 1);
    make_resident(reinterpret_cast<void*>(first), round_up(reinterpret_cast<uintptr_t>(p) + bytes - first, kPage));
  }
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemHostUnregister(void* p) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("%p", p);
  {
    AddressSpace& as = address_space();
    std::shared_lock lock(as.mu);
    auto it = as.regions.find(reinterpret_cast<uintptr_t>(p));
    if (it == as.regions.end() || it->second.kind != RegionKind::kRegisteredHost)
      return call.ret(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  }
  synchronize_all_devices();  // no copy still reads or writes the range
  AddressSpace& as = address_space();
  std::unique_lock lock(as.mu);
  auto it = as.regions.find(reinterpret_cast<uintptr_t>(p));
  if (it == as.regions.end() || it->second.kind != RegionKind::kRegisteredHost)  // unregistered meanwhile
    return call.ret(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  registered_host_bytes().fetch_sub(it->second.size);
  as.regions.erase(it);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* pdptr, void* p, unsigned int flags) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!pdptr || flags != 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (classify(p, 1).type != PointerInfo::Type::kPinnedHost) return call.ret(CUDA_ERROR_INVALID_VALUE);
  *pdptr = reinterpret_cast<CUdeviceptr>(p);  // unified addressing: the same address
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemHostGetFlags(unsigned int* flags, void* p) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!flags) return call.ret(CUDA_ERROR_INVALID_VALUE);
  AddressSpace& as = address_space();
  std::shared_lock lock(as.mu);
  Region* r = as.find(reinterpret_cast<uintptr_t>(p));
  if (!r || r->kind != RegionKind::kPinnedHost) return call.ret(CUDA_ERROR_INVALID_VALUE);
  *flags = r->flags;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  PointerInfo info = classify(reinterpret_cast<void*>(dptr), 1);
  if (info.type != PointerInfo::Type::kDevice) return call.ret(CUDA_ERROR_NOT_FOUND);
  if (pbase) *pbase = info.base;
  if (psize) *psize = info.size;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attr, CUdeviceptr ptr) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!data) return call.ret(CUDA_ERROR_INVALID_VALUE);
  PointerInfo info = classify(reinterpret_cast<void*>(ptr), 1);
  if (info.type == PointerInfo::Type::kPageableHost || info.type == PointerInfo::Type::kUnmappedDevice)
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (info.host_located) {
    // Which memory type, device and context a GPU reports for host-located VMM memory is
    // not documented.
    report_unsupported_once("cuPointerGetAttribute on host-located VMM memory");
    return call.ret(CUDA_ERROR_NOT_SUPPORTED);
  }
  const bool dev = info.type == PointerInfo::Type::kDevice;
  switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      *static_cast<CUcontext*>(data) = device(info.device)->primary_context();
      break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      *static_cast<unsigned*>(data) = dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      *static_cast<CUdeviceptr*>(data) = ptr;
      break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      if (dev) return call.ret(CUDA_ERROR_INVALID_VALUE);
      *static_cast<void**>(data) = reinterpret_cast<void*>(ptr);
      break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      *static_cast<unsigned*>(data) = 0;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      *static_cast<int*>(data) = info.device;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      *static_cast<CUdeviceptr*>(data) = info.base;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      *static_cast<size_t*>(data) = info.size;
      break;
    case CU_POINTER_ATTRIBUTE_MAPPED:
      *static_cast<unsigned*>(data) = 1;
      break;
    default:
      report_unsupported_once("cuPointerGetAttribute with this attribute");
      return call.ret(CUDA_ERROR_NOT_SUPPORTED);
  }
  return call.ret(CUDA_SUCCESS);
}

// ---- Copies and memsets: each in its default-stream and per-thread-stream forms --------

// args: (dst, src, n, stream, per_thread_default, synchronous_call, dst_must_be_device,
// src_must_be_device)
#define CUDASIM_COPY(name, sig, args)      \
  CUresult name sig {                      \
    Call call(#name);                      \
    if (!call.ok()) return call.status();  \
    call.note("%zu bytes", n);             \
    return call.ret(copy args);            \
  }

// clang-format off
CUDASIM_COPY(cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t n),
             ((void*)dst, (const void*)src, n, nullptr, false, true, -1, -1))
CUDASIM_COPY(cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n),
             ((void*)dst, (const void*)src, n, nullptr, true, true, -1, -1))
CUDASIM_COPY(cuMemcpyAsync, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h),
             ((void*)dst, (const void*)src, n, h, false, false, -1, -1))
CUDASIM_COPY(cuMemcpyAsync_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h),
             ((void*)dst, (const void*)src, n, h, true, false, -1, -1))
CUDASIM_COPY(cuMemcpyHtoD_v2, (CUdeviceptr dst, const void* src, size_t n),
             ((void*)dst, src, n, nullptr, false, true, 1, -1))
CUDASIM_COPY(cuMemcpyHtoD_v2_ptds, (CUdeviceptr dst, const void* src, size_t n),
             ((void*)dst, src, n, nullptr, true, true, 1, -1))
CUDASIM_COPY(cuMemcpyDtoH_v2, (void* dst, CUdeviceptr src, size_t n),
             (dst, (const void*)src, n, nullptr, false, true, -1, 1))
CUDASIM_COPY(cuMemcpyDtoH_v2_ptds, (void* dst, CUdeviceptr src, size_t n),
             (dst, (const void*)src, n, nullptr, true, true, -1, 1))
CUDASIM_COPY(cuMemcpyDtoD_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n),
             ((void*)dst, (const void*)src, n, nullptr, false, true, 1, 1))
CUDASIM_COPY(cuMemcpyDtoD_v2_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n),
             ((void*)dst, (const void*)src, n, nullptr, true, true, 1, 1))
CUDASIM_COPY(cuMemcpyHtoDAsync_v2, (CUdeviceptr dst, const void* src, size_t n, CUstream h),
             ((void*)dst, src, n, h, false, false, 1, -1))
CUDASIM_COPY(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr dst, const void* src, size_t n, CUstream h),
             ((void*)dst, src, n, h, true, false, 1, -1))
CUDASIM_COPY(cuMemcpyDtoHAsync_v2, (void* dst, CUdeviceptr src, size_t n, CUstream h),
             (dst, (const void*)src, n, h, false, false, -1, 1))
CUDASIM_COPY(cuMemcpyDtoHAsync_v2_ptsz, (void* dst, CUdeviceptr src, size_t n, CUstream h),
             (dst, (const void*)src, n, h, true, false, -1, 1))
CUDASIM_COPY(cuMemcpyDtoDAsync_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h),
             ((void*)dst, (const void*)src, n, h, false, false, 1, 1))
CUDASIM_COPY(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h),
             ((void*)dst, (const void*)src, n, h, true, false, 1, 1))
// clang-format on
#undef CUDASIM_COPY

#define CUDASIM_MEMSET(name, type, elem, sync, per_thread)                                                 \
  CUresult name(CUdeviceptr dst, type value, size_t n) {                                                   \
    Call call(#name);                                                                                      \
    if (!call.ok()) return call.status();                                                                  \
    return call.ret(memset_elements((void*)dst, uint32_t(value), elem, n, nullptr, per_thread, sync));     \
  }
#define CUDASIM_MEMSET_ASYNC(name, type, elem, per_thread)                                                  \
  CUresult name(CUdeviceptr dst, type value, size_t n, CUstream h) {                                       \
    Call call(#name);                                                                                      \
    if (!call.ok()) return call.status();                                                                  \
    return call.ret(memset_elements((void*)dst, uint32_t(value), elem, n, h, per_thread, false));          \
  }

CUDASIM_MEMSET(cuMemsetD8_v2, unsigned char, 1, true, false)
CUDASIM_MEMSET(cuMemsetD8_v2_ptds, unsigned char, 1, true, true)
CUDASIM_MEMSET(cuMemsetD16_v2, unsigned short, 2, true, false)
CUDASIM_MEMSET(cuMemsetD16_v2_ptds, unsigned short, 2, true, true)
CUDASIM_MEMSET(cuMemsetD32_v2, unsigned int, 4, true, false)
CUDASIM_MEMSET(cuMemsetD32_v2_ptds, unsigned int, 4, true, true)
CUDASIM_MEMSET_ASYNC(cuMemsetD8Async, unsigned char, 1, false)
CUDASIM_MEMSET_ASYNC(cuMemsetD8Async_ptsz, unsigned char, 1, true)
CUDASIM_MEMSET_ASYNC(cuMemsetD16Async, unsigned short, 2, false)
CUDASIM_MEMSET_ASYNC(cuMemsetD16Async_ptsz, unsigned short, 2, true)
CUDASIM_MEMSET_ASYNC(cuMemsetD32Async, unsigned int, 4, false)
CUDASIM_MEMSET_ASYNC(cuMemsetD32Async_ptsz, unsigned int, 4, true)
#undef CUDASIM_MEMSET
#undef CUDASIM_MEMSET_ASYNC

}  // extern "C"
