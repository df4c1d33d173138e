// The memory snapshot document. See snapshot_document.h.
#include "runtime/snapshot_document.h"

#include <algorithm>

#include "stats/json_writer.h"

namespace vramswap {
namespace {

using Block = pool::DevicePool::BlockView;
using pool::TraceEvent;

const char* state_name(Block::State s) {
  switch (s) {
    case Block::State::kLive: return "active_allocated";
    case Block::State::kPendingFree: return "active_pending_free";
    case Block::State::kFree: return "inactive";
  }
  return "inactive";
}

const char* action_name(TraceEvent::Action a) {
  switch (a) {
    case TraceEvent::Action::kAlloc: return "alloc";
    case TraceEvent::Action::kFreeRequested: return "free_requested";
    case TraceEvent::Action::kFreeCompleted: return "free_completed";
    case TraceEvent::Action::kSegmentMap: return "segment_map";
    case TraceEvent::Action::kSegmentUnmap: return "segment_unmap";
    case TraceEvent::Action::kOom: return "oom";
  }
  return "unknown";
}

// What a block asks for within [lo, hi): the size asked for when the segment holds all of a
// live block whose allocation the history recorded, else the part.
uint64_t requested_part(const Block& b, uintptr_t lo, uintptr_t hi) {
  const bool whole = lo == b.addr && hi == b.addr + b.size;
  return whole && b.state == Block::State::kLive && b.requested ? b.requested : hi - lo;
}

// One segment: the mapped stretch [addr, addr + bytes) and the blocks (address order) that
// overlap it, from `first` on; returns the index of the first block that may overlap the
// next stretch.
size_t write_segment(stats::JsonWriter& w, int device, uintptr_t addr, uint64_t bytes,
                     const std::vector<Block>& blocks, size_t first) {
  const uintptr_t end = addr + bytes;
  while (first < blocks.size() && blocks[first].addr + blocks[first].size <= addr) ++first;
  uint64_t allocated = 0, active = 0, requested = 0;
  for (size_t i = first; i < blocks.size() && blocks[i].addr < end; ++i) {
    const uintptr_t lo = std::max(addr, blocks[i].addr), hi = std::min<uintptr_t>(end, blocks[i].addr + blocks[i].size);
    if (blocks[i].state == Block::State::kLive) {
      allocated += hi - lo;
      requested += requested_part(blocks[i], lo, hi);
    }
    if (blocks[i].state != Block::State::kFree) active += hi - lo;
  }
  w.begin_object()
      .field("device", device)
      .field("address", uint64_t(addr))
      .field("total_size", bytes)
      .field("allocated_size", allocated)
      .field("active_size", active)
      .field("requested_size", requested)
      .field("stream", uint64_t(0))
      .field("segment_type", "large");
  w.field("is_expandable", true);
  w.begin_array("frames").end_array();
  w.begin_array("blocks");
  size_t i = first;
  for (; i < blocks.size() && blocks[i].addr < end; ++i) {
    const Block& b = blocks[i];
    const uintptr_t lo = std::max(addr, b.addr), hi = std::min<uintptr_t>(end, b.addr + b.size);
    w.begin_object()
        .field("address", uint64_t(lo))
        .field("size", uint64_t(hi - lo))
        .field("requested_size", requested_part(b, lo, hi))
        .field("state", state_name(b.state));
    w.begin_array("frames").end_array();
    if (b.state == Block::State::kLive)
      w.begin_object("vramswap").field("tagged", b.offloadable).field("evicted", b.away).end_object();
    w.end_object();
  }
  w.end_array().end_object();
  // A block running past this stretch may overlap the next one too.
  return i > first && blocks[i - 1].addr + blocks[i - 1].size > end ? i - 1 : i;
}

}  // namespace

std::string snapshot_document(const std::vector<DeviceMemoryView>& devices) {
  stats::JsonWriter w;
  w.begin_object().begin_array("segments");
  for (const DeviceMemoryView& d : devices) {
    size_t next = 0;
    for (const auto& [addr, bytes] : d.view.mapped) next = write_segment(w, d.device, addr, bytes, d.view.blocks, next);
  }
  w.end_array().begin_array("device_traces");
  int ordinal = 0;
  for (const DeviceMemoryView& d : devices) {
    for (; ordinal < d.device; ++ordinal) w.begin_array().end_array();  // no pool: no events
    w.begin_array();
    for (const TraceEvent& e : d.view.trace) {
      w.begin_object()
          .field("action", action_name(e.action))
          .field("addr", uint64_t(e.addr))
          .field("size", e.size)
          .field("stream", uint64_t(e.stream))
          .field("time_us", e.time_us);
      w.begin_array("frames").end_array();
      if (e.action == TraceEvent::Action::kOom) w.field("device_free", e.device_free);
      if (e.cause != TraceEvent::Cause::kNone) w.field("vramswap", e.cause == TraceEvent::Cause::kEvict ? "evict" : "fetch");
      w.end_object();
    }
    w.end_array();
    ordinal = d.device + 1;
  }
  w.end_array().begin_object("vramswap").begin_array("evicted");
  for (const DeviceMemoryView& d : devices) {
    const auto& mapped = d.view.mapped;
    for (const Block& b : d.view.blocks) {
      if (b.state != Block::State::kLive || !b.away) continue;
      // Listed here when no page of it is mapped (a page still mapped shows it in a segment).
      const bool in_a_segment = std::any_of(mapped.begin(), mapped.end(), [&](const auto& m) {
        return m.first < b.addr + b.size && b.addr < m.first + m.second;
      });
      if (in_a_segment) continue;
      w.begin_object()
          .field("device", d.device)
          .field("address", uint64_t(b.addr))
          .field("size", b.size)
          .field("stream", uint64_t(b.stream))
          .end_object();
    }
  }
  w.end_array().end_object().end_object();
  return w.str();
}

}  // namespace vramswap
