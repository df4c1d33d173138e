// The host tier when the host will not pin more: cudasim's CUDASIM_HOST_PINNED_LIMIT (CTest
// registers these cases again with it; alone, they skip) stands for a host that cannot lock
// more pages (its RAM, or RLIMIT_MEMLOCK in a container), where a real driver's
// cudaHostAlloc fails with out-of-memory.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "host_tier_test_util.h"

namespace host_tier_test {
namespace {

bool pinned_limit_is(const char* value) {
  const char* v = std::getenv("CUDASIM_HOST_PINNED_LIMIT");
  return v && std::strcmp(v, value) == 0;
}

// The host pins at most 24 MiB; the tier's chunks are 256 MiB (the default). A chunk of the
// default size cannot be pinned, one the size of the block can: the tier used to refuse the
// block (and the engine stopped evicting) when the 256 MiB chunk failed, though 24 MiB of
// pinned memory were there for the asking.
TEST(HostTierPinnedLimit, AChunkTheHostWillNotPinIsTriedAgainAtTheBlocksSize) {
  if (!pinned_limit_is("24MiB")) GTEST_SKIP() << "needs CUDASIM_HOST_PINNED_LIMIT=24MiB (ctest sets it)";
  HostTierOptions options;
  options.limit_bytes = 1 * kGiB;
  HostTier tier(options);
  std::vector<void*> blocks;
  std::string error;
  for (int i = 0; i < 6; ++i) {
    void* p = tier.allocate(4 * kMiB, &error);
    ASSERT_NE(nullptr, p) << "block " << i << ": " << error;
    std::memset(p, i, 4 * kMiB);
    blocks.push_back(p);
  }
  EXPECT_EQ(24 * kMiB, tier.stats().pinned_bytes);
  // The host's pinned memory is spent: the refusal says so, with the driver's words.
  EXPECT_EQ(nullptr, tier.allocate(4 * kMiB, &error));
  EXPECT_NE(std::string::npos, error.find("pinning a chunk of 256 MiB failed")) << error;
  EXPECT_NE(std::string::npos, error.find("pinning 4 MiB, the least that holds the block, failed too")) << error;
  EXPECT_NE(std::string::npos, error.find("out of memory")) << error;
  EXPECT_EQ(24 * kMiB, tier.stats().pinned_bytes) << "a refused pin holds nothing";
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(static_cast<unsigned char>(i), bytes_of(blocks[size_t(i)])[4 * kMiB - 1]) << i;
    EXPECT_TRUE(tier.free(blocks[size_t(i)]));
  }
}

}  // namespace
}  // namespace host_tier_test
