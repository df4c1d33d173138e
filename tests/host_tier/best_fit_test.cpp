// Best fit, the placement that ships (Note [The host tier], host_tier.h): which hole a block
// goes to, merging, the fragmentation figure, chunk boundaries, and how the limit is met
// (the last chunk shrinks; chunks with no live block are released to make room).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "host_tier_test_util.h"

namespace host_tier_test {
namespace {

HostTier best_fit(uint64_t limit_bytes, uint64_t chunk_bytes) {
  HostTierOptions options;
  options.limit_bytes = limit_bytes;
  options.chunk_bytes = chunk_bytes;
  return HostTier(options);
}

TEST(HostTierBestFit, FreedNeighboursMerge) {
  // One chunk, and a limit that allows no second one: only merging can make room.
  HostTier t = best_fit(8 * kMiB, 8 * kMiB);
  std::vector<void*> b;
  for (int i = 0; i < 4; ++i) b.push_back(t.allocate(2 * kMiB));
  ASSERT_TRUE(b[0] && b[1] && b[2] && b[3]);
  std::string error;
  EXPECT_EQ(nullptr, t.allocate(512, &error)) << "the chunk is full";
  ASSERT_TRUE(t.free(b[1]));
  ASSERT_TRUE(t.free(b[2]));
  void* merged = t.allocate(4 * kMiB, &error);
  EXPECT_EQ(b[1], merged) << error;
  ASSERT_TRUE(t.free(merged));
  ASSERT_TRUE(t.free(b[0]));
  ASSERT_TRUE(t.free(b[3]));
  const HostTierStats s = t.stats();
  EXPECT_EQ(8 * kMiB, s.largest_free_bytes) << "everything merged back into one extent";
  EXPECT_EQ(0.0, t.fragmentation());
  EXPECT_EQ(1u, s.num_chunks);
}

TEST(HostTierBestFit, TakesTheSmallestHoleThatFitsAndMeasuresFragmentation) {
  HostTier t = best_fit(16 * kMiB, 16 * kMiB);
  // [a 3 MiB][s 1 MiB][b 1 MiB][u 1 MiB][free 10 MiB]
  void* a = t.allocate(3 * kMiB);
  void* s = t.allocate(kMiB);
  void* b = t.allocate(kMiB);
  void* u = t.allocate(kMiB);
  ASSERT_TRUE(a && s && b && u);
  ASSERT_EQ(address(a) + 3 * kMiB, address(s)) << "blocks are carved in address order";
  ASSERT_TRUE(t.free(a));
  ASSERT_TRUE(t.free(b));
  // Holes: 3 MiB, 1 MiB, and the 10 MiB tail.
  EXPECT_EQ(10 * kMiB, t.stats().largest_free_bytes);
  EXPECT_DOUBLE_EQ(1.0 - 10.0 / 14.0, t.fragmentation());
  EXPECT_EQ(b, t.allocate(kMiB)) << "the 1 MiB hole, not a piece of a larger one";
  void* two = t.allocate(2 * kMiB);
  EXPECT_EQ(a, two) << "the 3 MiB hole, not the 10 MiB tail";
  EXPECT_EQ(10 * kMiB, t.stats().largest_free_bytes);
  EXPECT_DOUBLE_EQ(1.0 - 10.0 / 11.0, t.fragmentation());
}

TEST(HostTierBestFit, TheLastChunkShrinksToTheLimit) {
  HostTier t = best_fit(40 * kMiB, 32 * kMiB);
  void* a = t.allocate(30 * kMiB);
  ASSERT_NE(nullptr, a);
  EXPECT_EQ(32 * kMiB, t.pinned_bytes());
  std::string error;
  void* b = t.allocate(6 * kMiB, &error);  // a second chunk of 8 MiB, not 32
  ASSERT_NE(nullptr, b) << error;
  EXPECT_EQ(40 * kMiB, t.pinned_bytes());
  EXPECT_EQ(2u, t.stats().num_chunks);
  void* c = t.allocate(2 * kMiB, &error);  // what is left of each chunk: 2 MiB
  void* d = t.allocate(2 * kMiB, &error);
  EXPECT_TRUE(c && d) << error;
  EXPECT_EQ(nullptr, t.allocate(512, &error));
  EXPECT_NE(std::string::npos, error.find("limit is reached")) << error;
  EXPECT_EQ(40 * kMiB, t.stats().peak_pinned_bytes);
}

// At the limit, chunks with no live block are given back when a larger chunk is needed.
TEST(HostTierBestFit, ChunksWithNoLiveBlockAreReleasedToMakeRoom) {
  HostTier t = best_fit(64 * kMiB, 32 * kMiB);
  void* a = t.allocate(20 * kMiB);
  void* b = t.allocate(20 * kMiB);
  ASSERT_TRUE(a && b);
  ASSERT_EQ(64 * kMiB, t.pinned_bytes());
  ASSERT_TRUE(t.free(a));
  std::string error;
  EXPECT_EQ(nullptr, t.allocate(40 * kMiB, &error)) << "one chunk is free: 32 MiB cannot hold it";
  ASSERT_TRUE(t.free(b));
  void* big = t.allocate(40 * kMiB, &error);
  ASSERT_NE(nullptr, big) << error;
  const HostTierStats s = t.stats();
  EXPECT_EQ(2u, s.num_chunks_released);
  EXPECT_EQ(1u, s.num_chunks);
  EXPECT_EQ(40 * kMiB, s.pinned_bytes);
  EXPECT_LE(s.peak_pinned_bytes, 64 * kMiB);
  EXPECT_EQ(cudaMemoryTypeHost, memory_type(bytes_of(big) + 40 * kMiB - 1));
}

// Extents never merge across chunks, even chunks that are neighbours in memory: a block
// always lies inside one chunk, which cudaFreeHost can release whole.
TEST(HostTierBestFit, BlocksNeverSpanTwoChunks) {
  HostTier t = best_fit(1 * kGiB, 4 * kMiB);
  std::vector<void*> chunks;
  for (int i = 0; i < 16; ++i) chunks.push_back(t.allocate(4 * kMiB));  // a chunk each
  for (void* p : chunks) ASSERT_NE(nullptr, p);
  for (void* p : chunks) ASSERT_TRUE(t.free(p));
  EXPECT_EQ(4 * kMiB, t.stats().largest_free_bytes);
  const uint64_t pinned = t.pinned_bytes();
  void* big = t.allocate(6 * kMiB);
  ASSERT_NE(nullptr, big);
  EXPECT_EQ(pinned + 6 * kMiB, t.pinned_bytes()) << "a new chunk, not two neighbours joined";
  EXPECT_TRUE(t.free(big));
  EXPECT_EQ(pinned + 6 * kMiB, t.trim());
}

}  // namespace
}  // namespace host_tier_test
