// DevicePool at a limit of a few granules, where pages are mapped in whole granules: an
// out-of-memory with memory reserved but free says why that memory could not serve (Note [Why
// nothing fits] in pressure.cpp), by bytes or by granules. From the compatibility suite
// (tests/compat): resnet10t at 60% of its peak ran out of memory asking for an 8 MiB gradient
// with 9.2 MiB reserved but free, and Llama at 40% asking for a 1 MiB saved tensor with 4.5 MiB
// of the mapped granules free, and neither report said why that memory could not serve.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

#include "pool_test_util.h"

namespace pool_test {
namespace {

// A pool limited to 8 MiB: four 2 MiB granules (below the card, so it places for eviction).
class GranuleFit : public PoolTest {
 protected:
  static constexpr uint64_t kLimit = 8 * kMiB;
  uint64_t limit() const override { return kLimit; }
  // Sixteen 512 KiB blocks on the limit's four granules, every other one freed: 4 MiB free in
  // eight pieces of 512 KiB beside blocks in use. The blocks kept are the even ones.
  void fill_with_pieces(void* (&blocks)[16]) {
    for (void*& b : blocks) {
      b = allocate(512 * kKiB);
      ASSERT_NE(nullptr, b);
    }
    ASSERT_EQ(kLimit, sim_counters()->mapped_bytes);
    for (int i = 1; i < 16; i += 2) deallocate(blocks[i]);
  }
  void free_pieces(void* (&blocks)[16]) {
    for (int i = 0; i < 16; i += 2) deallocate(blocks[i]);
  }
};

// Note [Why nothing fits]: an out-of-memory with memory reserved but free says why that memory
// cannot serve. Sixteen 512 KiB blocks fill the limit's four granules; every other one freed
// leaves 4 MiB free in eight pieces of 512 KiB: 768 KiB fits by bytes, in no piece, and needs a
// granule the limit does not leave.
TEST_F(GranuleFit, AnOutOfMemoryReportSaysWhyTheFreeMemoryCannotServe) {
  SKIP_UNLESS_CUDASIM();
  ASSERT_EQ(2 * kMiB, granularity());
  void* blocks[16] = {};
  ASSERT_NO_FATAL_FAILURE(fill_with_pieces(blocks));
  std::string error;
  EXPECT_EQ(nullptr, pool().allocate(768 * kKiB, stream_, &error));
  EXPECT_NE(std::string::npos, error.find("reserved but free")) << error;
  EXPECT_NE(std::string::npos, error.find("by bytes it would")) << error;
  EXPECT_NE(std::string::npos, error.find("needs 1 (")) << "the granule it lacks: " << error;
  EXPECT_NE(std::string::npos, error.find("on 4 granules")) << error;
  EXPECT_TRUE(mentions_size(error, 512 * kKiB)) << "the largest piece: " << error;
  free_pieces(blocks);
}

// The same for a block given up that is needed back: its own place needs a granule the limit
// does not leave, while 4 MiB lie free in 512 KiB pieces beside the blocks that took its page.
TEST_F(GranuleFit, ARefusedMapBlockSaysWhyTheFreeMemoryCannotServe) {
  SKIP_UNLESS_CUDASIM();
  const size_t g = granularity();
  ASSERT_EQ(2 * kMiB, g);
  std::string error;
  void* t = pool().allocate_offloadable(g, stream_, &error);
  ASSERT_NE(nullptr, t) << error;
  ASSERT_TRUE(pool().unmap_block(t).ok);  // away: its page goes to the blocks below
  void* blocks[16] = {};
  ASSERT_NO_FATAL_FAILURE(fill_with_pieces(blocks));
  const Result r = pool().map_block(t, DevicePool::MapWait::kSynchronize, stream_);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.out_of_memory);
  EXPECT_NE(std::string::npos, r.message.find("its place needs 1 (")) << r.message;
  EXPECT_NE(std::string::npos, r.message.find("on 4 granules")) << r.message;
  free_pieces(blocks);
  ASSERT_TRUE(pool().map_block(t, DevicePool::MapWait::kSynchronize, stream_).ok);
  deallocate(t);
}

// When the blocks in use and the request pass the limit, the report says that no placement
// could serve it.
TEST_F(GranuleFit, AnOutOfMemoryReportSaysWhenTheBytesInUsePassTheLimit) {
  SKIP_UNLESS_CUDASIM();
  void* a = allocate(7 * kMiB);
  ASSERT_NE(nullptr, a);
  std::string error;
  EXPECT_EQ(nullptr, pool().allocate(2 * kMiB, stream_, &error));
  EXPECT_NE(std::string::npos, error.find("no placement can serve it")) << error;
  EXPECT_TRUE(mentions_size(error, 9 * kMiB)) << "in use with the request: " << error;
  deallocate(a);
}

}  // namespace
}  // namespace pool_test
