// The eviction plan for a step that repeats: which tagged blocks to copy out as soon as they
// go cold, and when to start bringing each back. Pure functions over a recorded step; no
// CUDA, no engine.
//
// Note [Planned eviction]
// -----------------------
// A training loop runs the same step again and again. The engine records one (see
// step_recorder.h, Note [Recording and following a step]) as a sequence of *points*:
// the engine calls of the step (tagged allocations, packs, mark_colds, unpacks, releases),
// numbered from 0. At each point it notes the *demand*: the most device memory the pool had
// allocated at any moment since the point before (live blocks as rounded, tagged blocks as
// placed, evicted ones included: the memory the step would need with nothing evicted). Each
// tagged block the step packed has its size, the point at which it went cold and the point
// at which backward needed it again (its unpack, or its release when it was never unpacked).
//
// At point j, X(j) = demand(j) + margin + extra(j) - limit bytes must be out (0 when
// negative). A block chosen as a victim is out from the point after its cold point up to
// the point at which its fetch starts (at the latest, the one before its use). The plan:
//
//  * Victims (Belady's rule, as the reactive policy uses it, but with the whole step known):
//    walking the points forward, wherever the victims chosen so far do not cover X(j),
//    the block needed furthest in the future among those cold before j and needed after j
//    becomes a victim, until X(j) is covered. The engine starts a victim's copy the moment
//    it goes cold (the copy engine idles during most of the forward), and its pages stay
//    mapped (clean) until an allocation needs them: early copying costs PCIe time the step
//    was not using, not memory.
//  * Smaller victims. Belady's rule takes whole blocks, the one needed furthest first, so at
//    mild pressure one large block can be most of what moves (VGG-16 at batch 128 and 90%:
//    its first activation, 1.53 GiB, for 1 GiB that must leave). When the victims exceed
//    the worst X by more than a margin (X/64), the largest victim is set aside with every
//    block of its size or more that the plan left alone, and Belady's rule picks again (for
//    X plus the margin: a plan of small blocks can match X to the byte, and X holds the
//    pool's overhead only where an allocation waited); up to `smaller_victim_trials` times,
//    the largest victim not yet tried each time. The other plan is kept when it costs less
//    (its bytes, plus `victim_cost_ns` a victim at the copy rate: a victim's pages are
//    unmapped and mapped again, a fixed cost that a plan of many small blocks pays many
//    times) and risks no more: no more of X uncovered, no later fetches (summed over the
//    victims, at the copy rate; copies out landing late are not weighed: see Risk in
//    planner.cpp). Each trial costs
//    as much as the first plan (bench/policy/planner_bench.cpp).
//  * Fetches, scheduled by memory: walking the victims in order of use, each one's fetch
//    starts right after the last point that still needs its bytes out (given the fetches
//    scheduled before it), so it lands as early as memory allows. A victim no point needs
//    out at all is dropped from the plan (it would have been copied for nothing).
//  * Where even every cold block cannot cover X(j) (the step's working set does not fit),
//    the plan covers what it can and says how much is missing (shortfall_bytes): the
//    reactive policy deals with the rest, as it would without a plan.
//
// Time. When the step's point times and the copy rate are known, a victim counts as out at
// a point only once its copy can have landed there: the copies run one after another in
// the order their blocks went cold (the engine starts each at its mark_cold), each taking
// bytes / rate. A candidate whose copy could not land by the point that needs it is passed
// over for one that went cold earlier (the block saved just before the forward ends is
// needed late in backward, but its copy cannot be done by the junction). Where no copy can
// land in time (the forward makes bytes cold faster than the bus takes them), the step waits
// at that point whatever the plan says: the victims are then the blocks whose copies land
// first (the least wait), counted as out from their cold point on, rather than bytes left to
// the reactive policy, which would evict beyond the plan and wait too. Without times the
// plan goes by the order of points alone. Fetches are placed by memory only; the engine's
// feedback corrects what the plan gets wrong: `extra` (bytes an allocation still had to
// wait for at a point beyond the evictions under way, added to that point next step), and
// `fetch_by` (a point a victim's fetch must start after at the latest: its range out ends
// there, for a fetch that landed late on the device; Note [Late fetches] in
// step_recorder.h).
//
// Thread safety: pure functions on values.
#pragma once

#include <cstdint>
#include <vector>

namespace vramswap::policy {

constexpr uint32_t kNoPoint = UINT32_MAX;

// One tagged block of a recorded step, in the order the step first packed it.
struct StepBlock {
  uint64_t bytes = 0;         // as placed (512-byte units): about what its eviction frees
  uint32_t cold = kNoPoint;   // the point at which it went cold; kNoPoint: never
  uint32_t use = kNoPoint;    // the point at which backward needed it again (its unpack, or
                              // its release when never unpacked); kNoPoint: not in the step
};

struct RecordedStep {
  std::vector<uint64_t> demand;  // per point: the pool's highest allocated bytes since the
                                 // point before, up to and including this one
  std::vector<StepBlock> blocks;
  std::vector<uint64_t> time_ns;  // per point: when the device reached it, from the step's
                                  // start; empty: not known (the plan ignores time)
};

struct PlanOptions {
  uint64_t limit_bytes = 0;
  uint64_t margin_bytes = 0;       // added to every point's demand: the pool's overhead
  std::vector<uint64_t> extra;     // per point (shorter: 0 past its end): feedback
  double bytes_per_ns = 0;         // the device-to-host copy rate; 0: not known (the plan
                                   // ignores time)
  uint64_t victim_cost_ns = 0;     // what a victim costs beyond its copy (its pages unmapped
                                   // and mapped again), weighed at bytes_per_ns against the
                                   // bytes a plan of smaller victims saves
  int smaller_victim_trials = 8;   // how many of the largest victims make_plan tries to
                                   // replace by smaller blocks (0: Belady's victims as chosen)
  std::vector<uint32_t> fetch_by{};  // per block (shorter: kNoPoint past its end): a victim's
                                   // fetch starts after this point at the latest (feedback
                                   // from a fetch that landed late); kNoPoint: no constraint
  uint64_t fetch_margin_bytes = 0;  // what a fetch leaves free at every point it holds its
                                   // bytes: room for the pool's overhead that the demand
                                   // misses (Note [Room the fetches leave] in step_recorder.h)
};

struct Plan {
  std::vector<uint8_t> evict;       // per block: 1 = copy it out as soon as it is cold
  std::vector<uint32_t> fetch_at;   // per block: the point after which its fetch starts;
                                    // kNoPoint for a block that is not a victim
  uint64_t must_leave_bytes = 0;    // the largest X(j)
  uint32_t worst_point = kNoPoint;  // where X(j) is largest (kNoPoint when it is 0 everywhere)
  uint64_t planned_bytes = 0;       // the victims' bytes: what the plan copies out
  uint64_t shortfall_bytes = 0;     // the most bytes of X(j) no cold block could cover
  uint32_t num_victims = 0;
};

// The plan for `step` under `options`. A block never cold (cold kNoPoint, or not before
// the step's end) is never a victim; one with no use point (kNoPoint, or past the end) may
// stay out until the step's end. Pure.
Plan make_plan(const RecordedStep& step, const PlanOptions& options);

}  // namespace vramswap::policy
