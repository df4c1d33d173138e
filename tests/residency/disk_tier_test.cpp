// The disk tier (src/residency/disk_tier.h): its file nobody else can open, its extents,
// its I/O threads, and its errors (a missing directory, the limit, a full filesystem),
// with no CUDA.
#include "residency/disk_tier.h"

#include <sys/resource.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "temp_dir.h"

namespace vramswap::residency {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

using residency_test::TempDir;

std::unique_ptr<DiskTier> open_tier(const TempDir& dir, uint64_t limit, bool named = false) {
  std::string error;
  auto tier = DiskTier::open({dir.path(), limit, 2, named}, &error);
  EXPECT_NE(nullptr, tier) << error;
  return tier;
}

std::vector<unsigned char> pattern(uint64_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(DiskTier, BlocksComeBackByteForByte) {
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 64 * kMiB);
  ASSERT_NE(nullptr, tier);
  std::mt19937 rng(7);
  std::vector<std::vector<unsigned char>> blocks;
  std::vector<uint64_t> offsets;
  std::vector<DiskTier::JobRef> jobs;
  std::string error;
  for (unsigned i = 0; i < 48; ++i) {
    blocks.push_back(pattern(1 + rng() % (512 * 1024), i));
    const auto offset = tier->reserve(blocks.back().size(), &error);
    ASSERT_TRUE(offset) << error;
    EXPECT_EQ(0u, *offset % kDiskUnit);
    offsets.push_back(*offset);
    jobs.push_back(tier->write(*offset, blocks.back().data(), blocks.back().size()));
  }
  for (auto& job : jobs) EXPECT_EQ("", tier->wait(job));
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::vector<unsigned char> back(blocks[i].size(), 0xAA);
    EXPECT_EQ("", tier->wait(tier->read(offsets[i], back.data(), back.size())));
    EXPECT_EQ(blocks[i], back) << "block " << i;
  }
  uint64_t total = 0;
  for (auto& b : blocks) total += b.size();
  const DiskTierStats s = tier->stats();
  EXPECT_EQ(total, s.bytes_written);
  EXPECT_EQ(total, s.bytes_read);
  EXPECT_EQ(0u, s.num_failed_jobs);
}

TEST(DiskTier, ItsFileIsInNoDirectoryAndOnlyItsOwnerMayReadIt) {
  for (bool named : {false, true}) {
    TempDir dir("vramswap-disk-test");
    auto tier = open_tier(dir, 16 * kMiB, named);
    ASSERT_NE(nullptr, tier);
    std::string error;
    const auto offset = tier->reserve(kMiB, &error);
    ASSERT_TRUE(offset) << error;
    EXPECT_TRUE(dir.entries().empty()) << (named ? "named" : "O_TMPFILE") << ": " << dir.entries().front();
    EXPECT_EQ(0600u, tier->file_mode()) << (named ? "named" : "O_TMPFILE");
  }
}

TEST(DiskTier, AMissingDirectoryIsAClearError) {
  std::string error;
  EXPECT_EQ(nullptr, DiskTier::open({"/nonexistent/vramswap-disk", 16 * kMiB}, &error));
  EXPECT_NE(std::string::npos, error.find("VRAMSWAP_DISK_DIR='/nonexistent/vramswap-disk'")) << error;
  EXPECT_NE(std::string::npos, error.find("No such file or directory")) << error;
  EXPECT_EQ(nullptr, DiskTier::open({"", 16 * kMiB}, &error));
  EXPECT_NE(std::string::npos, error.find("VRAMSWAP_DISK_DIR is empty")) << error;
}

TEST(DiskTier, TheLimitRefusesAndSaysSo) {
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 2 * kMiB);
  ASSERT_NE(nullptr, tier);
  std::string error;
  ASSERT_TRUE(tier->reserve(1536 * 1024, &error)) << error;
  EXPECT_FALSE(tier->reserve(kMiB, &error));
  EXPECT_NE(std::string::npos, error.find("VRAMSWAP_DISK_LIMIT")) << error;
  EXPECT_NE(std::string::npos, error.find(dir.path())) << error;
  EXPECT_TRUE(tier->reserve(512 * 1024, &error)) << "what is left still fits: " << error;
}

TEST(DiskTier, FreedSpaceIsReusedAndTheFileShrinksAtItsEnd) {
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 64 * kMiB);
  ASSERT_NE(nullptr, tier);
  std::string error;
  const uint64_t a = *tier->reserve(kMiB, &error), b = *tier->reserve(2 * kMiB, &error),
                 c = *tier->reserve(kMiB, &error);
  EXPECT_EQ(4 * kMiB, tier->stats().file_bytes);
  ASSERT_TRUE(tier->release(b, &error)) << error;
  EXPECT_FALSE(tier->release(b, &error));
  EXPECT_NE(std::string::npos, error.find("double release")) << error;
  EXPECT_EQ(b, *tier->reserve(kMiB, &error)) << "best fit: the hole b left";
  EXPECT_EQ(b + kMiB, *tier->reserve(kMiB, &error)) << "and the rest of it";
  EXPECT_EQ(4 * kMiB, tier->stats().file_bytes);
  for (uint64_t off : {a, b, b + kMiB}) ASSERT_TRUE(tier->release(off, &error)) << error;
  EXPECT_EQ(4 * kMiB, tier->stats().file_bytes) << "c still holds the end";
  ASSERT_TRUE(tier->release(c, &error)) << error;
  EXPECT_EQ(0u, tier->stats().file_bytes) << "every extent freed: the file is empty";
  EXPECT_EQ(0u, tier->stats().used_bytes);
  EXPECT_EQ(4 * kMiB, tier->stats().peak_used_bytes);
}

// A filesystem that takes no more (here: a file-size limit on the process, which the
// kernel enforces as it would a full disk): reserve() says so, naming the directory, and
// what was written before comes back whole.
// The child's side: 0 when everything went as it must, else a code saying where not.
int fill_a_small_filesystem(const std::string& dir) {
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit small{};
  small.rlim_cur = small.rlim_max = 2 * kMiB;
  if (::setrlimit(RLIMIT_FSIZE, &small) != 0) return 3;
  std::string error;
  auto tier = DiskTier::open({dir, 64 * kMiB}, &error);
  if (!tier) return 4;
  const auto data = pattern(kMiB, 11);
  const auto first = tier->reserve(kMiB, &error);
  if (!first || !tier->wait(tier->write(*first, data.data(), data.size())).empty()) return 5;
  if (tier->reserve(4 * kMiB, &error)) return 6;
  std::fprintf(stderr, "%s\n", error.c_str());
  std::vector<unsigned char> back(kMiB);
  if (!tier->wait(tier->read(*first, back.data(), back.size())).empty() || back != data) return 7;
  return 0;
}

// The threadsafe style runs the test's body again in the child, which makes a directory of
// its own; it exits without destructors, so it removes that directory itself (the tier's
// file has no name in it), or a run would leave one behind.
[[noreturn]] void fill_a_small_filesystem_and_exit(TempDir& dir) {
  const int code = fill_a_small_filesystem(dir.path());
  std::_Exit(dir.remove() ? code : 8);
}

TEST(DiskTierDeathTest, AFullFilesystemIsAClearErrorAndLosesNothing) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* prefix = "vramswap-disk-death-test";
  const size_t before = TempDir::count(prefix);
  TempDir dir(prefix);
  EXPECT_EXIT(fill_a_small_filesystem_and_exit(dir), ::testing::ExitedWithCode(0),
              "cannot reserve 4 MiB for the disk tier in .*: File too large");
  EXPECT_EQ(before + 1, TempDir::count(prefix)) << "the child's directory is left behind (the test's own is 1)";
}

TEST(DiskTier, ThreadsReservingWritingAndReadingAtOnce) {
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 256 * kMiB);
  ASSERT_NE(nullptr, tier);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::string error;
      for (unsigned round = 0; round < 20; ++round) {
        const auto data = pattern(64 * 1024 + round * 4096 + t, t * 100 + round);
        const auto offset = tier->reserve(data.size(), &error);
        ASSERT_TRUE(offset) << error;
        ASSERT_EQ("", tier->wait(tier->write(*offset, data.data(), data.size())));
        std::vector<unsigned char> back(data.size());
        ASSERT_EQ("", tier->wait(tier->read(*offset, back.data(), back.size())));
        ASSERT_EQ(data, back);
        ASSERT_TRUE(tier->release(*offset, &error)) << error;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(0u, tier->stats().used_bytes);
  EXPECT_EQ(0u, tier->stats().file_bytes);
}

}  // namespace
}  // namespace vramswap::residency
