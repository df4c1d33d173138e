// Host time in long CUDA calls. See host_time.h.
#include "cuda/host_time.h"

#include <atomic>
#include <chrono>

namespace vramswap::cuda {
namespace {

std::atomic<uint64_t> g_sums[3];
std::atomic<uint64_t> g_vmm_bytes[4];
std::atomic<uint64_t> g_vmm_calls[4];

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

}  // namespace

HostTimes host_times() {
  HostTimes t;
  t.wait_ns = g_sums[int(HostTime::kWait)].load(std::memory_order_relaxed);
  t.vmm_ns = g_sums[int(HostTime::kVmm)].load(std::memory_order_relaxed);
  t.pin_ns = g_sums[int(HostTime::kPin)].load(std::memory_order_relaxed);
  t.vmm_created_bytes = g_vmm_bytes[int(VmmCall::kCreate)].load(std::memory_order_relaxed);
  t.vmm_mapped_bytes = g_vmm_bytes[int(VmmCall::kMap)].load(std::memory_order_relaxed);
  t.vmm_unmapped_bytes = g_vmm_bytes[int(VmmCall::kUnmap)].load(std::memory_order_relaxed);
  t.vmm_released_bytes = g_vmm_bytes[int(VmmCall::kRelease)].load(std::memory_order_relaxed);
  t.vmm_create_calls = g_vmm_calls[int(VmmCall::kCreate)].load(std::memory_order_relaxed);
  t.vmm_map_calls = g_vmm_calls[int(VmmCall::kMap)].load(std::memory_order_relaxed);
  t.vmm_unmap_calls = g_vmm_calls[int(VmmCall::kUnmap)].load(std::memory_order_relaxed);
  t.vmm_release_calls = g_vmm_calls[int(VmmCall::kRelease)].load(std::memory_order_relaxed);
  return t;
}

void count_vmm_call(VmmCall call, uint64_t bytes) {
  g_vmm_bytes[int(call)].fetch_add(bytes, std::memory_order_relaxed);
  g_vmm_calls[int(call)].fetch_add(1, std::memory_order_relaxed);
}

TimedCall::TimedCall(HostTime what) : what_(what), start_ns_(now_ns()) {}

TimedCall::~TimedCall() { g_sums[int(what_)].fetch_add(now_ns() - start_ns_, std::memory_order_relaxed); }

}  // namespace vramswap::cuda
