// History: the pool's recent allocator events, for memory snapshots in torch's format
// (stats/snapshot.h, vramswap_snapshot_json, vramswap.dump_snapshot).
//
// Note [Memory history]
// ---------------------
// torch's caching allocator records, once torch.cuda.memory._record_memory_history() asks
// it to, each of its actions in a bounded trace per device: a block handed out ("alloc"),
// a free asked for ("free_requested") and the moment the block is reusable
// ("free_completed": later than the request when other streams' work must finish first),
// pages mapped or unmapped under its expandable segments ("segment_map", "segment_unmap"),
// and a refused allocation ("oom"). The pool records the same actions with the same
// meanings: its granule runs are torch's expandable segments (pages mapped and unmapped
// under a fixed range of addresses). What torch never does, the pool also records with
// those actions: an eviction unmaps a block's pages ("segment_unmap", cause kEvict) and a
// fetch maps them again ("segment_map", cause kFetch; with the limit reached, the idle
// cached pages it unmaps to make room are "segment_unmap" events of cause kFetch too), so
// torch's tools show vramswap's evictions as the memory they give back. Sizes, as torch's: an alloc's is the size asked
// for, and its frees carry the same (a block allocated before recording began is freed with
// its rounded size); a mapping's, the bytes mapped or unmapped. Times are the host's
// clock, in microseconds, when the pool made the change.
//
// The trace is a ring of the last `capacity` events (torch's max_entries): older ones are
// dropped, and the oldest kept is where the snapshot's trace starts. Capacity 0 (the
// default) records nothing: the hot path's cost is one test of recording().
//
// Thread safety: none; the pool's mutex guards it.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace vramswap::pool {

struct TraceEvent {
  enum class Action : uint8_t { kAlloc, kFreeRequested, kFreeCompleted, kSegmentMap, kSegmentUnmap, kOom };
  enum class Cause : uint8_t { kNone, kEvict, kFetch };
  Action action = Action::kAlloc;
  Cause cause = Cause::kNone;
  uintptr_t addr = 0;
  uint64_t size = 0;
  uintptr_t stream = 0;  // the stream the action was for (0: none named)
  uint64_t time_us = 0;
  uint64_t device_free = 0;  // kOom: the bytes the pool could still map (torch: the device's
                             // free memory), as torch's tools expect of an oom event
};

class History {
 public:
  bool recording() const { return capacity_ > 0; }

  // Keeps the last `capacity` events from now on (0: none); the events kept so far go.
  void reset(size_t capacity) {
    capacity_ = capacity;
    events_.clear();
    events_.shrink_to_fit();
    next_ = 0;
  }

  void add(TraceEvent::Action action, uintptr_t addr, uint64_t size, uintptr_t stream,
           TraceEvent::Cause cause = TraceEvent::Cause::kNone, uint64_t device_free = 0) {
    if (capacity_ == 0) return;
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    const TraceEvent e{action,
                       cause,
                       addr,
                       size,
                       stream,
                       uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(now).count()),
                       device_free};
    if (events_.size() < capacity_) {
      events_.push_back(e);
    } else {
      events_[next_] = e;
      next_ = (next_ + 1) % capacity_;
    }
  }

  // The events kept, oldest first.
  std::vector<TraceEvent> events() const {
    std::vector<TraceEvent> out(events_.begin() + next_, events_.end());
    out.insert(out.end(), events_.begin(), events_.begin() + next_);
    return out;
  }

 private:
  size_t capacity_ = 0;
  std::vector<TraceEvent> events_;
  size_t next_ = 0;  // when full: the oldest event, overwritten next
};

}  // namespace vramswap::pool
