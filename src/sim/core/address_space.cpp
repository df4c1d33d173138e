// The address space registry and pointer classification. See address_space.h.
#include "address_space.h"

#include <algorithm>

namespace cudasim {

AddressSpace& address_space() {
  static AddressSpace* space = new AddressSpace;  // leaked on purpose: used during exit
  return *space;
}

Region* AddressSpace::find(uintptr_t addr) {
  auto it = regions.upper_bound(addr);
  if (it == regions.begin()) return nullptr;
  --it;
  Region& r = it->second;
  uint64_t extent = r.kind == RegionKind::kReservation ? r.map_size : r.size;
  if (extent == 0) extent = 1;  // a zero-byte allocation still names its address
  return addr - r.base < extent ? &r : nullptr;
}

bool AddressSpace::overlaps(uintptr_t base, uint64_t size) {
  auto it = regions.lower_bound(base + size);
  if (it == regions.begin()) return false;
  --it;
  const Region& r = it->second;
  uint64_t extent = r.kind == RegionKind::kReservation ? r.map_size : std::max<uint64_t>(r.size, 1);
  return r.base + extent > base;
}

PointerInfo classify(const void* ptr, uint64_t bytes) {
  PointerInfo info;
  auto addr = reinterpret_cast<uintptr_t>(ptr);
  AddressSpace& as = address_space();
  std::shared_lock lock(as.mu);
  Region* r = as.find(addr);
  if (!r) return info;  // pageable host memory
  info.device = r->device;
  info.base = r->base;
  info.size = r->size;
  uint64_t end = addr + bytes;
  switch (r->kind) {
    case RegionKind::kPinnedHost:
    case RegionKind::kRegisteredHost:
      info.type = PointerInfo::Type::kPinnedHost;
      info.range_ok = end <= r->base + r->size;
      return info;
    case RegionKind::kDevice:
      info.type = PointerInfo::Type::kDevice;
      info.range_ok = end <= r->base + r->size && !r->free_pending;
      return info;
    case RegionKind::kReservation: {
      // Walk the mappings from the one containing addr; they must cover [addr, end).
      auto it = r->mappings.upper_bound(addr);
      if (it == r->mappings.begin() || std::prev(it)->first + std::prev(it)->second.size <= addr) {
        info.type = PointerInfo::Type::kUnmappedDevice;
        info.range_ok = false;
        return info;
      }
      --it;
      info.type = PointerInfo::Type::kDevice;
      info.device = it->second.device;
      info.base = it->first;
      info.size = it->second.size;
      bool host_located = it->second.on_host();
      uintptr_t covered = it->first + it->second.size;
      for (++it; covered < end && it != r->mappings.end() && it->first == covered; ++it) {
        covered += it->second.size;
        host_located = host_located && it->second.on_host();
      }
      info.range_ok = covered >= end;
      info.host_located = host_located;
      return info;
    }
  }
  return info;
}

uintptr_t first_inaccessible(const void* ptr, uint64_t bytes, bool write) {
  auto addr = reinterpret_cast<uintptr_t>(ptr);
  AddressSpace& as = address_space();
  std::shared_lock lock(as.mu);
  Region* r = as.find(addr);
  if (!r) return addr;
  if (r->kind != RegionKind::kReservation) return 0;
  const uint64_t end = addr + bytes;
  uintptr_t at = addr;
  auto it = r->mappings.upper_bound(addr);
  if (it != r->mappings.begin()) --it;
  for (; at < end; ++it) {
    if (it == r->mappings.end() || it->first > at || it->first + it->second.size <= at) return at;
    if (!permits(view_of(it->second), write)) return at;
    at = it->first + it->second.size;
  }
  return 0;
}

uintptr_t first_inaccessible_to(int device, const void* ptr, uint64_t bytes, bool write) {
  auto addr = reinterpret_cast<uintptr_t>(ptr);
  AddressSpace& as = address_space();
  std::shared_lock lock(as.mu);
  Region* r = as.find(addr);
  if (!r || r->kind != RegionKind::kReservation) return 0;
  const uint64_t end = addr + bytes;
  auto it = r->mappings.upper_bound(addr);
  if (it != r->mappings.begin()) --it;
  // Unlike first_inaccessible, gaps are passed over: what is unmapped faults on the host.
  for (uintptr_t at = addr; at < end && it != r->mappings.end(); ++it) {
    if (it->first + it->second.size <= at) continue;
    if (it->first >= end) break;
    const Mapping& m = it->second;
    if (m.device != device && !permits(access_of(m, device), write)) return std::max(at, it->first);
    at = it->first + m.size;
  }
  return 0;
}

}  // namespace cudasim
