// A copy the engine queued cannot be taken back (Note [A queued copy cannot be taken back]
// in src/residency/engine_copies.cpp): when a call after it fails (the record of its event),
// the copy still runs whenever its stream reaches it, so the block's pages and its host
// buffer stay in use by it. These cases fail the record of an eviction's event with cudasim's
// fault injection, hold the copy behind a gate, and free the block: its memory must not be
// given out again, nor unmapped, before the copy has read it. Reproductions of N4, which the
// fault-injected stress test found: "cudasim: illegal address ... during memcpy DtoH" (the
// pool had unmapped a freed block's pages while the eviction copy queued before the failed
// record still had to read them).
//
// The copy is held without knowing the engine's streams: it waits for the block's cold
// event, and the block is marked cold on a stream of the case's own that a gate holds (the
// program's last use of the block is over; that stream merely has other work queued first).
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/cuda_test_util.h"
#include "cudasim.h"
#include "engine_test_util.h"

namespace engine_test {
namespace {

constexpr std::chrono::milliseconds kHangTimeout{10000};

class QueuedCopy : public EngineFixture {
 protected:
  void SetUp() override {
    configure_ = reinterpret_cast<decltype(configure_)>(dlsym(RTLD_DEFAULT, "cudasim_fail_configure"));
    injected_ = reinterpret_cast<decltype(injected_)>(dlsym(RTLD_DEFAULT, "cudasim_failures_injected"));
    counters_ = reinterpret_cast<decltype(counters_)>(dlsym(RTLD_DEFAULT, "cudasim_get_counters"));
    if (!configure_ || !injected_ || !counters_) GTEST_SKIP() << "needs cudasim's fault injection";
  }
  void TearDown() override {
    if (configure_) configure_(nullptr);
    if (late_) {
      gate_.open();
      cudaStreamSynchronize(late_);
    }
    EngineFixture::TearDown();
    if (late_) cudaStreamDestroy(late_);
  }
  // Fails CUDA calls by cudasim's rules from now on ("" clears them).
  void fail(const char* spec) { ASSERT_EQ(0, configure_(spec)) << spec; }
  uint64_t bytes_d2h() {
    cudasim_counters c{};
    counters_(0, &c);
    return c.bytes_d2h;
  }
  ::testing::AssertionResult consistent() {
    const std::string broken = pool_->check_invariants() + engine_->check_invariants();
    if (broken.empty()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << broken;
  }

  // A pool of `limit` bytes whose engine copies a cold block out as soon as it is marked
  // cold (soft watermark 2 MiB); no plan, so that the only events the engine records in
  // mark_cold are the cold mark's and the copy's.
  void start_evicting_at_once(uint64_t limit) {
    EngineOptions options;
    options.soft_limit_bytes = 2 * kMiB;
    options.horizon = 0;
    options.plan = false;
    start(limit, options);
    ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&late_, cudaStreamNonBlocking));
  }

  // Block `a` (seed 1), packed; then `neighbour` blocks in use after it (seeds 2...).
  void save(void** a, uint64_t* handle, void** neighbour = nullptr) {
    engine_->graph_begin();
    *a = tagged(1);
    ASSERT_NE(nullptr, *a);
    *handle = engine_->pack(*a, stream_);
    ASSERT_NE(0u, *handle);
    if (neighbour) {
      *neighbour = tagged(2);
      ASSERT_NE(nullptr, *neighbour);
    }
  }
  // Marks the saved block cold on late_ behind the gate: the soft watermark starts its copy
  // out at once, queued behind the cold mark, and the record of the copy's event fails. The
  // copy stays queued (the gate holds it); the block is resident as before. The case's next
  // call must free it: another engine call would start its eviction again, with a copy that
  // does record its event (and orders what comes after both).
  void mark_cold_with_a_failed_eviction(uint64_t handle) {
    ASSERT_CUDA_OK(gate_.hold(late_));
    const uint64_t injected = injected_();
    fail("cudaEventRecord:2");  // 1: the cold mark's event; 2: the copy out's
    const auto cold = engine_->mark_cold(handle, late_);
    fail("");
    ASSERT_TRUE(cold.ok) << cold.message;
    ASSERT_EQ(injected + 1, injected_()) << "the copy out's event was not the one that failed";
    EXPECT_EQ(0u, stats().in_flight_bytes) << "a failed eviction counts as in flight";
    EXPECT_TRUE(consistent());
  }

  // Opens the gate and waits for everything; the copy out that was queued has run.
  void let_the_copy_run(uint64_t d2h_before) {
    gate_.open();
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(d2h_before + kBlock, bytes_d2h()) << "the copy out was never queued: the case tests nothing";
  }

  // The death test's statement: frees `a` and runs memory short, so that the pool must unmap
  // a's pages to find room (8 MiB where 4 MiB of the 12 MiB limit are c's, placed right after
  // a, and 4 MiB cached in a's place); then the copy runs. Exits 0 when everything held.
  void free_and_run_short_then_copy(void* a, void* c, uint64_t d2h_before) {
    ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
    // The gate opens after a while, as a slow copy stream would let the copy go on, for an
    // allocation that rightly waits for it.
    cuda_test::GateTimer opens_later(gate_, std::chrono::milliseconds(300), cuda_test::GateTimer::OnStop::kOpen);
    std::string error;
    void* big = pool_->allocate(2 * kBlock, stream_, &error);
    ASSERT_NE(nullptr, big) << error;
    let_the_copy_run(d2h_before);
    opens_later.stop();
    ASSERT_TRUE(pool_->deallocate(big, stream_).ok);
    ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    if (!HasFailure()) std::_Exit(0);
  }

  int (*configure_)(const char*) = nullptr;
  uint64_t (*injected_)() = nullptr;
  int (*counters_)(int, cudasim_counters*) = nullptr;
  cudaStream_t late_ = nullptr;
  cuda_test::StreamGate gate_{kHangTimeout};
};

// The block freed on the stream it was allocated on is reusable at once by that stream, as
// far as the program's work goes; but the copy out queued before the failed record still
// reads it, so the pool must hold it back until the copy stream has passed that copy.
TEST_F(QueuedCopy, ABlockWhoseEvictionFailedAfterItsCopyWasQueuedIsNotReusedBeforeTheCopyRan) {
  start_evicting_at_once(64 * kMiB);
  void* a = nullptr;
  uint64_t h = 0;
  save(&a, &h);
  if (HasFatalFailure()) return;
  const uint64_t d2h_before = bytes_d2h();
  mark_cold_with_a_failed_eviction(h);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  std::string error;
  void* b = engine_->allocate_tagged(kBlock, stream_, &error);
  ASSERT_NE(nullptr, b) << error;
  const auto at = [](void* p) { return reinterpret_cast<uintptr_t>(p); };
  EXPECT_FALSE(at(b) < at(a) + kBlock && at(a) < at(b) + kBlock)
      << "the freed block's memory was given out again while the copy out queued before the failed record "
         "still had to read it";
  let_the_copy_run(d2h_before);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(consistent());
  EXPECT_EQ(0u, stats().tagged_bytes);
  EXPECT_EQ(0u, stats().host_bytes) << "the failed eviction's pinned buffer did not go back";
}

// The stress test's crash itself: the block is freed and memory runs short, the pool unmaps
// the freed block's pages, and the copy out queued before the failed record reads unmapped
// memory when its stream reaches it (cudasim stops the process with an illegal address, as a
// GPU would raise one). The pages must go back to the pool only after the copy: the
// allocation waits for it, and the process lives.
TEST_F(QueuedCopy, ABlockWhoseEvictionFailedAfterItsCopyWasQueuedKeepsItsPagesUntilTheCopyRan) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  start_evicting_at_once(12 * kMiB);
  void* a = nullptr;
  void* c = nullptr;  // in use, placed after a
  uint64_t h = 0;
  save(&a, &h, &c);
  if (HasFatalFailure()) return;
  ASSERT_EQ(reinterpret_cast<uintptr_t>(a) + kBlock, reinterpret_cast<uintptr_t>(c));
  const uint64_t d2h_before = bytes_d2h();
  mark_cold_with_a_failed_eviction(h);
  if (HasFatalFailure()) return;
  EXPECT_EXIT(free_and_run_short_then_copy(a, c, d2h_before), ::testing::ExitedWithCode(0), "");
  // This process only watched: its copy is still held, and both blocks live.
  gate_.open();
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(consistent());
  EXPECT_EQ(0u, stats().host_bytes) << "the failed eviction's pinned buffer did not go back";
}

}  // namespace
}  // namespace engine_test
