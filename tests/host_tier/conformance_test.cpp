// What every placement of HostTier promises (Note [The host tier], host_tier.h), one
// property per case, run once per placement (host_tier_test_util.h): alignment, no overlap,
// pinned memory, the limit, chunk growth, refused frees, counters, owns(), teardown.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "host_tier_test_util.h"

namespace host_tier_test {
namespace {

class HostTierConformance : public ::testing::TestWithParam<Placement> {
 protected:
  std::unique_ptr<HostTier> tier(uint64_t limit_bytes, uint64_t chunk_bytes) {
    HostTierOptions options;
    options.limit_bytes = limit_bytes;
    options.chunk_bytes = chunk_bytes;
    return make_tier(GetParam(), options);
  }
};

TEST_P(HostTierConformance, ReportsItsPlacement) {
  auto t = tier(256 * kMiB, 64 * kMiB);
  EXPECT_EQ(GetParam().name, t->placement());
}

TEST_P(HostTierConformance, BlocksAreAlignedTo512Bytes) {
  auto t = tier(512 * kMiB, 64 * kMiB);
  std::vector<void*> blocks;
  for (size_t size : {size_t{1}, size_t{16}, size_t{511}, size_t{512}, size_t{513}, size_t{4097},
                      size_t{100'000}, size_t{128 * kKiB + 1}, size_t{kMiB}, size_t{kMiB + 1},
                      size_t{3 * kMiB + 512}, size_t{17 * kMiB}}) {
    std::string error;
    void* p = t->allocate(size, &error);
    ASSERT_NE(nullptr, p) << size << " bytes: " << error;
    EXPECT_EQ(0u, address(p) % kHostBlockAlignment) << size << " bytes at " << p;
    blocks.push_back(p);
  }
  for (void* p : blocks) EXPECT_TRUE(t->free(p));
}

TEST_P(HostTierConformance, ZeroBytesIsNullWithoutError) {
  auto t = tier(64 * kMiB, 32 * kMiB);
  std::string error = "stale";
  EXPECT_EQ(nullptr, t->allocate(0, &error));
  EXPECT_EQ("", error);
  EXPECT_EQ(0u, t->pinned_bytes());
  EXPECT_EQ(0u, t->stats().num_refused);
}

TEST_P(HostTierConformance, UsedBytesAreSizesRoundedTo512) {
  auto t = tier(256 * kMiB, 64 * kMiB);
  void* a = t->allocate(1);
  void* b = t->allocate(513);
  void* c = t->allocate(kMiB);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(512u + 1024u + kMiB, t->used_bytes());
  EXPECT_TRUE(t->free(b));
  EXPECT_EQ(512u + kMiB, t->used_bytes());
  EXPECT_TRUE(t->free(a));
  EXPECT_TRUE(t->free(c));
  EXPECT_EQ(0u, t->used_bytes());
}

TEST_P(HostTierConformance, BlocksArePinnedHostMemory) {
  auto t = tier(256 * kMiB, 64 * kMiB);
  for (size_t size : {size_t{512}, size_t{5 * kMiB + 512}, size_t{100 * kMiB}}) {
    void* p = t->allocate(size);
    ASSERT_NE(nullptr, p);
    EXPECT_EQ(cudaMemoryTypeHost, memory_type(p)) << size;
    EXPECT_EQ(cudaMemoryTypeHost, memory_type(bytes_of(p) + size - 1)) << size;
    EXPECT_TRUE(t->owns(p));
    EXPECT_TRUE(t->owns(bytes_of(p) + size - 1));
    EXPECT_TRUE(t->free(p));
  }
}

// Random allocations and frees with a fixed seed: no two live blocks overlap, and no block
// is written by anyone else while it is live (each is stamped at both ends).
TEST_P(HostTierConformance, RandomAllocFreeNeverOverlaps) {
  auto t = tier(1 * kGiB, 64 * kMiB);
  std::mt19937_64 rng(0x0057'a11c);
  LiveRanges ranges;
  struct Live {
    void* p;
    size_t size;
    uint64_t stamp;
  };
  std::vector<Live> live;
  uint64_t next_stamp = 1;
  uint64_t used = 0;
  for (int step = 0; step < 4000; ++step) {
    const bool allocate = live.empty() || (live.size() < 64 && rng() % 100 < 55);
    if (allocate) {
      // Mostly activation-like sizes (64 KiB .. 8 MiB), some small, some odd.
      const size_t size = rng() % 4 == 0 ? 16 + rng() % (64 * kKiB) : 64 * kKiB + rng() % (8 * kMiB);
      std::string error;
      void* p = t->allocate(size, &error);
      ASSERT_NE(nullptr, p) << "step " << step << ": " << error;
      ASSERT_TRUE(ranges.add(p, size)) << "step " << step;
      stamp(p, size, next_stamp);
      live.push_back({p, size, next_stamp++});
      used += round_up(size, kHostBlockAlignment);
    } else {
      const size_t i = rng() % live.size();
      const Live block = live[i];
      live[i] = live.back();
      live.pop_back();
      ASSERT_TRUE(has_stamp(block.p, block.size, block.stamp))
          << "step " << step << ": block " << block.p << " was overwritten while live";
      ranges.remove(block.p);
      std::string error;
      ASSERT_TRUE(t->free(block.p, &error)) << error;
      used -= round_up(block.size, kHostBlockAlignment);
    }
    ASSERT_EQ(used, t->used_bytes()) << "step " << step;
  }
  for (const Live& block : live) {
    EXPECT_TRUE(has_stamp(block.p, block.size, block.stamp));
    EXPECT_TRUE(t->free(block.p));
  }
  const HostTierStats s = t->stats();
  EXPECT_EQ(0u, s.used_bytes);
  EXPECT_EQ(s.num_allocs, s.num_frees);
  EXPECT_LE(s.peak_pinned_bytes, s.limit_bytes);
}

TEST_P(HostTierConformance, PinnedMemoryNeverPassesTheLimit) {
  const uint64_t limit = 200 * kMiB;
  auto t = tier(limit, 64 * kMiB);
  std::vector<void*> blocks;
  std::string error;
  for (;;) {
    void* p = t->allocate(3 * kMiB, &error);
    if (p == nullptr) break;
    blocks.push_back(p);
    ASSERT_LE(t->pinned_bytes(), limit);
    ASSERT_LT(blocks.size(), 1000u) << "the limit was never reached";
  }
  EXPECT_GT(blocks.size(), 10u) << "refused too early: " << error;
  EXPECT_NE(std::string::npos, error.find("limit")) << error;
  EXPECT_NE(std::string::npos, error.find("3 MiB")) << error;
  EXPECT_NE(std::string::npos, error.find("200 MiB")) << error;
  const HostTierStats s = t->stats();
  EXPECT_LE(s.peak_pinned_bytes, limit) << ::testing::PrintToString(s);
  EXPECT_EQ(1u, s.num_refused);

  // Freeing one makes room for one again, with nothing more pinned.
  const uint64_t pinned = t->pinned_bytes();
  ASSERT_TRUE(t->free(blocks.back()));
  blocks.pop_back();
  void* again = t->allocate(3 * kMiB, &error);
  EXPECT_NE(nullptr, again) << error;
  EXPECT_EQ(pinned, t->pinned_bytes());
  if (again != nullptr) blocks.push_back(again);
  for (void* p : blocks) EXPECT_TRUE(t->free(p));
}

TEST_P(HostTierConformance, RequestLargerThanTheLimitIsRefused) {
  auto t = tier(64 * kMiB, 32 * kMiB);
  std::string error;
  EXPECT_EQ(nullptr, t->allocate(64 * kMiB + 1, &error));
  EXPECT_NE(std::string::npos, error.find("larger than the limit")) << error;
  EXPECT_EQ(0u, t->pinned_bytes()) << "nothing is pinned for a request that cannot fit";
  EXPECT_EQ(nullptr, t->allocate(SIZE_MAX, &error));
  EXPECT_EQ(2u, t->stats().num_refused);
}

// Memory is pinned chunk by chunk, only when a block does not fit in what is pinned.
TEST_P(HostTierConformance, ChunksArePinnedOnDemand) {
  auto t = tier(2 * kGiB, 64 * kMiB);
  EXPECT_EQ(0u, t->pinned_bytes()) << "nothing is pinned before the first allocation";
  std::vector<void*> blocks;
  void* first = t->allocate(kMiB);
  ASSERT_NE(nullptr, first);
  blocks.push_back(first);
  const uint64_t one_chunk = t->pinned_bytes();
  EXPECT_GE(one_chunk, 64 * kMiB);
  EXPECT_EQ(1u, t->stats().num_chunks);
  // More blocks of the same size fill the chunk before another is pinned.
  for (int i = 0; i < 8; ++i) blocks.push_back(t->allocate(kMiB));
  EXPECT_EQ(one_chunk, t->pinned_bytes());
  // Past what one chunk holds, more chunks come.
  for (int i = 0; i < 200; ++i) {
    void* p = t->allocate(kMiB);
    ASSERT_NE(nullptr, p);
    blocks.push_back(p);
  }
  const HostTierStats s = t->stats();
  EXPECT_GE(s.num_chunks, 3u) << ::testing::PrintToString(s);
  EXPECT_EQ(s.num_chunks, s.num_chunks_pinned);
  EXPECT_EQ(s.pinned_bytes, s.peak_pinned_bytes);
  for (void* p : blocks) EXPECT_TRUE(t->free(p));
}

TEST_P(HostTierConformance, RequestLargerThanAChunkGetsItsOwnChunk) {
  auto t = tier(1 * kGiB, 32 * kMiB);
  std::string error;
  void* big = t->allocate(100 * kMiB + 512, &error);
  ASSERT_NE(nullptr, big) << error;
  EXPECT_GE(t->pinned_bytes(), 100 * kMiB + 512);
  EXPECT_EQ(1u, t->stats().num_chunks);
  EXPECT_TRUE(t->owns(bytes_of(big) + 100 * kMiB));
  EXPECT_TRUE(t->free(big));
}

TEST_P(HostTierConformance, ForeignPointersAreRefused) {
  auto t = tier(128 * kMiB, 32 * kMiB);
  void* block = t->allocate(kMiB);
  ASSERT_NE(nullptr, block);
  const HostTierStats before = t->stats();

  int on_stack = 0;
  void* heap = std::malloc(4096);
  auto other = tier(128 * kMiB, 32 * kMiB);
  void* elsewhere = other->allocate(kMiB);
  ASSERT_NE(nullptr, elsewhere);
  for (void* p : {static_cast<void*>(&on_stack), heap, elsewhere}) {
    std::string error;
    EXPECT_FALSE(t->free(p, &error)) << p;
    EXPECT_NE(std::string::npos, error.find("refused")) << error;
    EXPECT_NE(std::string::npos, error.find("did not allocate")) << error;
    EXPECT_FALSE(t->owns(p));
  }
  std::free(heap);
  const HostTierStats after = t->stats();
  EXPECT_EQ(before.used_bytes, after.used_bytes);
  EXPECT_EQ(before.num_frees, after.num_frees);
  EXPECT_EQ(3u, after.num_bad_frees);
  EXPECT_TRUE(other->free(elsewhere));
  EXPECT_TRUE(t->free(block));
}

TEST_P(HostTierConformance, DoubleFreeIsRefused) {
  auto t = tier(128 * kMiB, 32 * kMiB);
  void* a = t->allocate(kMiB);
  void* b = t->allocate(kMiB);  // keeps the chunk busy, so `a` stays a known address
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(t->free(a));
  std::string error;
  EXPECT_FALSE(t->free(a, &error));
  EXPECT_NE(std::string::npos, error.find("refused")) << error;
  EXPECT_NE(std::string::npos, error.find("free")) << error;
  EXPECT_EQ(kMiB, t->used_bytes()) << "the refused free changed nothing";
  EXPECT_EQ(1u, t->stats().num_frees);
  EXPECT_EQ(1u, t->stats().num_bad_frees);
  // b is still live and still freeable once.
  EXPECT_TRUE(t->free(b));
  EXPECT_FALSE(t->free(b));
  EXPECT_EQ(0u, t->used_bytes());
}

TEST_P(HostTierConformance, InteriorPointerIsRefused) {
  auto t = tier(128 * kMiB, 32 * kMiB);
  void* p = t->allocate(2 * kMiB);
  ASSERT_NE(nullptr, p);
  std::string error;
  EXPECT_FALSE(t->free(bytes_of(p) + 512, &error));
  EXPECT_NE(std::string::npos, error.find("refused")) << error;
  EXPECT_EQ(2 * kMiB, t->used_bytes());
  EXPECT_TRUE(t->free(p));
}

TEST_P(HostTierConformance, FreeOfNullIsANoOp) {
  auto t = tier(64 * kMiB, 32 * kMiB);
  std::string error = "stale";
  EXPECT_TRUE(t->free(nullptr, &error));
  EXPECT_EQ("", error);
  EXPECT_EQ(0u, t->stats().num_frees);
  EXPECT_EQ(0u, t->stats().num_bad_frees);
}

TEST_P(HostTierConformance, PeaksFollowUseAndReset) {
  auto t = tier(256 * kMiB, 32 * kMiB);
  void* a = t->allocate(4 * kMiB);
  void* b = t->allocate(6 * kMiB);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(10 * kMiB, t->peak_used_bytes());
  EXPECT_TRUE(t->free(b));
  EXPECT_EQ(4 * kMiB, t->used_bytes());
  EXPECT_EQ(10 * kMiB, t->peak_used_bytes());
  t->reset_peaks();
  EXPECT_EQ(4 * kMiB, t->peak_used_bytes());
  EXPECT_EQ(t->pinned_bytes(), t->stats().peak_pinned_bytes);
  EXPECT_TRUE(t->free(a));
  EXPECT_EQ(4 * kMiB, t->peak_used_bytes());
}

TEST_P(HostTierConformance, StatsAddUp) {
  auto t = tier(256 * kMiB, 64 * kMiB);
  void* a = t->allocate(3 * kMiB);
  void* b = t->allocate(kMiB);
  ASSERT_TRUE(a && b);
  const HostTierStats s = t->stats();
  EXPECT_EQ(4 * kMiB, s.used_bytes);
  EXPECT_EQ(256 * kMiB, s.limit_bytes);
  EXPECT_EQ(64 * kMiB, s.chunk_bytes);
  EXPECT_EQ(s.pinned_bytes - s.used_bytes - s.unusable_bytes, s.free_bytes);
  EXPECT_LE(s.largest_free_bytes, s.free_bytes);
  EXPECT_EQ(2u, s.num_allocs);
  EXPECT_EQ(t->used_bytes(), s.used_bytes);
  EXPECT_EQ(t->pinned_bytes(), s.pinned_bytes);
  const double f = t->fragmentation();
  if (GetParam().knows_largest_free) {
    EXPECT_GE(f, 0.0);
    EXPECT_LT(f, 1.0);
  } else {
    EXPECT_TRUE(std::isnan(f));
  }
  EXPECT_TRUE(t->free(a));
  EXPECT_TRUE(t->free(b));
}

// trim() releases exactly the chunks with no live block; a placement that cannot give
// chunks back (mimalloc) releases nothing and keeps working.
TEST_P(HostTierConformance, TrimReleasesOnlyChunksWithNoLiveBlock) {
  auto t = tier(1 * kGiB, 32 * kMiB);
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    void* p = t->allocate(20 * kMiB);  // best fit: one chunk each
    ASSERT_NE(nullptr, p);
    stamp(p, 20 * kMiB, 100 + i);
    blocks.push_back(p);
  }
  ASSERT_TRUE(t->free(blocks[0]));
  ASSERT_TRUE(t->free(blocks[2]));
  const HostTierStats before = t->stats();
  const uint64_t released = t->trim();
  const HostTierStats s = t->stats();
  if (GetParam().releases_chunks) {
    EXPECT_EQ(4u, before.num_chunks);
    EXPECT_EQ(before.pinned_bytes / 2, released);
    EXPECT_EQ(2u, s.num_chunks);
    EXPECT_EQ(2u, s.num_chunks_released);
    EXPECT_EQ(before.pinned_bytes - released, s.pinned_bytes);
    EXPECT_EQ(cudaMemoryTypeUnregistered, memory_type(blocks[0])) << "the chunk was unpinned";
  } else {
    EXPECT_EQ(0u, released);
    EXPECT_EQ(before.pinned_bytes, s.pinned_bytes);
  }
  // The live blocks are untouched and still pinned.
  for (int i : {1, 3}) {
    EXPECT_EQ(cudaMemoryTypeHost, memory_type(blocks[i]));
    EXPECT_TRUE(has_stamp(blocks[i], 20 * kMiB, 100 + i));
  }
  void* again = t->allocate(20 * kMiB);
  EXPECT_NE(nullptr, again);
  EXPECT_TRUE(t->free(again));
  EXPECT_TRUE(t->free(blocks[1]));
  EXPECT_TRUE(t->free(blocks[3]));
  if (GetParam().releases_chunks) {
    t->trim();
    EXPECT_EQ(0u, t->pinned_bytes());
    EXPECT_EQ(0u, t->stats().num_chunks);
  }
}

TEST_P(HostTierConformance, DestructionUnpinsEverythingEvenLiveBlocks) {
  void* live = nullptr;
  void* freed = nullptr;
  {
    auto t = tier(256 * kMiB, 32 * kMiB);
    live = t->allocate(5 * kMiB);
    freed = t->allocate(40 * kMiB);  // a chunk of its own
    ASSERT_TRUE(live && freed);
    ASSERT_TRUE(t->free(freed));
    ASSERT_EQ(cudaMemoryTypeHost, memory_type(live));
  }
  EXPECT_EQ(cudaMemoryTypeUnregistered, memory_type(live));
  EXPECT_EQ(cudaMemoryTypeUnregistered, memory_type(freed));
}

TEST_P(HostTierConformance, OwnsOnlyItsChunks) {
  auto t = tier(128 * kMiB, 32 * kMiB);
  int on_stack = 0;
  EXPECT_FALSE(t->owns(&on_stack));
  EXPECT_FALSE(t->owns(nullptr));
  void* p = t->allocate(kMiB);
  ASSERT_NE(nullptr, p);
  EXPECT_TRUE(t->owns(p));
  EXPECT_FALSE(t->owns(&on_stack));
  EXPECT_TRUE(t->free(p));
  EXPECT_TRUE(t->owns(p)) << "a freed block's chunk stays pinned until trim()";
}

INSTANTIATE_TEST_SUITE_P(Placements, HostTierConformance, ::testing::ValuesIn(placements()));

}  // namespace
}  // namespace host_tier_test
