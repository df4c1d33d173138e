// The coalescing free list both memory tiers keep: extents in address order (a std::map from
// address to the tier's own record, which has a `size`), the free ones indexed by (size,
// address) for best fit, and a freed extent merged with its free neighbours at once. Each
// tier says which neighbours may merge: the device pool those free on the same stream tag
// (pool/placement.cpp, one index per tag), the host tier those free in the same chunk
// (residency/host_tier_best_fit.cpp, one index for all its chunks).
//
// Thread safety: none; each tier guards its own list.
#pragma once

#include <cstdint>
#include <iterator>
#include <set>
#include <utility>

namespace vramswap::pool {

// The free extents of one class, as (size, address): the first at or after (n, 0) is the
// best fit for n bytes (the smallest that holds them, the lowest address among equals).
using FreeIndex = std::set<std::pair<uint64_t, uintptr_t>>;

inline FreeIndex::const_iterator best_fit(const FreeIndex& index, uint64_t bytes) {
  return index.lower_bound({bytes, 0});
}

// Merges the free extent at `it` (not in its index yet) with its neighbours in `extents`
// that `mergeable(record)` accepts (they are in their index: `unindex(iterator)` takes
// each out), the lower address absorbing the higher: the survivor's size grows by the
// other's and `combine(survivor, other)` merges the tier's other fields. Returns the
// survivor, which the caller indexes.
template <class Map, class Mergeable, class Unindex, class Combine>
typename Map::iterator coalesce(Map& extents, typename Map::iterator it, Mergeable mergeable, Unindex unindex,
                                Combine combine) {
  if (it != extents.begin()) {
    auto prev = std::prev(it);
    if (mergeable(prev->second)) {
      unindex(prev);
      prev->second.size += it->second.size;
      combine(prev->second, it->second);
      extents.erase(it);
      it = prev;
    }
  }
  auto next = std::next(it);
  if (next != extents.end() && mergeable(next->second)) {
    unindex(next);
    it->second.size += next->second.size;
    combine(it->second, next->second);
    extents.erase(next);
  }
  return it;
}

}  // namespace vramswap::pool
