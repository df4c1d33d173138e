// StepRecorder: records each step the engine sees as points (policy/planner.h), says whether
// the current step repeats the recorded one, and answers the plan's questions while it
// does. No CUDA: the engine feeds it and acts on its answers.
//
// Note [Recording and following a step]
// -------------------------------------
// A step starts when a graph begins with no block tracked, and ends when the next such graph
// begins: gradient accumulation's several forwards before their backwards are one step, and
// a forward that releases every block it saved so far before saving more (it happens) is
// not cut in two. A step that follows the plan ends as soon as it has made every recorded
// point (the engine checks complete() when the last tracked block goes). Every step is
// recorded: each engine call of it is a point (its kind, the block's ordinal in the step's
// pack order, its placed size) with the pool's demand since the point before. An allocation that had to ask the engine for memory
// (pressure()) says what the pool really needed then, its overhead included: the next
// point's demand is at least that. The plan for the next step is made from the step that
// ended (make_plan, at the pool's limit), with the device's times of the points and the
// copy rate when the engine has measured them (plan_next()), before the next step begins.
//
// The next step *follows* the plan as long as its tagged allocations and packs are the
// recorded ones, in the same order (kind, ordinal and size: the signature of the step); the
// first that differs (or one past the recording's end) is a *divergence*: the step goes on
// under the reactive policy, and is recorded afresh for the step after it. The other points
// (cold marks, unpacks, releases) are not compared: the tracker finds blocks cold when its
// hooks run, and several found at once may come in another order from one step to the next,
// which moves a fetch by a point or two and changes nothing else. A step that ended
// following the plan counts as planned; the bytes its allocations still had to wait for at
// a point beyond the evictions then under way (waited()) are added to that point's demand
// in the next plan (feedback).
//
// A plan must earn its place: when the points' times are known, two planned steps in a
// row (the second with the first's feedback) that took longer (first point to last) than
// the last step the reactive policy ran, by more than 2%, send the next steps back to the
// reactive policy (recorded, not following) for 2, 4, 8 ... up to 64 steps before the plan
// is tried again; a planned step that is not slower ends the back-off.
//
// Note [Late fetches]
// -------------------
// Capuchin's other feedback: a fetch that landed late moves earlier next step. "Late" is
// measured on the device: following a plan, the engine times each copy back on the copy
// stream (events before and after it) and, when a block is used while its copy is in
// flight, the using stream just before it waits. A fetch is late by how much its copy ended
// after that use; it could have landed sooner only if the copy stream idled before it
// started (the copies ahead of it ended earlier): the lesser of the two is what an earlier
// start could win. A fetch late for want of bandwidth (the copies back run end to end) is
// not moved: an earlier start would only queue behind them, while the victims the move
// needs (below) add copies both ways. A planned fetch is late on the device where the
// memory the plan gives it is freed by the compute stream shortly before the block's use
// (the copy waits for those frees). Moving it earlier pays only where the victims that
// take its place are out by then as far as the host knows: their copies landed and the
// host has seen it, having waited for the device since (loss.item(), a value checked on the
// host). A host far ahead of the device learns of those copies too late, and the move gains
// nothing (it is undone, below). In the benchmark's generated steps no planned fetch is late
// on the device and `vramswap bench all` moves none (the engine's num_late_prefetches counts
// uses the host reached before the copy ended, not the device); tests/bench_py/
// test_late_fetch.py has a step where the move pays and two where it does not.
//
// The move: the step's last point whose time on the device is no later than the copy's
// start less what it could win becomes the block's fetch_by (PlanOptions::fetch_by): its
// range out ends there, and the next plan covers the points after with other victims (or
// leaves them uncovered when nothing can). A move stays only when the step with it is
// faster than the planned step before it (by 0.1%); otherwise it is undone and the block
// is never moved again while the step repeats (a move that gains nothing still copies more
// out). A divergence forgets the moves with the recording. The move only acts from the
// third step on (recorded, planned and late, then moved).
//
// Note [Room the fetches leave]
// -----------------------------
// The plan counts bytes; the pool maps granules and places blocks where they fit. A point's
// demand therefore misses the pool's overhead there, and a fetch the plan starts as soon as
// memory allows takes the last free pages: an allocation after it then finds a granule or
// two missing with nothing on its way out, and the reactive policy gives up the resident
// block needed furthest away. Following a plan, that is often a block a planned fetch just
// brought back (optimizer state needed after the whole backward), whose fetch then queues
// behind every fetch already started, and the blocks' copies out run on into the next
// step's forward, which waits for them. The feedback at the point (`extra`) does not stop
// it: with the fetches moved, the next step comes short at another point. So after a
// planned step in which an allocation waited for bytes the evictions under way did not
// cover while fetches were in flight (the fetches held memory it lacked), the plan's
// fetches leave room: a fetch starts only where what is out beyond the point's need and the
// room below the limit there leave kFetchRoomFactor times the most bytes such an allocation
// waited for free (PlanOptions::fetch_margin_bytes), at most the limit / kFetchRoomShare.
// The room only grows while the step repeats, and a divergence forgets it. A wait with no
// fetch in flight is left to `extra`: the disk step's waits are for its writes, and room
// left there only delayed reads the disk was already late with (gpt-small-disk at 75%,
// four warm-ups, 1.359x -> 1.641x the bound). Measured (`vramswap bench all --json`, 106
// rows, four warm-ups): GPT-2 medium with AdamW state kept at 90, 75, 50% of its peak
// 1.570, 1.710, 1.177x the bound -> 1.382, 1.139, 1.094x, no other row moved by 2%; the
// geometric mean 1.0843 -> 1.0618; with the H100's host costs (CUDASIM_HOST_COSTS=h100)
// 1.6342 -> 1.6149. After one and two warm-ups with cudasim's default costs nothing moved
// by 2% (the room comes with the second planned step, and the first planned step's copies
// still run into the measured one); after two with the H100's, 1.6423 -> 1.6226.
//
// Thread safety: none; the engine's mutex guards it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "policy/planner.h"

namespace vramswap::policy {

enum class PointKind : uint8_t { kGraph, kAlloc, kPack, kCold, kUnpack, kRelease };

// What a victim costs the step beyond its copy (PlanOptions::victim_cost_ns): its pages
// unmapped when it leaves and mapped again when it comes back. Measured on an H100
// (tests/gpu/vmm_cost.py): map, access and unmap of one physical allocation take 60-98 us
// whatever its size, and a victim's pages are one allocation (Note [Runs] in
// pool/granules.cpp).
constexpr uint64_t kVictimCostNs = 100'000;

// Note [Room the fetches leave] (above): the room a plan's fetches leave is this many times
// the most an allocation waited for, at most the limit / kFetchRoomShare.
constexpr uint64_t kFetchRoomFactor = 8;
constexpr uint64_t kFetchRoomShare = 256;

// A planned fetch that landed after its block was needed, measured on the device: the block
// (its ordinal in the step) and the time (ns from the step's first point) by which the fetch
// should have started to land in time, as far as the copy stream, idle before it started,
// would have let it.
struct LateFetch {
  uint32_t block = kNoPoint;
  uint64_t start_by_ns = 0;
};

class StepRecorder {
 public:
  // `enabled` false: nothing is recorded and no plan is ever followed (VRAMSWAP_PLAN=off).
  // Steps longer than `max_points` are not recorded (their plan would cost too much memory).
  explicit StepRecorder(bool enabled, uint64_t limit_bytes, size_t max_points = size_t(1) << 18)
      : enabled_(enabled), limit_(limit_bytes), max_points_(max_points) {}

  bool enabled() const { return enabled_; }
  // A step is under way.
  bool active() const { return active_; }
  // The current step repeats the recorded one so far: the plan applies.
  bool following() const { return following_; }

  // A graph began with no block tracked: a new step.
  void begin_step();
  // The last tracked block went: the step ends.
  void end_step();
  // Following the plan, every recorded point has been made: the step is the recorded one.
  bool complete() const {
    return following_ && shape_.size() == recorded_shape_.size() && step_.demand.size() >= recorded_points_;
  }
  // A step ended whose plan is not made yet.
  bool plan_pending() const { return plan_pending_; }
  // Makes the next step's plan from the step that ended, with its points' times (ns from
  // the step's start, one per point; empty: unknown) and the device-to-host copy rate (0:
  // unknown). begin_step() makes it without times when the engine did not. `late`: the
  // step's planned fetches that landed late (feedback: Note [Late fetches]).
  void plan_next(std::vector<uint64_t> time_ns, double bytes_per_ns, const std::vector<LateFetch>& late = {});

  // The ordinal in the current step of a block packed for the first time in it, or (with
  // `cold_from_start`) of a kept block cold as the step begins: cold from its first point.
  uint32_t new_block(uint64_t bytes, bool cold_from_start = false);

  // Records a point of the current step (nothing outside a step); `block` is the block's
  // ordinal (kNoPoint for points that name none), `demand` the pool's since the point
  // before; `bytes` names the point (an allocation's: the size asked for, whatever the pool
  // placed). Returns the point's index, or kNoPoint when none was recorded. A point that
  // differs from the recording while following is a divergence.
  uint32_t point(PointKind kind, uint32_t block, uint64_t bytes, uint64_t demand);

  // Following: the plan copies `block` out as soon as it is cold.
  bool planned_victim(uint32_t block) const {
    return following_ && block < plan_.evict.size() && plan_.evict[block];
  }
  // Following: `block` is a victim the plan wants out now (its planned fetch is still to
  // come).
  bool planned_out(uint32_t block) const {
    return planned_victim(block) && plan_.fetch_at[block] != kNoPoint && step_.demand.size() <= plan_.fetch_at[block];
  }
  // Following: the most bytes the plan has out (its victims from their cold point to the
  // point after which their fetch starts) at any point from the current one to the step's
  // end: what pinned memory, and a disk tier behind it, must hold before the step ends.
  uint64_t planned_out_ahead() const {
    const size_t p = step_.demand.size();
    return following_ && p < out_ahead_.size() ? out_ahead_[p] : 0;
  }
  // The point at which the recording needed `block` (kNoPoint: never, or not recorded).
  uint32_t recorded_use(uint32_t block) const {
    return block < recorded_use_.size() ? recorded_use_[block] : kNoPoint;
  }
  // Following: the blocks whose fetch starts after point `p`, in order of use.
  const std::vector<uint32_t>& fetches_after(uint32_t p) const;
  // Following: `block` was evicted although the plan keeps it (an allocation found memory
  // short). Its fetch joins the plan's in order of use: just before the first planned fetch
  // still to come of a block needed after it, or after the next point when none is (a fetch
  // on demand at its use would queue behind every copy back already started).
  void refetch(uint32_t block);

  // Following: an allocation at the current point still had to wait for `bytes` of
  // evictions, `under_way` bytes of evictions and `fetching` bytes of fetches being in
  // flight (Note [Room the fetches leave]). What they do not cover is
  // feedback for the next plan (added to the point's demand); what they cover is the plan's
  // copies landing late, not memory it lacked: counting that too, the plan grew at every
  // step where the copies, not the plan, kept the allocation waiting.
  void waited(uint64_t bytes, uint64_t under_way = 0, uint64_t fetching = 0);
  // An allocation since the last point needed the pool to map `bytes` with nothing evicted
  // (what was mapped, what it lacked, and the evicted blocks' bytes): the next point's
  // demand is at least that.
  void pressure(uint64_t bytes) { pressure_ = std::max(pressure_, bytes); }

  uint64_t num_planned_steps() const { return planned_steps_; }
  // Planned steps that were slower than the reactive policy's (each began a back-off).
  uint64_t num_backoffs() const { return backoffs_; }
  // True while steps run reactive after planned steps that were slower (a back-off).
  // True when the step that began last runs reactive because of a back-off.
  bool backing_off() const { return skipping_; }
  uint64_t num_divergences() const { return divergences_; }
  // Fetches moved earlier for landing late, and moves undone because the step was no faster.
  uint64_t num_fetch_moves() const { return fetch_moves_; }
  uint64_t num_fetch_moves_undone() const { return fetch_moves_undone_; }
  // The points of the step that ended last (the recording the plan is made from).
  size_t recorded_points() const { return recorded_points_; }
  // The plan being followed (or to be followed by the next step).
  const Plan& plan() const { return plan_; }
  // One line on the plan for the log.
  std::string describe() const;

 private:
  struct Point {
    PointKind kind;
    uint32_t block;
    uint64_t bytes;
    bool operator==(const Point&) const = default;
  };
  void diverge();
  void move_late_fetches(uint64_t took, const std::vector<uint64_t>& time_ns, const std::vector<LateFetch>& late);

  const bool enabled_;
  const uint64_t limit_;
  const size_t max_points_;
  bool active_ = false;
  bool following_ = false;
  bool overflow_ = false;         // the current step passed max_points_: not recorded
  bool plan_pending_ = false;
  uint64_t pressure_ = 0;
  // The step being recorded now (one demand per point) and its tagged allocations and packs.
  RecordedStep step_;
  std::vector<Point> shape_;
  std::vector<uint64_t> waited_;  // per point of the current step
  // The recording the plan was made from (its points; its tagged allocations and packs: the
  // signature), its plan, and the fetches by point.
  size_t recorded_points_ = 0;
  std::vector<Point> recorded_shape_;
  std::vector<uint64_t> extra_;   // feedback carried into the plan
  uint64_t uncovered_max_ = 0;    // the most an allocation of this step waited for beyond
                                  // the evictions under way (following a plan)
  uint64_t fetch_margin_ = 0;     // feedback carried into the plan: PlanOptions::fetch_margin_bytes
  std::vector<uint32_t> fetch_by_;  // feedback carried into the plan: PlanOptions::fetch_by
  struct Move {
    uint32_t block, before;  // the block's fetch_by before the move
  };
  std::vector<Move> moved_;         // moves made for the step now following the plan
  std::vector<uint8_t> settled_;    // per block: a move was undone, never moved again
  uint64_t planned_ns_ = 0;         // how long the last planned step without new moves took
  uint64_t fetch_moves_ = 0, fetch_moves_undone_ = 0;
  Plan plan_;
  std::vector<std::vector<uint32_t>> fetches_;
  std::vector<uint32_t> recorded_use_;  // per block of the recording: its use point
  std::vector<uint64_t> out_ahead_;     // per point: planned_out_ahead() there
  uint64_t planned_steps_ = 0, divergences_ = 0, backoffs_ = 0;
  bool ended_planned_ = false;  // the step that ended last followed the plan to its end
  uint64_t reactive_ns_ = 0;    // how long the last step the reactive policy ran took
  uint32_t losses_ = 0;         // planned steps slower than that one, in a row
  bool skipping_ = false;       // the step that began last is one of the skipped ones
  uint32_t skip_ = 0;           // steps left to run reactive before the plan is tried again
};

}  // namespace vramswap::policy
