// The reactive policy (src/policy/reactive.h), table-driven: the rules over one block, and
// the decisions Reactive makes over a use order of blocks, carried out by a fake engine
// that records what it was asked to do.
#include "policy/reactive.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace vramswap::policy {
namespace {

using S = BlockState;

BlockView block(S state, bool cold = true, uint64_t placed = 100) {
  BlockView b;
  b.live = true;
  b.state = state;
  b.cold = cold;
  b.placed = placed;
  return b;
}

// ---- The rules over one block ----

struct RuleRow {
  const char* what;
  BlockView b;
  bool in_window;
  bool evictable, kept_clean;
  Room room;
  Mate mate;
};

BlockView with(BlockView b, void (*f)(BlockView&)) {
  f(b);
  return b;
}

TEST(ReactiveRules, OneBlock) {
  const RuleRow rows[] = {
      {"cold resident", block(S::kResident), false, true, false, Room::kEvict, Mate::kJoins},
      {"cold resident in the window", block(S::kResident), true, false, false, Room::kPass, Mate::kHolds},
      {"resident, not cold", block(S::kResident, false), false, false, false, Room::kPass, Mate::kHolds},
      {"resident, unpacked", with(block(S::kResident), [](BlockView& b) { b.unpacked = true; }), false, false, false,
       Room::kPass, Mate::kHolds},
      {"not live", with(block(S::kResident), [](BlockView& b) { b.live = false; }), false, false, false, Room::kPass,
       Mate::kHolds},
      {"small cold resident", with(block(S::kResident), [](BlockView& b) { b.shares_granules = true; }), false, true,
       false, Room::kEvictGranule, Mate::kJoins},
      {"clean", block(S::kClean), false, false, false, Room::kDrop, Mate::kAway},
      {"clean in the window", block(S::kClean), true, false, true, Room::kPass, Mate::kHolds},
      {"clean in the window, planned out", with(block(S::kClean), [](BlockView& b) { b.planned_out = true; }), true,
       false, false, Room::kDrop, Mate::kHolds},
      // A frozen kept block keeps its host copy while it is used: clean, not cold.
      {"clean, in use", block(S::kClean, false), false, false, false, Room::kPass, Mate::kHolds},
      {"evicting", block(S::kEvicting), false, false, false, Room::kPass, Mate::kAway},
      {"evicting, cancelled", with(block(S::kEvicting), [](BlockView& b) { b.cancelled = true; }), false, false, false,
       Room::kPass, Mate::kHolds},
      {"evicted", block(S::kEvicted), false, false, false, Room::kPass, Mate::kAway},
      {"fetching", block(S::kFetching), false, false, false, Room::kPass, Mate::kHolds},
  };
  for (const RuleRow& r : rows) {
    SCOPED_TRACE(r.what);
    EXPECT_EQ(evictable(r.b, r.in_window), r.evictable);
    EXPECT_EQ(kept_clean(r.b, r.in_window), r.kept_clean);
    EXPECT_EQ(room_for(r.b, r.in_window), r.room);
    EXPECT_EQ(granule_mate(r.b, r.in_window), r.mate);
  }
}

TEST(ReactiveRules, SoftExcess) {
  struct Row {
    uint64_t soft, mapped, clean, leaving, excess;
  } rows[] = {
      {1000, 900, 0, 0, 0},       // below
      {1000, 1000, 0, 0, 0},      // at the limit
      {1000, 1300, 0, 0, 300},    // over: the excess leaves
      {1000, 1300, 200, 0, 100},  // clean blocks count as gone
      {1000, 1300, 200, 100, 0},  // and what is leaving already
      {1000, 1300, 2000, 0, 0},   // more clean than mapped (shared granules): none resident
      {0, 10, 0, 0, 10},
  };
  for (const Row& r : rows) EXPECT_EQ(soft_excess(r.soft, r.mapped, r.clean, r.leaving), r.excess) << r.mapped;
}

// ---- Decisions over a use order ----

// Blocks 0..n-1, block 0 needed first and block n-1 furthest away. The fake carries out
// what it is asked: an eviction makes a block evicting (until the host tier's room, in
// blocks, runs out); an awaited or completed eviction makes it clean; a drop unmaps its
// bytes; a fetch makes it fetching while memory below the soft limit allows.
class FakeEngine final : public ReactiveEngine {
 public:
  explicit FakeEngine(std::vector<BlockView> blocks) : blocks_(std::move(blocks)) {
    for (uint32_t i = 0; i < blocks_.size(); ++i) order.insert({1, blocks_.size() - i}, i);
  }

  BlockView view(uint32_t slot) const override { return blocks_[slot]; }
  bool start_eviction(uint32_t slot) override {
    if (host_room == 0) {
      log.push_back("refused " + std::to_string(slot));
      return false;
    }
    --host_room;
    blocks_[slot].state = S::kEvicting;
    queue_.push_back(slot);
    log.push_back("evict " + std::to_string(slot));
    return true;
  }
  uint64_t drop(uint32_t slot) override {
    blocks_[slot].state = S::kEvicted;
    unmapped_ += blocks_[slot].placed;
    mapped -= blocks_[slot].placed;
    log.push_back("drop " + std::to_string(slot));
    return blocks_[slot].placed;
  }
  uint64_t evict_granule(uint32_t slot, const Window& window) override {
    log.push_back("granule " + std::to_string(slot) + (window.count(slot) ? " (in the window)" : ""));
    return granule_bytes;
  }
  uint64_t unmapped_total() const override { return unmapped_; }
  uint64_t leaving_bytes() const override {
    uint64_t n = 0;
    for (const BlockView& b : blocks_)
      if (b.state == S::kEvicting && !b.cancelled) n += b.placed;
    return n;
  }
  uint64_t clean_bytes() const override {
    uint64_t n = 0;
    for (const BlockView& b : blocks_)
      if (b.state == S::kClean) n += b.placed;
    return n;
  }
  void complete_copies(bool wait) override {
    if (!wait) return;  // nothing lands by itself
    log.push_back("wait all");
    for (BlockView& b : blocks_) {
      if (b.state == S::kEvicting) b.state = b.cancelled ? S::kResident : S::kClean;
      if (b.state == S::kFetching) b.state = S::kResident;
    }
    queue_.clear();
  }
  bool copies_in_flight() const override {
    for (const BlockView& b : blocks_)
      if (b.state == S::kEvicting || b.state == S::kFetching) return true;
    return false;
  }
  std::vector<std::pair<uint64_t, uint32_t>> queued_evictions() const override {
    std::vector<std::pair<uint64_t, uint32_t>> q;
    for (size_t i = 0; i < queue_.size(); ++i) q.emplace_back(i, queue_[i]);
    return q;
  }
  bool await_eviction(uint32_t slot, uint64_t) override {
    if (blocks_[slot].state != S::kEvicting) return false;
    log.push_back("await " + std::to_string(slot));
    blocks_[slot].state = S::kClean;
    return true;
  }
  void cancel_eviction(uint32_t slot) override {
    blocks_[slot].cancelled = true;
    log.push_back("cancel " + std::to_string(slot));
  }
  bool prefetch(uint32_t slot, bool ahead) override {
    if (mapped + blocks_[slot].placed > memory) {
      log.push_back("no room for " + std::to_string(slot));
      return false;
    }
    mapped += blocks_[slot].placed;
    blocks_[slot].state = S::kFetching;
    log.push_back((ahead ? "ahead " : "prefetch ") + std::to_string(slot));
    return true;
  }
  bool fetches_in_flight() const override {
    for (const BlockView& b : blocks_)
      if (b.state == S::kFetching) return true;
    return false;
  }
  uint64_t mapped_bytes() const override { return mapped; }
  uint64_t soft_limit() const override { return soft; }

  UseOrder order;
  std::vector<std::string> log;
  int host_room = 1000;
  uint64_t granule_bytes = 0;
  uint64_t mapped = 0, memory = UINT64_MAX, soft = UINT64_MAX;

 private:
  std::vector<BlockView> blocks_;
  std::vector<uint32_t> queue_;
  uint64_t unmapped_ = 0;
};

using Log = std::vector<std::string>;

TEST(Reactive, StartVictimsTakesTheFurthestEvictableBlocksUntilTheBytesLeave) {
  struct Row {
    const char* what;
    std::vector<BlockView> blocks;
    int horizon;
    uint64_t bytes;
    uint32_t except;
    bool window_too;
    int host_room;
    uint64_t started;
    Log log;
  } rows[] = {
      {"furthest first", {block(S::kResident), block(S::kResident), block(S::kResident)}, 0, 150, kNoSlot, false,
       1000, 200, {"evict 2", "evict 1"}},
      {"not cold, clean, evicted: passed over",
       {block(S::kResident), block(S::kResident, false), block(S::kClean), block(S::kEvicted)}, 0, 100, kNoSlot,
       false, 1000, 100, {"evict 0"}},
      {"the window is spared", {block(S::kResident), block(S::kResident), block(S::kResident)}, 2, 300, kNoSlot,
       false, 1000, 100, {"evict 2"}},
      {"unless window_too", {block(S::kResident), block(S::kResident), block(S::kResident)}, 2, 300, kNoSlot, true,
       1000, 300, {"evict 2", "evict 1", "evict 0"}},
      {"except", {block(S::kResident), block(S::kResident)}, 0, 100, 1, false, 1000, 100, {"evict 0"}},
      {"the host tier full: it stops", {block(S::kResident), block(S::kResident), block(S::kResident)}, 0, 300,
       kNoSlot, false, 1, 100, {"evict 2", "refused 1"}},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.what);
    FakeEngine e(r.blocks);
    e.host_room = r.host_room;
    EXPECT_EQ(Reactive(e.order, r.horizon, false, e).start_victims(r.bytes, r.except, r.window_too), r.started);
    EXPECT_EQ(e.log, r.log);
  }
}

TEST(Reactive, MakeRoomDropsCleanBlocksAndEvictsOthersFurthestFirst) {
  BlockView small = block(S::kResident);
  small.shares_granules = true;
  BlockView planned = block(S::kClean);
  planned.planned_out = true;
  struct Row {
    const char* what;
    std::vector<BlockView> blocks;
    int horizon;
    uint64_t bytes;
    int host_room;
    uint64_t granule_bytes;
    uint64_t freed;
    Log log;
  } rows[] = {
      {"clean and evictable together", {block(S::kResident), block(S::kClean), block(S::kResident)}, 0, 200, 1000, 0,
       100, {"evict 2", "drop 1"}},
      {"evictions under way count", {block(S::kResident), block(S::kResident), block(S::kEvicting)}, 0, 200, 1000, 0,
       0, {"evict 1"}},
      {"a cancelled eviction does not", {block(S::kResident), block(S::kResident),
                                          with(block(S::kEvicting), [](BlockView& b) { b.cancelled = true; })},
       0, 200, 1000, 0, 0, {"evict 1", "evict 0"}},
      {"a small block takes its granule", {block(S::kResident), small}, 0, 150, 1000, 2048, 0, {"granule 1"}},
      {"a granule that cannot go covers nothing", {block(S::kResident), small}, 0, 150, 1000, 0, 0,
       {"granule 1", "evict 0"}},
      {"the host tier full: clean blocks still help", {block(S::kClean), block(S::kResident)}, 0, 200, 0, 0, 100,
       {"refused 1", "drop 0"}},
      {"a clean block in the window stays", {block(S::kClean), block(S::kResident)}, 1, 200, 1000, 0, 0,
       {"evict 1"}},
      {"unless the plan wants it out", {planned, block(S::kResident)}, 1, 200, 1000, 0, 100, {"evict 1", "drop 0"}},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.what);
    FakeEngine e(r.blocks);
    e.host_room = r.host_room;
    e.granule_bytes = r.granule_bytes;
    EXPECT_EQ(Reactive(e.order, r.horizon, false, e).make_room(r.bytes), r.freed);
    EXPECT_EQ(e.log, r.log);
  }
}

TEST(Reactive, DropCleanSparesTheWindowAndTheExcepted) {
  FakeEngine e({block(S::kClean), block(S::kClean), block(S::kClean), block(S::kResident)});
  EXPECT_EQ(Reactive(e.order, 1, false, e).drop_clean(1000, 2), 100u);
  EXPECT_EQ(e.log, (Log{"drop 1"}));
  EXPECT_EQ(Reactive(e.order, 1, false, e).drop_clean(1000, kNoSlot, true), 200u);
  EXPECT_EQ(e.log, (Log{"drop 1", "drop 2", "drop 0"}));
}

TEST(Reactive, ReclaimRounds) {
  struct Row {
    const char* what;
    std::vector<BlockView> blocks;
    int horizon;
    bool following, wait;
    uint64_t bytes;
    uint64_t freed;
    Log log;
  } rows[] = {
      {"no wait: evictions start, nothing is freed", {block(S::kResident), block(S::kResident)}, 0, false, false, 100,
       0, {"evict 1"}},
      {"waiting: the oldest eviction, then its pages", {block(S::kResident), block(S::kResident)}, 0, false, true,
       100, 100, {"evict 1", "await 1", "drop 1"}},
      {"only as far as needed", {block(S::kResident), block(S::kResident), block(S::kResident)}, 0, false, true, 100,
       100, {"evict 2", "await 2", "drop 2"}},
      {"the window goes last (round 2)", {block(S::kResident), block(S::kResident)}, 1, false, true, 200, 200,
       {"evict 1", "await 1", "drop 1", "wait all", "evict 0", "await 0", "drop 0"}},
      {"a fetch that lands is a victim before the window is", {block(S::kResident), block(S::kFetching),
       block(S::kResident)}, 1, false, true, 300, 300,
       {"evict 2", "await 2", "drop 2", "wait all", "evict 1", "await 1", "drop 1", "wait all", "evict 0", "await 0",
        "drop 0"}},
      {"following: the plan's clean victims first", {block(S::kResident), block(S::kClean)}, 0, true, false, 100,
       100, {"drop 1"}},
      {"following, no wait: only the plan's clean victims", {block(S::kResident), block(S::kClean)}, 0, true, false,
       200, 100, {"drop 1"}},
      {"following, waiting: then Belady's rule", {block(S::kResident), block(S::kClean)}, 0, true, true, 200, 200,
       {"drop 1", "evict 0", "await 0", "drop 0"}},
      {"nothing to free: every round looks, none waits", {block(S::kResident, false)}, 0, false, true, 100, 0, {}},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.what);
    FakeEngine e(r.blocks);
    EXPECT_EQ(Reactive(e.order, r.horizon, r.following, e).reclaim(r.bytes, r.wait), r.freed);
    EXPECT_EQ(e.log, r.log);
  }
}

TEST(Reactive, SoftWatermarkEvictsTheExcessUnlessAPlanIsFollowed) {
  for (bool following : {false, true}) {
    FakeEngine e({block(S::kResident), block(S::kResident), block(S::kResident)});
    e.mapped = 1150;
    Reactive(e.order, 0, following, e).soft_evict(1000);
    EXPECT_EQ(e.log, following ? Log() : Log({"evict 2", "evict 1"})) << following;
  }
  FakeEngine none({block(S::kResident)});
  none.mapped = 1150;
  Reactive(none.order, 0, false, none).soft_evict(0);  // no soft limit set
  EXPECT_TRUE(none.log.empty());
}

TEST(Reactive, AfterAnUnpackTheWindowComesBackAndOneBlockPastIt) {
  BlockView planned = block(S::kEvicted);
  planned.planned_out = true;
  struct Row {
    const char* what;
    std::vector<BlockView> blocks;
    int horizon;
    bool following;
    uint64_t memory, soft;
    Log log;
  } rows[] = {
      {"the window, then one ahead", {block(S::kEvicted), block(S::kEvicted), block(S::kEvicted), block(S::kEvicted)},
       2, false, UINT64_MAX, UINT64_MAX, {"prefetch 0", "prefetch 1"}},
      {"ahead only with no fetch in flight",
       {block(S::kResident), block(S::kEvicting), block(S::kResident), block(S::kEvicted)}, 2, false, UINT64_MAX,
       UINT64_MAX, {"cancel 1", "ahead 3"}},
      {"ahead only below the soft limit",
       {block(S::kResident), block(S::kResident), block(S::kEvicted)}, 2, false, UINT64_MAX, 50, {}},
      {"ahead: the nearest evicted block only",
       {block(S::kResident), block(S::kResident), block(S::kEvicted, true, 300), block(S::kEvicted)}, 2, false,
       UINT64_MAX, 200, {}},
      {"a planned victim is left to its plan", {planned, block(S::kEvicted), block(S::kEvicted)}, 2, true,
       UINT64_MAX, UINT64_MAX, {"prefetch 1"}},
      {"the first without memory ends it", {block(S::kEvicted), block(S::kEvicted), block(S::kEvicted)}, 3, false,
       150, UINT64_MAX, {"prefetch 0", "no room for 1"}},
      {"no window: nothing", {block(S::kEvicted)}, 0, false, UINT64_MAX, UINT64_MAX, {}},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.what);
    FakeEngine e(r.blocks);
    e.memory = r.memory;
    e.soft = r.soft;
    Reactive(e.order, r.horizon, r.following, e).after_unpack();
    EXPECT_EQ(e.log, r.log);
  }
}

}  // namespace
}  // namespace vramswap::policy
