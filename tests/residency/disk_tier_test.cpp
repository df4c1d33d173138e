// The disk tier (src/residency/disk_tier.h): its file nobody else can open, its extents,
// its I/O on threads and on streams (cudasim's libcufile), and its errors (a missing
// directory, the limit, a full filesystem); in virtual time, what a wait for the disk costs.
#include "residency/disk_tier.h"

#include <cuda_runtime_api.h>
#include <sys/resource.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_test_util.h"
#include "temp_dir.h"

namespace vramswap::residency {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

using residency_test::TempDir;

std::unique_ptr<DiskTier> open_tier(const TempDir& dir, uint64_t limit, bool named = false,
                                    DiskIo io = DiskIo::kThreads) {
  std::string error;
  auto tier = DiskTier::open({dir.path(), limit, 2, named, io}, &error);
  EXPECT_NE(nullptr, tier) << error;
  if (tier) {
    EXPECT_EQ(io, tier->io());
  }
  return tier;
}

// Pinned host memory (what the engine hands the tier), filled from a vector.
class Pinned {
 public:
  explicit Pinned(const std::vector<unsigned char>& from) : bytes_(from.size()) {
    EXPECT_EQ(cudaSuccess, cudaMallocHost(&p_, bytes_));
    std::copy(from.begin(), from.end(), data());
  }
  explicit Pinned(uint64_t bytes) : Pinned(std::vector<unsigned char>(bytes, 0xAA)) {}
  ~Pinned() { cudaFreeHost(p_); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  unsigned char* data() const { return static_cast<unsigned char*>(p_); }
  uint64_t size() const { return bytes_; }
  std::vector<unsigned char> bytes() const { return {data(), data() + bytes_}; }

 private:
  void* p_ = nullptr;
  uint64_t bytes_;
};

std::string io_name(const ::testing::TestParamInfo<DiskIo>& info) {
  return info.param == DiskIo::kCuFile ? "cufile" : "threads";
}

}  // namespace

// How a test's parameter reads in its name.
void PrintTo(DiskIo io, std::ostream* os) { *os << (io == DiskIo::kCuFile ? "cufile" : "threads"); }

namespace {

std::vector<unsigned char> pattern(uint64_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

class DiskTierIo : public ::testing::TestWithParam<DiskIo> {};

TEST_P(DiskTierIo, BlocksComeBackByteForByte) {
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 64 * kMiB, false, GetParam());
  ASSERT_NE(nullptr, tier);
  std::mt19937 rng(7);
  std::vector<std::unique_ptr<Pinned>> blocks;
  std::vector<uint64_t> offsets;
  std::vector<DiskTier::JobRef> jobs;
  std::string error;
  for (unsigned i = 0; i < 48; ++i) {
    blocks.push_back(std::make_unique<Pinned>(pattern(1 + rng() % (512 * 1024), i)));
    const auto offset = tier->reserve(blocks.back()->size(), &error);
    ASSERT_TRUE(offset) << error;
    EXPECT_EQ(0u, *offset % kDiskUnit);
    offsets.push_back(*offset);
    jobs.push_back(tier->write(*offset, blocks.back()->data(), blocks.back()->size()));
  }
  for (auto& job : jobs) EXPECT_EQ("", tier->wait(job));
  for (auto& job : jobs) EXPECT_TRUE(tier->done(job));
  for (size_t i = 0; i < blocks.size(); ++i) {
    Pinned back(blocks[i]->size());
    EXPECT_EQ("", tier->wait(tier->read(offsets[i], back.data(), back.size())));
    EXPECT_EQ(blocks[i]->bytes(), back.bytes()) << "block " << i;
  }
  uint64_t total = 0;
  for (auto& b : blocks) total += b->size();
  const DiskTierStats s = tier->stats();
  EXPECT_EQ(total, s.bytes_written);
  EXPECT_EQ(total, s.bytes_read);
  EXPECT_EQ(0u, s.num_failed_jobs);
}

// done() finishes a job nobody waits for once it ran (the engine polls its reads ahead and
// writes ahead so), and wait() then gives its outcome.
TEST_P(DiskTierIo, DoneAnswersWithoutWaiting) {
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 16 * kMiB, false, GetParam());
  ASSERT_NE(nullptr, tier);
  Pinned data(pattern(3 * kMiB + 5, 3));
  std::string error;
  const auto offset = tier->reserve(data.size(), &error);
  ASSERT_TRUE(offset) << error;
  const DiskTier::JobRef write = tier->write(*offset, data.data(), data.size());
  while (!tier->done(write)) std::this_thread::yield();
  EXPECT_EQ("", tier->wait(write)) << "done() finished it; wait() gives its outcome";
  Pinned back(data.size());
  const DiskTier::JobRef read = tier->read(*offset, back.data(), back.size());
  while (!tier->done(read)) std::this_thread::yield();
  EXPECT_EQ(data.bytes(), back.bytes());
  EXPECT_EQ(data.size(), tier->stats().bytes_read);
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

TEST_P(DiskTierIo, ThreadsReservingWritingAndReadingAtOnce) {
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 256 * kMiB, false, GetParam());
  ASSERT_NE(nullptr, tier);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::string error;
      for (unsigned round = 0; round < 20; ++round) {
        Pinned data(pattern(64 * 1024 + round * 4096 + t, t * 100 + round));
        const auto offset = tier->reserve(data.size(), &error);
        ASSERT_TRUE(offset) << error;
        ASSERT_EQ("", tier->wait(tier->write(*offset, data.data(), data.size())));
        Pinned back(data.size());
        ASSERT_EQ("", tier->wait(tier->read(*offset, back.data(), back.size())));
        ASSERT_EQ(data.bytes(), back.bytes());
        ASSERT_TRUE(tier->release(*offset, &error)) << error;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(0u, tier->stats().used_bytes);
  EXPECT_EQ(0u, tier->stats().file_bytes);
}

INSTANTIATE_TEST_SUITE_P(Io, DiskTierIo, ::testing::Values(DiskIo::kThreads, DiskIo::kCuFile), io_name);

using cuda_test::virtual_now_ns;
using cuda_test::virtual_time;

// Note [Disk time]: with cuFile, the tier's I/O is stream work that cudasim times on its
// disk engine (CUDASIM_DISK_GBPS=6 here: 6 bytes a ns). A job is not done before the host
// clock reaches its end, and a wait moves the clock there: a step that waits for the disk
// is charged for it. Reads and writes share the one disk.
TEST(DiskTierCuFile, AWaitForTheDiskCostsTheHostTheDisksTime) {
  if (!virtual_time()) GTEST_SKIP() << "virtual time only (CUDASIM_TIME=virtual)";
  TempDir dir("vramswap-disk-test");
  auto tier = open_tier(dir, 256 * kMiB, false, DiskIo::kCuFile);
  ASSERT_NE(nullptr, tier);
  constexpr uint64_t kBytes = 60'000'000;  // 10 ms at 6 GB/s
  constexpr uint64_t kDiskNs = 10'000'000;
  Pinned a(pattern(kBytes, 1)), b(pattern(kBytes, 2));
  std::string error;
  const auto at_a = tier->reserve(kBytes, &error);
  const auto at_b = tier->reserve(kBytes, &error);
  ASSERT_TRUE(at_a && at_b) << error;
  const uint64_t t0 = virtual_now_ns();
  const DiskTier::JobRef write_a = tier->write(*at_a, a.data(), kBytes);
  const DiskTier::JobRef write_b = tier->write(*at_b, b.data(), kBytes);
  EXPECT_FALSE(tier->done(write_a)) << "the host clock has not reached the write's end";
  EXPECT_EQ(t0, virtual_now_ns()) << "queuing costs the host nothing";
  EXPECT_EQ("", tier->wait(write_a));
  EXPECT_EQ(t0 + kDiskNs, virtual_now_ns()) << "waiting for a write: the clock at its end";
  EXPECT_FALSE(tier->done(write_b)) << "the second write runs after the first, on the one disk";
  Pinned back(kBytes);
  const DiskTier::JobRef read = tier->read(*at_a, back.data(), kBytes);
  EXPECT_EQ("", tier->wait(read));
  EXPECT_EQ(t0 + 3 * kDiskNs, virtual_now_ns()) << "the read (on its own stream) waited for the disk behind the writes";
  EXPECT_TRUE(tier->done(write_b));
  EXPECT_EQ(a.bytes(), back.bytes());
}

}  // namespace
}  // namespace vramswap::residency
