// The reactive policy (Note [The reactive policy] in reactive.h): Belady's victims, the
// reclaimer's rounds, the soft watermark, the prefetch window and the fetch ahead of it.
#include "policy/reactive.h"

#include <algorithm>

namespace vramswap::policy {

Window window_of(const UseOrder& order, int horizon) {
  const std::vector<uint32_t> w = order.window(horizon);
  return {w.begin(), w.end()};
}

bool evictable(const BlockView& b, bool in_window) {
  return b.live && b.state == BlockState::kResident && b.cold && !b.unpacked && !in_window;
}

bool kept_clean(const BlockView& b, bool in_window) {
  return b.state == BlockState::kClean && in_window && !b.planned_out;
}

bool droppable(const BlockView& b, bool in_window) {
  return b.state == BlockState::kClean && b.cold && !kept_clean(b, in_window);
}

Room room_for(const BlockView& b, bool in_window) {
  if (droppable(b, in_window)) return Room::kDrop;
  if (!evictable(b, in_window)) return Room::kPass;
  return b.shares_granules ? Room::kEvictGranule : Room::kEvict;
}

Mate granule_mate(const BlockView& b, bool in_window) {
  if (evictable(b, in_window)) return Mate::kJoins;
  const bool away = b.state == BlockState::kEvicted || (b.state == BlockState::kEvicting && !b.cancelled) ||
                    (b.state == BlockState::kClean && b.cold && !in_window);
  return away ? Mate::kAway : Mate::kHolds;
}

uint64_t soft_excess(uint64_t soft_limit, uint64_t mapped, uint64_t clean, uint64_t leaving) {
  const uint64_t resident = mapped - std::min(mapped, clean);
  return resident > soft_limit + leaving ? resident - soft_limit - leaving : 0;
}

uint64_t Reactive::start_victims(uint64_t bytes, uint32_t except, bool window_too) {
  const Window w = window(window_too);
  uint64_t started = 0;
  order_.each_furthest_first([&](uint32_t slot) {
    if (started >= bytes) return false;
    if (slot == except) return true;
    const BlockView b = engine_.view(slot);
    if (!evictable(b, w.count(slot))) return true;
    if (!engine_.start_eviction(slot)) return false;  // the host tier is full
    started += b.placed;
    return true;
  });
  return started;
}

uint64_t Reactive::drop_clean(uint64_t bytes, uint32_t except, bool window_too) {
  if (engine_.clean_bytes() == 0) return 0;
  const Window w = window(window_too);
  uint64_t dropped = 0;
  order_.each_furthest_first([&](uint32_t slot) {
    if (dropped >= bytes) return false;
    if (slot == except) return true;
    const BlockView b = engine_.view(slot);
    if (!droppable(b, w.count(slot))) return true;
    dropped += engine_.drop(slot);
    return true;
  });
  return dropped;
}

uint64_t Reactive::make_room(uint64_t bytes, uint32_t except, bool window_too) {
  const Window w = window(window_too);
  uint64_t covered = engine_.leaving_bytes();  // evictions under way free pages too
  const uint64_t unmapped_before = engine_.unmapped_total();
  order_.each_furthest_first([&](uint32_t slot) {
    if (covered >= bytes) return false;
    if (slot == except) return true;
    const BlockView b = engine_.view(slot);
    switch (room_for(b, w.count(slot))) {
      case Room::kPass:
        break;
      case Room::kDrop:  // what it freed: a granule shared with a block in use stays
        covered += engine_.drop(slot);
        break;
      case Room::kEvictGranule:
        covered += engine_.evict_granule(slot, w);
        break;
      case Room::kEvict:  // the host tier full: only clean blocks help
        if (engine_.start_eviction(slot)) covered += b.placed;
        break;
    }
    return true;
  });
  return engine_.unmapped_total() - unmapped_before;
}

uint64_t Reactive::reclaim(uint64_t bytes, bool wait, uint32_t except) {
  const uint64_t unmapped_before = engine_.unmapped_total();
  auto freed = [&] { return engine_.unmapped_total() - unmapped_before; };
  // Copies that already landed first: an eviction that completed leaves a clean block to
  // drop at once; a fetch that completed makes its block resident, and it may be a victim
  // by now (the window moved on while it was in flight).
  engine_.complete_copies(false);
  if (following_) {
    // The plan's victims, copied out since they went cold, are what it gives up at once; no
    // eviction starts beyond the plan before the pool has tried its own measures (the
    // forward's cached blocks, once the stream is synchronized: waiting for queued work
    // costs less than two copies over the bus). An allocation that must wait gives them up
    // first as well: Belady's rule over clean and evictable blocks together copies out a
    // block needed later than a victim of the plan, which only wants its pages unmapped.
    drop_clean(bytes, except);
    if (!wait || freed() >= bytes) return freed();
  }
  make_room(bytes - freed(), except);
  if (!wait) return freed();
  // Rounds 0 and 1 spare the prefetch window; waiting for round 0's copies may land fetches
  // whose blocks are victims for round 1. Round 2 is the last resort before an out-of-memory:
  // it takes blocks kept for the prefetch window too (they come back late, as faults, but
  // the step goes on).
  bool landed = true;  // copies may have landed since victims were last looked for
  for (int round = 0; round < 3 && freed() < bytes; ++round) {
    const bool window_too = round == 2;
    if (!landed && !window_too) continue;
    if (round > 0) make_room(bytes - freed(), except, window_too);
    landed = engine_.copies_in_flight();
    if (landed && freed() < bytes) {  // (make_room may have dropped enough clean blocks)
      // The evictions first, oldest first, as far as needed; then fetches too (a block that
      // lands may be a victim by now), which free nothing themselves.
      await_evictions(bytes - freed(), except, window_too);
      if (freed() < bytes) {
        engine_.complete_copies(true);
        drop_clean(bytes - freed(), except, window_too);
      }
    }
  }
  return freed();
}

void Reactive::await_evictions(uint64_t bytes, uint32_t except, bool window_too) {
  const uint64_t unmapped_before = engine_.unmapped_total();
  auto freed = [&] { return engine_.unmapped_total() - unmapped_before; };
  for (const auto& [seq, slot] : engine_.queued_evictions()) {
    if (freed() >= bytes) return;
    if (!engine_.await_eviction(slot, seq)) continue;  // landed or gone meanwhile
    if (freed() < bytes) drop_clean(bytes - freed(), except, window_too);
  }
}

void Reactive::soft_evict(uint64_t soft_limit_bytes) {
  // Following a plan, its evictions replace the watermark's: copies made for the watermark
  // would be bytes the plan does not need out.
  if (soft_limit_bytes == 0 || following_) return;
  const uint64_t excess =
      soft_excess(soft_limit_bytes, engine_.mapped_bytes(), engine_.clean_bytes(), engine_.leaving_bytes());
  if (excess > 0) start_victims(excess);
}

void Reactive::after_unpack() {
  if (horizon_ <= 0) return;
  // A victim the plan being followed still wants out is left to its planned fetch: fetched
  // sooner, it takes memory the plan counts on, and the allocations there evict beyond it.
  for (uint32_t next : order_.window(horizon_)) {
    const BlockView b = engine_.view(next);
    if (b.planned_out) continue;
    if (b.state == BlockState::kEvicting) {
      engine_.cancel_eviction(next);
    } else if (b.state == BlockState::kEvicted) {
      if (!engine_.prefetch(next, false)) break;  // make_room started evictions for next time
    }
  }
  // Following a plan, its fetches are scheduled; fetching ahead would take memory the plan
  // counts on.
  if (!engine_.fetches_in_flight() && !following_) fetch_ahead();
}

// Note [Fetch ahead]
// ------------------
// Backward starts with the blocks saved last, which are resident; the window (the next
// `horizon` blocks) reaches the first evicted one only later, so under heavy eviction the
// H2D engine idled for the first part of backward while backward was freeing memory.
// When no fetch is in flight, the nearest evicted block past the window is fetched into
// memory that is free now, below the soft limit: one at a time, so that it keeps the copy
// engine busy without filling memory ahead of backward's own allocations.
void Reactive::fetch_ahead() {
  const uint64_t soft = engine_.soft_limit();
  order_.each_after_cursor([&](uint32_t next) {
    const BlockView b = engine_.view(next);
    if (b.state != BlockState::kEvicted) return true;
    if (engine_.mapped_bytes() + b.placed <= soft) engine_.prefetch(next, true);
    return false;
  });
}

}  // namespace vramswap::policy
