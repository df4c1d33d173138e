// DevicePool under four threads at once (fixed seeds), each with its own stream:
//
//   - allocate, fill with a byte of its own (cudaMemsetAsync), verify, free: sometimes
//     freeing right after queuing the read-back, so the block is freed with work queued;
//   - hand a block to another thread through a shared queue: that thread reads it on its
//     own stream, calls record_stream for that stream and frees it on the allocating
//     stream, as torch does after tensor.record_stream(); only record_stream keeps the
//     allocating thread from refilling the block before the other stream's read ran.
//
// Checked: no two live blocks ever overlap (a registry of live ranges under a mutex), no
// block's bytes change while it is live or while queued work still reads it, and the
// counters add up afterwards. Variants: no limit; a 40 MiB limit, where requests may fail
// (counted, never thrown) and the pool must wait and unmap to make room; and a fifth
// thread calling empty_cache() and checking stats() all along. Under CUDASIM_CHAOS
// (CMakeLists.txt) stream work is delayed at random, which is what exposes a reuse that
// an event should have ordered.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pool_test_util.h"

namespace pool_test {
namespace {

constexpr int kThreads = 4;
// ThreadSanitizer checks every byte the workers fill and read back (cudasim's copies and
// this file's checks), which makes a step 10 to 20 times dearer: a quarter of the steps
// keeps each case within its timeout, and the threads still interleave thousands of times.
#if defined(__SANITIZE_THREAD__)
constexpr int kStepsPerThread = 1000;
#else
constexpr int kStepsPerThread = 4000;
#endif
constexpr size_t kMaxLivePerThread = 16;
constexpr size_t kMaxBlock = 6 * kMiB;
constexpr size_t kMaxQueued = 32;
constexpr uint64_t kSeed = 0x5eed'2024;

// A block the test owns, with the byte it was filled with and the stream it was
// allocated on.
struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  unsigned char byte = 0;
  cudaStream_t stream = nullptr;
};

// What the threads share: the pool, the registry of live ranges, the hand-off queue, the
// counts to compare with the pool's, and the first failures.
class Shared {
 public:
  explicit Shared(DevicePool& pool) : pool_(pool) {}
  DevicePool& pool() { return pool_; }

  // Registers a block the pool just handed out; false (and a failure) if it overlaps.
  bool register_block(const Block& b) {
    std::lock_guard lock(live_mu_);
    const ::testing::AssertionResult r = live_.insert(b.ptr, b.size);
    if (!r) fail(r.message());
    return static_cast<bool>(r);
  }
  // Called before the block goes back to the pool, so that its next owner's registration
  // cannot race with this one's removal.
  void unregister_block(const Block& b) {
    std::lock_guard lock(live_mu_);
    live_.erase(b.ptr);
  }

  bool push(const Block& b) {
    std::lock_guard lock(queue_mu_);
    if (queue_.size() >= kMaxQueued) return false;
    queue_.push_back(b);
    return true;
  }
  bool pop(Block* b) {
    std::lock_guard lock(queue_mu_);
    if (queue_.empty()) return false;
    *b = queue_.front();
    queue_.pop_front();
    return true;
  }

  void fail(const std::string& what) {
    std::lock_guard lock(fail_mu_);
    if (failures_.size() < 8) failures_.push_back(what);
    failed_.store(true);
  }
  bool failed() const { return failed_.load(); }
  std::vector<std::string> failures() {
    std::lock_guard lock(fail_mu_);
    return failures_;
  }

  std::atomic<uint64_t> allocs{0};
  std::atomic<uint64_t> frees{0};
  std::atomic<uint64_t> ooms{0};
  std::atomic<uint64_t> handoffs{0};

 private:
  DevicePool& pool_;
  std::mutex live_mu_;
  LiveBlocks live_;
  std::mutex queue_mu_;
  std::deque<Block> queue_;
  std::mutex fail_mu_;
  std::vector<std::string> failures_;
  std::atomic<bool> failed_{false};
};

// One thread's work on its own stream, with one pinned staging buffer for read-backs. A
// read-back queued but not yet checked is "deferred": checked before the staging buffer
// is used again, after the block may already have been freed.
class Worker {
 public:
  Worker(Shared& shared, int index, cudaStream_t stream)
      : shared_(shared), index_(index), stream_(stream), rng_(kSeed + 977 * index),
        staging_(kMaxBlock) {}

  void run() {
    if (!check(staging_.status(), "cudaMallocHost")) return;
    for (int step = 0; step < kStepsPerThread && !shared_.failed(); ++step) {
      const uint64_t r = rng_() % 100;
      if (r < 45 && mine_.size() < kMaxLivePerThread) {
        allocate_and_fill();
      } else if (r < 70 && !mine_.empty()) {
        read_back_and_free(take_random());
      } else if (r < 80 && !mine_.empty()) {
        hand_off(take_random());
      } else if (r < 90) {
        Block b;
        if (shared_.pop(&b)) free_handed_over(b);
      } else if (!mine_.empty()) {
        verify_in_place(mine_[rng_() % mine_.size()]);
      }
    }
    while (!mine_.empty() && !shared_.failed()) read_back_and_free(take_random());
    finish_deferred();
  }

 private:
  bool check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    shared_.fail(std::string("thread ") + std::to_string(index_) + ": " + what + " returned " +
                 cudaGetErrorName(e));
    return false;
  }

  size_t random_size() {
    const uint64_t r = rng_() % 100;
    if (r < 70) return 1 + rng_() % (16 * kKiB);
    if (r < 95) return 16 * kKiB + rng_() % (kMiB - 16 * kKiB);
    return kMiB + rng_() % (kMaxBlock - kMiB);
  }

  // A byte no other thread uses (its low two bits are the thread's index), never 0, and
  // different from this thread's previous one.
  unsigned char next_byte() {
    ++fills_;
    return static_cast<unsigned char>((index_ & 3) | ((1 + fills_ % 63) << 2));
  }

  Block take_random() {
    const size_t i = rng_() % mine_.size();
    Block b = mine_[i];
    mine_[i] = mine_.back();
    mine_.pop_back();
    return b;
  }

  void allocate_and_fill() {
    Block b;
    b.size = random_size();
    b.stream = stream_;
    std::string error;
    b.ptr = shared_.pool().allocate(b.size, stream_, &error);
    if (b.ptr == nullptr) {
      // Only a limited pool may refuse; it must say why.
      if (shared_.pool().stats().limit_bytes == kCardBytes || error.empty()) {
        shared_.fail("thread " + std::to_string(index_) + ": allocate(" +
                     std::to_string(b.size) + ") failed: " + error);
      }
      shared_.ooms.fetch_add(1);
      return;
    }
    shared_.allocs.fetch_add(1);
    if (!shared_.register_block(b)) return;
    b.byte = next_byte();
    if (!check(cudaMemsetAsync(b.ptr, b.byte, b.size, stream_), "cudaMemsetAsync")) return;
    mine_.push_back(b);
  }

  // Queues a read-back of `b` on this thread's stream into the staging buffer, to be
  // checked later (after `b` may have been freed and reused).
  void queue_read_back(const Block& b) {
    finish_deferred();
    if (!check(cudaMemcpyAsync(staging_.get(), b.ptr, b.size, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync")) {
      return;
    }
    deferred_ = b;
    has_deferred_ = true;
  }

  void finish_deferred() {
    if (!has_deferred_) return;
    has_deferred_ = false;
    if (!check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return;
    const size_t at = first_mismatch(staging_.get(), deferred_.size, deferred_.byte);
    if (at != deferred_.size) {
      std::ostringstream what;
      what << "thread " << index_ << ": byte " << at << " of block " << deferred_.ptr << " +"
           << deferred_.size << " was " << int{staging_.get()[at]} << ", expected "
           << int{deferred_.byte} << " (written by thread " << (staging_.get()[at] & 3) << ")";
      shared_.fail(what.str());
    }
  }

  // The stream-ordered free: the read-back is queued, then the block is freed at once.
  void read_back_and_free(const Block& b) {
    queue_read_back(b);
    shared_.unregister_block(b);
    free(b, b.stream);
  }

  void verify_in_place(const Block& b) {
    queue_read_back(b);
    finish_deferred();
  }

  // Hands a filled block to whichever thread takes it; keeps it if the queue is full.
  void hand_off(const Block& b) {
    if (!check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return;
    if (!shared_.push(b)) mine_.push_back(b);
  }

  // A block another thread filled: read it on this stream, record this stream, free it on
  // the stream it was allocated on (torch's record_stream pattern).
  void free_handed_over(const Block& b) {
    queue_read_back(b);
    const Result recorded = shared_.pool().record_stream(b.ptr, stream_);
    if (!recorded.ok) shared_.fail("record_stream refused a live block: " + recorded.message);
    shared_.unregister_block(b);
    free(b, b.stream);
    shared_.handoffs.fetch_add(1);
  }

  void free(const Block& b, cudaStream_t stream) {
    const Result r = shared_.pool().deallocate(b.ptr, stream);
    if (!r.ok) {
      shared_.fail("deallocate refused a live block: " + r.message);
      return;
    }
    shared_.frees.fetch_add(1);
  }

  Shared& shared_;
  const int index_;
  const cudaStream_t stream_;
  std::mt19937_64 rng_;
  PinnedBuffer staging_;
  std::vector<Block> mine_;
  Block deferred_;
  bool has_deferred_ = false;
  unsigned fills_ = 0;
};

// Runs the workers (and, with `concurrent_empty_cache`, a thread that empties the cache
// and checks stats() while they work), then checks the totals.
void run_stress(uint64_t limit, bool concurrent_empty_cache) {
  ASSERT_CUDA_OK(cudaSetDevice(0));
  DevicePool pool(PoolOptions{0, limit});
  Shared shared(pool);
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < kThreads; ++i) {
    streams.push_back(std::make_unique<Stream>());
    ASSERT_CUDA_OK(streams.back()->status());
  }

  std::atomic<bool> done{false};
  std::atomic<uint64_t> empties{0};
  std::thread emptier;
  if (concurrent_empty_cache) {
    emptier = std::thread([&] {
      while (!done.load()) {
        pool.empty_cache();
        empties.fetch_add(1);
        const PoolStats s = pool.stats();
        if (s.allocated_bytes > s.reserved_bytes || s.reserved_bytes > s.limit_bytes ||
            s.peak_allocated_bytes < s.allocated_bytes ||
            s.peak_reserved_bytes < s.reserved_bytes || s.reserved_bytes % granularity() != 0) {
          std::ostringstream what;
          what << "inconsistent stats() reading: ";
          vramswap::pool::PrintTo(s, &what);
          shared.fail(what.str());
        }
        std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
    });
  }
  {
    std::vector<std::unique_ptr<Worker>> workers;
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      workers.push_back(std::make_unique<Worker>(shared, i, streams[i]->get()));
    }
    for (int i = 0; i < kThreads; ++i) threads.emplace_back([&, i] { workers[i]->run(); });
    for (std::thread& t : threads) t.join();
  }
  done.store(true);
  if (emptier.joinable()) emptier.join();

  // Blocks still in the queue: check and free them here.
  Block b;
  while (shared.pop(&b)) {
    EXPECT_TRUE(holds_byte(b.ptr, b.size, b.byte));
    shared.unregister_block(b);
    const Result r = pool.deallocate(b.ptr, b.stream);
    EXPECT_TRUE(r.ok) << r.message;
    if (r.ok) shared.frees.fetch_add(1);
  }
  ASSERT_CUDA_OK(cudaDeviceSynchronize());

  for (const std::string& f : shared.failures()) ADD_FAILURE() << f;
  ASSERT_FALSE(shared.failed());

  const PoolStats s = pool.stats();
  EXPECT_EQ(0u, s.allocated_bytes);
  EXPECT_EQ(shared.allocs.load(), s.num_allocs);
  EXPECT_EQ(shared.frees.load(), s.num_frees);
  EXPECT_EQ(shared.ooms.load(), s.num_ooms);
  EXPECT_LE(s.peak_reserved_bytes, s.limit_bytes);
  EXPECT_GT(shared.handoffs.load(), 0u) << "the case did not exercise cross-thread frees";
  if (limit == 0) {
    EXPECT_EQ(0u, shared.ooms.load()) << "an unlimited pool refused requests";
  }
  if (concurrent_empty_cache) {
    EXPECT_GT(empties.load(), 0u);
  }

  // Every stream is idle: nothing is live or pending, so nothing needs to stay mapped.
  pool.empty_cache();
  EXPECT_EQ(0u, pool.stats().reserved_bytes);
  if (const auto sim = sim_counters()) {
    EXPECT_EQ(0u, sim->physical_bytes);
  }

  ::testing::Test::RecordProperty("allocations", std::to_string(shared.allocs.load()));
  ::testing::Test::RecordProperty("handoffs", std::to_string(shared.handoffs.load()));
  ::testing::Test::RecordProperty("out_of_memory", std::to_string(shared.ooms.load()));
}

TEST(Stress, FourThreadsWithCrossThreadFrees) { run_stress(0, false); }

TEST(Stress, FourThreadsUnderALimit) { run_stress(40 * kMiB, false); }

TEST(Stress, FourThreadsWithConcurrentEmptyCache) { run_stress(0, true); }

}  // namespace
}  // namespace pool_test
