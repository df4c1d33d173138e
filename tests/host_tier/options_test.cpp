// HostTier's options and defaults: the default limit (half of the memory the process may
// use, cgroup included), the chunk size, and refused options. Table-driven where pure.
#include <gtest/gtest.h>
#include <unistd.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "host_tier_test_util.h"
#include "residency/host_memory.h"

namespace host_tier_test {
namespace {

using vramswap::residency::default_host_limit_bytes;
using vramswap::residency::host_memory_bytes;
using vramswap::residency::kDefaultHostChunkBytes;
using vramswap::residency::make_best_fit_placer;
using vramswap::residency::parse_cgroup_memory_limit;

TEST(HostTierOptions, CgroupMemoryLimitParses) {
  struct Row {
    const char* text;
    std::optional<uint64_t> limit;
  };
  const Row rows[] = {
      {"max\n", std::nullopt},
      {"max", std::nullopt},
      {"8589934592\n", uint64_t{8} << 30},
      {"8589934592", uint64_t{8} << 30},
      {"9223372036854771712\n", uint64_t{9223372036854771712u}},  // cgroup v1 "unlimited"
      {"18446744073709551615", UINT64_MAX},
      {"18446744073709551616", std::nullopt},  // overflows
      {"", std::nullopt},
      {"\n", std::nullopt},
      {"-1", std::nullopt},
      {"12 34", std::nullopt},
      {"1G", std::nullopt},
  };
  for (const Row& row : rows) {
    EXPECT_EQ(row.limit, parse_cgroup_memory_limit(row.text)) << "\"" << row.text << "\"";
  }
}

TEST(HostTierOptions, DefaultLimitIsHalfOfMemoryInWholeGranules) {
  struct Row {
    uint64_t memory;
    uint64_t limit;
  };
  const Row rows[] = {
      {64 * kGiB, 32 * kGiB},
      {24 * kGiB + 3 * kMiB, 12 * kGiB},  // 12 GiB + 1.5 MiB, rounded down to 2 MiB
      {6 * kMiB, 2 * kMiB},
      {2 * kMiB, 1 * kMiB},  // less than a granule: half, unrounded
      {0, 0},
  };
  for (const Row& row : rows) EXPECT_EQ(row.limit, default_host_limit_bytes(row.memory)) << row.memory;
}

TEST(HostTierOptions, HostMemoryIsAtMostPhysicalMemory) {
  const uint64_t physical = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
  const uint64_t memory = host_memory_bytes();
  EXPECT_GT(memory, 0u);
  EXPECT_LE(memory, physical);
}

TEST(HostTierOptions, ZeroMeansTheDefaults) {
  HostTier t{HostTierOptions{}};
  EXPECT_EQ(default_host_limit_bytes(host_memory_bytes()), t.limit_bytes());
  EXPECT_EQ(kDefaultHostChunkBytes, t.chunk_bytes());
  EXPECT_EQ(256 * kMiB, t.chunk_bytes());
  EXPECT_STREQ("best_fit", t.placement());
  EXPECT_EQ(0u, t.pinned_bytes()) << "nothing is pinned before the first allocation";
}

TEST(HostTierOptions, ChunkSizeRoundsUpToTheGranularity) {
  HostTierOptions options;
  options.limit_bytes = 64 * kMiB;
  options.chunk_bytes = 3 * kMiB;
  HostTier t(options);
  EXPECT_EQ(4 * kMiB, t.chunk_bytes());
  void* p = t.allocate(512);
  ASSERT_NE(nullptr, p);
  EXPECT_EQ(4 * kMiB, t.pinned_bytes());
  EXPECT_TRUE(t.free(p));
}

TEST(HostTierOptions, BadOptionsAreRefused) {
  HostTierOptions options;
  options.device = -1;
  EXPECT_THROW(HostTier{options}, std::invalid_argument);
  EXPECT_THROW(HostTier(HostTierOptions{}, nullptr), std::invalid_argument);
  EXPECT_NO_THROW(HostTier(HostTierOptions{}, make_best_fit_placer()));
}

}  // namespace
}  // namespace host_tier_test
