// cudasim's unified address space: every range the driver handed out, by start address.
//
// Kinds: device blocks (cuMemAlloc / cudaMalloc / cuMemAllocAsync: anonymous mappings,
// host-accessible so that CPU code can stand in for kernels), VMM reservations (PROT_NONE
// until cuMemMap maps memfd pages with MAP_FIXED; cuMemSetAccess is mprotect), pinned
// host memory (cuMemHostAlloc) and registered host ranges (cuMemHostRegister).
//
// A reservation's mappings are of device memory or of host-located memory (cuMemCreate with
// a host location), side by side in one reservation as on a GPU. The host's view of a
// mapping (its mprotect, view_of) is what CPU code standing in for kernels may do: for
// device memory the owning device's access; for host-located memory what any device was
// granted. CPU code cannot be told apart from a kernel's stand-in, so a host-located
// mapping's grant to the host itself (a CU_MEM_LOCATION_TYPE_HOST_NUMA access descriptor)
// is kept and reported but opens nothing: the devices' grants decide.
//
// Invariants: regions never overlap; a reservation's mappings lie inside it, never
// overlap, and each covers whole granules; a VA that is not inside a mapping whose view
// allows access is PROT_NONE, so touching it raises SIGSEGV as a GPU raises an illegal
// address.
//
// Thread safety: one shared mutex guards the map; lookups take it shared, changes take
// it exclusively. No stream work runs under it.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <map>
#include <shared_mutex>

namespace cudasim {

enum class RegionKind { kDevice, kReservation, kPinnedHost, kRegisteredHost };

struct Mapping {
  uint64_t size = 0;
  uint64_t physical_id = 0;                       // the CUmemGenericAllocationHandle
  int device = 0;                                 // the owning device; -1: host-located memory
  // The owner's access: the owning device's (the host's view of device memory), or for
  // host-located memory the host's own grant (a CU_MEM_LOCATION_TYPE_HOST_NUMA descriptor).
  CUmemAccess_flags access = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  uint32_t peer_read = 0, peer_write = 0;  // other devices granted access: device_bit(d)

  bool on_host() const { return device < 0; }
};

// Device `d`'s bit in a mask of devices (0 for a device past the 32 a mask holds).
inline uint32_t device_bit(int d) { return d >= 0 && d < 32 ? 1u << d : 0; }

// The access `device` has to mapping `m` (cuMemGetAccess's answer), and setting it
// (cuMemSetAccess): the owning device's is the host's view, the others' are kept per device.
inline CUmemAccess_flags access_of(const Mapping& m, int device) {
  if (device == m.device) return m.access;
  const uint32_t bit = device_bit(device);
  return (m.peer_write & bit)  ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
         : (m.peer_read & bit) ? CU_MEM_ACCESS_FLAGS_PROT_READ
                               : CU_MEM_ACCESS_FLAGS_PROT_NONE;
}
inline void set_access_of(Mapping& m, int device, CUmemAccess_flags flags) {
  if (device == m.device) {
    m.access = flags;
    return;
  }
  const uint32_t bit = device_bit(device);
  m.peer_read = flags != CU_MEM_ACCESS_FLAGS_PROT_NONE ? m.peer_read | bit : m.peer_read & ~bit;
  m.peer_write = flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? m.peer_write | bit : m.peer_write & ~bit;
}

// Whether `flags` allow a read, or with `write` a write.
inline bool permits(CUmemAccess_flags flags, bool write) {
  return flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE || (!write && flags == CU_MEM_ACCESS_FLAGS_PROT_READ);
}

// The host's view of mapping `m` (its mprotect): the owning device's access, or for
// host-located memory the most any device was granted (see the top of this file).
inline CUmemAccess_flags view_of(const Mapping& m) {
  if (!m.on_host()) return m.access;
  return m.peer_write  ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
         : m.peer_read ? CU_MEM_ACCESS_FLAGS_PROT_READ
                       : CU_MEM_ACCESS_FLAGS_PROT_NONE;
}

struct Region {
  uintptr_t base = 0;
  uint64_t size = 0;        // bytes the program asked for (reservations: the reserved size)
  uint64_t map_size = 0;    // bytes actually mmapped
  RegionKind kind = RegionKind::kDevice;
  int device = 0;
  unsigned flags = 0;       // host allocation / registration flags
  uint64_t charged = 0;     // bytes charged against the device's capacity
  bool free_pending = false;  // cuMemFreeAsync queued
  std::map<uintptr_t, Mapping> mappings;  // reservations only: by start address
};

struct AddressSpace {
  std::shared_mutex mu;
  std::map<uintptr_t, Region> regions;

  // The region containing `addr`, or nullptr. Caller holds mu.
  Region* find(uintptr_t addr);
  // True when [base, base+size) intersects a region. Caller holds mu.
  bool overlaps(uintptr_t base, uint64_t size);
};

AddressSpace& address_space();

// What a pointer range is, for copies, memsets and cuPointerGetAttribute.
struct PointerInfo {
  enum class Type { kPageableHost, kPinnedHost, kDevice, kUnmappedDevice } type = Type::kPageableHost;
  int device = -1;
  uintptr_t base = 0;   // start of the allocation (device blocks, host allocations)
  uint64_t size = 0;    // its size
  bool range_ok = true; // [ptr, ptr+bytes) lies inside the allocation (device: inside mapped memory)
  // kDevice only: the whole range lies in mappings of host-located memory. Such a range is
  // a device address like any VMM mapping (copies and memsets accept it as device memory,
  // and it follows their rules for device memory), but its bytes cross the link: copies
  // count and time it as host memory. device is -1 then.
  bool host_located = false;
};

// Classifies [ptr, ptr+bytes). A device range must lie inside one device block or inside
// contiguous mappings of one reservation, else range_ok is false.
PointerInfo classify(const void* ptr, uint64_t bytes);

// For an operation that does not touch the bytes (CUDASIM_UNBACKED): the first address of
// the device range [ptr, ptr+bytes) that the host may not read (or, with `write`, write):
// inside a reservation but not mapped, or mapped without that access in the host's view
// (view_of); `ptr` itself when
// the range is no longer known at all (its block was freed). 0 when the whole range may
// be touched.
uintptr_t first_inaccessible(const void* ptr, uint64_t bytes, bool write);

// For work queued on a stream of `device`: the first address of [ptr, ptr+bytes) in a
// mapping of another device, or of host-located memory, to which `device` was not granted
// the access (cuMemSetAccess grants each device its own), or 0. Memory from cuMemAlloc is
// not checked (a copy between devices is staged by the driver where peers cannot reach each
// other).
uintptr_t first_inaccessible_to(int device, const void* ptr, uint64_t bytes, bool write);

}  // namespace cudasim
