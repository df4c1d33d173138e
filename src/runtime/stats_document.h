// The statistics document: what vramswap_stats_json returns and VRAMSWAP_STATS_FILE holds
// (its keys and their order are documented in include/vramswap/vramswap.h, and a test holds
// the two together).
//
// Its counters are one list (kCounters in stats_document.cpp): each key and where the pool
// or the engine keeps it. The totals add every device's counters (the peaks are sums of
// each device's peak); each device's object repeats them, then adds the pool's
// num_free_blocks and va_reserved_bytes. The process-wide numbers (refused frees, host time
// in long CUDA calls) come once, after the totals.
//
// Thread safety: pure functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/host_time.h"
#include "pool/device_pool.h"
#include "residency/engine.h"

namespace vramswap {

// One device's numbers.
struct DeviceStats {
  int device = 0;
  pool::PoolStats pool;
  residency::EngineStats engine;
};

// The JSON document for `devices` (those with a pool, in ordinal order), the allocator's
// own count of refused frees and the host time in long CUDA calls (cuda/host_time.h).
std::string stats_document(const std::vector<DeviceStats>& devices, uint64_t num_invalid_frees,
                           const cuda::HostTimes& host_times);

}  // namespace vramswap
