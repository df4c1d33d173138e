// residency::Engine's reclaim (the pool's reclaimer) and fetches the engine has not reaped
// yet. A block whose fetch (prefetch or fault) was still in flight, or had landed but was
// not yet reaped by the engine, is kFetching inside the engine, so choosing victims before
// reaping the copies passed it over even when it was cold, not unpacked and outside the
// prefetch window; waiting for the copies then made it resident and evictable, but the
// reclaim was over: it returned 0 and the allocation failed with a report saying
// "4 MiB evictable" (seen in the second training step's backward of a torch run). These
// cases fail that way when reclaim chooses its victims before the copies are reaped, tries
// only one round, or measures what it freed as the net change of the bytes on the host
// (which landing fetches decrease).
//
// * A fetch that landed but was not reaped: reachable through the public API alone. The
//   engine reaps at the start of most calls (unpack, prefetch, mark_cold, free_tagged,
//   allocate_tagged after its allocation, stats, pressure_report), so the case starts the
//   fetch with the last call before the allocation and lets it land with a device
//   synchronization.
// * A fetch still in flight when the allocation comes: its H2D copy must be held back, and
//   it waits for nothing the caller queues (start_fetch copies on the engine's own H2D
//   stream with no event wait). The engine does not expose that stream, so this file
//   interposes cudaStreamCreateWithPriority (the engine creates its copy streams with it,
//   the H2D one with the greatest priority; nothing else in this executable does) to learn
//   its handle, and holds it with a StreamGate (tests/pool/pool_test_util.h).
// * Evictions in flight: their D2H copies are held the same way. The D2H stream is learned
//   from the copies themselves: cudaMemcpyAsync is interposed too, and the stream of a
//   device-to-host copy queued on a stream other than the case's own is the engine's.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_test_util.h"
#include "engine_test_util.h"
#include "pool/device_pool.h"
#include "pool/pool_test_util.h"
#include "residency/engine.h"

namespace {

// The streams created through cudaStreamCreateWithPriority while `recording` (the engine's
// copy streams), with their priorities.
struct CreatedStreams {
  std::mutex mu;
  bool recording = false;
  std::vector<std::pair<cudaStream_t, int>> streams;
};
CreatedStreams& created_streams() {
  static CreatedStreams c;
  return c;
}

// The stream of the last device-to-host copy queued on a stream other than `own_stream`.
struct CopyStreams {
  std::mutex mu;
  cudaStream_t own_stream = nullptr;
  cudaStream_t d2h = nullptr;
};
CopyStreams& copy_streams() {
  static CopyStreams c;
  return c;
}

}  // namespace

// Interposed for the engine (src/cuda/stream.cpp is linked statically into this executable,
// so its call binds here); forwards to cudasim's libcudart.
cudaError_t CUDARTAPI cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
  using Fn = cudaError_t (*)(cudaStream_t*, unsigned int, int);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "cudaStreamCreateWithPriority"));
  if (real == nullptr) return cudaErrorUnknown;
  const cudaError_t status = real(stream, flags, priority);
  CreatedStreams& c = created_streams();
  std::lock_guard lock(c.mu);
  if (status == cudaSuccess && c.recording) c.streams.emplace_back(*stream, priority);
  return status;
}

// Interposed like cudaStreamCreateWithPriority (src/cuda/stream.cpp's copy_async binds here).
cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                      cudaStream_t stream) {
  using Fn = cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "cudaMemcpyAsync"));
  if (real == nullptr) return cudaErrorUnknown;
  cudaPointerAttributes to{};
  const bool to_host = cudaPointerGetAttributes(&to, dst) == cudaSuccess && to.type != cudaMemoryTypeDevice;
  CopyStreams& c = copy_streams();
  {
    std::lock_guard lock(c.mu);
    if (to_host && stream != c.own_stream) c.d2h = stream;
  }
  return real(dst, src, count, kind, stream);
}

namespace {

using namespace engine_test;
using pool_test::LetGoLater;
using pool_test::StreamGate;

class ReclaimTest : public engine_test::EngineFixture {
 protected:
  // Records the streams the engine creates, to find h2d_: its fetch stream.
  void make_engine(const EngineOptions& options) override {
    CreatedStreams& c = created_streams();
    {
      std::lock_guard lock(c.mu);
      c.streams.clear();
      c.recording = true;
    }
    engine_ = std::make_unique<Engine>(*pool_, options);
    std::lock_guard lock(c.mu);
    c.recording = false;
    // The copy stream with the greatest priority (the lowest number) is the H2D one.
    for (auto& [s, priority] : c.streams) {
      if (h2d_ == nullptr || priority < h2d_priority_) {
        h2d_ = s;
        h2d_priority_ = priority;
      }
    }
  }

  // Starts the engine with two blocks' room (horizon 0, `options` otherwise) and runs a
  // forward that saves a and b (seeds 1 and 2) and goes on with two more blocks, which send
  // both to the host: the case goes on with a and b evicted.
  void start_with_two_evicted(EngineOptions options, Saved* saved) {
    options.horizon = 0;
    start(8 * kMiB, options);
    ASSERT_NE(nullptr, h2d_) << "the engine's H2D stream was not seen being created";
    engine_->graph_begin();
    *saved = save_cold(2, 1);
    void* c = tagged(3);
    ASSERT_NE(nullptr, c);
    void* d = tagged(4);
    ASSERT_NE(nullptr, d);
    ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
    ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    ASSERT_EQ(8 * kMiB, stats().evicted_bytes) << "a and b";
  }

  cudaStream_t h2d_ = nullptr;
  int h2d_priority_ = 0;
};

// Backward is using b; a was evicted and is prefetched; the prefetch lands but no engine
// call reaps it before an allocation needs a block's room. a (cold, not unpacked, nothing
// protected with horizon 0) is the only block that can go: the reclaim must reap the fetch
// and evict a, not report out of memory with a evictable.
TEST_F(ReclaimTest, AFetchThatLandedButWasNotReapedIsAVictim) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);  // two blocks
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = pack_cold(a);
  void* b = tagged(2);
  const uint64_t hb = pack_cold(b);
  void* c = tagged(3);  // evicts a (needed last)
  ASSERT_NE(nullptr, c);
  ASSERT_EQ(1u, stats().num_evictions);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_TRUE(engine_->unpack(hb, stream_).ok);  // backward needs b: in use, not a victim
  ASSERT_TRUE(engine_->prefetch(ha).ok);         // a comes back (the limit is full again)
  // The fetch lands; no engine call reaps it before the allocation below.
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::string error;
  void* d = engine_->allocate_tagged(kBlock, stream_, &error);
  ASSERT_NE(nullptr, d) << "a (cold, not unpacked, outside the window) had landed and could go: " << error;
  EngineStats s = stats();
  EXPECT_EQ(2u, s.num_evictions) << "a again";
  EXPECT_EQ(1u, s.num_prefetches);
  EXPECT_LE(s.resident_bytes, 8 * kMiB);
  // Backward goes on: b is done with, then a is needed (a fault now) and intact.
  EXPECT_TRUE(holds(b, 2));
  ASSERT_TRUE(engine_->release(hb).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
  EXPECT_TRUE(holds(a, 1));
  EXPECT_EQ(1u, stats().num_faults);
  ASSERT_TRUE(engine_->release(ha).ok);
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
}

// The window moves on while a prefetch is in flight: unpack(c) prefetches b (the window of
// 1), then backward needs a before b (an order the prediction missed), so the cursor jumps
// past b. b's fetch, held back on the engine's H2D stream, is still in flight when an
// allocation needs a block's room; b is cold, not unpacked and outside the window: once its
// fetch lands (waited for by the reclaim) it must be evicted in the same reclaim.
TEST_F(ReclaimTest, AFetchStillInFlightWhenTheWindowMovesOnIsAVictimOnceItLands) {
  EngineOptions options;
  options.horizon = 1;
  start(12 * kMiB, options);  // three blocks
  ASSERT_NE(nullptr, h2d_) << "the engine's H2D stream was not seen being created";
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = pack_cold(a);
  void* b = tagged(2);
  const uint64_t hb = pack_cold(b);
  void* c = tagged(3);
  const uint64_t hc = pack_cold(c);
  // Forward goes on: a, then b go to the host (c is the window).
  void* d = tagged(4);
  ASSERT_NE(nullptr, d);
  void* e = tagged(5);
  ASSERT_NE(nullptr, e);
  ASSERT_EQ(2u, stats().num_evictions);
  ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(e, stream_).ok);
  const EngineStats before = stats();
  {
    StreamGate gate;  // opens, at the latest, when the case leaves this scope
    // Only a path that wrongly waits for the held fetch before the allocation gets this
    // far; it then fails below instead of hanging.
    LetGoLater watchdog(gate, pool_test::kHangTimeout);
    ASSERT_CUDA_OK(gate.hold(h2d_));
    ASSERT_TRUE(engine_->unpack(hc, stream_).ok);  // the window is b: its fetch starts, held
    EXPECT_EQ(before.num_prefetches + 1, stats().num_prefetches);  // (reaps nothing: held)
    // Backward needs a now (a fault; there is room): the window moves past b, whose fetch has
    // not landed (held), so this call cannot have reaped it.
    ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
    ASSERT_FALSE(gate.is_open());
    // An allocation of backward: only b can make room (a and c are in use). Its fetch lands
    // while the reclaim waits for the copies.
    LetGoLater let_go(gate, pool_test::kLetGoDelay);
    std::string error;
    void* g = engine_->allocate_tagged(kBlock, stream_, &error);
    ASSERT_NE(nullptr, g) << "b (cold, not unpacked, outside the window) landed during the reclaim and could go: "
                          << error;
    let_go.finish();
    watchdog.finish();
    EXPECT_FALSE(watchdog.fired()) << "something waited for the held fetch before the allocation";
    EngineStats s = stats();
    EXPECT_EQ(3u, s.num_evictions) << "b again";
    EXPECT_LE(s.resident_bytes, 12 * kMiB);
    // a came back intact (its fault fetch was held too); then backward needs b (a fault).
    EXPECT_TRUE(holds(a, 1));
    EXPECT_TRUE(holds(c, 3));
    ASSERT_TRUE(engine_->release(hc).ok);
    ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
    ASSERT_TRUE(engine_->unpack(hb, stream_).ok);
    EXPECT_TRUE(holds(b, 2));
    EXPECT_EQ(before.num_faults + 2, stats().num_faults) << "a, then b";
    ASSERT_TRUE(engine_->release(ha).ok);
    ASSERT_TRUE(engine_->release(hb).ok);
    ASSERT_TRUE(engine_->free_tagged(g, stream_).ok);
  }
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
}

// A block freed while its fetch is still in flight (the host runs ahead of the device:
// backward frees a block whose copy back it has queued work behind, before the copy has
// landed) is reusable once *its* copy lands, not once every copy queued on the fetch stream
// after it has. Ordering the reuse by an event recorded on the fetch stream at the free made
// an allocation wait for the whole fetch queue: on gpt-1.3b-flash at half its peak, the
// planned fetches queued 190 ms of copies ahead, and backward's host waited for all of them
// at an allocation (the step 9% slower than the bound). Here a's fetch is held by one gate,
// b's (queued after it) by a second; a is freed, then its gate opens while an allocation
// needs a's memory: it must not wait for b's gate.
TEST_F(ReclaimTest, ABlockFreedWhileItsFetchIsInFlightIsReusableOnceThatFetchLands) {
  Saved saved;
  ASSERT_NO_FATAL_FAILURE(start_with_two_evicted({}, &saved));
  void* a = saved.blocks[0];
  void* b = saved.blocks[1];
  const uint64_t ha = saved.handles[0], hb = saved.handles[1];
  void* e = nullptr;
  {
    StreamGate first, second;  // open, at the latest, when the case leaves this scope
    LetGoLater watchdog(second, pool_test::kHangTimeout);
    ASSERT_CUDA_OK(first.hold(h2d_));
    ASSERT_TRUE(engine_->prefetch(ha).ok);  // behind the first gate
    ASSERT_CUDA_OK(second.hold(h2d_));
    ASSERT_TRUE(engine_->prefetch(hb).ok);  // behind the second
    ASSERT_EQ(2u, stats().num_prefetches);
    // Backward uses a (its stream waits for the fetch) and frees it, all queued while the
    // fetch is still in flight.
    ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
    ASSERT_TRUE(engine_->release(ha).ok);
    ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
    // An allocation needs a's memory (b's is taken); a's copy lands while it waits.
    LetGoLater let_go(first, pool_test::kLetGoDelay);
    std::string error;
    e = engine_->allocate_tagged(kBlock, stream_, &error);
    ASSERT_NE(nullptr, e) << error;
    let_go.finish();
    EXPECT_FALSE(watchdog.fired()) << "the allocation waited for b's fetch, queued after a's";
    watchdog.finish();
  }
  ASSERT_TRUE(engine_->unpack(hb, stream_).ok);  // waits for b's fetch
  EXPECT_TRUE(holds(b, 2));
  ASSERT_TRUE(engine_->release(hb).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(e, stream_).ok);
}

// With VRAMSWAP_VERIFY a fetch queues a readback behind it. A block freed while its fetch is
// in flight leaves that readback buffer to be freed once the fetch stream has done with it;
// the buffer had no event of its own, and every later engine call, including those that
// must never wait, synchronized the whole fetch stream to free it.
TEST_F(ReclaimTest, AReadbackBufferLeftByAFreedBlockIsNotWaitedForByLaterCalls) {
  EngineOptions options;
  options.verify = true;
  Saved saved;
  ASSERT_NO_FATAL_FAILURE(start_with_two_evicted(options, &saved));
  void* a = saved.blocks[0];
  void* b = saved.blocks[1];
  const uint64_t ha = saved.handles[0], hb = saved.handles[1];
  {
    StreamGate gate;  // opens, at the latest, when the case leaves this scope
    LetGoLater watchdog(gate, pool_test::kHangTimeout);
    ASSERT_CUDA_OK(gate.hold(h2d_));
    ASSERT_TRUE(engine_->prefetch(ha).ok);  // its fetch and readback wait behind the gate
    ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
    ASSERT_TRUE(engine_->release(ha).ok);
    ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);  // while its fetch is in flight
    ASSERT_TRUE(engine_->prefetch(hb).ok);            // a call that reaps what has landed
    EXPECT_FALSE(watchdog.fired()) << "a later call waited for the fetch stream";
    watchdog.finish();
  }
  ASSERT_TRUE(engine_->unpack(hb, stream_).ok);
  EXPECT_TRUE(holds(b, 2));
  ASSERT_TRUE(engine_->release(hb).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  EXPECT_EQ(0u, stats().num_verify_failures);
}

// Evictions run in the order they were queued: an allocation that needs one block's room
// waits for the first eviction under way to land, not for all of them. Waiting for every
// copy in flight, an allocation in the forward waited for all the plan's evictions queued
// ahead of it (38 ms of copies on gpt-small-v10k at 75%, three times a step). Here a's
// eviction is held by one gate and b's, queued after it, by a second; an allocation needs
// one block's room while the first gate opens: it must not wait for the second.
TEST_F(ReclaimTest, AnAllocationWaitsOnlyForTheEvictionsItNeeds) {
  start_soft(12 * kMiB, kMiB, 0);  // three blocks; every cold block is copied out at once
  {
    std::lock_guard lock(copy_streams().mu);
    copy_streams().own_stream = stream_;
    copy_streams().d2h = nullptr;
  }
  engine_->graph_begin();
  // A first eviction shows which stream the engine copies out on; then z goes.
  void* z = tagged(9);
  const uint64_t hz = pack_cold(z);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  cudaStream_t d2h = nullptr;
  {
    std::lock_guard lock(copy_streams().mu);
    d2h = copy_streams().d2h;
  }
  ASSERT_NE(nullptr, d2h) << "no eviction was seen being queued";
  ASSERT_EQ(1u, stats().num_evictions);
  ASSERT_TRUE(engine_->release(hz).ok);
  ASSERT_TRUE(engine_->free_tagged(z, stream_).ok);
  void* d = nullptr;
  void* a = nullptr;
  void* b = nullptr;
  uint64_t ha = 0, hb = 0;
  {
    StreamGate first, second;  // open, at the latest, when the case leaves this scope
    LetGoLater watchdog(second, pool_test::kHangTimeout);
    ASSERT_CUDA_OK(first.hold(d2h));
    a = tagged(1);
    ha = pack_cold(a);  // its copy out waits behind the first gate
    ASSERT_CUDA_OK(second.hold(d2h));
    b = tagged(2);
    hb = pack_cold(b);  // behind the second
    void* c = tagged(3);  // the limit is full now
    ASSERT_NE(nullptr, c);
    ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    c = tagged(4);
    ASSERT_NE(nullptr, c);
    // One more block's room: a's copy lands while the allocation waits.
    LetGoLater let_go(first, pool_test::kLetGoDelay);
    std::string error;
    d = engine_->allocate_tagged(kBlock, stream_, &error);
    ASSERT_NE(nullptr, d) << error;
    let_go.finish();
    EXPECT_FALSE(watchdog.fired()) << "the allocation waited for b's eviction, queued after a's";
    watchdog.finish();
    ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  }
  const EngineStats s = stats();
  EXPECT_EQ(4 * kMiB, s.evicted_bytes) << "a gave its pages up";
  EXPECT_LE(s.resident_bytes, 12 * kMiB);
  ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
  ASSERT_TRUE(engine_->unpack(hb, stream_).ok);
  EXPECT_TRUE(holds(b, 2));
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
  EXPECT_TRUE(holds(a, 1));
  for (uint64_t h : {ha, hb}) ASSERT_TRUE(engine_->release(h).ok);
  for (void* p : {a, b}) ASSERT_TRUE(engine_->free_tagged(p, stream_).ok);
}

// A clean block (copied out, pages still mapped) gives its pages up at once when an
// allocation needs them: with the compute stream held, an allocation past the limit
// succeeds, so nothing waited for the device or for a copy; the block comes back intact.
TEST_F(ReclaimTest, CleanBlocksAreGivenUpWithoutWaiting) {
  start_soft(16 * kMiB, 4 * kMiB, 0);
  engine_->graph_begin();
  const Saved saved = save_cold(2, 1);
  void* a = saved.blocks[0];
  void* b = saved.blocks[1];
  const uint64_t ha = saved.handles[0], hb = saved.handles[1];
  void* c = tagged(3);
  const uint64_t hc = engine_->pack(c, stream_);  // not cold: the forward still uses it
  ASSERT_NE(0u, hc);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());  // the copies out land
  const EngineStats before = stats();
  ASSERT_EQ(8 * kMiB, before.clean_bytes) << "a and b";
  ASSERT_EQ(12 * kMiB, before.resident_bytes);
  void* d = nullptr;
  {
    StreamGate gate;
    LetGoLater watchdog(gate, pool_test::kHangTimeout);
    ASSERT_CUDA_OK(gate.hold(stream_));  // a device synchronization would wait for it
    std::string error;
    d = engine_->allocate_tagged(2 * kBlock, stream_, &error);
    ASSERT_NE(nullptr, d) << error;
    watchdog.finish();
    EXPECT_FALSE(watchdog.fired()) << "the allocation waited for the held stream";
  }
  const EngineStats s = stats();
  EXPECT_EQ(before.num_evictions, s.num_evictions) << "no copy was needed";
  EXPECT_EQ(4 * kMiB, s.evicted_bytes) << "a, needed last, gave its pages up; no more was needed";
  EXPECT_EQ(4 * kMiB, s.clean_bytes) << "b";
  EXPECT_EQ(16 * kMiB, s.resident_bytes);
  ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
  ASSERT_TRUE(engine_->unpack(hc, stream_).ok);
  EXPECT_TRUE(holds(c, 3));
  ASSERT_TRUE(engine_->unpack(hb, stream_).ok);
  EXPECT_TRUE(holds(b, 2));
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
  EXPECT_TRUE(holds(a, 1));
  EXPECT_EQ(1u, stats().num_faults) << "a";
  EXPECT_EQ(1u, stats().num_clean_reuses) << "b";
  for (uint64_t h : {ha, hb, hc}) ASSERT_TRUE(engine_->release(h).ok);
  for (void* p : {a, b, c}) ASSERT_TRUE(engine_->free_tagged(p, stream_).ok);
}

}  // namespace
