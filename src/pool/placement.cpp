// Where a block goes: best fit over the free blocks of the allocating stream's tag and of
// any stream, the rules of placing for eviction (Note [Placing for eviction] in
// device_pool.h: closed granules, the open granule of a stream's small offloadable blocks,
// places that need no new pages), and a released block merged with its free neighbours of
// the same tag back into the free index.
#include "pool/pool_impl.h"

namespace vramswap::pool {

DevicePool::Impl::BlockIt DevicePool::Impl::find_fit(uint64_t size, cudaStream_t stream, bool offloadable,
                                                     bool aligned, uintptr_t* start, bool strict) {
  // While placing for eviction, for a small block (below half a granule) a place that
  // occupies no granule without live blocks comes first, then one on mapped granules: a
  // small block put at the start of a free range over unmapped granules (or on a cached,
  // idle granule) pins a page of its own while a hole on an occupied one waits. Those
  // searches are bounded; then the first fit by size. (A larger block fills most of what it
  // maps; tried for every size, the benchmark's rows moved both ways, geometric mean of
  // step/bound 1.076 to 1.081; for small blocks only, 1.072.)
  const int first_pass = grouping() && size < granularity_ / 2 ? 0 : 2;
  for (int pass = first_pass; pass < 3; ++pass) {
    auto acceptable = [&](uintptr_t a) {
      if (cuts_busy_run(a, size)) return false;
      if (pass == 2) return true;
      for (uint64_t g = granule_index(a), last = granule_index(a + size - 1); g <= last; ++g)
        if (!mapped(g) || (pass == 0 && live_on_[0][g] == 0 && live_on_[1][g] == 0)) return false;
      return true;
    };
    BlockIt best = blocks_.end();
    uint64_t best_size = UINT64_MAX;
    size_t looked = 0;
    for (cudaStream_t tag : {stream, kAnyStream}) {
      auto it = free_.find(tag);
      if (it == free_.end()) continue;
      for (auto fit = best_fit(it->second, size); fit != it->second.end() && fit->first < best_size; ++fit) {
        if (pass < 2 && ++looked > kMappedFitLooks) break;
        uintptr_t lo = 0, hi = 0;
        if (!usable_part(fit->second, fit->first, stream, offloadable, strict, &lo, &hi)) continue;
        if (aligned) lo = round_up(lo, granularity_);
        // A small offloadable block placed for eviction lies within one granule: fetching it
        // back then needs one page, not two.
        else if (offloadable && grouping() && granule_index(lo) != granule_index(lo + size - 1))
          lo = round_up(lo + 1, granularity_);
        if (hi <= lo || hi - lo < size) continue;
        if (!acceptable(lo)) {
          // The range's last granule may be acceptable where its first is not: the block
          // goes at the end instead (within one granule, or aligned, as above).
          const uintptr_t end_start = hi - size;
          const bool keeps_rules = aligned ? end_start % granularity_ == 0
                                           : !(offloadable && granule_index(end_start) != granule_index(hi - 1));
          if (!keeps_rules || !acceptable(end_start)) continue;
          lo = end_start;
        }
        best_size = fit->first;
        best = blocks_.find(fit->second);
        *start = lo;
        break;
      }
    }
    if (best != blocks_.end()) return best;
  }
  return blocks_.end();
}

// Note [A step's addresses]
// -------------------------
// A training loop makes the same allocations in the same order every step. At the limit,
// best fit places each by size among the free blocks of the moment, and those differ from
// step to step (a block freed late, a fetch's pages, an eviction's hole), so a block often
// lands on addresses whose pages were taken since, and is given pages from idle cached runs
// elsewhere: each a cuMemUnmap of those runs, a cuMemRelease, a cuMemCreate, a cuMemMap and
// a cuMemSetAccess, tens of microseconds each on a GPU (Note [Runs] in granules.cpp). With
// the step before's addresses kept, the allocation of the same order and size goes where
// that step put it when that place is free for it under find_fit's rules (`strict` as
// there: no closed granule, no busy run cut, aligned where asked): its pages are usually
// still mapped there, left by its own free in the step before. Not always: an eviction or a
// fetch may have taken them since, and where best fit's place has fewer granules unmapped
// the block goes there (allocate_slow; the test
// LimitOfEight.ARepeatedStepsBlockGoesWhereThePagesAreIfItsPlaceLostThem). Kept whatever
// its pages, the place cost AdamW's state rows remaps: gpt-medium-adamw at 75% of its peak
// made 4,184 VMM calls where best fit made 3,626, 2.817x its bound with the H100's host
// costs against 2.501x. Only blocks of half a
// granule or more (the ones that map runs); the order is theirs alone, counted from the
// engine's step boundary (DevicePool::begin_step); a place that is taken or closed falls
// back to best fit, and the step after follows wherever this one put the block. Only while
// placing for eviction (grouping()) and at the limit (pages_scarce: a block's new pages
// would be taken from elsewhere): with pages to
// spare the place is no cheaper than best fit's, and taking it splits a larger free block for
// nothing (gpt-small-lora with its limit above its peak reserved 18.1 GiB with it, 16.5
// without; LimitOfSixtyFour.WithPagesToSpareARepeatedStepsBlockGoesWhereBestFitPutsIt).
// Measured (`vramswap bench all --json`, 106 rows, VMM calls over the measured steps;
// step/bound as a geometric mean): two warm-ups with the H100's host costs
// (CUDASIM_HOST_COSTS=h100) 381,036 -> 347,312 calls, 1.6775 -> 1.6423 (rows within 1.05x
// 49 -> 50); four warm-ups 353,054 -> 339,143, 1.6479 -> 1.6342 (51 -> 55); without host
// costs 380,138 -> 345,357 calls, 1.0870 -> 1.0881.
DevicePool::Impl::BlockIt DevicePool::Impl::find_step_place(uint64_t key, uint64_t size, cudaStream_t stream,
                                                            bool offloadable, bool aligned, uintptr_t* start,
                                                            bool strict) {
  const size_t i = step_now_.size();
  if (!grouping() || key < granularity_ / 2 || i >= step_before_.size() || step_before_[i].first != key) return blocks_.end();
  const uintptr_t at = step_before_[i].second;
  if (aligned && (at - va_.base()) % granularity_ != 0) return blocks_.end();
  auto b = blocks_.upper_bound(at);
  if (b == blocks_.begin()) return blocks_.end();
  --b;  // the block holding `at`
  const Block& f = b->second;
  uintptr_t lo = 0, hi = 0;
  if (f.state != State::kFree || (f.tag != stream && f.tag != kAnyStream) || at + size > b->first + f.size ||
      !usable_part(b->first, f.size, stream, offloadable, strict, &lo, &hi) || at < lo || at + size > hi ||
      cuts_busy_run(at, size))
    return blocks_.end();
  *start = at;
  return b;
}

bool DevicePool::Impl::usable_part(uintptr_t addr, uint64_t size, cudaStream_t stream, bool offloadable,
                                   bool strict, uintptr_t* lo, uintptr_t* hi) const {
  // Only the free block's first and last granules can hold live blocks (the rest lie
  // inside it); a granule closed to this block is left out.
  *lo = addr;
  *hi = addr + size;
  if (strict && closed_to(granule_index(*lo), offloadable, stream))
    *lo = va_.base() + (granule_index(*lo) + 1) * granularity_;
  if (strict && *hi > *lo && closed_to(granule_index(*hi - 1), offloadable, stream))
    *hi = va_.base() + granule_index(*hi - 1) * granularity_;
  return *hi > *lo;
}

// Note [Placing on mapped pages]
// -------------------------------
// Best fit chooses by size alone. At the limit, the hole it picks is often one whose pages
// were given up (an evicted block freed, a cached granule unmapped for another request)
// while a larger cached block still has its pages mapped: the block then maps a fresh
// granule for each it covers, taking the pages of idle cached ones, which the next
// request's best fit may pick again. A training step at 90% of its peak so mapped and
// unmapped ~2,650 granules a step where its evictions moved 288; on a GPU each costs
// cuMemMap + cuMemSetAccess and cuMemUnmap, on the allocating thread (~40 + 25 us on an idle
// H100, more on a busy one: cuda/host_time.h). So when a block of half a granule or more
// cannot be given new pages without taking a cached granule's (pages_scarce), the place
// needing the fewest new mappings among the free blocks find_fit looks at is compared with
// best fit's, and taken when it saves at least half the block's granules: a smaller saving
// is not worth the larger free block it splits (tried with any saving: a replayed LM step
// spent its cached holes on blocks of a few granules and waited 27 ms more for fetches).
// Not while a block is away (evicted, not yet back): the fetches that bring it back take
// the pages of blocks the program's stream freed, which only a synchronization of that
// stream frees for them, and best fit's places at the limit have the allocation make it
// (kSynchronizeStream); placed on the mapped pages instead, allocations stopped making it,
// and fetches waited (GPT-2 small at 75%: first step 131 -> 150 ms; a replayed LM step
// 154 -> 181 ms). Tried and not kept: promoting large frees (deallocate_to_any's event) so
// that fetches could take those pages anyway: fetches ahead then filled memory backward
// needed (VGG-16 at batch 128 and 75%: 1.017 -> 1.175 of the bound).
// With CUDASIM_HOST_COSTS=h100, `vramswap bench all`'s geometric mean of step/bound went from
// 3.34 to 3.11 (GPT-2 small at 90%: 4.60 to 2.36, ~2,850 granules mapped and unmapped a step
// to ~2,130); without host costs 1.0361 to 1.0384 at warm-up 2 (no row within 1.05 of the
// bound left it; VGG-16 at batch 128 and 75% 1.017 -> 1.044) and 1.0384 to 1.0365 at warm-up 1.
// Measured again with plans and runs (2026-11-28, two warm-ups, 106 rows), the rule applied
// with blocks away too: VMM calls over all rows' measured steps 412,504 -> 367,822 and the
// geometric mean 1.0857 -> 1.0853 without host costs; with the H100's, 381,036 -> 376,568
// calls and 1.6775 -> 1.6504, but rows moved both ways by up to a third (GPT-2 small at 90%
// 1.371 -> 1.258, GPT-2 small-lora at 90% and horizon 8 1.125 -> 1.482, the AdamW step at
// 75% without host costs 1.698 -> 1.809): not kept. Most of a step's remapping is not this
// rule's to save: the places it compares need new pages too (DESIGN.md, Remapping).
DevicePool::Impl::BlockIt DevicePool::Impl::find_mapped_fit(uint64_t size, cudaStream_t stream, bool offloadable,
                                                            bool aligned, uintptr_t* start, bool strict,
                                                            uint64_t* missing) {
  BlockIt best = blocks_.end();
  uint64_t best_missing = UINT64_MAX, best_size = UINT64_MAX;
  std::vector<uint32_t> unmapped_below;  // per granule of the part looked at: unmapped ones before it
  for (cudaStream_t tag : {stream, kAnyStream}) {
    auto it = free_.find(tag);
    if (it == free_.end()) continue;
    size_t looked = 0;
    for (auto fit = best_fit(it->second, size); fit != it->second.end() && best_missing > 0; ++fit) {
      if (++looked > kMappedFitLooks) break;
      uintptr_t lo = 0, hi = 0;
      if (!usable_part(fit->second, fit->first, stream, offloadable, strict, &lo, &hi)) continue;
      if (aligned) lo = round_up(lo, granularity_);
      if (hi <= lo || hi - lo < size) continue;
      // No granule at or above mapped_top_ is mapped: a place starting there needs all new.
      const uint64_t g_lo = granule_index(lo);
      if (g_lo >= mapped_top_) continue;
      const uintptr_t last_start = std::min(hi - size, va_.base() + mapped_top_ * granularity_);
      const uint64_t g_hi = granule_index(last_start + size - 1);
      unmapped_below.assign(g_hi - g_lo + 2, 0);
      for (uint64_t g = g_lo; g <= g_hi; ++g)
        unmapped_below[g - g_lo + 1] = unmapped_below[g - g_lo] + (mapped(g) ? 0 : 1);
      // The block may start at the part's start or at any granule boundary after it.
      auto consider = [&](uintptr_t s) {
        if (cuts_busy_run(s, size)) return;
        const uint64_t m =
            unmapped_below[granule_index(s + size - 1) - g_lo + 1] - unmapped_below[granule_index(s) - g_lo];
        if (m < best_missing || (m == best_missing && fit->first < best_size)) {
          best_missing = m;
          best_size = fit->first;
          best = blocks_.find(fit->second);
          *start = s;
        }
      };
      consider(lo);
      for (uintptr_t s = va_.base() + (g_lo + 1) * granularity_; s <= last_start && best_missing > 0;
           s += granularity_)
        consider(s);
    }
  }
  *missing = best_missing;
  return best;
}

void DevicePool::Impl::count_on_granules(uintptr_t addr, uint64_t size, int row, int delta) {
  std::vector<uint32_t>& counts = live_on_[row];
  for (uint64_t g = granule_index(addr), last = granule_index(addr + size - 1); g <= last; ++g) counts[g] += delta;
}

void DevicePool::Impl::release_block(BlockIt b, cudaStream_t tag, uint64_t serial) {
  b->second.state = State::kFree;
  unlend(b);
  b->second.tag = tag;
  b->second.also_on.clear();
  if (b->second.away) --away_blocks_;
  b->second.away = false;  // a free block's contents are no one's
  // Every release to a stream gets a fresh serial, and a merged block carries the latest:
  // only that release's promotion event (the latest on the stream, so it covers the
  // others) may hand it to any stream. A release with no promotion thus blocks older ones.
  b->second.serial = tag == kAnyStream ? 0 : serial != 0 ? serial : ++next_serial_;
  b = coalesce(
      blocks_, b, [&](const Block& n) { return n.state == State::kFree && n.tag == tag; },
      [&](BlockIt n) { index_erase(n); },
      [](Block& kept, const Block& gone) { kept.serial = std::max(kept.serial, gone.serial); });
  index_insert(b);
}

}  // namespace vramswap::pool
