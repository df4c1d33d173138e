// Physical memory under the reservation: granules mapped in runs from one handle of pages
// each (Note [Runs]), spare pages reused before new ones are created, unmapping what no
// block needs (Note [Taking only the pages needed]), an offloadable block's pages given up
// and mapped again (unmap_block, map_block), and access for peer devices.
#include "pool/pool_impl.h"

namespace vramswap::pool {

bool DevicePool::Impl::needs_no_pages(const Block& block) {
  return (block.state == State::kFree && block.tag == kAnyStream) || (block.state == State::kLive && block.away);
}

bool DevicePool::Impl::range_idle(uint64_t g, uint64_t count) const {
  const uintptr_t start = va_.base() + g * granularity_, end = start + count * granularity_;
  auto b = blocks_.upper_bound(start);
  if (b != blocks_.begin()) --b;  // the block holding the granule's first byte
  for (; b != blocks_.end() && b->first < end; ++b)
    if (!needs_no_pages(b->second)) return false;
  return true;
}

// Note [Runs]
// -----------
// On a GPU the VMM calls cost per call, not per byte: cuMemMap + cuMemSetAccess +
// cuMemUnmap of one handle took 62-98 us whether it held 1 or 256 granules of 2 MiB, where
// one cuMemSetAccess over 256 granules mapped from a handle each took 6-12 ms (H100,
// tests/gpu/vmm_cost.py, 2026-11-26). With one handle per granule, a training step at 80%
// of its peak, remapping 13.8 GiB, spent 472 ms of host time in those calls (the step took
// 791 ms where torch's took 391). So once pages change place (a mapping was refused, or a
// block was given up: remapping_), map_range maps each stretch of consecutive unmapped
// granules it needs as one run: one handle of physical pages (a spare one of exactly that
// size when there is one, else a new one), one cuMemMap, one cuMemSetAccess. Spare pages
// keep their size: as many bytes of spare pages no run of this call can use are released
// (cuMemRelease) as new ones are created, so that what the pool holds does not grow with
// pages of a shape nothing asks for; past the limit, idle runs are unmapped as well.
//
// A run can only be unmapped whole: cuMemUnmap refuses part of a mapping, and cuMemMap maps
// a handle from its start only. So a run must never hold the pages of two blocks that live
// apart. The granules a block covers only in part, at its ends, which a neighbour may share,
// are runs of their own; and no block is placed so that it cuts a run (takes part of it, or
// reaches into it with a granule it covers only in part) while a block still needs any of
// that run's pages (cuts_busy_run: a live or pending block, or one free only for its stream,
// whose work may still be queued). A run no block needs is unmapped before a block cuts it
// (unmap_cut_runs), so that the block's pages are its own. Tried without that rule, the
// blocks placed into the runs of blocks freed just before them kept those runs mapped long
// after (an activation beside a cached temporary, each holding half a run): evictions freed
// nothing (a replayed GPT-1.3B step on its card moved 55 -> 89 GB), and with runs of at most
// 8 granules GPT-2 small at 90% ran out of memory. Before pages first change place one
// granule is one run, as it always was: with runs from the start, the rule kept blocks out
// of their stream's cached memory and a limit above the peak grew to the limit and evicted
// (GPT-2 small-v10k at 112%, 466 MB in its first step); letting blocks cut runs until then
// left shared runs that ran the pool out of memory later (GPT-2 small at 75%). A block given
// up starts them too: a step whose plan evicts early enough may never meet the limit.
// What those first steps mapped stays one granule a run until it is unmapped, one call a
// granule: GPT-2 small at 90% with cudasim's H100 host costs is 1.32x its bound after two
// warm-up steps and still unmaps hundreds of such granules a step after six.
bool DevicePool::Impl::map_range(uintptr_t addr, uint64_t size, std::string* why, uint64_t* lacking) {
  const uint64_t first = granule_index(addr), last = granule_index(addr + size - 1);
  if (unmapped_in(addr, size) == 0) return true;
  // The runs to map: each stretch of unmapped granules, its granules at the block's ends
  // that the block covers in part split off.
  struct Run {
    uint64_t first, count;
    size_t spare = SIZE_MAX;  // the index in spare_ of the pages it takes, or SIZE_MAX: new
  };
  std::vector<Run> runs;
  uint64_t whole_lo = 0, whole_end = 0;
  whole_granules(addr, size, &whole_lo, &whole_end);
  auto whole = [&](uint64_t g) { return g >= whole_lo && g < whole_end; };
  for (uint64_t g = first; g <= last;) {
    if (mapped(g)) {
      ++g;
      continue;
    }
    uint64_t h = g + 1;
    if (whole(g))
      while (h <= last && !mapped(h) && whole(h) && remapping_) ++h;
    runs.push_back({g, h - g});
    g = h;
  }
  // Spare pages of a run's size are taken first; what none fits is created.
  uint64_t created = 0;
  std::vector<bool> taken;
  auto match = [&] {
    taken.assign(spare_.size(), false);
    created = 0;
    for (Run& r : runs) {
      r.spare = SIZE_MAX;
      for (size_t i = 0; i < spare_.size(); ++i)
        if (!taken[i] && spare_[i].size() == r.count * granularity_) {
          taken[i] = true;
          r.spare = i;
          break;
        }
      if (r.spare == SIZE_MAX) created += r.count * granularity_;
    }
  };
  match();
  // Spare pages no run here can use give way to the new ones: kept, they would only add to
  // what the pool holds (reserved) for pages of a shape nothing asks for now.
  if (created > 0 && release_spare_for(created, taken) > 0) match();
  if (created > 0 && reserved_ + created > limit_) {
    const uint64_t over = (reserved_ + created - limit_ + granularity_ - 1) / granularity_;
    unmap_unused(over, first, last);
    match();
    if (reserved_ + created > limit_ && release_spare_for(reserved_ + created - limit_, taken) > 0) match();
  }
  if (reserved_ + created > limit_) {  // refuse before mapping anything
    *why = "the limit";
    pressed_ = remapping_ = true;
    *lacking = reserved_ + created - limit_;
    return false;
  }
  cuda::ContextScope scope(device_);
  // The spare pages the runs take, out of spare_ (highest index first, so that the others'
  // indexes hold).
  std::vector<cuda::PhysicalPages> pages_of(runs.size());
  {
    std::vector<std::pair<size_t, size_t>> by_index;  // (spare index, run)
    for (size_t r = 0; r < runs.size(); ++r)
      if (runs[r].spare != SIZE_MAX) by_index.emplace_back(runs[r].spare, r);
    std::sort(by_index.rbegin(), by_index.rend());
    for (auto [i, r] : by_index) pages_of[r] = take_spare(i);
  }
  std::vector<std::pair<uint64_t, bool>> mapped_now;  // the runs this call mapped: (head, pages were spare)
  for (size_t r = 0; r < runs.size(); ++r) {
    const Run& run = runs[r];
    const bool recycled = run.spare != SIZE_MAX;
    try {
      cuda::PhysicalPages pages = std::move(pages_of[r]);
      if (!recycled) {
        pages = cuda::PhysicalPages(device_, run.count * granularity_);
        reserved_ += pages.size();
      }
      try {
        granules_[run.first].mapping = cuda::Mapping(va_.base() + run.first * granularity_, pages, peers_);
      } catch (...) {
        give_back(std::move(pages), recycled);
        throw;
      }
      granules_[run.first].pages = std::move(pages);
      granules_[run.first].count = run.count;
      for (uint64_t g = run.first; g < run.first + run.count; ++g) granules_[g].head = run.first;
      mapped_top_ = std::max(mapped_top_, run.first + run.count);
      mapped_now.emplace_back(run.first, recycled);
      history_.add(TraceEvent::Action::kSegmentMap, va_.base() + run.first * granularity_, run.count * granularity_, 0,
                   cause_);
      mapped_ += run.count * granularity_;
    } catch (const cuda::CudaError& e) {
      // The device is full: undo this call, so that a refused request leaves the device as
      // it found it for its other users (recycled pages go back to the spare list).
      for (auto [head, was_spare] : mapped_now) {
        try {
          unmap_run(head);
        } catch (const cuda::CudaError&) {
          continue;  // CUDA refused: it stays mapped, counted, an unused run unmapped later
        }
        give_back(take_spare(spare_.size() - 1), was_spare);  // the pages unmap_run made spare
      }
      for (size_t k = r + 1; k < runs.size(); ++k)
        if (pages_of[k]) push_spare(std::move(pages_of[k]));
      if (!e.out_of_memory()) throw;
      *why = "the device's free memory";
      pressed_ = remapping_ = true;
      *lacking = created;  // how much the device lacks is not known
      return false;
    }
  }
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  peak_mapped_ = std::max(peak_mapped_, mapped_);
  return true;
}

void DevicePool::Impl::give_back(cuda::PhysicalPages pages, bool was_spare) {
  if (!was_spare) {
    try {
      const uint64_t bytes = pages.size();
      pages.release();
      reserved_ -= bytes;
      return;
    } catch (const cuda::CudaError&) {
      // CUDA refused: kept as spare (still reserved), released again by release_spare().
    }
  }
  push_spare(std::move(pages));
}

bool DevicePool::Impl::unmap_cut_runs(uintptr_t addr, uint64_t size) {
  std::vector<uint64_t> heads;
  for_each_cut_run(addr, size, [&](uint64_t head, uint64_t n) {
    if (range_idle(head, n)) heads.push_back(head);  // a busy one is never cut (cuts_busy_run)
  });
  if (heads.empty()) return true;
  cuda::ContextScope scope(device_);
  for (uint64_t head : heads) {
    try {
      unmap_run(head);
    } catch (const cuda::CudaError&) {
      return false;
    }
  }
  return true;
}

void DevicePool::Impl::unmap_run(uint64_t head) {
  Granule& h = granules_[head];
  h.mapping.unmap();
  const uint64_t count = h.count;
  history_.add(TraceEvent::Action::kSegmentUnmap, va_.base() + head * granularity_, count * granularity_, 0, cause_);
  push_spare(std::move(h.pages));
  for (uint64_t g = head; g < head + count; ++g) granules_[g].head = kUnmapped;
  h.count = 0;
  mapped_ -= count * granularity_;
}

// Note [Taking only the pages needed]
// ------------------------------------
// At the limit, a range to map takes its pages from granules nothing uses (cached free
// blocks', unmapped for it), as many as it lacks and no more. Every measure of the
// escalation (relieve) used to end by unmapping every unused granule of the pool: the next
// allocations then found their cached free memory unmapped and mapped it again, so that
// a training step at 90% of its peak mapped ~5,000 granules and unmapped ~4,000 where its
// evictions moved 288. On a GPU each run given pages costs cuMemMap + cuMemSetAccess
// (~30-40 us) and each unmapped a cuMemUnmap (~20-25 us), on the allocating thread
// (cuda/host_time.h, CUDASIM_HOST_COSTS), whatever its length (Note [Runs]). Runs go whole,
// so up to a run less one granule more than asked for may go. The highest go first: the
// lowest hold what is placed first and reused most. (Tried: the smallest idle run that
// covers what is missing, else the largest; with cudasim's H100 costs the geometric mean of
// step/bound moved 1.802 -> 1.792 with rows both ways, GPT-2 small at 75% 1.03 -> 1.09.)
uint64_t DevicePool::Impl::unmap_unused(uint64_t count, uint64_t keep_first, uint64_t keep_last) {
  uint64_t done = 0;
  std::unique_ptr<cuda::ContextScope> scope;
  for (uint64_t g = std::min<uint64_t>(mapped_top_, granules_.size()); g-- > 0 && done < count;) {
    if (!mapped(g)) continue;
    const uint64_t head = granules_[g].head, n = granules_[head].count;
    g = head;  // the loop goes on below the run
    if ((head <= keep_last && head + n > keep_first) || !range_idle(head, n)) continue;
    if (!scope) scope = std::make_unique<cuda::ContextScope>(device_);
    try {
      unmap_run(head);
    } catch (const cuda::CudaError&) {
      continue;  // CUDA refused: the run stays mapped (and counted), to be tried again later
    }
    done += n;
  }
  return done;
}

void DevicePool::Impl::release_spare() { release_spare_for(UINT64_MAX, {}); }

uint64_t DevicePool::Impl::release_spare_for(uint64_t bytes, const std::vector<bool>& keep) {
  uint64_t released = 0;
  if (spare_.empty()) return 0;
  cuda::ContextScope scope(device_);
  // One at a time: pages CUDA refuses to release stay spare (and counted), tried again later.
  for (size_t i = spare_.size(); i-- > 0 && released < bytes;) {
    if (i < keep.size() && keep[i]) continue;
    const uint64_t size = spare_[i].size();
    try {
      spare_[i].release();
    } catch (const cuda::CudaError&) {
      continue;
    }
    spare_.erase(spare_.begin() + std::ptrdiff_t(i));
    spare_bytes_ -= size;
    reserved_ -= size;
    released += size;
  }
  return released;
}

Result DevicePool::Impl::unmap_block(void* ptr, bool* partly, uint64_t* freed) {
  if (partly) *partly = false;
  if (freed) *freed = 0;
  std::lock_guard lock(mu_);
  auto b = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (b == blocks_.end() || b->second.state != State::kLive || !b->second.offloadable)
    return {false, "unmap of " + format_pointer(ptr) + ": not a live offloadable block"};
  if (b->second.away) return {false, "unmap of " + format_pointer(ptr) + ": already given up (unmapped)"};
  caches_off();  // pages are remapped from now on (Note [Thread caches])
  cuda::ContextScope scope(device_);
  b->second.away = true;  // so that granule_idle() sees its own granules as free of it
  remapping_ = true;
  ++away_blocks_;
  uint64_t done = 0;
  for (uint64_t g = granule_index(b->first), last = granule_index(b->first + b->second.size - 1); g <= last; ++g) {
    if (!mapped(g)) continue;
    const uint64_t head = granules_[g].head, n = granules_[head].count;
    g = head + n - 1;  // the loop goes on after the run
    if (!range_idle(head, n)) continue;  // shared with a block that needs it
    try {
      CauseScope eviction(cause_, TraceEvent::Cause::kEvict);
      unmap_run(head);
    } catch (const cuda::CudaError& e) {
      // That run stays mapped. The block counts as away once any granule went (a later
      // map_block maps what is missing); with none gone nothing changed.
      b->second.away = done > 0;
      if (done == 0) --away_blocks_;
      if (partly) *partly = done > 0;
      if (freed) *freed = done * granularity_;
      return {false, "unmap of " + format_pointer(ptr) + ": " + e.what()};
    }
    done += n;
  }
  if (freed) *freed = done * granularity_;
  return {};
}

Result DevicePool::Impl::map_block(void* ptr, MapWait wait, cudaStream_t stream) {
  std::unique_lock lock(mu_);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  auto b = blocks_.find(addr);
  if (b == blocks_.end() || b->second.state != State::kLive || !b->second.offloadable || !b->second.away)
    return {false, "map of " + format_pointer(ptr) + ": not a live offloadable block that was given up (unmap_block)"};
  const uint64_t size = b->second.size;
  caches_off();
  std::string why;
  // The pool's own measures, as for an allocation (no reclaim: the caller is the
  // reclaimer's owner), as far as `wait` allows.
  const Relief last = wait == MapWait::kStream ? Relief::kSynchronizeStream : Relief::kSynchronize;
  const Relief kSteps[] = {Relief::kUnusedGranules, Relief::kDrainPending, last};
  const size_t steps = wait == MapWait::kSynchronize || wait == MapWait::kStream ? 3
                       : wait == MapWait::kPendingFrees                           ? 2
                                                                                  : 1;
  for (int round = 0;; ++round) {
    for (size_t step = 0; step <= steps; ++step) {
      if (step > 0 && !relieve(kSteps[step - 1], size, wait == MapWait::kStream ? stream : kAnyStream, lock)) continue;
      uint64_t lacking = 0;
      bool done = false;
      {
        CauseScope fetch(cause_, TraceEvent::Cause::kFetch);
        done = map_range(addr, size, &why, &lacking);
      }
      if (done) {
        blocks_.at(addr).away = false;
        --away_blocks_;
        return {};
      }
      if (step > 0 && kSteps[step - 1] == Relief::kDrainPending && waiting()) --step;  // the next oldest
    }
    // Note [Blocks another synchronization holds], where `wait` allows waiting at all. The
    // block is the caller's (its engine's lock is held): still live and away after the wait.
    if (steps < 3 || !await_held_blocks(lock, round)) break;
  }
  // Note [Why nothing fits], for a block needed now (the others' refusals are tried again).
  const std::string why_not =
      wait == MapWait::kSynchronize && why == "the limit" ? why_nothing_fits(size, stream, true, addr) : "";
  return {false, "map of " + format_pointer(ptr) + " (" + format_size(size) + "): refused by " + why + ": " +
                     oom_report(size, size, why) + why_not,
          true};
}

Result DevicePool::Impl::grant_peer(int peer) {
  if (peer < 0 || peer >= 64 || peer == device_) return {};  // a pool's own device has access
  const uint64_t bit = uint64_t(1) << peer;
  std::lock_guard lock(mu_);
  if (peers_ & bit) return {};
  for (uint64_t g = 0; g < mapped_top_; ++g) {
    if (granules_[g].head != g || !granules_[g].mapping) continue;
    try {
      granules_[g].mapping.grant(peer);
    } catch (const cuda::CudaError& e) {
      return {false, "granting device " + std::to_string(peer) + " access to device " + std::to_string(device_) +
                         "'s memory at " + format_pointer(reinterpret_cast<void*>(va_.base() + g * granularity_)) +
                         " failed: " + e.what()};
    }
  }
  peers_ |= bit;
  return {};
}

}  // namespace vramswap::pool
