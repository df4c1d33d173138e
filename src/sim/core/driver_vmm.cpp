// Driver API: virtual memory management (CUDA VMM), emulated with mmap.
//
//   cuMemAddressReserve  mmap PROT_NONE (anonymous, MAP_NORESERVE), aligned to 2 MiB
//   cuMemCreate          an extent of the device's memfd, charged against its capacity; or,
//                        for a host location, an extent of the host's memfd (host_memory()),
//                        counted as pinned host memory and resident at once
//   cuMemMap             mmap of that extent with MAP_FIXED|MAP_SHARED, still PROT_NONE
//   cuMemSetAccess       mprotect to PROT_READ or PROT_READ|PROT_WRITE (the host's view:
//                        address_space.h, view_of)
//   cuMemUnmap           mmap PROT_NONE over the range again: the VA stays reserved
//
// So a touch of VA that is unmapped or has no access raises SIGSEGV, as a GPU raises an
// illegal address. The API's own rules are enforced with its error codes: sizes,
// addresses and offsets in granules, offset 0, no mapping over a mapped range, no unmap
// of part of a mapping, no access change on a range that is not fully mapped.
//
// Host-located physical memory (cuda.h, cuMemCreate): CU_MEM_LOCATION_TYPE_HOST (the id is
// ignored; requestedHandleTypes must be 0, else CUDA_ERROR_INVALID_VALUE) and
// CU_MEM_LOCATION_TYPE_HOST_NUMA with a NUMA node's id (cudasim's host has one node, 0; on a
// host without NUMA the id must be 0, so any other id is CUDA_ERROR_INVALID_VALUE).
// CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT is CUDA_ERROR_INVALID_VALUE, as the header says. A
// driver without host-located VMM (CUDASIM_HOST_VMM=0, where the device attributes
// HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED and HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
// read 0) answers CUDA_ERROR_NOT_SUPPORTED, cuda.h's code for "not supported on the current
// system or device" and one cuMemCreate documents; a program asks the attribute first.
// cuMemSetAccess grants devices access to such memory as to device memory, and the host
// with a CU_MEM_LOCATION_TYPE_HOST_NUMA descriptor (id ignored), which the header allows on
// host-located allocations only: over a range that maps any device memory it is
// CUDA_ERROR_INVALID_VALUE.
//
// cuMemUnmap does not wait for queued work: a copy still reading the range faults. That
// is the strict reading of CUDA's rules, and what lets tests catch an unmap that was not
// ordered after the work using the range.
//
// Thread safety: the address space lock (exclusive) is taken before the physical-handle
// lock; no stream work runs under either.
#include <cuda.h>
#include <fcntl.h>
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

// Where an allocation's properties place its memory: on `device`, or on the host (device
// null) at `location` / `location_id`.
struct Placement {
  Device* device = nullptr;
  CUmemLocationType location = CU_MEM_LOCATION_TYPE_DEVICE;
  int location_id = 0;
};

// Checks an allocation's properties (see the top of this file for host locations); fills
// *out, or returns the error.
CUresult check_prop(const CUmemAllocationProp* prop, Placement* out) {
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  out->location = prop->location.type;
  out->location_id = prop->location.id;
  switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      out->device = device(prop->location.id);
      return out->device ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
    case CU_MEM_LOCATION_TYPE_HOST:
      if (!settings().host_vmm) return CUDA_ERROR_NOT_SUPPORTED;
      // HOST allocations are not IPC capable: no shareable handle type.
      return prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_NONE ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
      if (!settings().host_vmm) return CUDA_ERROR_NOT_SUPPORTED;
      return prop->location.id == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
      return CUDA_ERROR_INVALID_VALUE;
    default:
      report_unsupported_once("VMM allocations located anywhere but on a device or the host");
      return CUDA_ERROR_NOT_SUPPORTED;
  }
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

// Physical memory on the host: an extent of host_memory(), counted as pinned host memory
// (CUDASIM_HOST_PINNED_LIMIT applies) and resident from the start, as the driver pins it
// (driver_memory.cpp, Note [Pinned pages are resident]; not under CUDASIM_UNBACKED). False,
// with nothing held, when it cannot be had.
bool allocate_on_host(uint64_t size, uint64_t* offset) {
  if (!lock_host_pages(pinned_host_bytes(), size)) return false;
  MemoryFile& file = host_memory();
  if (!file.allocate(size, offset)) {
    pinned_host_bytes().fetch_sub(size);
    return false;
  }
  if (!settings().unbacked && ::fallocate(file.fd(), 0, off_t(*offset), off_t(size)) != 0) {
    file.free(*offset, size);
    pinned_host_bytes().fetch_sub(size);
    return false;
  }
  return true;
}

// Frees a physical allocation whose counts both reached 0. Caller holds physical_mu.
void maybe_free(Driver* drv, std::map<uint64_t, PhysicalAlloc>::iterator it) {
  const PhysicalAlloc& a = it->second;
  if (a.mappings > 0 || a.handle_refs > 0) return;
  if (a.on_host()) {
    host_memory().free(a.file_offset, a.size);
    pinned_host_bytes().fetch_sub(a.size);
  } else {
    device(a.device)->free_physical(a.file_offset, a.size);
  }
  drv->physical.erase(it);
}

// The memory file behind a physical allocation.
int memory_fd_of(const PhysicalAlloc& a) { return a.on_host() ? host_memory().fd() : device(a.device)->memfd(); }

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
  Placement place;
  if (CUresult err = check_prop(prop, &place)) return call.ret(err);
  *granularity = kGranularity;  // host-located memory's too
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
  Placement place;
  if (CUresult err = check_prop(prop, &place)) return call.ret(err);
  uint64_t offset;
  if (place.device ? !place.device->allocate_physical(size, &offset) : !allocate_on_host(size, &offset))
    return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
  Driver* drv = driver();
  std::lock_guard lock(drv->physical_mu);
  PhysicalAlloc a;
  a.id = drv->next_physical_id++;
  a.device = place.device ? place.device->ordinal() : -1;
  a.location = place.location;
  a.location_id = place.location_id;
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
  prop->location.type = it->second.location;
  prop->location.id = it->second.location_id;  // for CU_MEM_LOCATION_TYPE_HOST, the id it was given
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
  void* p = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, memory_fd_of(a),
                   off_t(a.file_offset + offset));
  if (p == MAP_FAILED) return call.ret(CUDA_ERROR_OUT_OF_MEMORY);
  Mapping m;
  m.size = size;
  m.physical_id = a.id;
  m.device = a.device;
  r->mappings[uintptr_t(ptr)] = m;
  ++a.mappings;
  if (!a.on_host()) device(a.device)->counters().mapped_bytes.fetch_add(size);
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
    if (!t->second.on_host()) device(t->second.device)->counters().mapped_bytes.fetch_sub(t->second.size);
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
  bool to_host = false;  // a descriptor grants the host itself access
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
      to_host = true;  // its id is ignored
    } else if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      report_unsupported_once("cuMemSetAccess for locations other than devices and CU_MEM_LOCATION_TYPE_HOST_NUMA");
      return call.ret(CUDA_ERROR_NOT_SUPPORTED);
    } else if (!device(desc[i].location.id)) {
      return call.ret(CUDA_ERROR_INVALID_DEVICE);
    }
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
  // "Users cannot specify CU_MEM_LOCATION_TYPE_HOST_NUMA accessibility for allocations
  // created on with other location types."
  if (to_host)
    for (auto& t : tiles)
      if (!t->second.on_host()) return call.ret(CUDA_ERROR_INVALID_VALUE);
  // Device memory: the host stands in for the owning device, so the access that device was
  // given applies to the host's view. Other devices' grants are kept per device and checked
  // by the copies and memsets queued on their streams (first_inaccessible_to). Host-located
  // memory: every device's grant is kept that way, the host's own in `access`, and the
  // host's view is what the devices were granted (address_space.h, view_of).
  for (auto& t : tiles) {
    Mapping& m = t->second;
    for (size_t i = 0; i < count; ++i) {
      if (desc[i].location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) m.access = desc[i].flags;
      else set_access_of(m, desc[i].location.id, desc[i].flags);
    }
    ::mprotect(reinterpret_cast<void*>(t->first), m.size, prot_of(view_of(m)));
  }
  charge_host(settings().host_costs.mem_set_access_ns * tiles.size());
  return call.ret(CUDA_SUCCESS);
}

CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!flags || !location) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (location->type != CU_MEM_LOCATION_TYPE_DEVICE && location->type != CU_MEM_LOCATION_TYPE_HOST_NUMA)
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (location->type == CU_MEM_LOCATION_TYPE_DEVICE && !device(location->id))
    return call.ret(CUDA_ERROR_INVALID_DEVICE);
  AddressSpace& as = address_space();
  std::shared_lock lock(as.mu);
  Region* r = as.find(uintptr_t(ptr));
  if (!r || r->kind != RegionKind::kReservation) return call.ret(CUDA_ERROR_INVALID_VALUE);
  auto it = r->mappings.upper_bound(uintptr_t(ptr));
  if (it == r->mappings.begin() || std::prev(it)->first + std::prev(it)->second.size <= ptr)
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  --it;
  if (location->type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
    // The host's own grant exists for host-located memory only.
    if (!it->second.on_host()) return call.ret(CUDA_ERROR_INVALID_VALUE);
    *flags = it->second.access;
  } else {
    *flags = access_of(it->second, location->id);
  }
  return call.ret(CUDA_SUCCESS);
}

}  // extern "C"
