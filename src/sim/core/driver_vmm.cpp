// Driver API: virtual memory management (CUDA VMM), emulated with mmap.
//
//   cuMemAddressReserve  mmap PROT_NONE (anonymous, MAP_NORESERVE), aligned to 2 MiB
//   cuMemCreate          an extent of the device's memfd, charged against its capacity
//   cuMemMap             mmap of that extent with MAP_FIXED|MAP_SHARED, still PROT_NONE
//   cuMemSetAccess       mprotect to PROT_READ or PROT_READ|PROT_WRITE
//   cuMemUnmap           mmap PROT_NONE over the range again: the VA stays reserved
//
// So a touch of VA that is unmapped or has no access raises SIGSEGV, as a GPU raises an
// illegal address. The API's own rules are enforced with its error codes: sizes,
// addresses and offsets in granules, offset 0, no mapping over a mapped range, no unmap
// of part of a mapping, no access change on a range that is not fully mapped.
//
// cuMemUnmap does not wait for queued work: a copy still reading the range faults. That
// is the strict reading of CUDA's rules, and what lets tests catch an unmap that was not
// ordered after the work using the range.
//
// Thread safety: the address space lock (exclusive) is taken before the physical-handle
// lock; no stream work runs under either.
#include <cuda.h>
#include <sys/mman.h>

#include <cstring>

#include "address_space.h"
#include "api.h"
#include "config/units.h"
#include "virtual_time.h"

namespace cudasim {
namespace {

bool granular(uint64_t v) { return v % kGranularity == 0; }

int prot_of(CUmemAccess_flags f) {
  switch (f) {
    case CU_MEM_ACCESS_FLAGS_PROT_READ: return PROT_READ;
    case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: return PROT_READ | PROT_WRITE;
    default: return PROT_NONE;
  }
}

// Checks an allocation's properties; returns the device or sets *err.
Device* check_prop(const CUmemAllocationProp* prop, CUresult* err) {
  *err = CUDA_SUCCESS;
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) {
    *err = CUDA_ERROR_INVALID_VALUE;
    return nullptr;
  }
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    report_unsupported_once("VMM allocations located anywhere but on a device");
    *err = CUDA_ERROR_NOT_SUPPORTED;
    return nullptr;
  }
  Device* dev = device(prop->location.id);
  if (!dev) *err = CUDA_ERROR_INVALID_DEVICE;
  return dev;
}

// The reservation holding [ptr, ptr+size) entirely, or nullptr. Caller holds as.mu.
Region* reservation_of(AddressSpace& as, uintptr_t ptr, uint64_t size) {
  Region* r = as.find(ptr);
  if (!r || r->kind != RegionKind::kReservation || ptr + size > r->base + r->size) return nullptr;
  return r;
}

// The mappings that exactly tile [ptr, ptr+size) (whole mappings, no gaps), or an empty
// list. Caller holds as.mu.
std::vector<std::map<uintptr_t, Mapping>::iterator> exact_mappings(Region& r, uintptr_t ptr, uint64_t size) {
  std::vector<std::map<uintptr_t, Mapping>::iterator> out;
  auto it = r.mappings.find(ptr);
  uintptr_t at = ptr;
  while (it != r.mappings.end() && it->first == at && at < ptr + size) {
    out.push_back(it);
    at += it->second.size;
    ++it;
  }
  if (at != ptr + size) out.clear();
  return out;
}

// Frees a physical allocation whose counts both reached 0. Caller holds physical_mu.
void maybe_free(Driver* drv, std::map<uint64_t, PhysicalAlloc>::iterator it) {
  if (it->second.mappings > 0 || it->second.handle_refs > 0) return;
  device(it->second.device)->free_physical(it->second.file_offset, it->second.size);
  drv->physical.erase(it);
}

}  // namespace
}  // namespace cudasim

using namespace cudasim;

extern "C" {

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!granularity) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  CUresult err;
  if (!check_prop(prop, &err)) return call.ret(err);
  *granularity = kGranularity;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("%zu bytes, alignment %zu", size, alignment);
  if (!ptr || size == 0 || size % 4096 || flags != 0 || addr % 4096) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (alignment & (alignment - 1)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  const uint64_t align = std::max<uint64_t>(alignment, kGranularity);
  const int mflags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  void* p = MAP_FAILED;
  if (addr) {  // a hint: honoured when that exact, aligned range is free
    p = ::mmap(reinterpret_cast<void*>(addr), size, PROT_NONE, mflags | MAP_FIXED_NOREPLACE, -1, 0);
    if (p != MAP_FAILED && (reinterpret_cast<uintptr_t>(p) % align || reinterpret_cast<uintptr_t>(p) != addr)) {
      ::munmap(p, size);
      p = MAP_FAILED;
    }
  }
  if (p == MAP_FAILED) {
    void* raw = ::mmap(nullptr, size + align, PROT_NONE, mflags, -1, 0);
    if (raw == MAP_FAILED) return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t start = vramswap::round_up(reinterpret_cast<uintptr_t>(raw), align);
    uintptr_t head = start - reinterpret_cast<uintptr_t>(raw);
    if (head) ::munmap(raw, head);
    if (align - head) ::munmap(reinterpret_cast<void*>(start + size), align - head);
    p = reinterpret_cast<void*>(start);
  }
  Region r;
  r.base = reinterpret_cast<uintptr_t>(p);
  r.size = size;
  r.map_size = size;
  r.kind = RegionKind::kReservation;
  {
    AddressSpace& as = address_space();
    std::unique_lock lock(as.mu);
    as.regions[r.base] = r;
  }
  *ptr = r.base;
  call.note("%zu bytes -> 0x%llx", size, (unsigned long long)r.base);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("0x%llx %zu bytes", (unsigned long long)ptr, size);
  AddressSpace& as = address_space();
  std::unique_lock lock(as.mu);
  auto it = as.regions.find(uintptr_t(ptr));
  if (it == as.regions.end() || it->second.kind != RegionKind::kReservation || it->second.size != size)
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  // Still mapped: the program lost track of physical memory. CUDA leaves this undefined;
  // cudasim refuses it so that the leak is seen.
  if (!it->second.mappings.empty()) return call.ret(CUDA_ERROR_INVALID_VALUE);
  ::munmap(reinterpret_cast<void*>(ptr), size);
  as.regions.erase(it);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("%zu bytes", size);
  if (!handle || flags != 0 || size == 0 || !granular(size)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  CUresult err;
  Device* dev = check_prop(prop, &err);
  if (!dev) return call.ret(err);
  uint64_t offset;
  if (!dev->allocate_physical(size, &offset)) return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
  Driver* drv = driver();
  std::lock_guard lock(drv->physical_mu);
  PhysicalAlloc a;
  a.id = drv->next_physical_id++;
  a.device = dev->ordinal();
  a.size = size;
  a.file_offset = offset;
  drv->physical[a.id] = a;
  *handle = a.id;
  call.note("%zu bytes -> handle 0x%llx", size, (unsigned long long)a.id);
  charge_host(settings().host_costs.mem_create_ns);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("handle 0x%llx", (unsigned long long)handle);
  Driver* drv = driver();
  std::lock_guard lock(drv->physical_mu);
  auto it = drv->physical.find(handle);
  if (it == drv->physical.end() || it->second.handle_refs == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  --it->second.handle_refs;
  maybe_free(drv, it);
  charge_host(settings().host_costs.mem_release_ns);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!handle) return call.ret(CUDA_ERROR_INVALID_VALUE);
  AddressSpace& as = address_space();
  std::shared_lock lock(as.mu);
  Region* r = as.find(reinterpret_cast<uintptr_t>(addr));
  if (!r || r->kind != RegionKind::kReservation) return call.ret(CUDA_ERROR_INVALID_VALUE);
  auto it = r->mappings.upper_bound(reinterpret_cast<uintptr_t>(addr));
  if (it == r->mappings.begin()) return call.ret(CUDA_ERROR_INVALID_VALUE);
  --it;
  if (reinterpret_cast<uintptr_t>(addr) >= it->first + it->second.size) return call.ret(CUDA_ERROR_INVALID_VALUE);
  Driver* drv = driver();
  std::lock_guard plock(drv->physical_mu);
  ++drv->physical.at(it->second.physical_id).handle_refs;
  *handle = it->second.physical_id;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!prop) return call.ret(CUDA_ERROR_INVALID_VALUE);
  Driver* drv = driver();
  std::lock_guard lock(drv->physical_mu);
  auto it = drv->physical.find(handle);
  if (it == drv->physical.end() || it->second.handle_refs == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  std::memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = it->second.device;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("0x%llx %zu bytes, handle 0x%llx", (unsigned long long)ptr, size, (unsigned long long)handle);
  if (flags != 0 || offset != 0 || size == 0 || !granular(ptr) || !granular(size))
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  AddressSpace& as = address_space();
  std::unique_lock lock(as.mu);
  Region* r = reservation_of(as, uintptr_t(ptr), size);
  if (!r) return call.ret(CUDA_ERROR_INVALID_VALUE);
  // No overlap with an existing mapping.
  auto next = r->mappings.lower_bound(uintptr_t(ptr));
  if (next != r->mappings.end() && next->first < ptr + size) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (next != r->mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > ptr) return call.ret(CUDA_ERROR_INVALID_VALUE);
  }
  Driver* drv = driver();
  std::lock_guard plock(drv->physical_mu);
  auto it = drv->physical.find(handle);
  if (it == drv->physical.end() || it->second.handle_refs == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  PhysicalAlloc& a = it->second;
  if (offset + size > a.size) return call.ret(CUDA_ERROR_INVALID_VALUE);
  Device* dev = device(a.device);
  void* p = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, dev->memfd(),
                   off_t(a.file_offset + offset));
  if (p == MAP_FAILED) return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
  Mapping m;
  m.size = size;
  m.physical_id = a.id;
  m.device = a.device;
  r->mappings[uintptr_t(ptr)] = m;
  ++a.mappings;
  dev->counters().mapped_bytes.fetch_add(size);
  charge_host(settings().host_costs.mem_map_ns);
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("0x%llx %zu bytes", (unsigned long long)ptr, size);
  if (size == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  AddressSpace& as = address_space();
  std::unique_lock lock(as.mu);
  Region* r = reservation_of(as, uintptr_t(ptr), size);
  if (!r) return call.ret(CUDA_ERROR_INVALID_VALUE);
  auto tiles = exact_mappings(*r, uintptr_t(ptr), size);
  if (tiles.empty()) return call.ret(CUDA_ERROR_INVALID_VALUE);  // a sub-range, or not all mapped
  // Back to a plain reservation: no access, no pages.
  ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
         0);
  Driver* drv = driver();
  std::lock_guard plock(drv->physical_mu);
  for (auto& t : tiles) {
    auto it = drv->physical.find(t->second.physical_id);
    device(t->second.device)->counters().mapped_bytes.fetch_sub(t->second.size);
    --it->second.mappings;
    maybe_free(drv, it);
    r->mappings.erase(t);
  }
  charge_host(settings().host_costs.mem_unmap_ns * tiles.size());
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("0x%llx %zu bytes", (unsigned long long)ptr, size);
  if (!desc || count == 0 || size == 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      report_unsupported_once("cuMemSetAccess for locations other than devices");
      return call.ret(CUDA_ERROR_NOT_SUPPORTED);
    }
    if (!device(desc[i].location.id)) return call.ret(CUDA_ERROR_INVALID_DEVICE);
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      return call.ret(CUDA_ERROR_INVALID_VALUE);
  }
  AddressSpace& as = address_space();
  std::unique_lock lock(as.mu);
  Region* r = reservation_of(as, uintptr_t(ptr), size);
  if (!r) return call.ret(CUDA_ERROR_INVALID_VALUE);
  auto tiles = exact_mappings(*r, uintptr_t(ptr), size);
  if (tiles.empty()) return call.ret(CUDA_ERROR_INVALID_VALUE);
  // The host stands in for the owning device: the access that device was given applies to
  // the host's view. Other devices' grants are kept per device and checked by the copies and
  // memsets queued on their streams (first_inaccessible_to).
  for (auto& t : tiles) {
    Mapping& m = t->second;
    for (size_t i = 0; i < count; ++i) set_access_of(m, desc[i].location.id, desc[i].flags);
    ::mprotect(reinterpret_cast<void*>(t->first), m.size, prot_of(m.access));
  }
  charge_host(settings().host_costs.mem_set_access_ns * tiles.size());
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!flags || !location || location->type != CU_MEM_LOCATION_TYPE_DEVICE) return call.ret(CUDA_ERROR_INVALID_VALUE);
  AddressSpace& as = address_space();
  std::shared_lock lock(as.mu);
  Region* r = as.find(uintptr_t(ptr));
  if (!r || r->kind != RegionKind::kReservation) return call.ret(CUDA_ERROR_INVALID_VALUE);
  auto it = r->mappings.upper_bound(uintptr_t(ptr));
  if (it == r->mappings.begin() || std::prev(it)->first + std::prev(it)->second.size <= ptr)
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  --it;
  *flags = access_of(it->second, location->id);
  return call.ret(CUDA_SUCCESS);
}

}  // extern "C"
