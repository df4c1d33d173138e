// DevicePool's stream-ordered reuse (Note [The pool], PyTorch's rules): a block freed on
// stream S is reused at once on S; another stream gets it only after S's work queued
// before the free has completed; record_stream() adds streams whose work must complete
// first, even for S itself. At the limit the pool waits for such blocks before failing,
// and no memory loses its pages while queued work still uses it.
//
// "Work still queued" is made real with a StreamGate: a host function that holds the
// stream until the case opens it. Blocks are one granule, so that a block and its
// replacement cannot share a granule and the addresses say exactly which was reused.
// These cases also run under CUDASIM_CHAOS (tests/pool/CMakeLists.txt).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "pool_test_util.h"

namespace pool_test {
namespace {

class StreamOrder : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    ASSERT_CUDA_OK(b_.status());
    ASSERT_CUDA_OK(c_.status());
    g_ = granularity();
  }

  static bool disjoint(const void* p, const void* q, size_t size) {
    return address(p) + size <= address(q) || address(q) + size <= address(p);
  }

  Stream& a_ = stream_;  // the stream blocks are allocated and freed on
  Stream b_;
  Stream c_;
  size_t g_ = 0;
};

TEST_F(StreamOrder, AFreedBlockIsReusedAtOnceOnItsStreamThoughWorkIsQueued) {
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(a_));
  ASSERT_TRUE(gate.wait_entered());
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0x11, g_, a_));
  deallocate(p, a_);

  LetGoLater let_go(gate, kHangTimeout);
  void* q = allocate(g_, a_);
  EXPECT_EQ(p, q) << "stream order makes the reuse safe: nothing to wait for";
  EXPECT_FALSE(let_go.fired()) << "the allocation waited for the stream's work";
  EXPECT_EQ(1u, stats().num_cache_hits);
  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(a_));
  deallocate(q, a_);
}

TEST_F(StreamOrder, AnotherStreamDoesNotGetABlockWhileItsStreamIsBusy) {
  PinnedBuffer seen(g_);
  ASSERT_CUDA_OK(seen.status());
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(a_));
  ASSERT_TRUE(gate.wait_entered());
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  // Queued behind the gate: write the block, then read it back.
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0xa1, g_, a_));
  ASSERT_CUDA_OK(cudaMemcpyAsync(seen.get(), p, g_, cudaMemcpyDeviceToHost, a_));
  deallocate(p, a_);

  LetGoLater let_go(gate, kHangTimeout);
  void* q = allocate(g_, b_);
  ASSERT_NE(nullptr, q);
  EXPECT_NE(p, q) << "stream B got the block while stream A's work on it is queued";
  EXPECT_TRUE(disjoint(p, q, g_));
  EXPECT_FALSE(let_go.fired()) << "below the limit the pool maps more instead of waiting";
  ASSERT_CUDA_OK(cudaMemsetAsync(q, 0xb2, g_, b_));
  ASSERT_CUDA_OK(wait_for_stream(b_));

  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(a_));
  EXPECT_EQ(g_, first_mismatch(seen.get(), g_, 0xa1)) << "A's read saw another stream's write";
  EXPECT_TRUE(holds_byte(q, g_, 0xb2));
  deallocate(q, b_);
}

// deallocate_to_any (the eviction engine's free of tagged, offloadable blocks): the freeing
// stream reuses the block at once, though the host has not seen its work complete (a host
// runs ahead of the GPU); other streams get it once the event recorded at the free has
// completed, without a device synchronization.
TEST_F(StreamOrder, ToAnyIsReusedAtOnceOnItsStreamAndByOthersAfterItsEvent) {
  // Under a limit: the pool then looks at promotions on every allocation (see the next case).
  pool_ = std::make_unique<DevicePool>(PoolOptions{0, 512 * kMiB});
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(a_));
  ASSERT_TRUE(gate.wait_entered());
  std::string error;
  void* p = pool_->allocate_offloadable(g_, a_, &error);
  ASSERT_NE(nullptr, p) << error;
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0x11, g_, a_));
  ASSERT_TRUE(pool_->deallocate_to_any(p, a_).ok);
  void* q = pool_->allocate_offloadable(g_, a_, &error);
  EXPECT_EQ(p, q) << "the freeing stream waited for its own work";
  ASSERT_TRUE(pool_->deallocate_to_any(q, a_).ok);
  void* r = pool_->allocate_offloadable(g_, b_, &error);
  ASSERT_NE(nullptr, r) << error;
  EXPECT_TRUE(disjoint(p, r, g_)) << "stream B got the block while A's work on it is queued";
  gate.open();
  ASSERT_CUDA_OK(wait_for_stream(a_));
  void* t = pool_->allocate_offloadable(g_, c_, &error);
  EXPECT_EQ(p, t) << "the event completed: any stream may reuse the block";
  ASSERT_TRUE(pool_->deallocate_to_any(r, b_).ok);
  ASSERT_TRUE(pool_->deallocate_to_any(t, c_).ok);
}

// With no limit and no pressure, whether a block freed to any stream has become usable by
// others by the time of the next allocation depends on how far the GPU got; placement must
// not (the same script would peak differently from run to run): allocations do not look at
// promotions then, and another stream gets fresh memory even once the event completed.
TEST_F(StreamOrder, WithNoPressureAnotherStreamsAllocationDoesNotDependOnAFreesEvent) {
  std::string error;
  void* p = pool_->allocate_offloadable(g_, a_, &error);
  ASSERT_NE(nullptr, p) << error;
  ASSERT_TRUE(pool_->deallocate_to_any(p, a_).ok);
  ASSERT_CUDA_OK(wait_for_stream(a_));  // the free's event has completed
  void* t = pool_->allocate_offloadable(g_, c_, &error);
  ASSERT_NE(nullptr, t) << error;
  EXPECT_TRUE(disjoint(p, t, g_)) << "placement followed the event's completion";
  void* q = pool_->allocate_offloadable(g_, a_, &error);
  EXPECT_EQ(p, q) << "the freeing stream reuses it at once, as always";
  ASSERT_TRUE(pool_->deallocate_to_any(q, a_).ok);
  ASSERT_TRUE(pool_->deallocate_to_any(t, c_).ok);
  pool_->empty_cache();  // synchronizes: every block is any stream's again
  void* u = pool_->allocate_offloadable(g_, c_, &error);
  ASSERT_NE(nullptr, u) << error;
  ASSERT_TRUE(pool_->deallocate_to_any(u, c_).ok);
  EXPECT_EQ("", pool_->check_invariants());
}

// A block freed to any stream that merges with a neighbour freed later on the same stream
// is not handed to other streams when the first free's event completes: the neighbour's
// work, queued after that event, may still run.
TEST_F(StreamOrder, ToAnyIsNotPromotedWhileAMergedNeighbourIsBusy) {
  // Under a limit: with no pressure a free to any stream is a plain free (nothing promoted).
  pool_ = std::make_unique<DevicePool>(PoolOptions{0, 512 * kMiB});
  std::string error;
  void* both = pool_->allocate_offloadable(2 * g_, a_, &error);
  ASSERT_NE(nullptr, both) << error;
  ASSERT_TRUE(pool_->deallocate_to_any(both, a_).ok);
  ASSERT_CUDA_OK(wait_for_stream(a_));
  // Two adjacent one-granule blocks out of the freed range (best fit: the range itself).
  void* p = pool_->allocate_offloadable(g_, a_, &error);
  void* q = pool_->allocate_offloadable(g_, a_, &error);
  ASSERT_NE(nullptr, p);
  ASSERT_NE(nullptr, q);
  ASSERT_EQ(address(p) + g_, address(q)) << "the case needs adjacent blocks";
  ASSERT_TRUE(pool_->deallocate_to_any(p, a_).ok);
  ASSERT_CUDA_OK(wait_for_stream(a_));  // the event of p's free has completed
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(a_));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(cudaMemsetAsync(q, 0x22, g_, a_));  // queued work on q
  deallocate(q, a_);  // an ordinary free: merges with p's free block on stream A
  void* r = pool_->allocate_offloadable(2 * g_, b_, &error);
  ASSERT_NE(nullptr, r) << error;
  EXPECT_TRUE(disjoint(p, r, 2 * g_)) << "stream B got the merged block while A's work on q is queued";
  gate.open();
  ASSERT_CUDA_OK(wait_for_stream(a_));
  ASSERT_TRUE(pool_->deallocate_to_any(r, b_).ok);
}

// A pool of two granules: once A's block and B's first block are mapped, B's next request
// can be met only with A's block, so the pool must hand it over once A's work is done.
class StreamOrderAtTwoGranules : public StreamOrder {
 protected:
  uint64_t limit() const override { return 2 * granularity(); }
};

TEST_F(StreamOrderAtTwoGranules, AnotherStreamGetsTheBlockOnceItsStreamIsIdle) {
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(a_));
  ASSERT_TRUE(gate.wait_entered());
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0xa1, g_, a_));
  deallocate(p, a_);

  LetGoLater let_go(gate, kHangTimeout);
  void* q = allocate(g_, b_);
  ASSERT_NE(nullptr, q);
  EXPECT_NE(p, q) << "stream B got the block while stream A's work on it is queued";
  EXPECT_FALSE(let_go.fired()) << "within the limit the pool maps more instead of waiting";

  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(a_));
  std::string error;
  void* r = pool().allocate(g_, b_, &error);
  EXPECT_EQ(p, r) << "after A drained, B's request is met with A's block; " << error;
  EXPECT_EQ(0u, stats().num_ooms);
  EXPECT_LE(stats().peak_reserved_bytes, 2 * g_);
  deallocate(q, b_);
  if (r != nullptr) deallocate(r, b_);
}

TEST_F(StreamOrder, ABlockFreedOnAnotherStreamIsReusedThereOnceBothAreIdle) {
  // deallocate(ptr, stream) frees "for reuse in stream's order". Whether the work the
  // allocating stream queued before the free is waited for is the pool's choice (this
  // pool waits for it, as if record_stream had named that stream); once both streams are
  // idle, the block is reused on the freeing stream.
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  deallocate(p, b_);
  ASSERT_CUDA_OK(wait_for_stream(a_));
  ASSERT_CUDA_OK(wait_for_stream(b_));
  void* q = allocate(g_, b_);
  EXPECT_EQ(p, q);
  if (q != nullptr) deallocate(q, b_);
}

TEST_F(StreamOrder, RecordStreamHoldsTheBlockBackEvenOnItsOwnStream) {
  PinnedBuffer seen(g_);
  ASSERT_CUDA_OK(seen.status());
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0x5c, g_, a_));
  ASSERT_CUDA_OK(wait_for_stream(a_));

  // Stream B reads the block after a gate; the block is freed on A meanwhile.
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(b_));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(cudaMemcpyAsync(seen.get(), p, g_, cudaMemcpyDeviceToHost, b_));
  const Result recorded = pool().record_stream(p, b_);
  ASSERT_TRUE(recorded.ok) << recorded.message;
  deallocate(p, a_);

  LetGoLater let_go(gate, kHangTimeout);
  void* q = allocate(g_, a_);
  ASSERT_NE(nullptr, q);
  EXPECT_NE(p, q) << "reused on A while B's read of it is still queued";
  EXPECT_TRUE(disjoint(p, q, g_));
  ASSERT_CUDA_OK(cudaMemsetAsync(q, 0x77, g_, a_));
  ASSERT_CUDA_OK(wait_for_stream(a_));
  EXPECT_FALSE(let_go.fired()) << "below the limit the pool maps more instead of waiting";

  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(b_));
  EXPECT_EQ(g_, first_mismatch(seen.get(), g_, 0x5c)) << "B read the block after its reuse";

  void* r = allocate(g_, a_);
  EXPECT_EQ(p, r) << "once B's work completed, the block is reusable";
  deallocate(q, a_);
  if (r != nullptr) deallocate(r, a_);
}

TEST_F(StreamOrder, RecordStreamWaitsForEveryRecordedStream) {
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  StreamGate gate_b;
  StreamGate gate_c;
  ASSERT_CUDA_OK(gate_b.hold(b_));
  ASSERT_CUDA_OK(gate_c.hold(c_));
  ASSERT_TRUE(pool().record_stream(p, b_).ok);
  ASSERT_TRUE(pool().record_stream(p, c_).ok);
  deallocate(p, a_);

  gate_b.open();
  ASSERT_CUDA_OK(wait_for_stream(b_));
  LetGoLater let_go(gate_c, kHangTimeout);
  void* q = allocate(g_, a_);
  ASSERT_NE(nullptr, q);
  EXPECT_NE(p, q) << "reused while stream C still had work queued before the free";
  EXPECT_FALSE(let_go.fired()) << "below the limit the pool maps more instead of waiting";

  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(c_));
  void* r = allocate(g_, a_);
  EXPECT_EQ(p, r);
  deallocate(q, a_);
  if (r != nullptr) deallocate(r, a_);
}

TEST_F(StreamOrder, ARecordedBlockIsReleasedByTheFirstAllocationAfterItsEvent) {
  // The event recorded on B at the free completes once B is synchronized; pending events
  // are polled at the start of an allocation, so the very next one may reuse the block.
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_TRUE(pool().record_stream(p, b_).ok);
  deallocate(p, a_);
  ASSERT_CUDA_OK(wait_for_stream(b_));
  void* q = allocate(g_, a_);
  EXPECT_EQ(p, q);
  if (q != nullptr) deallocate(q, a_);
}

TEST_F(StreamOrder, RecordingTheAllocatingStreamIsHarmless) {
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_TRUE(pool().record_stream(p, a_).ok);
  deallocate(p, a_);
  ASSERT_CUDA_OK(wait_for_stream(a_));
  void* q = allocate(g_, a_);
  EXPECT_EQ(p, q);
  if (q != nullptr) deallocate(q, a_);
}

TEST_F(StreamOrder, AtTheLimitAHeldBackBlockIsAwaitedInsteadOfFailing) {
  // A one-granule pool whose only block is held back by queued work on B: a request on A
  // must wait for B's event (the lock released) rather than report out of memory.
  DevicePool limited(PoolOptions{0, g_});
  std::string error;
  void* p = limited.allocate(g_, a_, &error);
  ASSERT_NE(nullptr, p) << error;
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(b_));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_TRUE(limited.record_stream(p, b_).ok);
  ASSERT_TRUE(limited.deallocate(p, a_).ok);

  LetGoLater let_go(gate, kLetGoDelay);
  void* q = limited.allocate(g_, a_, &error);
  let_go.finish();
  EXPECT_NE(nullptr, q) << "failed instead of waiting for the pending block: " << error;
  EXPECT_EQ(0u, limited.stats().num_ooms);
  EXPECT_LE(limited.stats().peak_reserved_bytes, g_);
  ASSERT_CUDA_OK(wait_for_stream(b_));
  if (q != nullptr) {
    EXPECT_TRUE(limited.deallocate(q, a_).ok);
  }
}

TEST_F(StreamOrder, AtTheLimitOnlyTheHeldBackBlocksNeededAreAwaited) {
  // A two-granule pool whose blocks are both held back: p by queued work on B, q by queued
  // work on C. A request for one granule waits for p's event (B goes on) and must not also
  // wait for q's (C stays held until the case ends). Waiting for every pending free at once,
  // an engine's fetch waited for a block whose copy to the host ended 10 ms later than the
  // one it needed.
  DevicePool limited(PoolOptions{0, 2 * g_});
  std::string error;
  void* p = limited.allocate(g_, a_, &error);
  ASSERT_NE(nullptr, p) << error;
  void* q = limited.allocate(g_, a_, &error);
  ASSERT_NE(nullptr, q) << error;
  StreamGate first, second;
  LetGoLater watchdog(second, kHangTimeout);
  ASSERT_CUDA_OK(first.hold(b_));
  ASSERT_CUDA_OK(second.hold(c_));
  ASSERT_TRUE(limited.record_stream(p, b_).ok);
  ASSERT_TRUE(limited.record_stream(q, c_).ok);
  ASSERT_TRUE(limited.deallocate(p, a_).ok);
  ASSERT_TRUE(limited.deallocate(q, a_).ok);

  LetGoLater let_go(first, kLetGoDelay);
  void* r = limited.allocate(g_, a_, &error);
  let_go.finish();
  EXPECT_NE(nullptr, r) << error;
  EXPECT_FALSE(watchdog.fired()) << "the request waited for q's event too";
  EXPECT_EQ(p, r) << "p's memory, the block that became free";
  watchdog.finish();
  ASSERT_CUDA_OK(wait_for_stream(b_));
  ASSERT_CUDA_OK(wait_for_stream(c_));
  if (r != nullptr) {
    EXPECT_TRUE(limited.deallocate(r, a_).ok);
  }
}

TEST_F(StreamOrder, EmptyCacheNeverUnmapsMemoryThatQueuedWorkUses) {
  // A block freed on A while A's work on it is queued: empty_cache() may wait for that
  // work or leave the block's granules mapped, but must not unmap them under it (on
  // cudasim that work would fault and kill the process).
  SKIP_UNLESS_CUDASIM();
  const size_t size = 2 * g_;
  PinnedBuffer seen(size);
  ASSERT_CUDA_OK(seen.status());
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(a_));
  ASSERT_TRUE(gate.wait_entered());
  void* p = allocate(size, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0x3e, size, a_));
  ASSERT_CUDA_OK(cudaMemcpyAsync(seen.get(), p, size, cudaMemcpyDeviceToHost, a_));
  deallocate(p, a_);

  LetGoLater let_go(gate, kLetGoDelay);
  pool().empty_cache();
  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(a_));
  EXPECT_EQ(size, first_mismatch(seen.get(), size, 0x3e));

  pool().empty_cache();
  EXPECT_EQ(0u, stats().reserved_bytes) << "with the work done, nothing needs the pages";
  EXPECT_EQ(0u, sim_counters()->physical_bytes);
}

TEST_F(StreamOrder, EmptyCacheKeepsAHeldBackBlockUntilItsStreamsFinish) {
  SKIP_UNLESS_CUDASIM();
  PinnedBuffer seen(g_);
  ASSERT_CUDA_OK(seen.status());
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0x6b, g_, a_));
  ASSERT_CUDA_OK(wait_for_stream(a_));
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(b_));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_CUDA_OK(cudaMemcpyAsync(seen.get(), p, g_, cudaMemcpyDeviceToHost, b_));
  ASSERT_TRUE(pool().record_stream(p, b_).ok);
  deallocate(p, a_);

  LetGoLater let_go(gate, kLetGoDelay);
  pool().empty_cache();
  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(b_));
  EXPECT_EQ(g_, first_mismatch(seen.get(), g_, 0x6b));

  pool().empty_cache();
  EXPECT_EQ(0u, stats().reserved_bytes) << "B finished; the block is no longer pending";
  EXPECT_EQ(0u, sim_counters()->physical_bytes);
}

// Under the preload, which reports every stream before it is destroyed
// (PoolOptions::streams_reported), empty_cache and the pressure steps synchronize each stream
// that cached blocks are tagged with, one by one, instead of the device: a tag naming a
// destroyed stream is then a CUDA call on a destroyed handle (cudasim stops the program; on a
// GPU the driver may crash, or a new stream created at that address reuses the block with no
// ordering).
class StreamOrderStreamsReported : public StreamOrder {
 protected:
  bool streams_reported() const override { return true; }

  // The blocks whose view names `stream` (live: allocated on it; free: reusable only by it).
  std::vector<uintptr_t> blocks_naming(cudaStream_t stream) const {
    std::vector<uintptr_t> naming;
    for (const DevicePool::BlockView& b : pool_->memory_view().blocks)
      if (b.stream == address(stream)) naming.push_back(b.addr);
    return naming;
  }
};

// N3: a block allocated on A and freed on S waits for an event on A, then becomes free for S.
// S is destroyed (stream_destroyed first, as the preload's cudaStreamDestroy calls it) once
// A's event has completed: stream_destroyed synchronized S and polled the pending frees, and
// the block became free for S and kept that tag; empty_cache then synchronized S, destroyed
// by then. (In the attack report A's event completed in that window in 4 runs of 5; here
// A's work is awaited first, so every run takes that path.)
TEST_F(StreamOrderStreamsReported, AFreeWaitingForAnotherStreamNeverNamesItsDestroyedStream) {
  auto freeing = std::make_unique<Stream>();
  ASSERT_CUDA_OK(freeing->status());
  const cudaStream_t s = *freeing;
  void* p = allocate(g_, a_);
  ASSERT_NE(nullptr, p);
  ASSERT_CUDA_OK(cudaMemsetAsync(p, 0x4e, g_, a_));
  deallocate(p, s);  // pending behind an event on A, then free for S
  ASSERT_CUDA_OK(wait_for_stream(a_));
  const Result destroyed = pool().stream_destroyed(s);
  ASSERT_TRUE(destroyed.ok) << destroyed.message;
  // Asserted before the stream goes: with a block still tagged for it, empty_cache below would
  // stop the process.
  ASSERT_EQ(std::vector<uintptr_t>{}, blocks_naming(s)) << "a block still names the destroyed stream";
  freeing.reset();  // the program destroys it

  pool().empty_cache();
  EXPECT_EQ(0u, stats().reserved_bytes) << "the block is free for every stream: nothing keeps its pages";
  void* q = allocate(g_, b_);
  EXPECT_NE(nullptr, q);
  if (q != nullptr) deallocate(q, b_);
}

// Another thread's synchronization holds the free blocks of the streams it waits for out of the
// free index until it ends (synchronize_and_retire: here empty_cache, waiting for A's queued
// work). An allocation that needs them meanwhile waits for that synchronization to end
// instead of reporting an out-of-memory with the memory "reserved but free". (Four threads
// that destroyed their streams as they ended ran out of memory so at a 128 MiB limit with
// ~100 MiB reserved but free, 6 runs of 20.)
TEST_F(StreamOrderStreamsReported, AnAllocationWaitsForBlocksAnotherThreadsSynchronizationHolds) {
  DevicePool limited(PoolOptions{0, 2 * g_, true});
  std::string error;
  void* p = limited.allocate(g_, a_, &error);
  ASSERT_NE(nullptr, p) << error;
  void* q = limited.allocate(g_, a_, &error);
  ASSERT_NE(nullptr, q) << error;
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(a_));
  ASSERT_TRUE(gate.wait_entered());
  ASSERT_TRUE(limited.deallocate(p, a_).ok);  // free for A at once; A's work is queued
  ASSERT_TRUE(limited.deallocate(q, a_).ok);
  std::thread emptying([&] { limited.empty_cache(); });  // waits for A, holding both blocks
  auto held = [&] {
    for (const DevicePool::BlockView& b : limited.memory_view().blocks)
      if (b.state == DevicePool::BlockView::State::kPendingFree) return true;
    return false;
  };
  const auto deadline = std::chrono::steady_clock::now() + kHangTimeout;
  while (!held() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  ASSERT_TRUE(held()) << "empty_cache never took the blocks out of the free index";

  LetGoLater let_go(gate, kLetGoDelay);
  void* r = limited.allocate(g_, b_, &error);
  let_go.finish();
  emptying.join();
  EXPECT_NE(nullptr, r) << "failed while another thread's synchronization held the memory: " << error;
  EXPECT_EQ(0u, limited.stats().num_ooms);
  if (r != nullptr) {
    EXPECT_TRUE(limited.deallocate(r, b_).ok);
  }
}

// The same with the destroyed stream on the other side: a block allocated on S and named by
// record_stream for B, freed on A, waits for events on S and B. Once S is destroyed, neither
// the pending block nor the free block it becomes may name S.
TEST_F(StreamOrderStreamsReported, APendingBlockAllocatedOnADestroyedStreamNamesItNoMore) {
  auto allocating = std::make_unique<Stream>();
  ASSERT_CUDA_OK(allocating->status());
  const cudaStream_t s = *allocating;
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(b_));  // B's event stays incomplete: the block stays pending
  ASSERT_TRUE(gate.wait_entered());
  LetGoLater let_go(gate, kHangTimeout);
  void* p = allocate(g_, s);
  ASSERT_NE(nullptr, p);
  ASSERT_TRUE(pool().record_stream(p, b_).ok);
  deallocate(p, a_);
  const Result destroyed = pool().stream_destroyed(s);
  ASSERT_TRUE(destroyed.ok) << destroyed.message;
  ASSERT_EQ(std::vector<uintptr_t>{}, blocks_naming(s)) << "the pending block still names the destroyed stream";
  allocating.reset();

  let_go.finish();
  ASSERT_CUDA_OK(wait_for_stream(b_));
  pool().empty_cache();
  EXPECT_EQ(std::vector<uintptr_t>{}, blocks_naming(s));
  EXPECT_EQ(0u, stats().reserved_bytes);
}

}  // namespace
}  // namespace pool_test
