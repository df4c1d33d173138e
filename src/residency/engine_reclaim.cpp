// Giving device memory back: choosing victims (the block needed furthest in the future
// first, policy/use_order.h), dropping clean blocks' pages, making room for a fetch, the
// pool's reclaimer (what it can free now, then waiting for copies), the soft watermark,
// and the report an out-of-memory carries.
#include "residency/engine_impl.h"

namespace vramswap::residency {

uint64_t Engine::Impl::start_victims(uint64_t bytes, uint32_t except, bool window_too) {
  const std::set<uint32_t> window = window_too ? std::set<uint32_t>() : window_set();
  uint64_t started = 0;
  order_.each_furthest_first([&](uint32_t slot) {
    if (started >= bytes) return false;
    if (slot == except || !evictable(slot, window)) return true;
    if (!start_eviction(slot)) return false;  // the host tier is full
    started += slots_[slot].placed;
    return true;
  });
  return started;
}

uint64_t Engine::Impl::drop(uint32_t slot) {
  Slot& s = slots_[slot];
  bool partly = false;
  uint64_t freed = 0;
  pool::Result r = pool_.unmap_block(reinterpret_cast<void*>(s.addr), &partly, &freed);
  if (!r.ok && !partly) throw cuda::CudaError("eviction of " + hex(s.addr) + ": " + r.message, CUDA_ERROR_UNKNOWN);
  // Unmapped, or partly: the host copy is whole, and a fetch maps what is missing.
  s.residency = Residency::kEvicted;
  debug(r.ok ? "evicted (pages given up)" : "evicted (pages partly given up)", s);
  recorder_.refetch(s.step_block);  // a block the plan keeps: its fetch joins the plan's
  // The granules freed now: those it shares with a block still in use stay mapped (they go
  // with the last of their blocks), and ones it shares with blocks already away go now.
  unmapped_total_ += freed;
  st_.clean_bytes -= s.placed;
  st_.evicted_bytes += s.placed;
  if (!r.ok) throw cuda::CudaError("eviction of " + hex(s.addr) + ": " + r.message, CUDA_ERROR_UNKNOWN);
  return freed;
}

uint64_t Engine::Impl::drop_clean(uint64_t bytes, uint32_t except, bool window_too) {
  if (st_.clean_bytes == 0) return 0;
  const std::set<uint32_t> window = window_too ? std::set<uint32_t>() : window_set();
  uint64_t dropped = 0;
  order_.each_furthest_first([&](uint32_t slot) {
    if (dropped >= bytes) return false;
    if (slot == except || slots_[slot].residency != Residency::kClean || kept_clean(slot, window)) return true;
    dropped += drop(slot);
    return true;
  });
  return dropped;
}

uint64_t Engine::Impl::make_room(uint64_t bytes, uint32_t except, bool window_too) {
  const std::set<uint32_t> window = window_too ? std::set<uint32_t>() : window_set();
  uint64_t covered = in_flight_bytes(Residency::kEvicting);  // evictions under way free pages too
  const uint64_t unmapped_before = unmapped_total_;
  order_.each_furthest_first([&](uint32_t slot) {
    if (covered >= bytes) return false;
    if (slot == except) return true;
    Slot& s = slots_[slot];
    if (s.residency == Residency::kClean && !kept_clean(slot, window)) {
      covered += drop(slot);  // what it freed: a granule shared with a block in use stays
    } else if (!evictable(slot, window)) {
      return true;  // not a victim
    } else if (shares_granules(s)) {
      covered += evict_granule(slot, window);
    } else if (!start_eviction(slot)) {
      return true;  // the host tier is full: only clean blocks help
    } else {
      covered += s.placed;
    }
    return true;
  });
  return unmapped_total_ - unmapped_before;
}

uint64_t Engine::Impl::reclaim_locked(uint64_t bytes, ReclaimMode mode, uint32_t except) {
  const uint64_t unmapped_before = unmapped_total_;
  auto freed = [&] { return unmapped_total_ - unmapped_before; };
  // Copies that already landed first: an eviction that completed leaves a clean block to
  // drop at once; a fetch that completed makes its block resident, and it may be a victim
  // by now (the window moved on while it was in flight).
  complete_copies(false);
  if (recorder_.following()) {
    // The plan's victims, copied out since they went cold, are what it gives up at once; no
    // eviction starts beyond the plan before the pool has tried its own measures (the
    // forward's cached blocks, once the stream is synchronized: waiting for queued work
    // costs less than two copies over the bus). An allocation that must wait gives them up
    // first as well: Belady's rule over clean and evictable blocks together copies out a
    // block needed later than a victim of the plan, which only wants its pages unmapped.
    drop_clean(bytes, except);
    if (mode == ReclaimMode::kNoWait || freed() >= bytes) return freed();
  }
  make_room(bytes - freed(), except);
  if (mode == ReclaimMode::kNoWait) return freed();
  // Rounds 0 and 1 spare the prefetch window; waiting for round 0's copies may land fetches
  // whose blocks are victims for round 1. Round 2 is the last resort before an out-of-memory:
  // it takes blocks kept for the prefetch window too (they come back late, as faults, but
  // the step goes on).
  bool landed = true;  // copies may have landed since victims were last looked for
  for (int round = 0; round < 3 && freed() < bytes; ++round) {
    const bool window_too = round == 2;
    if (!landed && !window_too) continue;
    if (round > 0) make_room(bytes - freed(), except, window_too);
    landed = !in_flight_.empty();
    if (landed && freed() < bytes) {  // (make_room may have dropped enough clean blocks)
      // The evictions first, oldest first, as far as needed; then fetches too (a block that
      // lands may be a victim by now), which free nothing themselves.
      await_evictions(bytes - freed(), except, window_too);
      if (freed() < bytes) {
        complete_copies(true);
        drop_clean(bytes - freed(), except, window_too);
      }
    }
  }
  return freed();
}

void Engine::Impl::await_evictions(uint64_t bytes, uint32_t except, bool window_too) {
  const uint64_t unmapped_before = unmapped_total_;
  auto freed = [&] { return unmapped_total_ - unmapped_before; };
  std::vector<std::pair<uint64_t, uint32_t>> queued;  // (copy_seq, slot)
  for (uint32_t slot : in_flight_)
    if (slots_[slot].residency == Residency::kEvicting) queued.emplace_back(slots_[slot].copy_seq, slot);
  std::sort(queued.begin(), queued.end());
  for (const auto& [seq, slot] : queued) {
    if (freed() >= bytes) return;
    Slot& s = slots_[slot];
    if (s.residency != Residency::kEvicting || s.copy_seq != seq) continue;  // reaped meanwhile
    s.copy_event.synchronize();
    complete_copies(false);  // reaps it, and whatever else has landed
    if (freed() < bytes) drop_clean(bytes - freed(), except, window_too);
  }
}

void Engine::Impl::maybe_soft_evict() {
  // Following a plan, its evictions replace the watermark's: copies made for the watermark
  // would be bytes the plan does not need out.
  if (options_.soft_limit_bytes == 0 || recorder_.following()) return;
  // Clean blocks count as gone: their pages are given up at once when memory is needed.
  const uint64_t mapped = pool_.stats().mapped_bytes;
  const uint64_t resident = mapped - std::min(mapped, st_.clean_bytes);
  const uint64_t leaving = in_flight_bytes(Residency::kEvicting);
  if (resident <= options_.soft_limit_bytes + leaving) return;
  start_victims(resident - options_.soft_limit_bytes - leaving, UINT32_MAX);
}

std::string Engine::Impl::pressure_report() {
  const EngineStats s = stats();
  const pool::PoolStats ps = pool_.stats();
  const uint64_t untagged = ps.allocated_bytes > s.tagged_bytes ? ps.allocated_bytes - s.tagged_bytes : 0;
  const uint64_t tagged_resident = s.tagged_bytes > s.evicted_bytes ? s.tagged_bytes - s.evicted_bytes : 0;
  return "Offload: " + format_size(tagged_resident) + " tagged and resident, " + format_size(untagged) +
         " untagged, " + format_size(s.evictable_bytes) + " evictable (cold, outside the prefetch window of " +
         std::to_string(options_.horizon) + "), " + format_size(s.clean_bytes) + " copied out but still mapped, " +
         format_size(s.in_flight_bytes) + " in flight, " + format_size(s.evicted_bytes) + " on the host; host tier " +
         format_size(s.host_bytes) + " used of " + format_size(host_.limit_bytes()) + "." +
         (host_refusal_.empty() ? "" : " Eviction stopped: " + host_refusal_ + ".");  // the latest reason
}

}  // namespace vramswap::residency
