// The memory snapshot document: what vramswap_snapshot_json returns and, turned into Python
// objects and pickled, what vramswap.dump_snapshot() writes. Its layout is torch's
// (torch.cuda.memory._snapshot(), torch 2.1 and later), so that torch's tools read it:
//
//   {"segments": [segment, ...], "device_traces": [[event, ...] per device ordinal],
//    "vramswap": {"evicted": [block, ...]}}
//
// A segment is a stretch of mapped device memory of one device's pool (adjacent granule runs
// joined; torch's expandable segments are the same thing: pages mapped under reserved
// addresses): "device", "address", "total_size", "allocated_size", "active_size",
// "requested_size", "stream" (0: a pool serves every stream), "segment_type" ("large"),
// "is_expandable" (true), "frames" ([]) and "blocks". Its
// blocks tile it in address order, each cut to the segment's bounds: "address", "size",
// "requested_size" (for a live block the segment holds whole, allocated while the history
// recorded: the size asked for; else the size), "state"
// ("active_allocated", "active_pending_free" or "inactive"), "frames" ([]) and, for live
// blocks, "vramswap": {"tagged": an offload scope's block, "evicted": its contents are on
// the host}. The sizes of a segment's blocks add up to its total_size, as torch's tools
// check.
//
// An evicted block whose pages are all unmapped lies in no segment: it is listed under
// "vramswap"/"evicted" ("device", "address", "size", "stream"). Each trace event has
// "action", "addr", "size", "stream", "time_us", "frames" ([]), for an "oom" "device_free"
// (the bytes the pool could still map within its limit), and, for the pages an
// eviction unmapped or a fetch mapped (or unmapped to make room), "vramswap": "evict" or
// "fetch" (Note [Memory history] in pool/history.h).
//
// Thread safety: pure functions on values.
#pragma once

#include <string>
#include <vector>

#include "pool/device_pool.h"

namespace vramswap {

struct DeviceMemoryView {
  int device = 0;
  pool::DevicePool::MemoryView view;
};

// The document for `devices` (those with a pool, in ordinal order).
std::string snapshot_document(const std::vector<DeviceMemoryView>& devices);

}  // namespace vramswap
