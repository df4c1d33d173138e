// The reactive policy: which blocks give their memory back when an allocation finds none
// (and in what rounds it waits), which blocks come back after an unpack, and what leaves
// before memory runs short (the soft watermark). Decisions only, over the use order
// (use_order.h) and a read-only view of each block's state; the engine carries them out
// through ReactiveEngine and keeps the states, the copies and the events
// (residency/engine_reclaim.cpp). The plan (planner.h) replaces some of it while a
// recorded step repeats: where it does, `following` says so.
//
// Note [The reactive policy]
// --------------------------
// Victims are chosen by Belady's rule: the block needed furthest in the future first, in
// the use order autograd makes exact. A block may start its copy out (it is *evictable*)
// when it is live, resident, cold, not unpacked yet, and not among the next `horizon`
// blocks to be used (the prefetch window, which would only fetch it back). A block whose
// copy landed (clean) gives its pages up at once when memory is needed (*drop*), unless
// it is in use (a frozen kept block keeps its host copy while used) or the window keeps
// it (and the plan being followed does not want it out now).
//
//  * make_room, walking furthest first until the bytes leaving (evictions under way
//    included) cover the request: drops clean blocks, evicts evictable ones; one that covers
//    no granule whole (a small one, or one placed densely across two) goes with every block
//    on its granules, or not at all
//    (Note [A shared granule goes as a whole] in residency/engine_copies.cpp).
//  * reclaim (the pool's reclaimer): completes landed copies; following a plan, drops its
//    clean victims first (and stops there when it may not wait); then make_room. When it
//    may wait, up to three rounds: each waits for the evictions under way (oldest first,
//    only as far as needed, dropping each as it lands), then for every copy; rounds 0 and 1
//    spare the window, round 2 (the last resort before an out-of-memory) takes it too. A
//    round with nothing landed since the last is skipped (round 2 never is).
//  * The soft watermark (not while following a plan: its victims replace the
//    watermark's): when resident memory (mapped, clean blocks counting as gone) exceeds
//    the soft limit by more than what is leaving, the excess starts leaving.
//  * After an unpack: the window's evicted blocks are fetched (the first that finds no
//    memory ends it), evictions of its blocks under way are cancelled, and a victim the
//    plan still wants out is left to its planned fetch. With no fetch in flight and no plan
//    followed, the nearest evicted block past the window is fetched if it fits below the
//    soft limit now (Note [Fetch ahead] in reactive.cpp).
//
// Thread safety: none; the engine calls it under its mutex.
#pragma once

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "policy/use_order.h"

namespace vramswap::policy {

// A tagged block's residency (Note [Block states] in residency/engine.h).
enum class BlockState : uint8_t { kResident, kEvicting, kClean, kEvicted, kFetching };

// What the policy sees of one block.
struct BlockView {
  bool live = false;
  BlockState state = BlockState::kResident;
  bool cold = false;
  bool unpacked = false;
  bool cancelled = false;        // its eviction is under way but no longer wanted
  bool planned_out = false;      // following a plan: a victim the plan wants out now
  bool shares_granules = false;  // covers no granule whole (below half a granule, or placed
                                 // densely across two): it frees a page only with its mates
  uint64_t placed = 0;
};

// The prefetch window: the next `horizon` blocks after the use order's cursor.
using Window = std::set<uint32_t>;
Window window_of(const UseOrder& order, int horizon);

// Its eviction may start. Pure.
bool evictable(const BlockView& b, bool in_window);
// Clean, and kept for the window (the plan does not want it out now). Pure.
bool kept_clean(const BlockView& b, bool in_window);
// Clean, cold (a frozen kept block stays clean while it is used: Note [Kept blocks] in
// residency/engine.h) and not kept for the window: its pages may go at once. Pure.
bool droppable(const BlockView& b, bool in_window);

// What make_room does with a candidate. Pure.
enum class Room { kPass, kDrop, kEvictGranule, kEvict };
Room room_for(const BlockView& b, bool in_window);

// What a block on a small victim's granules means for the granule. kJoins: it leaves with
// the victim; kAway: it is gone or going already; kHolds: it keeps the granule mapped. Pure.
enum class Mate { kJoins, kAway, kHolds };
Mate granule_mate(const BlockView& b, bool in_window);

// The bytes the soft watermark starts evicting (0: none): resident memory is `mapped`
// less `clean` (given up at once when needed), and `leaving` is already on its way. Pure.
uint64_t soft_excess(uint64_t soft_limit, uint64_t mapped, uint64_t clean, uint64_t leaving);

// What the engine does for the policy. Every call acts at once; none chooses.
class ReactiveEngine {
 public:
  virtual BlockView view(uint32_t slot) const = 0;
  // Starts the copy out of an evictable block. False when the host tier is full.
  virtual bool start_eviction(uint32_t slot) = 0;
  // Gives up a clean block's pages (it becomes evicted); the bytes unmapped.
  virtual uint64_t drop(uint32_t slot) = 0;
  // A small victim's granules: evicts it with every block that joins it there, when no
  // block holds them; the granules' bytes, or 0 (nothing moved).
  virtual uint64_t evict_granule(uint32_t slot, const Window& window) = 0;
  // Device bytes unmapped ever (drop's): what reclaiming freed is its growth.
  virtual uint64_t unmapped_total() const = 0;
  // Bytes of the evictions under way that are still wanted.
  virtual uint64_t leaving_bytes() const = 0;
  // Bytes of the clean blocks (copied out, pages still mapped).
  virtual uint64_t clean_bytes() const = 0;
  // Completes the copies that landed (all of them, waiting, with `wait`).
  virtual void complete_copies(bool wait) = 0;
  virtual bool copies_in_flight() const = 0;
  // The evictions under way, in the order the copy engine runs them: (sequence, slot).
  virtual std::vector<std::pair<uint64_t, uint32_t>> queued_evictions() const = 0;
  // Waits for that eviction and completes what landed; false when it had completed or
  // gone meanwhile (nothing waited for).
  virtual bool await_eviction(uint32_t slot, uint64_t seq) = 0;
  // Cancels a wanted block's eviction under way (its pages stay and hold the data).
  virtual void cancel_eviction(uint32_t slot) = 0;
  // Starts a fetch for the window (it may make room: make_room) or, `ahead`, a fetch past
  // it into memory free now. False when it did not start.
  virtual bool prefetch(uint32_t slot, bool ahead) = 0;
  virtual bool fetches_in_flight() const = 0;
  virtual uint64_t mapped_bytes() const = 0;
  // The soft limit in bytes (the limit when none is set).
  virtual uint64_t soft_limit() const = 0;

 protected:
  ~ReactiveEngine() = default;
};

constexpr uint32_t kNoSlot = UINT32_MAX;

// The policy for one engine call: the use order as it is now, the window's size, whether a
// plan is being followed. `except`: a block never chosen (the one being fetched).
class Reactive {
 public:
  Reactive(const UseOrder& order, int horizon, bool following, ReactiveEngine& engine)
      : order_(order), horizon_(horizon), following_(following), engine_(engine) {}

  // Starts evictions, furthest first, until `bytes` are on their way; the bytes started.
  // Stops when the host tier is full. `window_too`: the window's blocks are victims too.
  uint64_t start_victims(uint64_t bytes, uint32_t except = kNoSlot, bool window_too = false);
  // Drops clean blocks, furthest first, until `bytes` were freed; the bytes freed.
  uint64_t drop_clean(uint64_t bytes, uint32_t except = kNoSlot, bool window_too = false);
  // Belady's rule over clean and evictable blocks together (above); the bytes freed now.
  uint64_t make_room(uint64_t bytes, uint32_t except = kNoSlot, bool window_too = false);
  // The pool's reclaimer (above); `wait`: it may wait for copies. The bytes freed.
  uint64_t reclaim(uint64_t bytes, bool wait, uint32_t except = kNoSlot);
  // The soft watermark (above); `soft_limit_bytes` 0: none set.
  void soft_evict(uint64_t soft_limit_bytes);
  // After an unpack moved the cursor (above).
  void after_unpack();

 private:
  // Waits for the evictions under way one at a time, in the order the copy engine runs
  // them, dropping each as it lands clean, until `bytes` were freed. Waiting for all of
  // them, an allocation that needed one block's room waited for every planned eviction
  // queued ahead (38 ms of copies on gpt-small-v10k at 75%).
  void await_evictions(uint64_t bytes, uint32_t except, bool window_too);
  void fetch_ahead();
  Window window(bool window_too) const { return window_too ? Window() : window_of(order_, horizon_); }

  const UseOrder& order_;
  const int horizon_;
  const bool following_;
  ReactiveEngine& engine_;
};

}  // namespace vramswap::policy
