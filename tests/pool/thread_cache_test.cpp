// The pool's thread caches (Note [Thread caches] in src/pool/thread_caches.cpp): a thread's
// same-stream free and reallocation of a size go through its own cache; everything else
// (another thread's free, record_stream, a double free, an exited thread, pressure, the
// history) finds the pool's rules and refusals exactly as before.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "pool_test_util.h"

namespace pool_test {
namespace {

class ThreadCaches : public PoolTest {
 protected:
  // A block freed on another stream than its allocation's, by this thread or (`elsewhere`)
  // another: not cached, and not reused on that stream before the allocation stream's work.
  void expect_a_free_on_another_stream_waits(bool elsewhere) {
    Stream other;
    void* p = allocate(64 * kKiB);
    ASSERT_NE(nullptr, p);
    StreamGate gate;
    ASSERT_CUDA_OK(gate.hold(stream_));
    Result freed;  // the allocation stream still has work queued
    if (elsewhere) std::thread([&] { freed = pool().deallocate(p, other); }).join();
    else freed = pool().deallocate(p, other);
    EXPECT_TRUE(freed.ok) << freed.message;
    void* q = allocate(64 * kKiB, other);
    EXPECT_NE(p, q) << "reused on the other stream before the allocation stream's work";
    gate.open();
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    deallocate(q, other);
    EXPECT_EQ("", pool().check_invariants());
  }
};

// Expects the pool's own check to find nothing broken.
void expect_invariants(DevicePool& pool) { EXPECT_EQ("", pool.check_invariants()); }

TEST_F(ThreadCaches, ARepeatedPairIsACacheHitAndTheCountersAddUp) {
  void* p = allocate(1000);
  ASSERT_NE(nullptr, p);
  deallocate(p);
  const PoolStats before = stats();
  EXPECT_EQ(0u, before.allocated_bytes) << "a cached block is not allocated";
  EXPECT_EQ(1024u, before.peak_allocated_bytes);
  for (int i = 0; i < 5; ++i) {
    void* q = allocate(1000);
    EXPECT_EQ(p, q) << "the block freed on this stream, by this thread";
    EXPECT_EQ(1024u, stats().allocated_bytes);
    deallocate(q);
  }
  const PoolStats after = stats();
  EXPECT_EQ(before.num_allocs + 5, after.num_allocs);
  EXPECT_EQ(before.num_frees + 5, after.num_frees);
  EXPECT_EQ(before.num_cache_hits + 5, after.num_cache_hits);
  EXPECT_EQ(0u, after.allocated_bytes);
  EXPECT_EQ(1024u, after.peak_allocated_bytes) << "hits of a freed block raise no peak";
  EXPECT_EQ(before.num_free_blocks, after.num_free_blocks);
  expect_invariants(pool());
}

TEST_F(ThreadCaches, ACachedBlockFreedAgainIsADoubleFreeAndChangesNothing) {
  void* p = allocate(4 * kKiB);
  ASSERT_NE(nullptr, p);
  deallocate(p);
  const PoolStats before = stats();
  const Result again = pool().deallocate(p, stream_);
  EXPECT_FALSE(again.ok);
  EXPECT_NE(std::string::npos, again.message.find("double free")) << again.message;
  Result from_other_thread;
  std::thread([&] { from_other_thread = pool().deallocate(p, stream_); }).join();
  EXPECT_FALSE(from_other_thread.ok);
  EXPECT_NE(std::string::npos, from_other_thread.message.find("double free")) << from_other_thread.message;
  EXPECT_TRUE(same_stats(before, stats()));
  EXPECT_EQ(p, allocate(4 * kKiB)) << "still cached, handed out once";
  deallocate(p);
  expect_invariants(pool());
}

TEST_F(ThreadCaches, ABlockAnotherThreadFreesOnItsStreamGoesToItsOwnersCache) {
  void* p = allocate(8 * kKiB);
  ASSERT_NE(nullptr, p);
  Result freed;
  std::thread([&] { freed = pool().deallocate(p, stream_); }).join();
  EXPECT_TRUE(freed.ok) << freed.message;
  EXPECT_EQ(0u, stats().allocated_bytes);
  expect_invariants(pool());
  const PoolStats before = stats();
  void* q = allocate(8 * kKiB);
  EXPECT_EQ(p, q) << "the owner's cache serves it";
  EXPECT_EQ(before.num_cache_hits + 1, stats().num_cache_hits);
  // Cached again: freeing it on the other thread a second time is a double free.
  deallocate(q);
  Result again;
  std::thread([&] { again = pool().deallocate(p, stream_); }).join();
  EXPECT_FALSE(again.ok);
  EXPECT_NE(std::string::npos, again.message.find("double free")) << again.message;
  expect_invariants(pool());
  // Another thread's miss empties every cache: best fit then gives it the block.
  void* third = nullptr;
  std::thread([&] {
    third = allocate(8 * kKiB);
    deallocate(third);
  }).join();
  EXPECT_EQ(p, third) << "the owner's cached block, given to the pool by the other thread's miss";
  expect_invariants(pool());
}

TEST_F(ThreadCaches, ABlockAnotherThreadFreesOnAnotherStreamGoesBackToThePoolBehindAnEvent) {
  expect_a_free_on_another_stream_waits(true);
}

TEST_F(ThreadCaches, AFreeFromAnotherThreadAfterTheCachesWentOffIsThePoolsOwn) {
  void* p = allocate(4 * kKiB);
  ASSERT_NE(nullptr, p);
  pool().record_history(100);  // the caches go off for good; p is the pool's again
  Result freed;
  std::thread([&] { freed = pool().deallocate(p, stream_); }).join();
  EXPECT_TRUE(freed.ok) << freed.message;
  EXPECT_EQ(0u, stats().allocated_bytes);
  Result again;
  std::thread([&] { again = pool().deallocate(p, stream_); }).join();
  EXPECT_FALSE(again.ok) << "a double free of a block once lent";
  expect_invariants(pool());
}

TEST_F(ThreadCaches, ABlockOfAnExitedThreadFreedHereIsTakenAndTheCacheEmptiedLater) {
  void* p = nullptr;
  std::thread([&] { p = allocate(32 * kKiB); }).join();  // its owner exits with it live
  ASSERT_NE(nullptr, p);
  deallocate(p);
  EXPECT_EQ(0u, stats().allocated_bytes);
  expect_invariants(pool());
  void* q = allocate(32 * kKiB);  // empties the exited thread's cache: best fit sees the block
  EXPECT_EQ(p, q);
  deallocate(q);
  expect_invariants(pool());
}

TEST_F(ThreadCaches, RecordStreamTakesTheBlockBackAndItsFreeWaitsForThatStream) {
  Stream other;
  void* p = allocate(64 * kKiB);
  ASSERT_NE(nullptr, p);
  ASSERT_TRUE(pool().record_stream(p, other).ok);
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(other));
  deallocate(p);
  void* q = allocate(64 * kKiB);
  EXPECT_NE(p, q) << "reused while the other stream's work may still use it";
  gate.open();
  ASSERT_CUDA_OK(cudaStreamSynchronize(other));
  deallocate(q);
  expect_invariants(pool());
}

TEST_F(ThreadCaches, AFreeOnAnotherStreamIsNotCachedAndWaitsForTheFirst) {
  expect_a_free_on_another_stream_waits(false);
}

TEST_F(ThreadCaches, AnExitedThreadsCachedBlocksGoBackToThePool) {
  void* p = nullptr;
  std::thread([&] {
    p = allocate(2 * kMiB);
    deallocate(p);  // cached by that thread
  }).join();
  ASSERT_NE(nullptr, p);
  EXPECT_EQ(0u, stats().allocated_bytes);
  // This thread's first allocation registers its own cache and empties the exited one's:
  // best fit then sees the block.
  void* q = allocate(2 * kMiB);
  EXPECT_EQ(p, q);
  deallocate(q);
  pool().empty_cache();
  EXPECT_EQ(0u, stats().reserved_bytes) << "empty_cache unmaps what the caches held";
  expect_invariants(pool());
}

TEST_F(ThreadCaches, AFullListReleasesTheBlockAsAFullQuickListDoes) {
  std::vector<void*> blocks;
  for (int i = 0; i < 40; ++i) blocks.push_back(allocate(kKiB));
  for (void* p : blocks) deallocate(p);
  // 32 stay cached; the other 8 were released and merged.
  EXPECT_EQ(0u, stats().allocated_bytes);
  expect_invariants(pool());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(blocks[31 - i], allocate(kKiB)) << i << ": the last freed first";
  expect_invariants(pool());
}

// Autograd's pattern on a GPU: the forward's thread allocates the activations, the
// backward's device thread frees them (into their owner's cache) and allocates its own
// tensors. Those must reuse the freed memory, not map more: on an H200 (torch 2.11, no
// limit) the GPU suite's step peaked 2 GiB above torch's allocator with the cached blocks
// out of the backward's reach.
TEST_F(ThreadCaches, AnotherThreadsAllocationTakesBlocksCachedForTheirOwnerBeforeNewPages) {
  std::vector<void*> forward;
  for (int i = 0; i < 8; ++i) forward.push_back(allocate(kMiB));
  for (void* p : forward) ASSERT_NE(nullptr, p);
  const uint64_t reserved = stats().reserved_bytes;
  std::thread([&] {
    for (void* p : forward) deallocate(p);  // each to its owner's cache
    std::vector<void*> backward;
    backward.push_back(allocate(3 * kMiB));  // sizes the forward never asked for
    for (int i = 0; i < 3; ++i) backward.push_back(allocate(kMiB + 512 * kKiB));
    for (void* p : backward) {
      EXPECT_NE(nullptr, p);
      deallocate(p);
    }
  }).join();
  EXPECT_EQ(reserved, stats().reserved_bytes) << "the freed activations' pages serve the backward";
  EXPECT_EQ(reserved, stats().peak_reserved_bytes);
  expect_invariants(pool());
  // The owner's next allocations still work, from the pool now.
  void* again = allocate(kMiB);
  EXPECT_NE(nullptr, again);
  deallocate(again);
  expect_invariants(pool());
}

// A block this thread freed and cached is handed to another thread's allocation of its size
// as the pool's quick lists would hand it with no caches: the last freed first, not where
// best fit would place the allocation once the blocks merged. Autograd on a GPU allocates
// on one thread what another freed; in bench/autograd_threads.py's step this kept the
// peak reserved at the pool's without caches (692 MiB) where merging first cost 756.
TEST_F(ThreadCaches, AnotherThreadTakesCachedBlocksInTheOrderTheQuickListsWould) {
  auto sequence = [&] {
    std::vector<void*> blocks;
    for (int i = 0; i < 4; ++i) blocks.push_back(allocate(64 * kKiB));
    void* large = allocate(256 * kKiB);
    deallocate(blocks[1]);
    deallocate(blocks[3]);  // freed last
    void* first = nullptr;
    void* second = nullptr;
    std::thread([&] {
      first = allocate(64 * kKiB);
      second = allocate(64 * kKiB);
    }).join();
    EXPECT_EQ(blocks[3], first) << "the block freed last, as from a quick list";
    EXPECT_EQ(blocks[1], second);
    for (void* p : {first, second, blocks[0], blocks[2], large}) deallocate(p);
    expect_invariants(pool());
  };
  sequence();
  pool().record_history(100);  // the caches off for good: the pool's own quick lists
  sequence();
}

TEST_F(ThreadCaches, TheMemoryViewShowsCachedBlocksFree) {
  void* p = allocate(4 * kKiB);
  ASSERT_NE(nullptr, p);
  deallocate(p);
  bool seen = false;
  for (const auto& b : pool().memory_view().blocks) {
    if (b.addr != address(p)) continue;
    seen = true;
    EXPECT_EQ(DevicePool::BlockView::State::kFree, b.state);
  }
  EXPECT_TRUE(seen);
}

TEST_F(ThreadCaches, RecordingTheHistoryTurnsThemOffAndFreesWhatTheyHeld) {
  void* live = allocate(4 * kKiB);
  void* cached = allocate(8 * kKiB);
  ASSERT_NE(nullptr, live);
  ASSERT_NE(nullptr, cached);
  deallocate(cached);
  pool().record_history(100);
  expect_invariants(pool());
  EXPECT_EQ(4 * kKiB, stats().allocated_bytes);
  deallocate(live);  // the pool's again: its free is recorded
  void* again = allocate(4 * kKiB);
  deallocate(again);
  const auto trace = pool().memory_view().trace;
  EXPECT_EQ(5u, trace.size()) << "free_requested, free_completed, alloc, free_requested, free_completed";
  expect_invariants(pool());
}

TEST_F(ThreadCaches, StreamDestroyedMakesItsCachedBlocksFreeForAnyStream) {
  auto* s = new Stream;
  void* p = allocate(16 * kKiB, *s);
  ASSERT_NE(nullptr, p);
  deallocate(p, *s);
  ASSERT_TRUE(pool().stream_destroyed(*s).ok);
  delete s;
  void* q = allocate(16 * kKiB);  // another stream
  EXPECT_EQ(p, q) << "free for any stream once its stream is gone";
  deallocate(q);
  expect_invariants(pool());
}

// Several threads, each with its own stream, allocating and freeing (their own blocks and
// each other's): the counters and the blocks agree at the end.
TEST_F(ThreadCaches, ThreadsAllocatingAndFreeingEachOthersBlocksKeepTheInvariants) {
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int t = 0; t < kThreads; ++t) streams.push_back(std::make_unique<Stream>());
  std::vector<std::vector<void*>> handoff(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      cudaStream_t s = *streams[t];
      std::vector<void*> mine;
      for (int r = 0; r < kRounds; ++r) {
        std::string error;
        void* p = pool().allocate(size_t(512) << (r % 5), s, &error);
        ASSERT_NE(nullptr, p) << error;
        if (r % 3 == 0) mine.push_back(p);
        else ASSERT_TRUE(pool().deallocate(p, s).ok);
      }
      handoff[t] = mine;
    });
  for (auto& th : threads) th.join();
  threads.clear();
  // Each thread frees the next one's blocks (another thread's, on their stream).
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      const int other = (t + 1) % kThreads;
      for (void* p : handoff[other]) ASSERT_TRUE(pool().deallocate(p, *streams[other]).ok);
    });
  for (auto& th : threads) th.join();
  const PoolStats s = stats();
  EXPECT_EQ(0u, s.allocated_bytes);
  EXPECT_EQ(s.num_allocs, s.num_frees);
  EXPECT_EQ(uint64_t(kThreads) * kRounds, s.num_allocs);
  expect_invariants(pool());
  for (auto& st : streams) ASSERT_TRUE(pool().stream_destroyed(*st).ok);
}

// Blocks handed from one thread to another while both run, the way autograd's backward
// thread frees what the forward's thread allocated: the consumer's frees go to the
// producer's cache as the producer allocates from it; midway the caches go off for good
// (the history), and frees that looked the owner up just before find a cache that refuses.
TEST_F(ThreadCaches, BlocksHandedToAnotherThreadWhileBothRunKeepTheInvariants) {
  constexpr int kBlocks = 4000;
  constexpr size_t kRing = 8;
  std::atomic<size_t> head{0}, tail{0};
  void* ring[kRing] = {};
  std::atomic<bool> failed{false};
  std::thread producer([&] {
    for (int i = 0; i < kBlocks && !failed; ++i) {
      std::string error;
      void* p = pool().allocate(size_t(512) << (i % 4), stream_, &error);
      if (p == nullptr) {
        failed = true;
        ADD_FAILURE() << error;
        break;
      }
      while (head - tail.load() == kRing && !failed) {
      }
      ring[head % kRing] = p;
      head.store(head + 1);
      if (i == kBlocks / 2) pool().record_history(16);
    }
  });
  std::thread consumer([&] {
    for (int i = 0; i < kBlocks && !failed; ++i) {
      while (head.load() == tail.load() && !failed) {
      }
      if (failed) break;
      const Result r = pool().deallocate(ring[tail % kRing], stream_);
      if (!r.ok) {
        failed = true;
        ADD_FAILURE() << r.message;
      }
      tail.store(tail + 1);
    }
  });
  producer.join();
  consumer.join();
  EXPECT_FALSE(failed);
  EXPECT_EQ(0u, stats().allocated_bytes);
  expect_invariants(pool());
}

}  // namespace
}  // namespace pool_test
