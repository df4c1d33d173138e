// policy::StepRecorder (src/policy/step_recorder.h): recording a step, following its plan
// while the next step repeats it, divergence and feedback. Pure: no CUDA.
#include "policy/step_recorder.h"

#include <gtest/gtest.h>

namespace vramswap::policy {
namespace {

using K = PointKind;

// A two-block step at limit 10: A and B (4 each) are saved and go cold; the junction's
// allocation raises the demand to 10 + `over` (0: no pressure); backward uses B, then A.
// Returns the points recorded. `b_bytes` changes B's size (a different step).
struct Driver {
  explicit Driver(StepRecorder& recorder) : r(recorder) {}
  StepRecorder& r;
  std::vector<uint32_t> points;
  uint32_t at(K kind, uint32_t block, uint64_t bytes, uint64_t demand) {
    const uint32_t p = r.point(kind, block, bytes, demand);
    points.push_back(p);
    return p;
  }
  // The points of the two cold marks and of the junction, for the tests' checks.
  uint32_t cold_a = kNoPoint, cold_b = kNoPoint, junction = kNoPoint;
  void step(uint64_t over, uint64_t b_bytes = 4, bool finish = true, bool swap_cold = false) {
    r.begin_step();
    at(K::kGraph, kNoPoint, 0, 0);
    at(K::kAlloc, kNoPoint, 4, 4);
    const uint32_t a = r.new_block(4);
    at(K::kPack, a, 4, 4);
    at(K::kAlloc, kNoPoint, b_bytes, 4 + b_bytes);
    const uint32_t b = r.new_block(b_bytes);
    at(K::kPack, b, b_bytes, 4 + b_bytes);
    if (swap_cold) {
      cold_b = at(K::kCold, b, 0, 4 + b_bytes);
      cold_a = at(K::kCold, a, 0, 4 + b_bytes);
    } else {
      cold_a = at(K::kCold, a, 0, 4 + b_bytes);
      cold_b = at(K::kCold, b, 0, 4 + b_bytes);
    }
    junction = at(K::kUnpack, b, 0, 10 + over);  // the loss gradient was allocated before it
    if (!finish) return;
    at(K::kRelease, b, 0, 8);
    at(K::kUnpack, a, 0, 6);
    at(K::kRelease, a, 0, 4);
    r.end_step();
    std::vector<uint64_t> times;
    if (took_ns) {
      times.assign(r.recorded_points(), 0);
      times.back() = took_ns;
    }
    r.plan_next(times, took_ns ? 1.0 : 0);
  }
  uint64_t took_ns = 0;  // the step's time from its first point to its last (0: unknown)
};

TEST(StepRecorder, TheFirstStepIsRecordedTheSecondFollowsThePlan) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(3);
  EXPECT_FALSE(r.following());
  EXPECT_EQ(0u, r.num_planned_steps());
  // The plan: A (needed last) leaves when cold and comes back after the junction.
  ASSERT_EQ(2u, r.plan().evict.size());
  EXPECT_EQ(1, r.plan().evict[0]);
  EXPECT_EQ(0, r.plan().evict[1]);
  EXPECT_EQ(3u, r.plan().must_leave_bytes);

  r.begin_step();
  EXPECT_TRUE(r.following());
  EXPECT_TRUE(r.planned_victim(0));
  EXPECT_FALSE(r.planned_victim(1));
  r.end_step();  // (an empty step diverges: a step is only followed when it repeats)
  EXPECT_EQ(1u, r.num_divergences());

  d.step(3);  // recorded afresh (the empty step was recorded)
  d.step(3);
  EXPECT_EQ(1u, r.num_planned_steps());
  EXPECT_EQ(1u, r.num_divergences());
}

TEST(StepRecorder, PlannedOutAheadIsThePlansMostBytesOutFromHereOn) {
  // What pinned memory and a disk tier behind it must hold before the step ends (the disk
  // tier writes ahead to it: Note [Writing ahead to the disk]): A (4) is out from its cold
  // mark through the junction, after which its fetch starts.
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(3);
  EXPECT_EQ(0u, r.planned_out_ahead()) << "not following a plan";
  r.begin_step();
  Driver f(r);
  f.at(K::kGraph, kNoPoint, 0, 0);
  EXPECT_EQ(4u, r.planned_out_ahead()) << "A will be out";
  f.at(K::kAlloc, kNoPoint, 4, 4);
  const uint32_t a = r.new_block(4);
  f.at(K::kPack, a, 4, 4);
  f.at(K::kAlloc, kNoPoint, 4, 8);
  const uint32_t b = r.new_block(4);
  f.at(K::kPack, b, 4, 8);
  f.at(K::kCold, a, 0, 8);
  f.at(K::kCold, b, 0, 8);
  EXPECT_EQ(4u, r.planned_out_ahead()) << "A is out";
  f.at(K::kUnpack, b, 0, 13);
  EXPECT_EQ(0u, r.planned_out_ahead()) << "past the junction: A's fetch has started, nothing more goes out";
  ASSERT_TRUE(r.following());
}

TEST(StepRecorder, FetchesStartAfterThePointThePlanNames) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(3);
  r.begin_step();
  Driver f(r);
  f.step(3, 4, false);
  EXPECT_TRUE(r.following());
  EXPECT_TRUE(r.fetches_after(f.cold_b).empty());
  ASSERT_EQ(1u, r.fetches_after(f.junction).size()) << "A comes back once the junction has passed";
  EXPECT_EQ(0u, r.fetches_after(f.junction)[0]);
}

TEST(StepRecorder, ADifferentStepDivergesAndIsRecordedForTheNext) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(3);
  d.step(3, 6, false);  // B is 6 bytes now: its allocation point differs
  EXPECT_FALSE(r.following());
  EXPECT_FALSE(r.planned_victim(0)) << "the reactive policy has the rest of a diverged step";
  EXPECT_EQ(1u, r.num_divergences());
  EXPECT_TRUE(r.fetches_after(d.junction).empty());
  d.points.clear();
  Driver rest(r);
  rest.at(K::kRelease, 1, 0, 8);
  rest.at(K::kUnpack, 0, 0, 6);
  rest.at(K::kRelease, 0, 0, 4);
  r.end_step();
  r.plan_next({}, 0);
  d.step(3, 6);  // the new shape repeats: followed
  EXPECT_EQ(1u, r.num_planned_steps());
  EXPECT_EQ(1u, r.num_divergences());
}

// A three-block step at limit 10: A, B and C (4 each) saved and cold; the junction raises
// the demand to 16, so A and B (needed last) leave; C is used before B and A. With
// `stop_at_junction` the step stops before the junction's point (the allocation is under
// way); otherwise it runs to the end. Returns the junction's point.
uint32_t three_block_step(StepRecorder& r, bool stop_at_junction = false) {
  r.begin_step();
  r.point(K::kGraph, kNoPoint, 0, 0);
  uint32_t block[3];
  for (int i = 0; i < 3; ++i) {
    r.point(K::kAlloc, kNoPoint, 4, 4 * uint64_t(i + 1));
    block[i] = r.new_block(4);
    r.point(K::kPack, block[i], 4, 4 * uint64_t(i + 1));
  }
  for (int i = 0; i < 3; ++i) r.point(K::kCold, block[i], 0, 12);
  if (stop_at_junction) return kNoPoint;
  const uint32_t junction = r.point(K::kAlloc, kNoPoint, 4, 16);  // X = 6: A and B out
  r.point(K::kUnpack, block[2], 0, 12);                            // X = 2: A alone covers it
  r.point(K::kRelease, block[2], 0, 8);
  r.point(K::kUnpack, block[1], 0, 8);
  r.point(K::kRelease, block[1], 0, 4);
  r.point(K::kUnpack, block[0], 0, 4);
  r.point(K::kRelease, block[0], 0, 0);
  r.end_step();
  r.plan_next({}, 0);
  return junction;
}

// Following, an allocation found memory short and the reactive policy evicted C, which the
// plan keeps. Fetched when backward asks for it, C would queue behind the planned fetches of
// B and A already started, though it is needed first; it joins them in order of use instead.
TEST(StepRecorder, ABlockEvictedBeyondThePlanIsFetchedInOrderOfUse) {
  StepRecorder r(true, 10);
  const uint32_t junction = three_block_step(r);
  ASSERT_EQ(10u, junction);
  ASSERT_EQ(2u, r.plan().num_victims);
  ASSERT_EQ(1, r.plan().evict[0]);
  ASSERT_EQ(1, r.plan().evict[1]);
  ASSERT_EQ(0, r.plan().evict[2]);
  ASSERT_EQ(junction, r.plan().fetch_at[1]) << "B comes back after the junction";
  ASSERT_EQ(junction + 1, r.plan().fetch_at[0]) << "A after C's use";

  three_block_step(r, /*stop_at_junction=*/true);
  ASSERT_TRUE(r.following());
  r.refetch(2);  // C, evicted for the junction's allocation
  EXPECT_EQ((std::vector<uint32_t>{2, 1}), r.fetches_after(junction)) << "C before B: it is needed sooner";
  r.refetch(2);
  EXPECT_EQ((std::vector<uint32_t>{2, 1}), r.fetches_after(junction)) << "once";
  r.refetch(0);  // A is a victim whose planned fetch is still to come: unchanged
  EXPECT_EQ(std::vector<uint32_t>{0}, r.fetches_after(junction + 1));
  EXPECT_EQ((std::vector<uint32_t>{2, 1}), r.fetches_after(junction));
}

// Not following (the first step, or after a divergence), nothing is planned to join.
TEST(StepRecorder, RefetchOutsideAPlanChangesNothing) {
  StepRecorder r(true, 10);
  three_block_step(r, /*stop_at_junction=*/true);
  ASSERT_FALSE(r.following());
  r.refetch(2);
  EXPECT_TRUE(r.fetches_after(10).empty());
}

// The tracker may find two blocks cold in the other order next time: the same step.
TEST(StepRecorder, ColdMarksInAnotherOrderAreTheSameStep) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(3);
  d.step(3, 4, true, true);
  EXPECT_EQ(1u, r.num_planned_steps());
  EXPECT_EQ(0u, r.num_divergences());
}

TEST(StepRecorder, NoPressureMeansAnEmptyPlanFollowed) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(0);
  d.step(0);
  EXPECT_EQ(1u, r.num_planned_steps());
  EXPECT_EQ(0u, r.plan().num_victims);
  EXPECT_EQ(0u, r.plan().planned_bytes);
}

// A step that follows the plan (Driver's, with nothing evicted) and whose junction
// allocation waited for `bytes` while `under_way` bytes of evictions were in flight; the next
// plan is made from it.
void planned_step_that_waited(StepRecorder& r, uint64_t bytes, uint64_t under_way) {
  r.begin_step();
  Driver f(r);
  f.step(0, 4, false);
  ASSERT_TRUE(r.following());
  r.waited(bytes, under_way);
  f.at(K::kRelease, 1, 0, 8);
  f.at(K::kUnpack, 0, 0, 6);
  f.at(K::kRelease, 0, 0, 4);
  r.end_step();
  r.plan_next({}, 0);
}

TEST(StepRecorder, WaitsAreCoveredByTheNextPlan) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(0);  // no pressure recorded: no victim
  EXPECT_EQ(0u, r.plan().num_victims);
  // The next step follows, but its junction allocation had to wait for 2 bytes (the pool's
  // overhead the demand does not show).
  planned_step_that_waited(r, 2, 0);
  EXPECT_EQ(1u, r.num_planned_steps());
  EXPECT_EQ(2u, r.plan().must_leave_bytes) << "the wait is added at the junction";
  EXPECT_EQ(1u, r.plan().num_victims);
}

TEST(StepRecorder, AWaitTheEvictionsUnderWayCoverIsNoFeedback) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(0);
  // The next step follows; its junction allocation waits for 2 bytes while 2 bytes of
  // evictions are still on their way out (the plan's copies land late): nothing is added.
  planned_step_that_waited(r, 2, 2);
  EXPECT_EQ(1u, r.num_planned_steps());
  EXPECT_EQ(0u, r.plan().must_leave_bytes) << "the copies were late, nothing was missing";
  // Once more, with 1 byte under way for the 3 waited for: 2 were missing.
  planned_step_that_waited(r, 3, 1);
  EXPECT_EQ(2u, r.plan().must_leave_bytes);
}

// Note [Room the fetches leave]: a one-block step at limit 2560, so that the room a fetch may
// leave (at most limit / kFetchRoomShare) is 10. A (400) is saved and goes cold; the
// junction is 40 over; backward's need falls by 5 a point until A's use. A step that follows
// the plan waits for `waited` bytes at its first allocation (where nothing is over), with
// `fetching` bytes of fetches in flight.
struct RoomStep {
  explicit RoomStep(StepRecorder& recorder) : r(recorder) {}
  StepRecorder& r;
  void step(uint64_t waited = 0, uint64_t fetching = 0, uint64_t junction_bytes = 2200) {
    r.begin_step();
    r.point(K::kGraph, kNoPoint, 0, 0);
    r.point(K::kAlloc, kNoPoint, 400, 400);
    if (r.following() && waited) r.waited(waited, 0, fetching);
    const uint32_t a = r.new_block(400);
    r.point(K::kPack, a, 400, 400);
    r.point(K::kCold, a, 0, 400);
    junction = r.point(K::kAlloc, kNoPoint, junction_bytes, 2600);
    for (uint64_t k = 0; k < 4; ++k) r.point(K::kAlloc, kNoPoint, k + 1, 2560 - 5 * k);
    r.point(K::kUnpack, a, 0, 2545);
    r.point(K::kRelease, a, 0, 2145);
    r.end_step();
    r.plan_next({}, 0);
  }
  uint32_t fetch_of_a() const { return r.plan().fetch_at.at(0); }
  uint32_t junction = kNoPoint;
};

TEST(StepRecorder, AWaitWhileFetchesHeldMemoryMakesTheNextPlansFetchesLeaveRoom) {
  static_assert(2560 / kFetchRoomShare == 10);
  StepRecorder r(true, 2560);
  RoomStep s(r);
  s.step();
  ASSERT_EQ(1u, r.plan().num_victims);
  EXPECT_EQ(s.junction, s.fetch_of_a()) << "back as soon as memory allows";
  s.step();  // followed, no wait: nothing changes
  EXPECT_EQ(s.junction, s.fetch_of_a());
  s.step(2, 4 * 400);  // 8 x 2 = 16, at most 10: A waits for a point 10 below the limit
  EXPECT_EQ(2u, r.num_planned_steps());
  EXPECT_EQ(s.junction + 2, s.fetch_of_a()) << "after the point at 2555, where only 5 would be free";
  s.step();  // the room stays while the step repeats
  EXPECT_EQ(s.junction + 2, s.fetch_of_a());
  EXPECT_EQ(400u, r.plan().planned_bytes) << "the room moves the fetch, it makes no victim";
}

TEST(StepRecorder, AWaitWithNoFetchInFlightLeavesNoRoom) {
  StepRecorder r(true, 2560);
  RoomStep s(r);
  s.step();
  s.step(2, 0);
  EXPECT_EQ(s.junction, s.fetch_of_a()) << "the wait is the point's feedback only";
}

TEST(StepRecorder, ADivergenceForgetsTheRoom) {
  StepRecorder r(true, 2560);
  RoomStep s(r);
  s.step();
  s.step(2, 400);
  EXPECT_EQ(s.junction + 2, s.fetch_of_a());
  s.step(0, 0, 2201);  // another junction allocation: a divergence, recorded afresh
  EXPECT_EQ(1u, r.num_divergences());
  EXPECT_EQ(s.junction, s.fetch_of_a()) << "the plan made from the new recording leaves no room";
}

TEST(StepRecorder, PressureRaisesTheNextPointsDemand) {
  StepRecorder r(true, 10);
  r.begin_step();
  r.point(K::kGraph, kNoPoint, 0, 4);
  const uint32_t a = r.new_block(4);
  r.point(K::kPack, a, 4, 4);
  r.point(K::kCold, a, 0, 4);
  r.pressure(13);  // an allocation found the pool needing 13 with nothing evicted
  r.point(K::kAlloc, kNoPoint, 2, 8);  // the allocated bytes alone say 8
  r.point(K::kUnpack, a, 0, 6);
  r.point(K::kRelease, a, 0, 4);
  r.end_step();
  EXPECT_TRUE(r.plan_pending());
  r.plan_next({}, 0);
  EXPECT_FALSE(r.plan_pending());
  EXPECT_EQ(3u, r.plan().must_leave_bytes);
  EXPECT_EQ(1u, r.plan().num_victims);
}

TEST(StepRecorder, BeginStepPlansWithoutTimesWhenNobodyDid) {
  StepRecorder r(true, 10);
  Driver d(r);
  d.step(3);  // plans (the driver calls plan_next)
  r.begin_step();
  r.point(K::kGraph, kNoPoint, 0, 0);
  // A step that ends without plan_next: the next begin_step makes the plan itself.
  const uint32_t a = r.new_block(4);
  r.point(K::kPack, a, 4, 4);
  r.point(K::kRelease, a, 0, 4);
  r.end_step();
  EXPECT_TRUE(r.plan_pending());
  r.begin_step();
  EXPECT_FALSE(r.plan_pending());
  EXPECT_TRUE(r.following());
}

// Two planned steps in a row slower than the reactive one (the second with the first's
// feedback) send the next two steps back to the reactive policy; then the plan is tried
// again, and a planned step as fast ends the back-off.
TEST(StepRecorder, APlanSlowerThanTheReactivePolicyBacksOff) {
  StepRecorder r(true, 10);
  Driver d(r);
  auto step_taking = [&](uint64_t ns) {
    d.took_ns = ns;
    d.step(3);
  };
  step_taking(100);  // reactive: 100 ns
  step_taking(110);  // planned, 10% slower: its feedback gets a chance
  EXPECT_EQ(1u, r.num_planned_steps());
  EXPECT_EQ(0u, r.num_backoffs());
  step_taking(110);  // planned, slower again: back off
  EXPECT_EQ(2u, r.num_planned_steps());
  EXPECT_EQ(1u, r.num_backoffs());
  EXPECT_FALSE(r.backing_off()) << "that step itself followed the plan";
  step_taking(100);  // reactive
  EXPECT_TRUE(r.backing_off());
  step_taking(100);  // reactive
  EXPECT_TRUE(r.backing_off());
  EXPECT_EQ(2u, r.num_planned_steps()) << "two steps back on the reactive policy";
  step_taking(101);  // planned, within 2%
  EXPECT_FALSE(r.backing_off());
  EXPECT_EQ(3u, r.num_planned_steps());
  step_taking(101);  // and the next one follows too
  EXPECT_EQ(4u, r.num_planned_steps());
  EXPECT_EQ(1u, r.num_backoffs());
}

// A step whose blocks A (2) and B (4) go cold before five allocations that need 3, then 2
// bytes out at limit 10; backward uses A at point 11 and B at point 12. Its points are 10 ns
// apart. The plan takes B (needed last) and brings it back after point 9.
struct LateStep {
  explicit LateStep(StepRecorder& recorder) : r(recorder) {}
  StepRecorder& r;
  std::vector<uint64_t> times;
  // Records one step that took `took_ns` from its first point to its last, and plans the next
  // with the fetches that landed late in it.
  void run(uint64_t took_ns, const std::vector<LateFetch>& late = {}) {
    r.begin_step();
    r.point(K::kGraph, kNoPoint, 0, 4);
    const uint32_t a = r.new_block(2);
    r.point(K::kPack, a, 2, 4);
    const uint32_t b = r.new_block(4);
    r.point(K::kPack, b, 4, 6);
    r.point(K::kCold, a, 0, 6);
    r.point(K::kCold, b, 0, 6);
    for (uint64_t demand : {13, 12, 12, 12, 12, 8}) r.point(K::kAlloc, kNoPoint, 1, demand);
    r.point(K::kUnpack, a, 0, 8);
    r.point(K::kUnpack, b, 0, 6);
    r.point(K::kRelease, a, 0, 4);
    r.point(K::kRelease, b, 0, 2);
    r.end_step();
    times.assign(r.recorded_points(), 0);
    for (size_t p = 0; p < times.size(); ++p) times[p] = 10 * p;
    times.back() = took_ns;
    r.plan_next(times, 1.0, late);
  }
};

// Feedback from a fetch that landed late (Capuchin's): its fetch moves earlier next step, to
// the last point by the time it should have started; the move stays only if the step with it
// is faster than the planned step before it, else it is undone for good.
TEST(StepRecorder, ALateFetchMovesEarlierAndStaysOnlyIfTheStepIsFaster) {
  StepRecorder r(true, 10);
  LateStep s(r);
  s.run(200);  // reactive, recorded
  EXPECT_EQ(std::vector<uint32_t>({kNoPoint, 9}), r.plan().fetch_at);
  s.run(200);  // planned
  // Planned again; B's fetch landed late: it should have started by t = 65 (point 6).
  s.run(200, {{1, 65}});
  EXPECT_EQ(1u, r.num_fetch_moves());
  EXPECT_EQ(std::vector<uint32_t>({9, 5}), r.plan().fetch_at) << "B back by point 6, A covering points 7-9";
  // The step with the move is faster: the move stays.
  s.run(190);
  EXPECT_EQ(std::vector<uint32_t>({9, 5}), r.plan().fetch_at);
  EXPECT_EQ(0u, r.num_fetch_moves_undone());
  // Late again, by point 4 (B's cold point): it could not leave at all. Tried, and no faster.
  s.run(190, {{1, 45}});
  EXPECT_EQ(2u, r.num_fetch_moves());
  EXPECT_EQ(kNoPoint, r.plan().fetch_at[1]);
  s.run(190);
  EXPECT_EQ(1u, r.num_fetch_moves_undone());
  EXPECT_EQ(std::vector<uint32_t>({9, 5}), r.plan().fetch_at) << "back to the plan before the move";
  // B is not moved again.
  s.run(190, {{1, 45}});
  EXPECT_EQ(2u, r.num_fetch_moves());
  EXPECT_EQ(std::vector<uint32_t>({9, 5}), r.plan().fetch_at);
  // A fetch reported late where it already starts by then moves nothing.
  s.run(190, {{0, 95}});
  EXPECT_EQ(2u, r.num_fetch_moves());
}

// The moves are the recorded step's: a step that diverges forgets them.
TEST(StepRecorder, ADivergenceForgetsTheMovedFetches) {
  StepRecorder r(true, 10);
  LateStep s(r);
  s.run(200);
  s.run(200, {{1, 65}});
  EXPECT_EQ(std::vector<uint32_t>({9, 5}), r.plan().fetch_at);
  r.begin_step();
  r.point(K::kGraph, kNoPoint, 0, 4);
  r.point(K::kPack, r.new_block(8), 8, 12);  // another step
  r.end_step();
  r.plan_next({}, 0);
  s.run(200);
  EXPECT_EQ(std::vector<uint32_t>({kNoPoint, 9}), r.plan().fetch_at);
}

TEST(StepRecorder, DisabledRecordsNothing) {
  StepRecorder r(false, 10);
  Driver d(r);
  d.step(3);
  d.step(3);
  EXPECT_FALSE(r.active());
  EXPECT_EQ(0u, r.num_planned_steps());
  for (uint32_t p : d.points) EXPECT_EQ(kNoPoint, p);
}

TEST(StepRecorder, ATooLongStepIsNotPlanned) {
  StepRecorder r(true, 10, 5);
  Driver d(r);
  d.step(3);
  EXPECT_EQ(0u, r.plan().num_victims);
  d.step(3);
  EXPECT_EQ(0u, r.num_planned_steps());
  EXPECT_FALSE(r.following());
}

}  // namespace
}  // namespace vramswap::policy
