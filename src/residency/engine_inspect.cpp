// Reading the engine: statistics, peaks, and check_invariants, which checks every slot
// against the invariants of engine_impl.h.
#include "residency/engine_impl.h"

namespace vramswap::residency {

void Engine::Impl::update_peaks() {
  st_.peak_host_bytes = std::max(st_.peak_host_bytes, host_.used_bytes() + backed_bytes_);
}

EngineStats Engine::Impl::stats() {
  std::lock_guard lock(mu_);
  complete_copies(false);  // copies that have completed count as done
  EngineStats s = st_;
  s.num_planned_steps = recorder_.num_planned_steps();
  s.num_plan_divergences = recorder_.num_divergences();
  s.num_plan_backoffs = recorder_.num_backoffs();
  s.num_plan_fetch_moves = recorder_.num_fetch_moves();
  s.num_plan_fetch_moves_undone = recorder_.num_fetch_moves_undone();
  const pool::PoolStats ps = pool_.stats();
  s.resident_bytes = ps.mapped_bytes;
  s.peak_resident_bytes = ps.peak_mapped_bytes;
  s.host_bytes = host_.used_bytes() + backed_bytes_;  // kept blocks' host VMM memory too
  s.peak_host_bytes = std::max(s.peak_host_bytes, s.host_bytes);
  const policy::Window window = policy::window_of(order_, options_.horizon);
  for (uint32_t slot = 0; slot < slots_.size(); ++slot)
    if (policy::evictable(view(slot), window.count(slot))) s.evictable_bytes += slots_[slot].placed;
  return s;
}

std::string Engine::Impl::check_invariants() {
  std::lock_guard lock(mu_);
  std::vector<std::string> broken;
  auto expect = [&](bool holds, const std::string& what) {
    if (!holds && broken.size() < 16) broken.push_back(what);
  };
  EngineStats sum;
  size_t live = 0, copying = 0;
  uint64_t backed = 0;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    const Slot& s = slots_[slot];
    if (!s.live) {
      expect(!s.host && !s.check, "free slot " + std::to_string(slot) + " holds a host buffer");
      expect(!s.unordered_copy, "free slot " + std::to_string(slot) + " names a copy stream");
      expect(!s.backing, "free slot " + std::to_string(slot) + " holds host VMM memory");
      continue;
    }
    ++live;
    const std::string block = "block " + format_hex(s.addr);
    auto at = by_addr_.find(s.addr);
    expect(at != by_addr_.end() && at->second == slot, block + " is missing from the address map");
    {
      std::lock_guard tlock(tagged_mu_);
      expect(tagged_.count(s.addr) == 1, block + " is missing from the tagged set");
    }
    sum.tagged_bytes += s.placed;
    sum.tagged_waste_bytes += s.placed - s.requested;
    const bool host = s.residency != Residency::kResident && (!s.on_disk() || s.reading);
    expect(!s.reading || (s.on_disk() && std::count(reading_.begin(), reading_.end(), slot) == 1),
           block + " is read back from a disk it is not on, or nobody watches the read");
    expect(!s.writing || (s.residency == Residency::kEvicted && s.host && !s.on_disk() &&
                          std::count(writing_.begin(), writing_.end(), slot) == 1),
           block + " is written to the disk but not an evicted block with its host copy, or nobody watches the write");
    expect((s.host != nullptr) == host, block + (host ? " has no host buffer" : " holds a host buffer it does not need"));
    expect(!s.on_disk() || (s.residency == Residency::kEvicted && disk_), block + " is on the disk but not evicted");
    if (s.on_disk()) sum.disk_bytes += s.requested;
    expect(!s.check || s.residency == Residency::kFetching, block + " holds a verify buffer with no fetch");
    expect(!s.pages_kept || s.residency == Residency::kEvicted, block + " has pages kept for a fetch but is not evicted");
    // Note [A queued copy cannot be taken back]: only a failed eviction leaves a copy out
    // unordered (the block then resident, or fetching, as before it), only a failed fetch a
    // copy in (the block evicted); a copy of it that recorded its event since ordered it.
    const bool resident_or_fetching = s.residency == Residency::kResident || s.residency == Residency::kFetching;
    expect(!s.unordered_copy || (s.unordered_copy == d2h_.get() && resident_or_fetching) ||
               (s.unordered_copy == h2d_.get() && s.residency == Residency::kEvicted),
           block + " names a copy stream it cannot have left a copy on");
    if (s.residency == Residency::kClean) sum.clean_bytes += s.placed;
    if (s.residency == Residency::kEvicted || s.residency == Residency::kFetching) sum.evicted_bytes += s.placed;
    if (s.residency == Residency::kEvicting || s.residency == Residency::kFetching) {
      ++copying;
      sum.in_flight_bytes += s.placed;
      expect(std::count(in_flight_.begin(), in_flight_.end(), slot) == 1, block + " has a copy nobody watches");
      expect(bool(s.copy_event), block + " has a copy with no event");
    }
    // Note [Kept blocks stay addressable]: host VMM memory is a kept block's that owns its
    // granules (or one unkept while away), its host copy when it has one, mapped at its
    // address only while its device pages are gone.
    if (s.backing) {
      backed += s.backing->pages.size();
      expect(owns_granules(s) && (s.kept || s.residency != Residency::kResident),
             block + " holds host VMM memory but is not a kept block that owns its granules");
      expect(!s.host || s.host == s.backing->host(), block + " has host VMM memory but its host copy elsewhere");
      expect(!s.backing->at_block || (s.residency == Residency::kEvicted && !s.pages_kept),
             block + " has its host memory mapped at its address while device pages are there");
      expect(!s.on_disk(), block + " has host VMM memory but is on the disk");
    }
    if (s.packs > 0) ++sum.num_tracked_blocks;
    if (s.kept) sum.kept_bytes += s.placed;
    expect(s.kept || !s.frozen, block + " is frozen but not kept");
    expect(s.residency != Residency::kClean || s.cold || s.frozen, block + " is clean and in use but not frozen");
    expect(!s.cold || bool(s.cold_event), block + " is cold with no cold event");
  }
  expect(by_addr_.size() == live, "the address map holds " + std::to_string(by_addr_.size()) + " blocks for " +
                                      std::to_string(live) + " live ones");
  expect(in_flight_.size() == copying, "in_flight lists " + std::to_string(in_flight_.size()) + " copies for " +
                                           std::to_string(copying));
  auto same = [&](uint64_t counted, uint64_t added, const char* name) {
    expect(counted == added, std::string(name) + " is " + std::to_string(counted) + " but the blocks add up to " +
                                 std::to_string(added));
  };
  same(st_.tagged_bytes, sum.tagged_bytes, "tagged_bytes");
  same(st_.tagged_waste_bytes, sum.tagged_waste_bytes, "tagged_waste_bytes");
  same(st_.clean_bytes, sum.clean_bytes, "clean_bytes");
  same(st_.evicted_bytes, sum.evicted_bytes, "evicted_bytes");
  same(st_.in_flight_bytes, sum.in_flight_bytes, "in_flight_bytes");
  same(st_.num_tracked_blocks, sum.num_tracked_blocks, "num_tracked_blocks");
  same(st_.disk_bytes, sum.disk_bytes, "disk_bytes");
  same(st_.kept_bytes, sum.kept_bytes, "kept_bytes");
  uint64_t deferred_backed = 0;
  for (const Deferred& d : deferred_)
    if (d.backing) deferred_backed += d.backing->pages.size();
  for (const auto& b : unreleased_) deferred_backed += b->pages.size();
  same(backed_bytes_, backed + deferred_backed, "host VMM bytes");
  std::string text;
  for (const std::string& b : broken) text += (text.empty() ? "" : "; ") + b;
  return text;
}

void Engine::Impl::reset_peaks() {
  std::lock_guard lock(mu_);
  st_.peak_host_bytes = host_.used_bytes() + backed_bytes_;
  st_.peak_tagged_waste_bytes = st_.tagged_waste_bytes;
}

}  // namespace vramswap::residency
