// HostTier's best-fit placement, the one that ships (make_best_fit_placer): every chunk
// tiled by extents in address order, the free ones indexed by (size, address), the smallest
// that fits taken and split, a freed extent merged with its free neighbours in the same
// chunk at once: the device pool's coalescing free list (pool/free_list.h).
//
// Invariants (checked by tests/host_tier through the public API): extents_ tiles every
// chunk exactly, in address order; each extent is a multiple of 512 bytes at a 512-aligned
// address; no two free extents of one chunk are neighbours (they are merged at once); free_
// indexes exactly the free extents.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "config/units.h"
#include "pool/free_list.h"
#include "residency/host_tier.h"

namespace vramswap::residency {
namespace {

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }
void* pointer(uintptr_t a) { return reinterpret_cast<void*>(a); }

class BestFitPlacer final : public HostTier::Placer {
 public:
  const char* name() const override { return "best_fit"; }

  uint64_t chunk_bytes_for(uint64_t bytes, uint64_t chunk_bytes) const override {
    return round_up(std::max(bytes, chunk_bytes), kHostChunkGranularity);
  }

  bool add_chunk(void* base, uint64_t size, std::string* error) override {
    const uintptr_t a = address(base);
    if (a % kHostBlockAlignment != 0 || size % kHostBlockAlignment != 0) {
      *error = "the chunk at " + format_pointer(base) + " is not 512-byte aligned";
      return false;
    }
    chunks_.emplace(a, size);
    extents_.emplace(a, Extent{size, a, false});
    free_.emplace(size, a);
    return true;
  }

  void* place(uint64_t bytes) override {
    auto best = pool::best_fit(free_, bytes);
    if (best == free_.end()) return nullptr;
    const uintptr_t a = best->second;
    free_.erase(best);
    auto it = extents_.find(a);
    Extent& e = it->second;
    if (e.size > bytes) {  // the rest stays free, right after the block
      extents_.emplace_hint(std::next(it), a + bytes, Extent{e.size - bytes, e.chunk, false});
      free_.emplace(e.size - bytes, a + bytes);
      e.size = bytes;
    }
    e.live = true;
    return pointer(a);
  }

  std::optional<uint64_t> release(void* p, std::string* error) override {
    const uintptr_t a = address(p);
    auto it = extents_.find(a);
    if (it == extents_.end() || !it->second.live) {
      *error = why_not_live(a, it);
      return std::nullopt;
    }
    const uint64_t size = it->second.size;
    it->second.live = false;
    const uintptr_t chunk = it->second.chunk;
    it = pool::coalesce(
        extents_, it, [&](const Extent& n) { return !n.live && n.chunk == chunk; },
        [&](ExtentMap::iterator n) { free_.erase({n->second.size, n->first}); }, [](Extent&, const Extent&) {});
    free_.emplace(it->second.size, it->first);
    return size;
  }

  uint64_t free_chunk_bytes() const override {
    uint64_t bytes = 0;
    for (const auto& [base, size] : chunks_) {
      if (is_free_chunk(base, size)) bytes += size;
    }
    return bytes;
  }

  std::vector<void*> take_free_chunks() override {
    std::vector<void*> taken;
    for (auto c = chunks_.begin(); c != chunks_.end();) {
      if (!is_free_chunk(c->first, c->second)) {
        ++c;
        continue;
      }
      free_.erase({c->second, c->first});
      extents_.erase(c->first);
      taken.push_back(pointer(c->first));
      c = chunks_.erase(c);
    }
    return taken;
  }

  std::optional<uint64_t> largest_free_bytes() const override {
    return free_.empty() ? 0 : free_.rbegin()->first;
  }

 private:
  struct Extent {
    uint64_t size;
    uintptr_t chunk;  // the base of the chunk it lies in: extents never span two chunks,
                      // even when the chunks happen to be neighbours in memory
    bool live;
  };
  using ExtentMap = std::map<uintptr_t, Extent>;
  using ExtentIt = ExtentMap::const_iterator;

  bool is_free_chunk(uintptr_t base, uint64_t size) const {
    auto it = extents_.find(base);
    return it != extents_.end() && !it->second.live && it->second.size == size;
  }

  // Why `a` is not the start of a live block (`exact` is its extent, if one starts there).
  std::string why_not_live(uintptr_t a, ExtentIt exact) const {
    if (exact != extents_.end()) return "the block was freed already (double free)";
    auto after = extents_.upper_bound(a);
    if (after != extents_.begin()) {
      const auto& [start, e] = *std::prev(after);
      if (a < start + e.size) {
        if (e.live) {
          return "it points " + std::to_string(a - start) + " bytes into the block at " +
                 format_pointer(pointer(start)) + " (" + format_size(e.size) + ")";
        }
        return "it lies in free memory of the tier (freed already?)";
      }
    }
    return "the host tier did not allocate it";
  }

  ExtentMap extents_;     // every extent, by address
  pool::FreeIndex free_;  // the free ones
  std::map<uintptr_t, uint64_t> chunks_;           // base -> size
};

}  // namespace

std::unique_ptr<HostTier::Placer> make_best_fit_placer() { return std::make_unique<BestFitPlacer>(); }

}  // namespace vramswap::residency
