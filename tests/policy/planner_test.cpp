// policy::make_plan (src/policy/planner.h) on hand-made steps whose best plan is known.
// Pure: no CUDA. Sizes in MiB-like units of 1 (the planner works on any unit).
#include "policy/planner.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace vramswap::policy {
namespace {

constexpr uint32_t N = kNoPoint;

struct Case {
  std::string name;
  std::vector<uint64_t> demand;
  std::vector<StepBlock> blocks;  // {bytes, cold, use}
  uint64_t limit;
  std::vector<uint32_t> fetch_at;  // the expected plan: kNoPoint = not a victim
  uint64_t must_leave;
  uint64_t shortfall;
  uint64_t margin = 0;
  std::vector<uint64_t> extra = {};
};

const Case kCases[] = {
    {"NoPressureNoVictim", {5, 8, 10, 6}, {{4, 0, 3}}, 10, {N}, 0, 0},
    // Point 2 is 1 over: the one cold block leaves and comes back right after point 2.
    {"OneBlockLeavesAndReturnsWhenMemoryAllows", {5, 8, 11, 9, 6, 4}, {{4, 0, 5}}, 10, {2}, 1, 0},
    // Two candidates, one needed: Belady takes the one needed furthest away (b1, use 9).
    {"BeladyTakesTheBlockNeededLast", {6, 8, 11, 10, 8, 7, 6, 5, 4, 3}, {{2, 0, 6}, {2, 0, 9}}, 10, {N, 2}, 1, 0},
    // The furthest block alone is too small; the next one covers, and makes the first useless.
    {"AVictimNoPointNeedsIsDropped", {6, 6, 12, 6, 6, 6, 6, 6, 6, 6}, {{4, 0, 8}, {1, 0, 9}}, 10, {2, N}, 2, 0},
    // The block is cold only after the point that needs it out: nothing can cover it.
    {"ABlockColdTooLateCannotCover", {6, 8, 11, 10, 5}, {{4, 2, 4}}, 10, {N}, 1, 1},
    {"ABlockNeverColdIsNeverAVictim", {6, 8, 11, 5}, {{4, N, 3}}, 10, {N}, 1, 1},
    // Over by 3 at point 2 and by 1 at point 4: the victim stays out until point 4.
    {"TheFetchWaitsForTheLastPointThatNeedsTheBytesOut", {6, 8, 13, 9, 11, 7, 6, 5}, {{4, 0, 7}}, 10, {4}, 3, 0},
    // Two victims come back in order of use: the first right after the peak, the second once
    // the first is back and the second alone covers point 3.
    {"FetchesShareTheSlackInOrderOfUse", {4, 6, 14, 11, 10, 8, 6, 5, 4}, {{2, 0, 6}, {2, 0, 8}}, 10, {2, 3}, 4, 0},
    // B (2, needed last) could come back at point 2 already, A (6) only after point 5: B
    // waits for A, so that the copies back run in the order of use.
    {"FetchesKeepTheOrderOfUse", {10, 10, 18, 14, 14, 14, 10, 10, 10, 10}, {{6, 0, 8}, {2, 0, 9}}, 10, {5, 5}, 8, 0},
    // A victim with no use in the step (released after it) may stay out to the end.
    {"NoUsePointMeansOutUntilTheEnd", {6, 8, 11, 5}, {{4, 0, N}}, 10, {2}, 1, 0},
    // The margin (the pool's overhead) raises every point's demand.
    {"TheMarginCounts", {6, 8, 10, 8, 5}, {{4, 0, 4}}, 10, {2}, 1, 0, 1},
    // Feedback: bytes an allocation waited for at point 1 last time are covered now.
    {"FeedbackAtAPointIsCovered", {6, 8, 9, 8, 5}, {{4, 0, 4}}, 10, {1}, 1, 0, 0, {0, 3}},
    // A working set larger than the limit: the plan covers what it can.
    {"ShortfallIsReported", {6, 16, 12, 5}, {{4, 0, 3}}, 10, {2}, 6, 2},
    {"AnEmptyStepHasNoPlan", {}, {}, 10, {}, 0, 0},
    // A use point before the cold point (never recorded) leaves no range.
    {"AUseBeforeTheColdPointIsIgnored", {6, 12, 6, 6}, {{4, 2, 1}}, 10, {N}, 2, 2},
    // 5 over at point 2: Belady takes the 8 needed last, 3 more than needed; the 4 and the 2
    // (needed sooner, still after the peak) move 6 (VGG-16 at 90%: one 1.53 GiB block for
    // 1 GiB that must leave). Fetches: the 4 right after the peak, the 2 once point 3 is past.
    {"SmallerBlocksReplaceAnOversizedVictim", {6, 8, 15, 12, 8, 6, 5, 4, 3, 3}, {{8, 0, 9}, {4, 0, 7}, {2, 0, 8}}, 10,
     {N, 2, 3}, 5, 0},
};

class MakePlan : public testing::TestWithParam<Case> {};

TEST_P(MakePlan, MatchesTheKnownBestPlan) {
  const Case& c = GetParam();
  RecordedStep step{c.demand, c.blocks, {}};
  PlanOptions options{c.limit, c.margin, c.extra, 0};
  const Plan plan = make_plan(step, options);
  ASSERT_EQ(c.blocks.size(), plan.fetch_at.size());
  uint64_t bytes = 0;
  uint32_t victims = 0;
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    EXPECT_EQ(c.fetch_at[b], plan.fetch_at[b]) << "block " << b;
    EXPECT_EQ(c.fetch_at[b] != N, bool(plan.evict[b])) << "block " << b;
    if (plan.evict[b]) {
      bytes += c.blocks[b].bytes;
      ++victims;
    }
  }
  EXPECT_EQ(c.must_leave, plan.must_leave_bytes);
  EXPECT_EQ(c.shortfall, plan.shortfall_bytes);
  EXPECT_EQ(bytes, plan.planned_bytes);
  EXPECT_EQ(victims, plan.num_victims);
}

INSTANTIATE_TEST_SUITE_P(Steps, MakePlan, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

// With the points' times (10 ns apart) and a copy rate of 1 byte/ns, a block's copy takes
// as many ns as it has bytes, and copies run one after another in the order of cold.
std::vector<uint64_t> every_10ns(size_t n) {
  std::vector<uint64_t> t(n);
  for (size_t j = 0; j < n; ++j) t[j] = 10 * j;
  return t;
}

TEST(MakePlanTimed, ACopyThatCannotLandInTimeIsPassedOver) {
  // X = 40 at point 4 (t = 40). B (needed last) goes cold at t = 30: its 40 ns copy lands at
  // 70. A went cold at t = 0 and lands at 40: A is the victim.
  RecordedStep step{{10, 10, 10, 10, 50, 10, 10, 10, 10, 10, 10, 10}, {{40, 0, 9}, {40, 3, 11}}, {}};
  const Plan blind = make_plan(step, {10, 0, {}, 0});
  EXPECT_EQ(std::vector<uint8_t>({0, 1}), blind.evict) << "without times, Belady takes B";
  step.time_ns = every_10ns(step.demand.size());
  const Plan timed = make_plan(step, {10, 0, {}, 1.0});
  EXPECT_EQ(std::vector<uint8_t>({1, 0}), timed.evict);
  EXPECT_EQ(4u, timed.fetch_at[0]);
  EXPECT_EQ(0u, timed.shortfall_bytes);
}

TEST(MakePlanTimed, CopiesQueueInTheOrderOfCold) {
  // A (cold at t = 0) and C (cold at t = 10), 40 bytes each, both needed out: A lands at 40,
  // C waits for A and lands at 80. Needed at point 8 (t = 80): both count.
  RecordedStep step{{10, 10, 10, 10, 10, 10, 10, 10, 90, 10, 10, 10}, {{40, 0, 10}, {40, 1, 11}}, {}};
  step.time_ns = every_10ns(step.demand.size());
  Plan plan = make_plan(step, {10, 0, {}, 1.0});
  EXPECT_EQ(std::vector<uint8_t>({1, 1}), plan.evict);
  EXPECT_EQ(0u, plan.shortfall_bytes);
  // Needed at point 7 (t = 70) instead: C cannot be out by then.
  step.demand = {10, 10, 10, 10, 10, 10, 10, 90, 10, 10, 10, 10};
  plan = make_plan(step, {10, 0, {}, 1.0});
  EXPECT_EQ(40u, plan.shortfall_bytes);
  EXPECT_EQ(1u, plan.num_victims);
}

TEST(MakePlanTimed, WhenNoCopyCanLandInTimeTheOneThatLandsFirstIsChosen) {
  // X = 40 at point 2 (t = 20). A (cold at t = 0) lands at 40, B (cold at t = 10, needed
  // last) at 50: neither is out by t = 20. The step waits at point 2 whatever the plan says;
  // left uncovered, the reactive policy evicts there and waits as well, beyond the plan (on
  // gpt-small-v10k at 75% the plan then alternated between two step lengths, 1.04x and 1.08x
  // the bound). A, which lands first, is the victim; it stays out until point 2 has passed.
  RecordedStep step{{10, 10, 50, 10, 10, 10, 10, 10, 10, 10, 10, 10}, {{40, 0, 9}, {40, 1, 11}}, {}};
  step.time_ns = every_10ns(step.demand.size());
  const Plan plan = make_plan(step, {10, 0, {}, 1.0});
  EXPECT_EQ(std::vector<uint8_t>({1, 0}), plan.evict);
  EXPECT_EQ(2u, plan.fetch_at[0]);
  EXPECT_EQ(0u, plan.shortfall_bytes);
  EXPECT_EQ(40u, plan.planned_bytes);
}

// Kept blocks cold as the step begins all go cold at point 0, and Belady takes them the one
// needed furthest first. Their copies queue in that order too (the engine starts them so): a
// block taken later joins the queue behind the others. Queued by ordinal instead (here the
// reverse of need), each one taken went ahead of those taken before it and pushed one of
// them past the point needing it, so the walk took every block and still fell short.
// Ten blocks of 10 bytes, cold at point 0, needed at points 20-29 (block k at 20 + k); X = 40
// at point 3 (t = 30): three copies land by then, and the fourth is the least wait.
TEST(MakePlanTimed, BlocksColdAtOnePointQueueTheOneNeededFurthestFirst) {
  RecordedStep step;
  step.demand.assign(31, 10);
  step.demand[3] = 50;
  for (uint32_t k = 0; k < 10; ++k) step.blocks.push_back({10, 0, 20 + k});
  step.time_ns = every_10ns(step.demand.size());
  const Plan plan = make_plan(step, {10, 0, {}, 1.0, 0, 0});
  EXPECT_EQ(std::vector<uint8_t>({0, 0, 0, 0, 0, 0, 1, 1, 1, 1}), plan.evict);
  EXPECT_EQ(40u, plan.planned_bytes);
  EXPECT_EQ(0u, plan.shortfall_bytes);
}

TEST(MakePlanTimed, TimesOfTheWrongLengthAreIgnored) {
  RecordedStep step{{10, 10, 10, 10, 50, 10, 10, 10, 10, 10, 10, 10}, {{40, 0, 9}, {40, 3, 11}}, {0, 10}};
  EXPECT_EQ(std::vector<uint8_t>({0, 1}), make_plan(step, {10, 0, {}, 1.0}).evict);
}

// Each victim costs a fixed time beyond its bytes (its pages unmapped, mapped again: VMM
// calls that take about as long for one granule as for a thousand). Replacing one 8-unit
// victim by five units of blocks of 1 saves 3 units of copy but adds four victims: at a cost
// of 1 unit each (1 ns at 1 byte/ns), the 8 stays; free, the five blocks replace it.
TEST(MakePlanVictimCost, SmallerVictimsMustSaveMoreThanTheyCost) {
  RecordedStep step{{6, 8, 15, 12, 8, 6, 5, 4, 3, 3},
                    {{8, 0, 9}, {1, 0, 8}, {1, 0, 8}, {1, 0, 8}, {1, 0, 8}, {1, 0, 8}, {1, 0, 8}},
                    {}};
  const Plan free_victims = make_plan(step, {10, 0, {}, 1.0, 0});
  EXPECT_EQ(0, free_victims.evict[0]);
  EXPECT_EQ(5u, free_victims.planned_bytes);
  const Plan costly = make_plan(step, {10, 0, {}, 1.0, 1});
  EXPECT_EQ(1, costly.evict[0]);
  EXPECT_EQ(8u, costly.planned_bytes);
  EXPECT_EQ(1u, costly.num_victims);
}

// Feedback from a fetch that landed late (step_recorder.h): its fetch must start by a point
// named in PlanOptions::fetch_by. X = 3 at point 2, 2 at points 3-6. Belady alone takes B (4,
// needed last) and brings it back after point 6. B must be back by point 3: it is out only
// until then, A (2) covers points 4-6, and both cover point 2; B comes back after point 2,
// where what is out beyond X no longer needs its bytes.
TEST(MakePlanFetchBy, ALateFetchStartsByItsPointAndAnotherBlockCoversTheRest) {
  RecordedStep step{{6, 8, 13, 12, 12, 12, 12, 8, 6, 5}, {{2, 0, 8}, {4, 0, 9}}, {}};
  const Plan before = make_plan(step, {10, 0, {}, 0});
  EXPECT_EQ(std::vector<uint32_t>({N, 6}), before.fetch_at);
  PlanOptions options{10, 0, {}, 0};
  options.fetch_by = {N, 3};
  const Plan after = make_plan(step, options);
  EXPECT_EQ(std::vector<uint32_t>({6, 2}), after.fetch_at);
  EXPECT_EQ(0u, after.shortfall_bytes);
  EXPECT_EQ(6u, after.planned_bytes);
  // By a point no later than its cold one: the block cannot leave at all, and A alone falls
  // short of point 2's 3 bytes.
  options.fetch_by = {N, 0};
  const Plan never = make_plan(step, options);
  EXPECT_EQ(std::vector<uint32_t>({6, N}), never.fetch_at);
  EXPECT_EQ(1u, never.shortfall_bytes);
}

// Note [Room the fetches leave] (step_recorder.h): with a fetch margin, a victim comes back
// only where the room below the limit and what is out beyond the need leave the margin
// free. A (4) must be out at point 2 (11 at limit 10); the need falls 10, 9, 8 after it.
TEST(MakePlanFetchMargin, AFetchStartsWhereItLeavesTheMarginFree) {
  RecordedStep step{{6, 8, 11, 10, 9, 8, 6}, {{4, 0, 6}}, {}};
  PlanOptions options{10, 0, {}, 0};
  EXPECT_EQ(std::vector<uint32_t>({2}), make_plan(step, options).fetch_at) << "as soon as memory allows";
  options.fetch_margin_bytes = 1;
  EXPECT_EQ(std::vector<uint32_t>({3}), make_plan(step, options).fetch_at) << "after point 3, 1 below the limit";
  options.fetch_margin_bytes = 2;
  EXPECT_EQ(std::vector<uint32_t>({4}), make_plan(step, options).fetch_at);
  // No point before its use leaves that much: the fetch starts at the last one.
  options.fetch_margin_bytes = 9;
  EXPECT_EQ(std::vector<uint32_t>({5}), make_plan(step, options).fetch_at);
  // The margin never makes a victim: what must leave and the bytes planned are the same.
  EXPECT_EQ(1u, make_plan(step, options).must_leave_bytes);
  EXPECT_EQ(4u, make_plan(step, options).planned_bytes);
}

// Two victims: B's fetch counts what A, still out, leaves free beyond the need.
TEST(MakePlanFetchMargin, WhatAnotherVictimLeavesOutCountsTowardTheMargin) {
  // Points 2-3 need 6 out (both victims), point 4 needs 2; A (2) is needed at 8, B (4) at 6.
  RecordedStep step{{6, 8, 16, 16, 12, 10, 9, 8, 6}, {{2, 0, 8}, {4, 0, 6}}, {}};
  PlanOptions options{10, 0, {}, 0};
  EXPECT_EQ(std::vector<uint32_t>({4, 3}), make_plan(step, options).fetch_at);
  options.fetch_margin_bytes = 1;
  // B comes back after point 4: at point 5 (10) A, still out, leaves 2 free. A comes back
  // after point 5: at point 6 (9) with both back, 1 is free.
  EXPECT_EQ(std::vector<uint32_t>({5, 4}), make_plan(step, options).fetch_at);
}

// Every point's bytes out under the plan cover what must be out there, wherever a cold
// block could: checked on a generated forward/backward step of many blocks.
TEST(MakePlanProperty, EveryCoverablePointIsCoveredAndNothingIsOutAtItsUse) {
  // Forward: block k (k = 0..39) allocated at point 2k, cold at 2k+1. Backward: used in
  // reverse order at 100 + 2(39-k). Demand: each live block's 3 units plus an untagged
  // peak of 20 at the junction (point 95).
  const uint32_t nblocks = 40, n = 200;
  RecordedStep step;
  step.demand.assign(n, 0);
  for (uint32_t k = 0; k < nblocks; ++k) step.blocks.push_back({3, 2 * k + 1, 100 + 2 * (nblocks - 1 - k)});
  for (uint32_t j = 0; j < n; ++j) {
    uint64_t d = 0;
    for (uint32_t k = 0; k < nblocks; ++k)
      if (2 * k <= j && j <= step.blocks[k].use + 1) d += 3;
    if (j == 95) d += 20;
    step.demand[j] = d;
  }
  for (uint64_t limit : {200u, 130u, 100u, 60u}) {
    const Plan plan = make_plan(step, {limit, 0, {}, 0});
    EXPECT_EQ(0u, plan.shortfall_bytes) << limit;
    for (uint32_t j = 0; j < n; ++j) {
      uint64_t out = 0;
      for (uint32_t k = 0; k < nblocks; ++k) {
        if (!plan.evict[k]) continue;
        const bool is_out = step.blocks[k].cold < j && j <= plan.fetch_at[k];
        if (is_out) out += 3;
        ASSERT_TRUE(!is_out || j < step.blocks[k].use) << "block " << k << " out at its use, limit " << limit;
      }
      const uint64_t must = step.demand[j] > limit ? step.demand[j] - limit : 0;
      ASSERT_GE(out, must) << "point " << j << ", limit " << limit;
    }
    // No more bytes than needed where the worst point decides: the victims are those it needs.
    EXPECT_LE(plan.planned_bytes, plan.must_leave_bytes + 3) << limit;
  }
}

}  // namespace
}  // namespace vramswap::policy
