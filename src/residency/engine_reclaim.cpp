// Giving device memory back, as the reactive policy decides (policy/reactive.h, Note [The
// reactive policy]): dropping a clean block's pages, waiting for an eviction in the order
// the copy engine runs them, the prefetches the policy asks for, and the report an
// out-of-memory carries.
#include "residency/engine_impl.h"

namespace vramswap::residency {

uint64_t Engine::Impl::drop(uint32_t slot) {
  Slot& s = slots_[slot];
  bool partly = false;
  uint64_t freed = 0;
  pool::Result r = pool_.unmap_block(reinterpret_cast<void*>(s.addr), &partly, &freed);
  if (!r.ok && !partly) throw cuda::CudaError("eviction of " + format_hex(s.addr) + ": " + r.message, CUDA_ERROR_UNKNOWN);
  // Unmapped, or partly: the host copy is whole, and a fetch maps what is missing.
  s.residency = Residency::kEvicted;
  if (s.frozen && !s.fresh_copy) st_.frozen_bytes_dropped += s.requested;  // no copy paid for this drop
  debug(r.ok ? "evicted (pages given up)" : "evicted (pages partly given up)", s);
  recorder_.refetch(s.step_block);  // a block the plan keeps: its fetch joins the plan's
  // The granules freed now: those it shares with a block still in use stay mapped (they go
  // with the last of their blocks), and ones it shares with blocks already away go now.
  unmapped_total_ += freed;
  st_.clean_bytes -= s.placed;
  st_.evicted_bytes += s.placed;
  if (!r.ok) throw cuda::CudaError("eviction of " + format_hex(s.addr) + ": " + r.message, CUDA_ERROR_UNKNOWN);
  return freed;
}

std::vector<std::pair<uint64_t, uint32_t>> Engine::Impl::queued_evictions() const {
  std::vector<std::pair<uint64_t, uint32_t>> queued;  // (copy_seq, slot)
  for (uint32_t slot : in_flight_)
    if (slots_[slot].residency == Residency::kEvicting) queued.emplace_back(slots_[slot].copy_seq, slot);
  std::sort(queued.begin(), queued.end());
  return queued;
}

bool Engine::Impl::await_eviction(uint32_t slot, uint64_t seq) {
  Slot& s = slots_[slot];
  if (s.residency != Residency::kEvicting || s.copy_seq != seq) return false;  // reaped meanwhile
  s.copy_event.synchronize();
  complete_copies(false);  // reaps it, and whatever else has landed
  return true;
}

bool Engine::Impl::prefetch(uint32_t slot, bool ahead) {
  if (!start_fetch(slot, ahead ? Fetch::kAhead : Fetch::kPrefetch).ok) return false;
  ++st_.num_prefetches;
  return true;
}

std::string Engine::Impl::pressure_report() {
  const EngineStats s = stats();
  const pool::PoolStats ps = pool_.stats();
  const uint64_t untagged = ps.allocated_bytes > s.tagged_bytes ? ps.allocated_bytes - s.tagged_bytes : 0;
  const uint64_t tagged_resident = s.tagged_bytes > s.evicted_bytes ? s.tagged_bytes - s.evicted_bytes : 0;
  return "Offload: " + format_size(tagged_resident) + " tagged and resident, " + format_size(untagged) +
         " untagged, " + format_size(s.evictable_bytes) + " evictable (cold, outside the prefetch window of " +
         std::to_string(options_.horizon) + "), " + format_size(s.clean_bytes) + " copied out but still mapped, " +
         format_size(s.in_flight_bytes) + " in flight, " + format_size(s.evicted_bytes) + " on the host" +
         (disk_ ? " (" + format_size(s.disk_bytes) + " of it moved on to the disk tier in " + disk_->dir() + ")" : "") +
         "; host tier " + format_size(s.host_bytes) + " used of " + format_size(host_.limit_bytes()) + "." +
         (host_refusal_.empty() ? "" : " Eviction stopped: " + host_refusal_ + ".") +  // the latest reason
         (disk_refusal_.empty() ? "" : " No disk tier: " + disk_refusal_ + ".");
}

}  // namespace vramswap::residency
