// HostTier under four threads at once (fixed seeds), for every placement:
//
//   - each thread allocates blocks of mixed sizes (512 B to 4 MiB), stamps both ends with a
//     number of its own, and frees them in random order after checking the stamps;
//   - a quarter of the blocks are handed to the next thread through a shared queue (at most
//     6 waiting) and freed there, so frees come from threads other than the allocating one;
//   - the limit (128 MiB, chunks of 16 MiB; the threads keep up to about 100 MiB live) is
//     reached at times, and an allocation may then be refused (counted, never thrown);
//   - a fifth thread calls trim() and stats() all along, so chunks are released while
//     others pin and place.
//
// Checked: no two live blocks overlap (a registry of live ranges), no block changes while
// live, pinned memory never passes the limit, and the counters add up afterwards.
#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "host_tier_test_util.h"

namespace host_tier_test {
namespace {

constexpr int kThreads = 4;
constexpr int kStepsPerThread = 20000;
constexpr size_t kMaxLivePerThread = 12;
constexpr size_t kMaxQueued = 6;  // per mailbox
constexpr uint64_t kLimit = 128 * kMiB;
constexpr uint64_t kChunk = 16 * kMiB;
constexpr uint64_t kSeed = 0x4057'71e2;

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  uint64_t stamp = 0;
};

// Blocks handed from thread i to thread (i + 1) % kThreads.
struct Mailbox {
  std::mutex mu;
  std::deque<Block> blocks;
};

class HostTierStress : public ::testing::TestWithParam<Placement> {};

TEST_P(HostTierStress, FourThreadsAllocateAndFreeAcrossThreads) {
  HostTierOptions options;
  options.limit_bytes = kLimit;
  options.chunk_bytes = kChunk;
  auto tier = make_tier(GetParam(), options);
  ASSERT_NE(nullptr, tier);

  LiveRanges ranges;
  Mailbox mailboxes[kThreads];
  std::atomic<uint64_t> refused{0};
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};
  std::atomic<int> finished{0};  // workers past their last step
  std::mutex failure_mu;
  std::string first_failure;
  auto fail = [&](const std::string& what) {
    std::lock_guard lock(failure_mu);
    if (failures++ == 0) first_failure = what;
  };

  auto check_and_free = [&](const Block& b) {
    if (!has_stamp(b.ptr, b.size, b.stamp)) fail("a block changed while live");
    ranges.remove(b.ptr);
    std::string error;
    if (!tier->free(b.ptr, &error)) fail("free refused: " + error);
  };

  auto worker = [&](int index) {
    std::mt19937_64 rng(kSeed + index);
    std::vector<Block> live;
    uint64_t next = uint64_t(index) << 48;
    // Blocks handed to this thread are freed here.
    auto drain = [&] {
      std::lock_guard lock(mailboxes[index].mu);
      while (!mailboxes[index].blocks.empty()) {
        check_and_free(mailboxes[index].blocks.front());
        mailboxes[index].blocks.pop_front();
      }
    };
    for (int step = 0; step < kStepsPerThread && failures == 0; ++step) {
      drain();
      if (live.size() < kMaxLivePerThread && rng() % 2 == 0) {
        const size_t size = rng() % 3 == 0 ? 512 + rng() % (64 * kKiB) : 64 * kKiB + rng() % (4 * kMiB);
        std::string error;
        void* p = tier->allocate(size, &error);
        if (p == nullptr) {
          if (error.find("limit") == std::string::npos) {
            fail("refused without naming the limit: " + error);
          }
          ++refused;
          continue;
        }
        if (address(p) % kHostBlockAlignment != 0) fail("misaligned block");
        if (!ranges.add(p, size)) fail("overlapping blocks");
        if (tier->pinned_bytes() > kLimit) fail("pinned past the limit");
        stamp(p, size, ++next);
        live.push_back({p, size, next});
      } else if (!live.empty()) {
        const size_t i = rng() % live.size();
        const Block b = live[i];
        live[i] = live.back();
        live.pop_back();
        bool handed = false;
        if (rng() % 4 == 0) {
          Mailbox& to = mailboxes[(index + 1) % kThreads];
          std::lock_guard lock(to.mu);
          // Bounded: a receiver the scheduler left asleep must not collect the whole limit.
          if (to.blocks.size() < kMaxQueued) {
            to.blocks.push_back(b);
            handed = true;
          }
        }
        if (!handed) check_and_free(b);
      }
    }
    for (const Block& b : live) check_and_free(b);
    // Blocks keep coming while the others run: a thread that stopped draining would pile
    // them up until the limit refused everyone.
    ++finished;
    while (finished < kThreads) {
      drain();
      std::this_thread::yield();
    }
    drain();
  };

  std::thread trimmer([&] {
    while (!done) {
      tier->trim();
      const HostTierStats s = tier->stats();
      if (s.pinned_bytes > kLimit || s.used_bytes > s.pinned_bytes) fail("inconsistent stats");
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  done = true;
  trimmer.join();
  for (Mailbox& m : mailboxes) {  // handed over after their receiver's last drain
    for (const Block& b : m.blocks) check_and_free(b);
  }

  EXPECT_EQ(0, failures.load()) << first_failure;
  const HostTierStats s = tier->stats();
  EXPECT_EQ(0u, s.used_bytes) << ::testing::PrintToString(s);
  EXPECT_EQ(s.num_allocs, s.num_frees);
  EXPECT_EQ(refused.load(), s.num_refused);
  EXPECT_EQ(0u, s.num_bad_frees);
  EXPECT_LE(s.peak_pinned_bytes, kLimit);
  EXPECT_GT(s.num_allocs, uint64_t(kThreads) * kStepsPerThread / 8)
      << "the run did little: " << ::testing::PrintToString(s);
  if (GetParam().releases_chunks) {
    tier->trim();
    EXPECT_EQ(0u, tier->pinned_bytes());
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, HostTierStress, ::testing::ValuesIn(placements()));

}  // namespace
}  // namespace host_tier_test
