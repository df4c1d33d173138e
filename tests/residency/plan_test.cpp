// Planned eviction (Note [Recording and following a step], policy/step_recorder.h) through
// the engine on cudasim: a step repeated, its plan followed from the second one on.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <functional>

#include "residency/engine_test_util.h"

namespace engine_test {
namespace {

constexpr size_t kJunction = 8 * kMiB;

class PlanTest : public EngineFixture {
 protected:
  struct StepCounts {
    uint64_t evicted = 0, planned = 0, faults = 0;
  };
  // Backward's use of block `i` of a forward saved from `seed`: unpacked and checked, then
  // `before_release` (the junction's free, after the first use), then released and freed.
  void use_and_free(const Saved& saved, int i, uint8_t seed, size_t size = kBlock,
                    const std::function<void()>& before_release = {}) {
    EXPECT_TRUE(engine_->unpack(saved.handles[i], stream_).ok) << i;
    EXPECT_TRUE(holds(saved.blocks[i], uint8_t(seed + i), size)) << "block " << i;
    if (before_release) before_release();
    EXPECT_TRUE(engine_->release(saved.handles[i]).ok) << i;
    EXPECT_TRUE(engine_->free_tagged(saved.blocks[i], stream_).ok) << i;
  }
  // One training step: a forward saves `n` blocks (block `odd` is `odd_size` bytes), the
  // junction allocates kJunction untagged bytes, backward uses the blocks last-saved first
  // (each checked), releases and frees them; the junction block goes after the first use.
  StepCounts step(int n, uint8_t seed, int odd = -1, size_t odd_size = kBlock) {
    const EngineStats before = stats();
    engine_->graph_begin();
    Saved saved;
    std::vector<size_t> sizes;
    for (int i = 0; i < n; ++i) {
      sizes.push_back(i == odd ? odd_size : kBlock);
      saved.blocks.push_back(tagged(uint8_t(seed + i), sizes.back()));
      saved.handles.push_back(pack_cold(saved.blocks.back()));
    }
    std::string error;
    void* junction = pool_->allocate(kJunction, stream_, &error);
    EXPECT_NE(nullptr, junction) << error;
    for (int i = n - 1; i >= 0; --i) {
      use_and_free(saved, i, seed, sizes[i], [&] {
        if (!junction) return;
        EXPECT_TRUE(pool_->deallocate(junction, stream_).ok);
        junction = nullptr;
      });
    }
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream_));
    EXPECT_EQ("", engine_->check_invariants());
    const EngineStats after = stats();
    return {after.bytes_evicted_total - before.bytes_evicted_total,
            after.planned_bytes_d2h - before.planned_bytes_d2h, after.num_faults - before.num_faults};
  }
};

// Six 4 MiB blocks and an 8 MiB junction under a 28 MiB limit: 4 MiB must leave.
TEST_F(PlanTest, TheSecondStepFollowsThePlanOfTheFirst) {
  start(28 * kMiB);
  const StepCounts first = step(6, 10);
  EXPECT_EQ(0u, stats().num_planned_steps) << "the first step is only recorded";
  EXPECT_EQ(0u, first.planned);
  EXPECT_GT(first.evicted, 0u) << "the reactive policy made room at the junction";
  for (int k = 2; k <= 3; ++k) {
    const StepCounts next = step(6, uint8_t(10 * k));
    EXPECT_EQ(uint64_t(k - 1), stats().num_planned_steps);
    EXPECT_EQ(0u, stats().num_plan_divergences);
    // The block needed last left as soon as it was cold, and only it: 4 MiB.
    EXPECT_EQ(kBlock, next.planned) << "step " << k;
    EXPECT_EQ(kBlock, next.evicted) << "step " << k;
    EXPECT_EQ(0u, next.faults) << "the plan fetched it back before its use, step " << k;
  }
}

// Following a plan, the pool's no-wait request gives up the plan's clean victims and starts
// nothing more: the pool's own measures (the stream's cached blocks) come before any eviction
// beyond the plan. (Starting evictions there moved 0.9 GB more than the plan at gpt-small's
// junction, in place of the forward's own cached blocks.)
TEST_F(PlanTest, FollowingAPlanTheNoWaitReclaimStartsNoEvictionBeyondIt) {
  start(28 * kMiB);
  step(6, 10);  // recorded: the plan evicts block 0, needed last
  // The forward below starts from an empty cache, so that it needs no page the plan's victim
  // holds: with the last step's blocks cached, where they lie depends on when the copy
  // stream's events completed, and a block that may not take part of a cached run (Note
  // [Runs] in granules.cpp) takes its pages from the victim before the checks below.
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  pool_->empty_cache();
  engine_->graph_begin();
  const Saved saved = save_cold(6, 40);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());  // the planned copy has landed
  EXPECT_EQ(kBlock, stats().clean_bytes) << "the plan's victim is copied out and still mapped";
  const uint64_t freed = engine_->reclaim(3 * kBlock, DevicePool::ReclaimMode::kNoWait);
  EXPECT_EQ(kBlock, freed) << "the plan's victim is given up";
  EXPECT_EQ(0u, stats().in_flight_bytes) << "no eviction beyond the plan was started";
  for (int i = 5; i >= 0; --i) use_and_free(saved, i, 40);
  EXPECT_EQ("", engine_->check_invariants());
}

// The plan's victims are the blocks it needs out, wherever they stand in backward's order:
// with two victims among six blocks and a prefetch window of five, block 1 is both. Kept
// for the window, it stayed mapped when an allocation needed its memory, and the reactive
// policy evicted a block the plan keeps in its place (at gpt-small's junction at 90%, a
// 384 MiB block for the 20 MiB the plan's small victims in the window would have freed).
TEST_F(PlanTest, APlannedVictimInThePrefetchWindowIsGivenUpWhenItsMemoryIsNeeded) {
  EngineOptions options;
  options.horizon = 5;
  start(24 * kMiB, options);
  step(6, 10);  // recorded: 8 MiB must leave at the junction; the plan evicts blocks 0 and 1
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  pool_->empty_cache();  // as in the test above: the forward needs no page a victim holds
  engine_->graph_begin();
  const Saved saved = save_cold(6, 40);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());  // the planned copies have landed
  ASSERT_EQ(2 * kBlock, stats().clean_bytes) << "the plan's two victims are copied out and still mapped";
  const uint64_t freed = engine_->reclaim(2 * kBlock, DevicePool::ReclaimMode::kNoWait);
  EXPECT_EQ(2 * kBlock, freed) << "both victims of the plan are given up, block 1 (in the window) too";
  EXPECT_EQ(0u, stats().in_flight_bytes);
  for (int i = 5; i >= 0; --i) use_and_free(saved, i, 40);
  EXPECT_EQ("", engine_->check_invariants());
}

// Following a plan whose victim is not the block needed last (here the 4 MiB block 1 covers
// the 2 MiB that must leave, where block 0 would move 8), an allocation that must wait gives
// up the plan's clean victim before it starts any eviction. Belady's rule over clean and
// evictable blocks together started the eviction of block 0, needed later, and waited for its
// copy (at gpt-small's junction at 90%, a 384 MiB block copied out for 20 MiB of the plan's
// small victims already copied out).
// The plan takes block 1 only where its copy can land by the junction at the copy rate
// measured in the first step. In virtual time (CTest runs the case there too) it always can;
// in real time a copy worker descheduled on a loaded machine made the one copy timed look 50
// times slower, and the plan took block 0 (correctly, for that rate): then the allocation
// gives up block 0 and nothing else leaves, which the case checks whichever the plan chose.
TEST_F(PlanTest, AnAllocationThatMustWaitGivesUpThePlansVictimsFirst) {
  start(34 * kMiB);
  step(6, 10, /*odd=*/0, /*odd_size=*/2 * kBlock);  // 2 MiB must leave at the junction
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  pool_->empty_cache();  // as in the tests above: the forward needs no page a victim holds
  const EngineStats before = stats();
  engine_->graph_begin();
  Saved saved;
  for (int i = 0; i < 6; ++i) {
    saved.blocks.push_back(tagged(uint8_t(40 + i), i == 0 ? 2 * kBlock : kBlock));
    saved.handles.push_back(pack_cold(saved.blocks.back()));
  }
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());  // the planned copy has landed
  const uint64_t planned = stats().clean_bytes;     // the plan's victim, copied out and still mapped
  if (virtual_time()) {
    ASSERT_EQ(kBlock, planned) << "the plan's victim, block 1, is copied out and still mapped";
  } else {
    ASSERT_TRUE(planned == kBlock || planned == 2 * kBlock) << planned << " bytes clean: one victim, block 1 or 0";
  }
  const uint64_t freed = engine_->reclaim(kBlock, DevicePool::ReclaimMode::kFull);
  EXPECT_EQ(planned, freed) << "the plan's victim is given up";
  EXPECT_EQ(planned, stats().bytes_evicted_total - before.bytes_evicted_total) << "nothing beyond the plan left";
  for (int i = 5; i >= 0; --i) use_and_free(saved, i, 40, i == 0 ? 2 * kBlock : kBlock);
  EXPECT_EQ("", engine_->check_invariants());
}

// Following a plan, the prefetch window does not fetch the plan's victims before their
// planned fetches: the plan brings each back once memory allows, and one fetched sooner takes
// memory the plan counts on (VGG-16 at batch 128 and 75%: the window fetched a 784 MiB victim
// early, the allocations after it waited, and the reactive policy evicted and fetched a
// 1.53 GiB block the plan keeps three times a step).
TEST_F(PlanTest, ThePrefetchWindowLeavesThePlansVictimsToThePlan) {
  EngineOptions options;
  options.horizon = 5;
  start(24 * kMiB, options);
  // Six 4 MiB blocks; the junction (8 MiB) goes after block 5's use, and another 8 MiB
  // untagged block is allocated after block 4's: 8 MiB must leave at the junction, 4 MiB
  // after block 4's use, when the window (blocks 3 to 0) finds 8 MiB free.
  auto run = [&](uint8_t seed) {
    engine_->graph_begin();
    const Saved saved = save_cold(6, seed);
    std::string error;
    void* junction = pool_->allocate(kJunction, stream_, &error);
    EXPECT_NE(nullptr, junction) << error;
    use_and_free(saved, 5, seed, kBlock, [&] { EXPECT_TRUE(pool_->deallocate(junction, stream_).ok); });
    EXPECT_TRUE(engine_->unpack(saved.handles[4], stream_).ok);
    void* late = pool_->allocate(kJunction, stream_, &error);
    EXPECT_NE(nullptr, late) << error;
    EXPECT_TRUE(holds(saved.blocks[4], uint8_t(seed + 4), kBlock));
    EXPECT_TRUE(engine_->release(saved.handles[4]).ok);
    EXPECT_TRUE(engine_->free_tagged(saved.blocks[4], stream_).ok);
    EXPECT_TRUE(pool_->deallocate(late, stream_).ok);
    for (int i = 3; i >= 0; --i) use_and_free(saved, i, seed);
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream_));
    EXPECT_EQ("", engine_->check_invariants());
  };
  run(10);  // recorded
  const EngineStats before = stats();
  run(40);
  EXPECT_EQ(1u, stats().num_planned_steps);
  EXPECT_EQ(0u, stats().num_plan_divergences);
  EXPECT_EQ(stats().planned_bytes_d2h - before.planned_bytes_d2h, stats().bytes_evicted_total - before.bytes_evicted_total)
      << "a victim fetched early by the window took the memory the late allocation needed: it evicted beyond the plan";
  EXPECT_EQ(0u, stats().num_faults - before.num_faults);
}

// Following the plan, the junction needs 4 MiB more than the recorded step did (untagged, so
// not a divergence): the reactive policy evicts block 1, which the plan keeps. Its fetch
// joins the plan's, ahead of block 0's (needed after it): before, it waited for the prefetch
// window to reach it (one block ahead here) and queued behind every copy back already
// under way, block 0's included, though it is needed first.
TEST_F(PlanTest, ABlockEvictedBeyondThePlanComesBackWithThePlansFetches) {
  EngineOptions options;
  options.horizon = 1;
  start(28 * kMiB, options);
  step(6, 10);  // recorded: the plan evicts block 0, needed last
  const EngineStats before = stats();
  engine_->graph_begin();
  const Saved saved = save_cold(6, 40);
  std::string error;
  void* junction = pool_->allocate(kJunction, stream_, &error);
  ASSERT_NE(nullptr, junction) << error;
  void* more = pool_->allocate(kBlock, stream_, &error);
  ASSERT_NE(nullptr, more) << error;
  EXPECT_EQ(2 * kBlock, stats().evicted_bytes) << "the plan's victim and block 1, beyond the plan";
  for (int i = 5; i >= 0; --i) {
    if (i == 2) {
      EXPECT_EQ(2u, stats().num_prefetches - before.num_prefetches)
          << "blocks 1 and 0 are on their way back before backward reaches block 2";
    }
    use_and_free(saved, i, 40, kBlock, [&] {
      if (!junction) return;
      EXPECT_TRUE(pool_->deallocate(junction, stream_).ok);
      EXPECT_TRUE(pool_->deallocate(more, stream_).ok);
      junction = more = nullptr;
    });
  }
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream_));
  EXPECT_EQ(1u, stats().num_planned_steps);
  EXPECT_EQ(0u, stats().num_plan_divergences) << "untagged pressure is not a divergence";
  EXPECT_EQ(0u, stats().num_faults - before.num_faults);
  EXPECT_EQ("", engine_->check_invariants());
}

TEST_F(PlanTest, ADifferentStepDivergesAndTheOneAfterFollowsIt) {
  start(28 * kMiB);
  step(6, 10);
  step(6, 20, 3, 2 * kMiB);  // block 3 is smaller: not the recorded step
  EXPECT_EQ(1u, stats().num_plan_divergences);
  EXPECT_EQ(0u, stats().num_planned_steps);
  const StepCounts again = step(6, 30, 3, 2 * kMiB);
  EXPECT_EQ(1u, stats().num_planned_steps) << "the changed step was recorded and repeats";
  EXPECT_EQ(1u, stats().num_plan_divergences);
  EXPECT_EQ(0u, again.faults);
}

TEST_F(PlanTest, NoPressureMovesNothing) {
  start(64 * kMiB);
  for (int k = 1; k <= 3; ++k) {
    const StepCounts s = step(6, uint8_t(10 * k));
    EXPECT_EQ(0u, s.evicted) << "step " << k;
  }
  EXPECT_EQ(2u, stats().num_planned_steps);
  EXPECT_EQ(0u, stats().planned_bytes_d2h);
}

// After a step without pressure the pool places densely (Note [A step without pressure] in
// pool/device_pool.h): a 3 MiB block placed in whole granules in the recorded step takes
// 3 MiB in the next. Where a block is placed is the pool's business: the step is the same
// one, and follows its plan (kept AdamW state at 112% of its peak diverged there, and the
// watermarks, deciding for the rest of the step, copied 12 MB out).
TEST_F(PlanTest, AStepPlacedDenselyAfterTheRecordedOneFollowsItsPlan) {
  start(64 * kMiB);
  for (int k = 1; k <= 3; ++k) {
    const StepCounts s = step(6, uint8_t(10 * k), 3, 3 * kMiB);
    EXPECT_EQ(0u, s.evicted) << "step " << k;
  }
  EXPECT_EQ(2u, stats().num_planned_steps);
  EXPECT_EQ(0u, stats().num_plan_divergences);
}

TEST_F(PlanTest, PlanOffNeverFollows) {
  EngineOptions options;
  options.plan = false;
  start(28 * kMiB, options);
  for (int k = 1; k <= 3; ++k) {
    const StepCounts s = step(6, uint8_t(10 * k));
    EXPECT_EQ(0u, s.planned) << "step " << k;
    EXPECT_GT(s.evicted, 0u) << "step " << k;
  }
  EXPECT_EQ(0u, stats().num_planned_steps);
  EXPECT_EQ(0u, stats().num_plan_divergences);
}

}  // namespace
}  // namespace engine_test
