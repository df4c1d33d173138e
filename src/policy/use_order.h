// The predicted order in which backward needs packed blocks, and the choices made from it.
//
// Autograd runs a graph's backward in reverse order of the forward: the block saved last
// is needed first. Several forwards before their backwards (gradient accumulation,
// pipeline microbatches) run their backwards oldest graph first. So a block saved as
// number `seq` of graph `graph` is needed before another when its graph is older, or, in
// the same graph, when it was saved later. This order is exact for the eager autograd
// engine; it is what makes Belady's rule (evict the block needed furthest in the future)
// usable here.
//
// Kept blocks (Note [Kept blocks] in residency/engine.h: frozen weights, optimizer state)
// are used again every step, outside backward. A graph's uses are in three lanes: lane 0,
// the uses while its forward runs (a frozen layer's weights, in the order they were used);
// lane 1, its backward (the packs, last saved first); lane 2, the uses after its backward
// (the optimizer's step, in the order used). A kept block's next use is predicted from its
// last: the same lane and position, one graph later.
//
// The cursor is the block unpacked last: the window is the next `n` packed blocks after
// it, those prefetched and never evicted. Before any unpack the window starts at the
// block needed first.
//
// Thread safety: none; the engine's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

namespace vramswap::policy {

enum : uint8_t { kForwardLane = 0, kBackwardLane = 1, kAfterBackwardLane = 2 };

struct UseKey {
  uint64_t graph = 0;
  uint64_t seq = 0;  // lane 1: the save's ordinal; lanes 0 and 2: the use's position
  uint8_t lane = kBackwardLane;
};

// True when the block saved (or used) at `a` is needed before the one at `b`. Pure.
inline bool needed_before(const UseKey& a, const UseKey& b) {
  if (a.graph != b.graph) return a.graph < b.graph;
  if (a.lane != b.lane) return a.lane < b.lane;
  return a.lane == kBackwardLane ? a.seq > b.seq : a.seq < b.seq;
}

class UseOrder {
 public:
  void insert(const UseKey& key, uint32_t slot) { order_.insert({key, slot}); }
  void erase(const UseKey& key, uint32_t slot) { order_.erase({key, slot}); }
  size_t size() const { return order_.size(); }

  // The block just unpacked: the window moves past it.
  void set_cursor(const UseKey& key) {
    cursor_ = key;
    has_cursor_ = true;
  }

  // The next `n` slots in order of use after the cursor.
  std::vector<uint32_t> window(int n) const {
    std::vector<uint32_t> out;
    auto it = has_cursor_ ? order_.upper_bound({cursor_, UINT32_MAX}) : order_.begin();
    for (; it != order_.end() && int(out.size()) < n; ++it) out.push_back(it->slot);
    return out;
  }

  // Calls `f(slot)` for the slots after the cursor, the next one needed first, until `f`
  // returns false. `f` must not insert or erase.
  template <class F>
  void each_after_cursor(F f) const {
    auto it = has_cursor_ ? order_.upper_bound({cursor_, UINT32_MAX}) : order_.begin();
    for (; it != order_.end(); ++it)
      if (!f(it->slot)) return;
  }

  // Calls `f(slot)` for every slot, the one needed furthest in the future first (Belady's
  // victim order), until `f` returns false. `f` must not insert or erase.
  template <class F>
  void each_furthest_first(F f) const {
    for (auto it = order_.rbegin(); it != order_.rend(); ++it)
      if (!f(it->slot)) return;
  }

 private:
  struct Entry {
    UseKey key;
    uint32_t slot;
    bool operator<(const Entry& o) const {
      if (needed_before(key, o.key)) return true;
      if (needed_before(o.key, key)) return false;
      return slot < o.slot;
    }
  };
  std::set<Entry> order_;
  UseKey cursor_;
  bool has_cursor_ = false;
};

}  // namespace vramswap::policy
