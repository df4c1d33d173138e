// DevicePool caching: a freed block is reused with no new mapping (a cache hit), free
// neighbours coalesce, empty_cache() unmaps exactly the granules no live block touches,
// and the statistics (allocated, reserved, peaks, counts) move as device_pool.h says.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "pool_test_util.h"

namespace pool_test {
namespace {

using Caching = PoolTest;

TEST_F(Caching, SameSizeOnTheSameStreamIsACacheHitThatMapsNothing) {
  SKIP_UNLESS_CUDASIM();
  const size_t size = 300 * kKiB + 3;
  void* p = allocate(size);
  ASSERT_NE(nullptr, p);
  deallocate(p);
  const PoolStats before = stats();
  const cudasim_counters sim = *sim_counters();

  void* q = allocate(size);
  EXPECT_EQ(p, q) << "the block freed on this stream is reused";
  const PoolStats after = stats();
  EXPECT_EQ(before.num_cache_hits + 1, after.num_cache_hits);
  EXPECT_EQ(before.reserved_bytes, after.reserved_bytes);
  EXPECT_EQ(sim.mapped_bytes, sim_counters()->mapped_bytes) << "a cache hit maps nothing";
  EXPECT_EQ(sim.physical_bytes, sim_counters()->physical_bytes) << "a cache hit creates nothing";
  deallocate(q);
}

TEST_F(Caching, OnlyAllocationsThatMapNothingAreCacheHits) {
  void* first = allocate(kMiB);
  ASSERT_NE(nullptr, first);
  EXPECT_EQ(0u, stats().num_cache_hits) << "the first allocation had to map";
  void* second = allocate(4 * granularity());
  ASSERT_NE(nullptr, second);
  EXPECT_EQ(0u, stats().num_cache_hits) << "a block larger than the cache had to map";
  deallocate(second);
  deallocate(first);
}

TEST_F(Caching, ASmallerRequestIsServedFromALargerFreeBlock) {
  SKIP_UNLESS_CUDASIM();
  void* big = allocate(6 * kMiB);
  ASSERT_NE(nullptr, big);
  deallocate(big);
  const uint64_t mapped = sim_counters()->mapped_bytes;
  const uint64_t hits = stats().num_cache_hits;
  std::vector<void*> small;
  LiveBlocks live;
  for (int i = 0; i < 12; ++i) {
    void* p = allocate(500 * kKiB);
    ASSERT_NE(nullptr, p);
    ASSERT_TRUE(live.insert(p, 500 * kKiB));
    EXPECT_TRUE(address(p) >= address(big) && address(p) + 500 * kKiB <= address(big) + 6 * kMiB)
        << "block " << i << " at " << p << " is outside the cached 6 MiB at " << big;
    small.push_back(p);
  }
  EXPECT_EQ(hits + 12, stats().num_cache_hits);
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes);
  for (void* p : small) deallocate(p);
}

TEST_F(Caching, TwoAdjacentFreedBlocksCoalesce) {
  SKIP_UNLESS_CUDASIM();
  const size_t half = 768 * kKiB;
  void* a = allocate(half);
  void* b = allocate(half);
  ASSERT_NE(nullptr, a);
  ASSERT_NE(nullptr, b);
  ASSERT_EQ(address(a) + half, address(b))
      << "precondition: two allocations from a fresh granule are neighbours";
  deallocate(a);
  deallocate(b);
  const uint64_t mapped = sim_counters()->mapped_bytes;
  const uint64_t hits = stats().num_cache_hits;

  void* both = allocate(2 * half);
  EXPECT_EQ(a, both) << "the two freed neighbours form one block";
  EXPECT_EQ(hits + 1, stats().num_cache_hits);
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes);
  deallocate(both);
}

TEST_F(Caching, AFreedBlockCoalescesWithBothNeighbours) {
  SKIP_UNLESS_CUDASIM();
  // Four quarters fill one granule; the middle one is freed last, between two free ones.
  const size_t quarter = granularity() / 4;
  void* q[4] = {};
  for (int i = 0; i < 4; ++i) {
    q[i] = allocate(quarter);
    ASSERT_NE(nullptr, q[i]);
    if (i > 0) {
      ASSERT_EQ(address(q[i - 1]) + quarter, address(q[i])) << "precondition";
    }
  }
  deallocate(q[0]);
  deallocate(q[2]);
  deallocate(q[1]);
  const uint64_t mapped = sim_counters()->mapped_bytes;
  void* three = allocate(3 * quarter);
  EXPECT_EQ(q[0], three);
  EXPECT_EQ(mapped, sim_counters()->mapped_bytes);
  deallocate(three);
  deallocate(q[3]);
}

TEST_F(Caching, BestFitPrefersTheSmallestFreeBlockThatFits) {
  // Free blocks of 1 MiB and 256 KiB, kept apart by live blocks: a 200 KiB request takes
  // the 256 KiB one.
  void* large = allocate(kMiB);
  void* guard1 = allocate(4 * kKiB);
  void* small = allocate(256 * kKiB);
  void* guard2 = allocate(4 * kKiB);
  ASSERT_TRUE(large && guard1 && small && guard2);
  deallocate(large);
  deallocate(small);
  void* p = allocate(200 * kKiB);
  EXPECT_EQ(small, p);
  deallocate(p);
  deallocate(guard1);
  deallocate(guard2);
}

TEST_F(Caching, EmptyCacheReleasesEverythingWhenNothingIsLive) {
  SKIP_UNLESS_CUDASIM();
  std::vector<void*> blocks;
  for (size_t size : {kKiB, 3 * kMiB, 17 * kMiB + 5, 64 * kKiB, 40 * kMiB}) {
    blocks.push_back(allocate(size));
    ASSERT_NE(nullptr, blocks.back());
  }
  for (void* p : blocks) deallocate(p);
  ASSERT_GT(stats().reserved_bytes, 0u);

  pool().empty_cache();
  const PoolStats s = stats();
  EXPECT_EQ(0u, s.reserved_bytes);
  EXPECT_EQ(0u, sim_counters()->mapped_bytes);
  EXPECT_EQ(0u, sim_counters()->physical_bytes) << "the pages were released, not only unmapped";
  EXPECT_GT(s.peak_reserved_bytes, 0u) << "the peak remembers";
}

TEST_F(Caching, EmptyCacheKeepsExactlyTheGranulesOfLiveBlocks) {
  SKIP_UNLESS_CUDASIM();
  // Live blocks scattered between freed ones; empty_cache() must leave mapped the granules
  // the live ones touch, and only those, with their contents intact.
  std::vector<std::pair<void*, size_t>> all;
  const size_t sizes[] = {4 * kKiB, 10 * kMiB, 700 * kKiB, 5 * kMiB + 1, 4 * kKiB,
                          9 * kMiB, 2 * kMiB,  300 * kKiB, 12 * kMiB,    1};
  for (size_t size : sizes) {
    void* p = allocate(size);
    ASSERT_NE(nullptr, p);
    all.emplace_back(p, size);
  }
  LiveBlocks live;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i % 3 == 0) {
      ASSERT_TRUE(live.insert(all[i].first, all[i].second));
      ASSERT_CUDA_OK(cudaMemset(all[i].first, 0x40 + static_cast<int>(i), all[i].second));
    } else {
      deallocate(all[i].first);
    }
  }
  const uint64_t needed = granule_bytes_touched(live.map());
  ASSERT_GT(stats().reserved_bytes, needed) << "precondition: something is cached";

  pool().empty_cache();
  EXPECT_EQ(needed, stats().reserved_bytes);
  EXPECT_EQ(needed, sim_counters()->mapped_bytes);
  EXPECT_EQ(needed, sim_counters()->physical_bytes);
  EXPECT_EQ(live.rounded_bytes(), stats().allocated_bytes);
  for (size_t i = 0; i < all.size(); i += 3) {
    EXPECT_TRUE(holds_byte(all[i].first, all[i].second, 0x40 + static_cast<int>(i)))
        << "live block " << i;
  }
  // And the pool goes on: new blocks map again, and are usable.
  void* p = allocate(8 * kMiB);
  ASSERT_NE(nullptr, p);
  EXPECT_TRUE(live.insert(p, 8 * kMiB));
  EXPECT_TRUE(round_trip(p, 8 * kMiB, 6));
  deallocate(p);
  for (size_t i = 0; i < all.size(); i += 3) deallocate(all[i].first);
}

TEST_F(Caching, NumFreeBlocksCountsFreeBlocksAndTheUnusedRange) {
  // "free blocks of all tags, ... and the unused rest of the address range included".
  EXPECT_EQ(1u, stats().num_free_blocks) << "a new pool is one free range";
  void* a = allocate(kMiB);
  void* guard = allocate(kMiB);
  void* b = allocate(3 * kMiB);
  void* guard2 = allocate(kMiB);
  ASSERT_TRUE(a && guard && b && guard2);
  deallocate(a);
  deallocate(b);
  EXPECT_GE(stats().num_free_blocks, 2u) << "two freed blocks, kept apart by a live one";
  deallocate(guard);
  deallocate(guard2);
  pool().empty_cache();
  EXPECT_EQ(0u, stats().reserved_bytes);
  EXPECT_EQ(1u, stats().num_free_blocks) << "after empty_cache() everything merged back into one range";
}

TEST_F(Caching, StatisticsFollowAllocationsAndFrees) {
  const size_t g = granularity();
  void* a = allocate(1000);         // 1024 as rounded
  void* b = allocate(3 * kMiB + 1);  // 3 MiB + 512
  ASSERT_TRUE(a && b);
  PoolStats s = stats();
  EXPECT_EQ(1024u + 3 * kMiB + 512, s.allocated_bytes);
  EXPECT_EQ(2u, s.num_allocs);
  EXPECT_EQ(0u, s.num_frees);
  EXPECT_EQ(s.allocated_bytes, s.peak_allocated_bytes);
  EXPECT_EQ(0u, s.reserved_bytes % g);
  EXPECT_GE(s.reserved_bytes, round_up(s.allocated_bytes, g));
  EXPECT_EQ(s.reserved_bytes, s.peak_reserved_bytes);

  deallocate(b);
  s = stats();
  EXPECT_EQ(1024u, s.allocated_bytes);
  EXPECT_EQ(1u, s.num_frees);
  EXPECT_EQ(1024u + 3 * kMiB + 512, s.peak_allocated_bytes) << "the peak stays";
  EXPECT_GE(s.reserved_bytes, round_up(1024u + 3 * kMiB + 512, g)) << "freed memory stays cached";
  EXPECT_GE(s.num_free_blocks, 1u);

  deallocate(a);
  s = stats();
  EXPECT_EQ(0u, s.allocated_bytes);
  EXPECT_EQ(2u, s.num_frees);
  EXPECT_EQ(s.num_allocs, s.num_frees);
}

TEST_F(Caching, ResetPeaksSetsThemToTheCurrentValues) {
  void* big = allocate(20 * kMiB);
  void* small = allocate(kMiB);
  ASSERT_TRUE(big && small);
  deallocate(big);
  pool().empty_cache();
  PoolStats s = stats();
  ASSERT_GT(s.peak_allocated_bytes, s.allocated_bytes);
  ASSERT_GT(s.peak_reserved_bytes, s.reserved_bytes);

  pool().reset_peaks();
  s = stats();
  EXPECT_EQ(s.allocated_bytes, s.peak_allocated_bytes);
  EXPECT_EQ(s.reserved_bytes, s.peak_reserved_bytes);
  EXPECT_EQ(2u, s.num_allocs) << "reset_peaks resets only the peaks";
  EXPECT_EQ(1u, s.num_frees);

  // Peaks rise again from there.
  void* again = allocate(4 * kMiB);
  ASSERT_NE(nullptr, again);
  s = stats();
  EXPECT_EQ(s.allocated_bytes, s.peak_allocated_bytes);
  EXPECT_EQ(s.reserved_bytes, s.peak_reserved_bytes);
  deallocate(again);
  deallocate(small);
}

}  // namespace
}  // namespace pool_test
