// DevicePool basics: construction, the promises every block keeps (512-byte aligned,
// usable memory, inside the pool's reservation, never overlapping another live block),
// size 0, freeing nullptr, and allocated_bytes as the sum of live blocks in 512-byte units.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "pool_test_util.h"

namespace pool_test {
namespace {

using Basics = PoolTest;

TEST_F(Basics, StartsEmptyWithTheCardAsItsLimit) {
  const PoolStats s = stats();
  EXPECT_EQ(0, pool().device());
  EXPECT_EQ(kCardBytes, s.limit_bytes) << "limit 0 means the whole card";
  EXPECT_GE(s.va_reserved_bytes, kCardBytes) << "the VA reservation is a few times the card";
  EXPECT_EQ(0u, s.allocated_bytes);
  EXPECT_EQ(0u, s.reserved_bytes);
  EXPECT_EQ(0u, s.peak_allocated_bytes);
  EXPECT_EQ(0u, s.peak_reserved_bytes);
  EXPECT_EQ(0u, s.num_allocs);
  EXPECT_EQ(0u, s.num_frees);
  EXPECT_EQ(0u, s.num_cache_hits);
  EXPECT_EQ(0u, s.num_ooms);
}

TEST_F(Basics, TheLimitOptionIsTheEffectiveLimit) {
  DevicePool limited(PoolOptions{0, 64 * kMiB});
  EXPECT_EQ(64 * kMiB, limited.stats().limit_bytes);
}

TEST_F(Basics, SizeZeroReturnsNullptrWithNoError) {
  const PoolStats before = stats();
  std::string error = "stale text from an earlier call";
  EXPECT_EQ(nullptr, pool().allocate(0, stream_, &error));
  EXPECT_TRUE(error.empty()) << "size 0 is not an error, but *error says: " << error;
  EXPECT_TRUE(same_stats(before, stats())) << "size 0 counts as nothing";
}

TEST_F(Basics, FreeingNullptrIsANoOp) {
  void* p = allocate(4096);
  ASSERT_NE(nullptr, p);
  const PoolStats before = stats();
  const Result r = pool().deallocate(nullptr, stream_);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_TRUE(r.message.empty()) << r.message;
  EXPECT_TRUE(same_stats(before, stats()));
  deallocate(p);
}

TEST_F(Basics, OwnsWhatItHandsOutAndNothingElse) {
  void* p = allocate(3 * kMiB + 5);
  ASSERT_NE(nullptr, p);
  EXPECT_TRUE(pool().owns(p));
  EXPECT_TRUE(pool().owns(offset(p, 3 * kMiB)));
  int on_stack = 0;
  EXPECT_FALSE(pool().owns(&on_stack));
  EXPECT_FALSE(pool().owns(nullptr));
  void* foreign = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&foreign, 4096));
  EXPECT_FALSE(pool().owns(foreign)) << "cudaMalloc's memory is not the pool's";
  ASSERT_CUDA_OK(cudaFree(foreign));
  deallocate(p);
}

// One block of each size: aligned, inside the reservation, counted in 512-byte units,
// and usable from its first byte to its last.
class BlockSizes : public PoolTest, public ::testing::WithParamInterface<size_t> {};

TEST_P(BlockSizes, AlignedCountedAndUsableEndToEnd) {
  const size_t size = GetParam();
  void* p = allocate(size);
  ASSERT_NE(nullptr, p);
  EXPECT_EQ(0u, address(p) % kBlockUnit) << p;
  EXPECT_TRUE(pool().owns(p));
  EXPECT_TRUE(pool().owns(offset(p, size - 1)));

  const PoolStats s = stats();
  EXPECT_EQ(round_up(size, kBlockUnit), s.allocated_bytes);
  EXPECT_EQ(1u, s.num_allocs);
  EXPECT_GE(s.reserved_bytes, round_up(size, granularity()))
      << "every granule the block touches is mapped";
  EXPECT_EQ(0u, s.reserved_bytes % granularity());
  EXPECT_LE(s.reserved_bytes, s.limit_bytes);

  // A pattern through the first and the last (up to) 256 KiB, then a memset of it all.
  const size_t window = std::min(size, 256 * kKiB);
  EXPECT_TRUE(round_trip(p, window, 1));
  EXPECT_TRUE(round_trip(offset(p, size - window), window, 2));
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0x5a, size, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_TRUE(holds_byte(p, window, 0x5a));
  EXPECT_TRUE(holds_byte(offset(p, size - window), window, 0x5a));

  deallocate(p);
  EXPECT_EQ(0u, stats().allocated_bytes);
  EXPECT_EQ(1u, stats().num_frees);
}

INSTANTIATE_TEST_SUITE_P(
    FromOneByteToManyGranules, BlockSizes,
    ::testing::Values(size_t{1}, size_t{7}, size_t{511}, size_t{512}, size_t{513},
                      size_t{4096} + 1, size_t{64} * kKiB, size_t{2} * kMiB - 1, size_t{2} * kMiB,
                      size_t{2} * kMiB + 1, size_t{3} * kMiB + 7, size_t{33} * kMiB + 1536,
                      size_t{200} * kMiB + 3),
    [](const ::testing::TestParamInfo<size_t>& info) {
      return "bytes_" + std::to_string(info.param);
    });

// Many live blocks at once, each filled with its own byte: every block still holds its
// byte afterwards, which a block overlapping another could not.
TEST_F(Basics, LiveBlocksKeepTheirOwnContents) {
  std::mt19937_64 rng(20240601);
  LiveBlocks live;
  std::vector<std::pair<void*, size_t>> blocks;
  for (int i = 0; i < 160; ++i) {
    const size_t size = (rng() % 4 == 0) ? 1 + rng() % (5 * kMiB) : 1 + rng() % (48 * kKiB);
    void* p = allocate(size);
    ASSERT_NE(nullptr, p);
    ASSERT_TRUE(live.insert(p, size));
    ASSERT_CUDA_OK(cudaMemsetAsync(p, 1 + i % 251, size, stream_));
    blocks.emplace_back(p, size);
  }
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(live.rounded_bytes(), stats().allocated_bytes);
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_TRUE(holds_byte(blocks[i].first, blocks[i].second, 1 + i % 251)) << "block " << i;
  }
  for (const auto& [p, size] : blocks) deallocate(p);
  EXPECT_EQ(0u, stats().allocated_bytes);
}

// A long random sequence of allocations and frees on two streams (fixed seed): no two live
// blocks ever overlap, every block is aligned, and the counters agree with the live set.
TEST_F(Basics, RandomSequenceNeverOverlaps) {
  SKIP_UNLESS_CUDASIM();
  Stream other;
  ASSERT_CUDA_OK(other.status());
  const cudaStream_t streams[2] = {stream_, other};
  std::mt19937_64 rng(7);
  LiveBlocks live;
  std::vector<std::pair<void*, int>> order;  // live blocks and their stream, for random frees
  uint64_t allocs = 0;
  uint64_t frees = 0;
  for (int step = 0; step < 4000; ++step) {
    const bool grow = order.empty() || (order.size() < 300 && rng() % 100 < 55);
    if (grow) {
      const int which = static_cast<int>(rng() % 2);
      const uint64_t r = rng() % 100;
      const size_t size = r < 60   ? 1 + rng() % (8 * kKiB)
                          : r < 90 ? 1 + rng() % (512 * kKiB)
                                   : 1 + rng() % (6 * kMiB);
      void* p = allocate(size, streams[which]);
      ASSERT_NE(nullptr, p) << "step " << step;
      ASSERT_TRUE(live.insert(p, size)) << "step " << step;
      order.emplace_back(p, which);
      ++allocs;
    } else {
      const size_t i = rng() % order.size();
      const auto [p, which] = order[i];
      order[i] = order.back();
      order.pop_back();
      live.erase(p);
      deallocate(p, streams[which]);
      ++frees;
    }
    if (step % 250 == 0) {
      const PoolStats s = stats();
      ASSERT_EQ(live.rounded_bytes(), s.allocated_bytes) << "step " << step;
      ASSERT_EQ(allocs, s.num_allocs);
      ASSERT_EQ(frees, s.num_frees);
      ASSERT_GE(s.reserved_bytes, granule_bytes_touched(live.map()))
          << "a live block's granule is not mapped";
      ASSERT_EQ(0u, s.reserved_bytes % granularity());
      ASSERT_GE(s.peak_allocated_bytes, s.allocated_bytes);
      ASSERT_GE(s.peak_reserved_bytes, s.reserved_bytes);
      ASSERT_EQ(s.reserved_bytes, sim_counters()->mapped_bytes)
          << "reserved_bytes is the pool's mapped memory";
    }
  }
  for (const auto& [p, which] : order) deallocate(p, streams[which]);
  EXPECT_EQ(0u, stats().allocated_bytes);
  EXPECT_EQ(stats().num_allocs, stats().num_frees);
}

TEST_F(Basics, WorksOnTheLegacyDefaultStream) {
  void* p = allocate(100 * kKiB, nullptr);
  ASSERT_NE(nullptr, p);
  EXPECT_TRUE(round_trip(p, 100 * kKiB, 3));
  deallocate(p, nullptr);
  void* q = allocate(100 * kKiB, nullptr);
  EXPECT_EQ(p, q) << "a block freed on the default stream is reused at once on it";
  deallocate(q, nullptr);
}

}  // namespace
}  // namespace pool_test
