// Host time spent in the CUDA calls that can take long, counted process-wide: the calling
// thread waiting for the device (event, stream and context synchronizations), the virtual
// memory calls that give pages to addresses and take them away (cuMemCreate, cuMemMap with
// its cuMemSetAccess, cuMemUnmap, cuMemRelease), and pinning or unpinning host memory.
//
// On a GPU these are where a step's time goes beyond the copies themselves: measured on an
// H100 (tests/gpu/vmm_cost.py, bench/results/vmm-2026-11-26-h100.json), giving one 2 MiB
// granule its pages and access costs ~40-60 us and taking them away ~25-45 us, on the
// calling thread, and pinning costs ~0.6 ms per MiB. They are reported in the statistics
// (host_wait_ns, host_vmm_ns, host_pin_ns), so that a slow step can be read, with what the
// VMM time bought in bytes (pages created, mapped, unmapped, released) and in calls: the
// bytes over a step's evictions say how much of the remapping the evictions needed, and the
// calls what it costs on a GPU, where a call costs the same whether it covers one granule or
// hundreds (Note [Runs] in pool/granules.cpp).
//
// Thread-safe: relaxed atomic sums; a reading is a snapshot of each.
#pragma once

#include <cstdint>

namespace vramswap::cuda {

enum class HostTime { kWait, kVmm, kPin };

struct HostTimes {
  uint64_t wait_ns = 0;
  uint64_t vmm_ns = 0;
  uint64_t pin_ns = 0;
  uint64_t vmm_created_bytes = 0;   // cuMemCreate
  uint64_t vmm_mapped_bytes = 0;    // cuMemMap (with its cuMemSetAccess)
  uint64_t vmm_unmapped_bytes = 0;  // cuMemUnmap
  uint64_t vmm_released_bytes = 0;  // cuMemRelease
  // The calls that did it: a map is a cuMemMap with its cuMemSetAccess.
  uint64_t vmm_create_calls = 0;
  uint64_t vmm_map_calls = 0;
  uint64_t vmm_unmap_calls = 0;
  uint64_t vmm_release_calls = 0;
};

enum class VmmCall { kCreate, kMap, kUnmap, kRelease };

// The sums so far.
HostTimes host_times();

// Counts one `call` of `bytes` (called once the call succeeded).
void count_vmm_call(VmmCall call, uint64_t bytes);

// Adds the time from its construction to its destruction to one of the sums.
class TimedCall {
 public:
  explicit TimedCall(HostTime what);
  ~TimedCall();
  TimedCall(const TimedCall&) = delete;
  TimedCall& operator=(const TimedCall&) = delete;

 private:
  HostTime what_;
  uint64_t start_ns_;
};

}  // namespace vramswap::cuda
