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
  // Note [Kept blocks stay addressable]: its host memory where its pages were, when they all
  // went (partly, some granules stay mapped and the block is evicted as any block).
  if (r.ok && s.backing && freed == s.placed) address_on_host(s);
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

// Note [Granules that cannot go]
// ------------------------------
// A granule's pages are unmapped only when every block on it can leave (Note [A shared
// granule goes as a whole] in engine_copies.cpp). Tagged blocks below half a granule share
// granules, with each other and, once the last-resort rule placed them so, with ordinary
// blocks; when each granule under the cold ones also holds a block that must stay (in use,
// untagged, or tagged and never saved), an allocation runs out of memory with megabytes
// evictable, or already on the host, and evicting them frees nothing. The report says so,
// with the numbers, so that "evictable" and "on the host" beside an out-of-memory explain
// themselves: the DTR prototype's TreeLSTM log at 90% of its peak ran out of memory with
// 29.9 MiB evictable and 62 MiB on the host, its saved 120 KB tensors among as many that
// were never saved, and the report said nothing of why.
std::string Engine::Impl::granules_that_cannot_go() {
  const pool::DevicePool::MemoryView memory = pool_.memory_view();  // the pool's lock, not ours
  // Tagged blocks that let their granules go, as make_room judges a granule's mates
  // (policy::granule_mate): evictable, or away, on the way out, or clean and cold.
  std::set<uintptr_t> can_go;
  {
    std::lock_guard lock(mu_);
    const policy::Window window = policy::window_of(order_, options_.horizon);
    for (uint32_t slot = 0; slot < slots_.size(); ++slot)
      if (slots_[slot].live && policy::granule_mate(view(slot), window.count(slot)) != policy::Mate::kHolds)
        can_go.insert(slots_[slot].addr);
  }
  const uint64_t g = pool_.granularity();
  // Per mapped granule (index): bit 1, a block on it lets it go; bit 2, one must stay.
  std::unordered_map<uint64_t, uint8_t> granules;
  for (const auto& [addr, bytes] : memory.mapped)
    for (uint64_t i = addr / g; i < (addr + bytes) / g; ++i) granules[i] = 0;
  using State = pool::DevicePool::BlockView::State;
  auto on_granules = [&](const pool::DevicePool::BlockView& b, auto&& fn) {
    for (uint64_t i = b.addr / g; i <= (b.addr + b.size - 1) / g; ++i)
      if (auto it = granules.find(i); it != granules.end()) fn(it->second);
  };
  for (const auto& b : memory.blocks) {
    if (b.state != State::kLive || b.size == 0) continue;
    const uint8_t bit = can_go.count(b.addr) ? 1 : 2;
    on_granules(b, [bit](uint8_t& f) { f |= bit; });
  }
  uint64_t held = 0;
  for (const auto& [index, f] : granules) held += f == 3;
  if (held == 0) return "";
  uint64_t away = 0, evictable = 0;  // bytes of such blocks on the granules held
  for (const auto& b : memory.blocks) {
    if (b.state != State::kLive || b.size == 0 || !can_go.count(b.addr)) continue;
    bool on_held = false;
    on_granules(b, [&](uint8_t& f) { on_held |= f == 3; });
    if (on_held) (b.away ? away : evictable) += b.size;
  }
  std::string blocks;
  if (away > 0) blocks = format_size(away) + " of blocks already on the host";
  if (evictable > 0) blocks += (blocks.empty() ? "" : " and ") + format_size(evictable) + " of cold blocks";
  return " " + std::to_string(held) + (held == 1 ? " granule (" : " granules (") + format_size(held * g) +
         (held == 1 ? ") stays" : ") stay") + " mapped under " + blocks +
         ", because another block on each is in use, untagged, or tagged and never saved: a granule's pages are "
         "freed only when every block on it can go, and tagged blocks below half a granule (" +
         format_size(g / 2) + ") share granules.";
}

std::string Engine::Impl::pressure_report() {
  // Tagged blocks resident and not evictable, by why: what could have been evicted and was not
  // (Note [Why nothing fits] in pool/pressure.cpp says what the pool's memory could not serve).
  uint64_t in_use = 0, in_window = 0;
  {
    std::lock_guard lock(mu_);
    const policy::Window window = policy::window_of(order_, options_.horizon);
    for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
      const policy::BlockView v = view(slot);
      if (!v.live || v.state != policy::BlockState::kResident || policy::evictable(v, window.count(slot))) continue;
      if (!v.cold || v.unpacked) in_use += v.placed;
      else if (window.count(slot)) in_window += v.placed;
    }
  }
  std::string held;
  if (in_use > 0) held = format_size(in_use) + " in use (not cold yet, or unpacked by backward)";
  if (in_window > 0) held += (held.empty() ? "" : " and ") + format_size(in_window) + " cold in the prefetch window";
  if (!held.empty()) held = " Tagged and resident but not evictable: " + held + ".";
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
         (disk_refusal_.empty() ? "" : " No disk tier: " + disk_refusal_ + ".") + held +
         granules_that_cannot_go();
}

}  // namespace vramswap::residency
