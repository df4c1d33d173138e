// residency::Engine on cudasim: what Note [Block states] (src/residency/engine.h)
// promises, driven as the autograd tracker drives it. Contents are written and read back
// through copies on the compute stream, as kernels would, so a missing order shows up as a
// wrong byte; touching an evicted block's pages faults (cudasim maps nothing there).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_test_util.h"
#include "engine_test_util.h"
#include "pool/device_pool.h"
#include "residency/engine.h"
#include "stats/log.h"

namespace {

using namespace engine_test;

using EngineTest = engine_test::EngineFixture;

TEST_F(EngineTest, ColdBlocksMakeRoomAndComeBackIntact) {
  start(24 * kMiB);  // room for six blocks, four of them the protected window
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  engine_->graph_begin();
  for (int i = 0; i < 8; ++i) {  // twice what fits
    void* p = tagged(uint8_t(i * 31 + 1));
    ASSERT_NE(nullptr, p) << "block " << i << " found no room although earlier blocks are cold";
    blocks.push_back(p);
    handles.push_back(pack_cold(p));
  }
  EngineStats s = stats();
  EXPECT_GT(s.num_evictions, 0u);
  EXPECT_GT(s.evicted_bytes, 0u);
  EXPECT_LE(s.resident_bytes, 24 * kMiB);
  EXPECT_LE(s.peak_resident_bytes, 24 * kMiB);
  // Backward: last saved first.
  for (int i = 7; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(handles[size_t(i)], stream_).ok) << i;
    EXPECT_TRUE(holds(blocks[size_t(i)], uint8_t(i * 31 + 1))) << "block " << i;
    ASSERT_TRUE(engine_->release(handles[size_t(i)]).ok);
    ASSERT_TRUE(engine_->free_tagged(blocks[size_t(i)], stream_).ok);
  }
  s = stats();
  EXPECT_GT(s.num_prefetches + s.num_faults, 0u);
  EXPECT_EQ(0u, s.tagged_bytes);
  EXPECT_EQ(0u, s.evicted_bytes);
  EXPECT_EQ(0u, s.host_bytes);
  EXPECT_EQ(0u, s.num_tracked_blocks);
}

TEST_F(EngineTest, TheVictimIsTheBlockNeededFurthestAway) {
  EngineOptions options;
  options.horizon = 0;
  start(12 * kMiB, options);  // three blocks
  engine_->graph_begin();
  void* first = tagged(1);
  void* second = tagged(2);
  void* third = tagged(3);
  pack_cold(first);
  pack_cold(second);
  pack_cold(third);
  ASSERT_NE(nullptr, tagged(4));  // needs one block's room
  EngineStats s = stats();
  EXPECT_EQ(1u, s.num_evictions);
  // Backward needs `third` first and `first` last: `first` must be the one on the host.
  // Its pages are gone, so a read of it through the pool would fault; the others still
  // read at once without any unpack.
  EXPECT_TRUE(holds(second, 2));
  EXPECT_TRUE(holds(third, 3));
}

TEST_F(EngineTest, TheWindowIsEvictedOnlyAsALastResort) {
  EngineOptions options;
  options.horizon = 2;
  start(12 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  void* b = tagged(2);
  void* c = tagged(3);
  const uint64_t ha = pack_cold(a);
  const uint64_t hb = pack_cold(b);
  const uint64_t hc = pack_cold(c);
  // The window is c and b (needed first): a goes first.
  void* d = tagged(4);
  ASSERT_NE(nullptr, d);
  EXPECT_EQ(1u, stats().num_evictions);
  EXPECT_TRUE(holds(b, 2));
  EXPECT_TRUE(holds(c, 3));
  // Nothing cold is left outside the window: rather than an out-of-memory, the window's
  // block needed last (b) goes, and c, needed first, stays.
  void* e = tagged(5);
  ASSERT_NE(nullptr, e);
  EXPECT_EQ(2u, stats().num_evictions);
  EXPECT_TRUE(holds(c, 3));
  // With c gone as well nothing cold is left: now it is an out-of-memory.
  void* f = tagged(6);
  ASSERT_NE(nullptr, f);
  EXPECT_EQ(3u, stats().num_evictions);
  std::string error;
  EXPECT_EQ(nullptr, engine_->allocate_tagged(kBlock, stream_, &error));
  EXPECT_NE(std::string::npos, error.find("out of memory")) << error;
  // Backward (after the forward's own blocks are gone) gets every block back intact.
  for (void* p : {d, e, f}) ASSERT_TRUE(engine_->free_tagged(p, stream_).ok);
  for (auto [h, p, seed] : {std::tuple{hc, c, 3}, std::tuple{hb, b, 2}, std::tuple{ha, a, 1}}) {
    ASSERT_TRUE(engine_->unpack(h, stream_).ok);
    EXPECT_TRUE(holds(p, uint8_t(seed)));
    ASSERT_TRUE(engine_->release(h).ok);
    ASSERT_TRUE(engine_->free_tagged(p, stream_).ok);
  }
}

TEST_F(EngineTest, OnlyColdBlocksAreEvicted) {
  EngineOptions options;
  options.horizon = 0;  // nothing protected by the window: only coldness decides
  start(8 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  void* b = tagged(2);
  ASSERT_NE(0u, engine_->pack(a, stream_));  // packed, never marked cold
  ASSERT_NE(0u, engine_->pack(b, stream_));
  std::string error;
  EXPECT_EQ(nullptr, engine_->allocate_tagged(kBlock, stream_, &error));
  EXPECT_EQ(0u, stats().num_evictions);
  EXPECT_TRUE(holds(a, 1));
  EXPECT_TRUE(holds(b, 2));
}

TEST_F(EngineTest, AFaultFetchesTheBlockWhenNothingWasPrefetched) {
  EngineOptions options;
  options.horizon = 0;  // no prefetch: every evicted block faults
  start(8 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = pack_cold(a);
  void* b = tagged(2);
  const uint64_t hb = pack_cold(b);
  void* c = tagged(3);  // evicts a (needed last)
  ASSERT_NE(nullptr, c);
  ASSERT_EQ(1u, stats().num_evictions);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_TRUE(engine_->unpack(hb, stream_).ok);
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
  EXPECT_EQ(1u, stats().num_faults);
  EXPECT_TRUE(holds(a, 1));
  EXPECT_TRUE(holds(b, 2));
}

// VRAMSWAP_LOG=debug: one line per event of a block (cold mark, copy out, drop, fetch, its
// landing) and per step begun, each naming the device and the block.
TEST_F(EngineTest, DebugLogHasOneLinePerEvent) {
  using vramswap::stats::LogLevel;
  const LogLevel saved = vramswap::stats::log_level();
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  vramswap::stats::set_log_level(LogLevel::kDebug);
  ::testing::internal::CaptureStderr();
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = pack_cold(a);
  void* b = tagged(2);
  const uint64_t hb = pack_cold(b);
  void* c = tagged(3);  // evicts a
  ASSERT_NE(nullptr, c);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_TRUE(engine_->unpack(hb, stream_).ok);
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);  // a fault
  EXPECT_TRUE(holds(a, 1));
  (void)stats();  // reaps the fetch
  const std::string log = ::testing::internal::GetCapturedStderr();
  vramswap::stats::set_log_level(saved);
  char block_a[64];
  snprintf(block_a, sizeof block_a, "block %#llx (4 MiB): ", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(a)));
  for (const char* what : {"cold", "copy out started", "copied out, clean", "evicted (pages given up)",
                           "fetch started (needed now: a fault)", "fetch landed, resident"}) {
    const std::string line = std::string("vramswap: device 0: ") + block_a + what + "\n";
    EXPECT_NE(std::string::npos, log.find(line)) << "no line \"" << line << "\" in:\n" << log;
  }
  EXPECT_NE(std::string::npos, log.find("vramswap: device 0: a step begins: ")) << log;
}

TEST_F(EngineTest, HandlesAreCheckedAndGoStale) {
  start(16 * kMiB);
  void* p = tagged(1);
  const uint64_t h = engine_->pack(p, stream_);
  ASSERT_NE(0u, h);
  EXPECT_EQ(h, engine_->pack(static_cast<char*>(p) + 1000, stream_)) << "one handle per block, any address in it";
  EXPECT_FALSE(engine_->unpack(0, stream_).ok);
  EXPECT_FALSE(engine_->mark_cold(h ^ 0x00ffffff00000000ull, stream_).ok) << "a slot never given out";
  EXPECT_TRUE(engine_->release(h).ok);
  EXPECT_TRUE(engine_->unpack(h, stream_).ok) << "packed twice: one release leaves it packed";
  EXPECT_TRUE(engine_->release(h).ok);
  vramswap::residency::Status r = engine_->unpack(h, stream_);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(std::string::npos, r.message.find("stale")) << r.message;
  const uint64_t again = engine_->pack(p, stream_);
  EXPECT_NE(h, again) << "a new pack after the release is a new handle";
  ASSERT_TRUE(engine_->free_tagged(p, stream_).ok);
  EXPECT_FALSE(engine_->release(again).ok) << "freed: stale";
  EXPECT_EQ(0u, engine_->pack(p, stream_)) << "not a live tagged block any more";
}

TEST_F(EngineTest, FreeInEveryStateLosesNothingAndLeaksNothing) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  pack_cold(a);
  void* b = tagged(2);
  pack_cold(b);
  void* c = tagged(3);  // evicts a
  ASSERT_NE(nullptr, c);
  ASSERT_EQ(1u, stats().num_evictions);
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok) << "evicted";
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok) << "cold, resident";
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok) << "resident, never packed";
  EngineStats s = stats();
  EXPECT_EQ(0u, s.host_bytes);
  EXPECT_EQ(0u, s.tagged_bytes);
  EXPECT_EQ(0u, s.evicted_bytes);
  EXPECT_FALSE(engine_->free_tagged(a, stream_).ok) << "double free";
  // The memory is usable again, all of it.
  void* d = tagged(4, 8 * kMiB);
  ASSERT_NE(nullptr, d);
  EXPECT_TRUE(holds(d, 4, 8 * kMiB));
  ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
}

TEST_F(EngineTest, SoftLimitEvictsWithoutAnAllocationWaiting) {
  EngineOptions options;
  options.soft_limit_bytes = 8 * kMiB;
  options.horizon = 0;
  start(32 * kMiB, options);
  engine_->graph_begin();
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(tagged(uint8_t(i + 1)));
    pack_cold(blocks.back());
  }
  ASSERT_TRUE(cudaStreamSynchronize(stream_) == cudaSuccess);
  // Nothing had to wait; the copies complete in the background and are reaped on the next
  // call. Any call will do.
  cudaDeviceSynchronize();
  void* small = tagged(9, kMiB);
  EngineStats s = stats();
  EXPECT_GT(s.num_evictions, 0u);
  // The copied-out blocks stay mapped (clean) while there is room: what has no host copy
  // is within the soft limit.
  EXPECT_GT(s.clean_bytes, 0u);
  EXPECT_LE(s.resident_bytes - s.clean_bytes, 8 * kMiB + 2 * kMiB + 4 * kMiB);
  EXPECT_EQ(0u, s.evicted_bytes) << "nothing needed the pages";
  ASSERT_TRUE(engine_->free_tagged(small, stream_).ok);
}

TEST_F(EngineTest, AnUnpackOfACleanBlockNeedsNoFetch) {
  start_soft(32 * kMiB, 4 * kMiB, 0);
  engine_->graph_begin();
  const auto [blocks, handles] = save_cold(3, 40);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());  // the copies out land
  EngineStats s = stats();
  ASSERT_EQ(2u, s.num_evictions) << "the two needed furthest away, down to the soft limit";
  ASSERT_EQ(8 * kMiB, s.clean_bytes);
  ASSERT_EQ(12 * kMiB, s.resident_bytes);
  for (int i = 2; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(handles[size_t(i)], stream_).ok);
    EXPECT_TRUE(holds(blocks[size_t(i)], uint8_t(i + 40)));
    ASSERT_TRUE(engine_->release(handles[size_t(i)]).ok);
  }
  s = stats();
  EXPECT_EQ(2u, s.num_clean_reuses);
  EXPECT_EQ(0u, s.bytes_prefetched_total) << "nothing came back over the bus";
  EXPECT_EQ(0u, s.num_faults);
  EXPECT_EQ(0u, s.clean_bytes);
  EXPECT_EQ(0u, s.host_bytes) << "the host copies were given back";
  for (void* b : blocks) ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
}

// Reclaim follows Belady's rule over clean and cold blocks together: a cold block needed
// later than a clean one starts its copy rather than the clean one being dropped, even when
// the caller cannot wait (the pool's first request); once its copy has landed it goes first.
TEST_F(EngineTest, ReclaimTakesTheBlockNeededLastCleanOrNot) {
  start_soft(32 * kMiB, 8 * kMiB, 0);
  engine_->graph_begin();
  void* a = tagged(1);  // needed last
  const uint64_t ha = engine_->pack(a, stream_);  // not cold yet: the forward still uses it
  ASSERT_NE(0u, ha);
  const Saved bc = save_cold(2, 2);  // b, c: past the soft limit b (cold, needed last) is copied
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EngineStats s = stats();
  ASSERT_EQ(4 * kMiB, s.clean_bytes) << "b";
  ASSERT_TRUE(engine_->mark_cold(ha, stream_).ok);  // a goes cold with nothing left over the soft limit
  ASSERT_EQ(1u, stats().num_evictions);

  using Mode = vramswap::pool::DevicePool::ReclaimMode;
  EXPECT_EQ(0u, engine_->reclaim(4 * kMiB, Mode::kNoWait)) << "b is not dropped while a is needed later";
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  s = stats();
  EXPECT_EQ(2u, s.num_evictions) << "a's copy was started";
  EXPECT_EQ(8 * kMiB, s.clean_bytes);
  EXPECT_EQ(4 * kMiB, engine_->reclaim(4 * kMiB, Mode::kNoWait)) << "a, now clean, goes at once";
  s = stats();
  EXPECT_EQ(4 * kMiB, s.evicted_bytes);
  EXPECT_EQ(4 * kMiB, s.clean_bytes) << "b stays";
  for (int i = 1; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(bc.handles[size_t(i)], stream_).ok);
    EXPECT_TRUE(holds(bc.blocks[size_t(i)], uint8_t(2 + i)));
    ASSERT_TRUE(engine_->release(bc.handles[size_t(i)]).ok);
  }
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
  EXPECT_TRUE(holds(a, 1));
  ASSERT_TRUE(engine_->release(ha).ok);
  for (void* p : {a, bc.blocks[0], bc.blocks[1]}) ASSERT_TRUE(engine_->free_tagged(p, stream_).ok);
}

// A clean block that backward never unpacks, or that the program frees, gives its host
// copy back; the device copy stays valid.
TEST_F(EngineTest, ACleanBlockReleasedOrFreedGivesItsHostCopyBack) {
  start_soft(32 * kMiB, 4 * kMiB, 0);
  engine_->graph_begin();
  const auto [blocks, handles] = save_cold(3, 90);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EngineStats s = stats();
  ASSERT_EQ(8 * kMiB, s.clean_bytes) << "blocks 0 and 1";
  ASSERT_GE(s.host_bytes, 8 * kMiB);
  ASSERT_TRUE(engine_->release(handles[1]).ok) << "released without an unpack";
  EXPECT_TRUE(holds(blocks[1], 91));
  ASSERT_TRUE(engine_->free_tagged(blocks[0], stream_).ok) << "freed while clean";
  s = stats();
  EXPECT_EQ(0u, s.clean_bytes);
  EXPECT_EQ(0u, s.host_bytes);
  EXPECT_EQ(0u, s.bytes_prefetched_total);
  EXPECT_EQ(0u, s.num_clean_reuses) << "neither was unpacked";
  ASSERT_TRUE(engine_->release(handles[2]).ok);
  ASSERT_TRUE(engine_->free_tagged(blocks[1], stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(blocks[2], stream_).ok);
}

// Note [Fetch ahead] (engine_copies.cpp): with the window on resident blocks and no fetch in
// flight, an unpack fetches the nearest evicted block past the window into memory that is
// free below the soft limit, and nothing when that would pass the soft limit.
class FetchAhead : public EngineTest, public ::testing::WithParamInterface<bool> {};

TEST_P(FetchAhead, FetchesTheNearestEvictedBlockPastTheWindowIntoFreeMemory) {
  const bool room = GetParam();
  start_soft(32 * kMiB, (room ? 16 : 14) * kMiB, 1);
  engine_->graph_begin();
  const auto [blocks, handles] = save_cold(5, 60);  // a, b, c, d, e: backward needs e first
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_EQ(8 * kMiB, engine_->reclaim(8 * kMiB)) << "a and b leave the device";
  EngineStats s = stats();
  ASSERT_EQ(8 * kMiB, s.evicted_bytes);
  ASSERT_EQ(12 * kMiB, s.resident_bytes);
  const uint64_t prefetches = s.num_prefetches;
  ASSERT_TRUE(engine_->unpack(handles[4], stream_).ok);  // e; the window is d, resident
  s = stats();
  if (room) {
    EXPECT_EQ(prefetches + 1, s.num_prefetches) << "b, past the window (c is resident)";
    EXPECT_EQ(16 * kMiB, s.resident_bytes);
  } else {
    EXPECT_EQ(prefetches, s.num_prefetches) << "b would pass the soft limit";
    EXPECT_EQ(12 * kMiB, s.resident_bytes);
  }
  for (int i = 4; i >= 0; --i) {
    if (i < 4) {
      ASSERT_TRUE(engine_->unpack(handles[size_t(i)], stream_).ok);
    }
    EXPECT_TRUE(holds(blocks[size_t(i)], uint8_t(60 + i)));
    ASSERT_TRUE(engine_->release(handles[size_t(i)]).ok);
    ASSERT_TRUE(engine_->free_tagged(blocks[size_t(i)], stream_).ok);
  }
}

INSTANTIATE_TEST_SUITE_P(SoftLimit, FetchAhead, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("RoomBelowIt") : std::string("NoRoomBelowIt");
                         });

TEST_F(EngineTest, VerifyFindsNothingWrongWithAnHonestRoundTrip) {
  EngineOptions options;
  options.verify = true;
  options.horizon = 1;
  start(8 * kMiB, options);
  engine_->graph_begin();
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(tagged(uint8_t(i * 13)));
    handles.push_back(pack_cold(blocks.back()));
  }
  ASSERT_GT(stats().num_evictions, 0u);
  for (int i = 3; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(handles[size_t(i)], stream_).ok);
    EXPECT_TRUE(holds(blocks[size_t(i)], uint8_t(i * 13)));
    ASSERT_TRUE(engine_->release(handles[size_t(i)]).ok);  // backward is done with it
    ASSERT_TRUE(engine_->free_tagged(blocks[size_t(i)], stream_).ok);
  }
  cudaDeviceSynchronize();
  void* poke = tagged(0, kMiB);  // reaps the last copies
  EXPECT_EQ(0u, stats().num_verify_failures);
  EXPECT_GT(stats().num_prefetches + stats().num_faults, 0u);
  ASSERT_TRUE(engine_->free_tagged(poke, stream_).ok);
}

// The engine's copies run on its own streams, after events recorded outside any capture,
// and its mapping calls in the relaxed capture mode: another stream's capture neither stops
// eviction nor is broken by it. (The first version refused to evict while any stream it had
// ever seen captured: it kept every stream handle forever and relied on a destroyed one
// failing the capture query, which a real driver does not promise.)
TEST_F(EngineTest, EvictionLeavesAnotherStreamsCaptureIntact) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = pack_cold(a);
  void* b = tagged(2);
  pack_cold(b);
  cudaStream_t capturing;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking));
  ASSERT_CUDA_OK(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeGlobal));
  std::string error;
  void* c = engine_->allocate_tagged(kBlock, stream_, &error);
  EXPECT_NE(nullptr, c) << error;
  EXPECT_GT(stats().num_evictions, 0u);
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(capturing, &graph));
  cudaGraphDestroy(graph);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_TRUE(engine_->unpack(ha, stream_).ok);
  EXPECT_TRUE(holds(a, 1));
  cudaStreamDestroy(capturing);
}

// mark_cold records the point of no use as an event on the caller's stream; on a stream
// that captures, that record would be a node of the graph, never a point in time. It is
// refused and the block stays in use: nothing evicts it.
TEST_F(EngineTest, MarkColdOnACapturingStreamIsRefusedAndTheBlockStaysInUse) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = engine_->pack(a, stream_);
  ASSERT_NE(0u, ha);
  cudaStream_t capturing;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking));
  ASSERT_CUDA_OK(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeRelaxed));
  const auto refused = engine_->mark_cold(ha, capturing);
  EXPECT_FALSE(refused.ok);
  EXPECT_NE(std::string::npos, refused.message.find("capturing")) << refused.message;
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamEndCapture(capturing, &graph));
  cudaGraphDestroy(graph);
  EXPECT_EQ(0u, stats().evictable_bytes);
  void* b = tagged(2);
  std::string error;
  EXPECT_EQ(nullptr, engine_->allocate_tagged(kBlock, stream_, &error)) << "a is not cold: nothing to evict";
  EXPECT_EQ(0u, stats().num_evictions);
  EXPECT_TRUE(holds(a, 1));
  ASSERT_TRUE(engine_->release(ha).ok);
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  cudaStreamDestroy(capturing);
}

// Issue 13: small tagged blocks share granules. Eight 256 KiB blocks saved one after
// another fill one granule (they took eight before); to free that granule all of them go to
// the host, and each comes back byte for byte at its address.
TEST_F(EngineTest, SmallBlocksShareAGranuleAndGoTogether) {
  EngineOptions options;
  options.horizon = 0;
  const size_t granule = 2 * kMiB;  // cudasim's granularity, as a GPU's
  start(2 * granule, options);
  const size_t small = 256 * 1024;
  const Saved saved = save_cold(8, 10, small);
  EXPECT_EQ(8 * small, stats().tagged_bytes);
  EXPECT_EQ(0u, stats().tagged_waste_bytes);
  ASSERT_EQ(granule, pool_->granularity());
  EXPECT_EQ(granule, pool_->stats().mapped_bytes) << "eight small blocks on one granule";
  std::string error;
  void* big = pool_->allocate(2 * granule - kMiB, stream_, &error);  // needs both granules
  ASSERT_NE(nullptr, big) << error;
  EXPECT_EQ(8 * small, stats().evicted_bytes) << "every block on the granule left to free it";
  EXPECT_EQ("", engine_->check_invariants());
  EXPECT_EQ("", pool_->check_invariants());
  ASSERT_TRUE(pool_->deallocate(big, stream_).ok);
  unpack_all(saved, 10, small);
  release_all(saved);
  EXPECT_EQ("", engine_->check_invariants());
  EXPECT_EQ("", pool_->check_invariants());
}

// Issue 13: a shared granule is fetched as a whole. When the first of its blocks is needed
// back, the granule is mapped for it anyway, and its neighbours, saved just before it, are
// needed next: their copies start with it, costing no page more. Eight 256 KiB blocks
// evicted together, then unpacked one after another with no prefetch window: one fault, the
// seven others already on their way (each unpack was a fault before).
//
// Fetched early, the others hold the granule until the last of them is used, where fetched
// one by one it could go between their uses: above the soft limit they are not fetched with
// it (a model at five granules ran out of memory in 2 of 6 runs with them, 0 of 6 without).
TEST_F(EngineTest, ASharedGranuleIsFetchedAsAWhole) {
 for (const bool above_soft : {false, true}) {
  SCOPED_TRACE(above_soft ? "above the soft limit" : "below the soft limit");
  EngineOptions options;
  options.horizon = 0;
  const size_t granule = 2 * kMiB;
  if (above_soft) options.soft_limit_bytes = granule / 2;
  start(2 * granule, options);
  const size_t small = 256 * 1024;
  const Saved saved = save_cold(8, 30, small);
  ASSERT_EQ(granule, pool_->stats().mapped_bytes);
  std::string error;
  void* big = pool_->allocate(2 * granule - kMiB, stream_, &error);  // evicts the eight
  ASSERT_NE(nullptr, big) << error;
  ASSERT_EQ(8 * small, stats().evicted_bytes);
  ASSERT_TRUE(pool_->deallocate(big, stream_).ok);
  const EngineStats before = stats();
  const uint64_t mapped_before = pool_->stats().mapped_bytes;  // big's two granules, cached
  unpack_all(saved, 30, small);
  if (above_soft) {
    EXPECT_EQ(before.num_faults + 8, stats().num_faults) << "one by one";
  } else {
    EXPECT_EQ(before.num_faults + 1, stats().num_faults) << "only the first was waited for";
    EXPECT_EQ(before.num_prefetches + 7, stats().num_prefetches) << "its neighbours came with it";
  }
  // One page for the eight, taken from big's cached granules (Note [Taking only the pages
  // needed]): nothing more is mapped, nothing more is reserved.
  EXPECT_EQ(mapped_before, pool_->stats().mapped_bytes) << "no page more";
  EXPECT_EQ(2 * granule, pool_->stats().reserved_bytes) << "no page more";
  release_all(saved);
  EXPECT_EQ("", engine_->check_invariants());
  EXPECT_EQ("", pool_->check_invariants());
  stop();
 }
}

// Issue 13: a shared granule goes as a whole or not at all. With one of its blocks still in
// use (packed, not cold), evicting the cold others frees no page: they stay (they were all
// copied out for nothing before, and counted as freed), and the allocation that needed the
// page is refused. Once that block is cold too, all of them go together.
TEST_F(EngineTest, ASharedGranuleWithABlockInUseIsNotAVictim) {
  EngineOptions options;
  options.horizon = 0;
  const size_t granule = 2 * kMiB;
  start(2 * granule, options);
  const size_t small = 256 * 1024;
  Saved saved = save_cold_beside_one_in_use(7, 50, small);  // block 7 in use
  ASSERT_NE(0u, saved.handles.back());
  ASSERT_EQ(granule, pool_->stats().mapped_bytes);
  std::string error;
  void* big = pool_->allocate(2 * granule - kMiB, stream_, &error);
  EXPECT_EQ(nullptr, big) << "the granule cannot go while block 7 is in use";
  EXPECT_EQ(0u, stats().num_evictions) << "nothing copied out for a page that stays";
  EXPECT_EQ(0u, stats().evicted_bytes);
  ASSERT_TRUE(engine_->mark_cold(saved.handles[7], stream_).ok);
  big = pool_->allocate(2 * granule - kMiB, stream_, &error);
  ASSERT_NE(nullptr, big) << error;
  EXPECT_EQ(8 * small, stats().evicted_bytes) << "all eight went together";
  ASSERT_TRUE(pool_->deallocate(big, stream_).ok);
  unpack_all(saved, 50, small);
  release_all(saved);
  EXPECT_EQ("", engine_->check_invariants());
  EXPECT_EQ("", pool_->check_invariants());
}

// An out-of-memory explains itself (Note [Granules that cannot go] in engine_reclaim.cpp):
// with cold blocks evictable and the allocation refused all the same, the report says which
// granules stay mapped and why, and once the block holding them is cold it says nothing of
// the kind. (The DTR prototype's TreeLSTM log ran out of memory with 29.9 MiB "evictable"
// and 62 MiB "on the host", and the report did not say why neither could help.) It also says
// what of the tagged and resident bytes could not be evicted and why: block 7, in use.
TEST_F(EngineTest, AnOutOfMemoryNamesTheGranulesItsColdBlocksCannotFree) {
  EngineOptions options;
  options.horizon = 0;
  const size_t granule = 2 * kMiB;
  start(2 * granule, options);
  const size_t small = 256 * 1024;
  Saved saved = save_cold_beside_one_in_use(7, 80, small);  // block 7 in use
  ASSERT_NE(0u, saved.handles.back());
  std::string error;
  EXPECT_EQ(nullptr, pool_->allocate(2 * granule - kMiB, stream_, &error));
  const std::string report = engine_->pressure_report();
  EXPECT_NE(std::string::npos,
            report.find("1 granule (2 MiB) stays mapped under 1.75 MiB of cold blocks, because another block on "
                        "each is in use, untagged, or tagged and never saved"))
      << report;
  EXPECT_NE(std::string::npos, report.find("Tagged and resident but not evictable: 256 KiB in use"))
      << "what could not be evicted, and why: " << report;
  ASSERT_TRUE(engine_->mark_cold(saved.handles[7], stream_).ok);
  EXPECT_EQ(std::string::npos, engine_->pressure_report().find("stays mapped")) << "every block on it may go now";
  unpack_all(saved, 80, small);
  release_all(saved);
  EXPECT_EQ("", engine_->check_invariants());
}

// The same with the cold blocks already copied out ahead (the soft limit): dropped one by
// one while block 7 holds their granule (DESIGN.md, A shared granule goes as a whole: still
// open), they are on the host and their page is not free; the report says so.
TEST_F(EngineTest, AnOutOfMemoryNamesTheGranulesBlocksOnTheHostLeftMapped) {
  const size_t granule = 2 * kMiB;
  start_soft(2 * granule, 256 * 1024, 0);
  const size_t small = 256 * 1024;
  Saved saved = save_cold_beside_one_in_use(7, 90, small);  // block 7 in use
  ASSERT_NE(0u, saved.handles.back());
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  std::string error;
  EXPECT_EQ(nullptr, pool_->allocate(2 * granule - kMiB, stream_, &error));
  const EngineStats st = stats();
  const std::string report = engine_->pressure_report();
  EXPECT_NE(0u, st.evicted_bytes) << report;
  EXPECT_NE(std::string::npos,
            report.find("1 granule (2 MiB) stays mapped under 1.75 MiB of blocks already on the host"))
      << report;
  unpack_all(saved, 90, small);
  release_all(saved);
  EXPECT_EQ("", engine_->check_invariants());
}

// A step without pressure makes the next place densely (Note [A step without pressure] in
// pool/device_pool.h): a block of one granule then lies across two, sharing each with a
// neighbour. When that step meets the limit after all, giving such a block up alone frees no
// page; it goes with the blocks on its granules, as a small one does, or not at all. Saved
// in the order 1 3 5 0 2 4, backward needs 4 2 0 5 3 1, so Belady's victims are every other
// block: copied out one by one, 1, 3 and 5 freed nothing and the allocation ran out of memory
// with 12 MiB cold. (Seen in the CPU-emulation mode: a gradient penalty's double backward,
// after steps that fit, copied out four such blocks for no page.)
TEST_F(EngineTest, ABlockPlacedAcrossGranulesGoesWithTheBlocksOnThem) {
  EngineOptions options;
  options.horizon = 0;
  const size_t g = 2 * kMiB;
  start(16 * g, options);
  ASSERT_EQ(g, pool_->granularity());
  engine_->graph_begin();  // a step far below the limit (a small block: its granule is no
                           // cached place for the blocks below)
  const Saved first = save_cold(1, 1, g / 4);
  unpack_all(first, 1, g / 4);
  release_all(first);
  engine_->graph_begin();
  std::string error;
  void* x = pool_->allocate(g / 2, stream_, &error);  // the blocks after it straddle granules
  ASSERT_NE(nullptr, x) << error;
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(tagged(uint8_t(60 + i), g));
  for (size_t i = 1; i < blocks.size(); ++i)
    ASSERT_EQ(reinterpret_cast<uintptr_t>(blocks[0]) + i * g, reinterpret_cast<uintptr_t>(blocks[i])) << "placed densely";
  ASSERT_NE(0u, reinterpret_cast<uintptr_t>(blocks[0]) % g) << "across two granules";
  const std::vector<int> order{1, 3, 5, 0, 2, 4};
  std::vector<uint64_t> handles;
  for (int i : order) handles.push_back(pack_cold(blocks[size_t(i)]));
  const uintptr_t start = reinterpret_cast<uintptr_t>(x) / g * g, end = reinterpret_cast<uintptr_t>(blocks[5]) + g;
  void* fill = pool_->allocate(start + 16 * g - end, stream_, &error);  // after block 5, up to the limit
  ASSERT_NE(nullptr, fill) << error;
  ASSERT_EQ(16 * g, pool_->stats().mapped_bytes) << "at the limit";
  void* more = pool_->allocate(g, stream_, &error);
  EXPECT_NE(nullptr, more) << error;
  EXPECT_EQ("", engine_->check_invariants());
  EXPECT_EQ("", pool_->check_invariants());
  for (void* p : {more, fill, x}) {
    if (p) {
      ASSERT_TRUE(pool_->deallocate(p, stream_).ok);
    }
  }
  for (size_t k = order.size(); k-- > 0;) {
    const int i = order[k];
    ASSERT_TRUE(engine_->unpack(handles[k], stream_).ok) << i;
    EXPECT_TRUE(holds(blocks[size_t(i)], uint8_t(60 + i), g)) << "block " << i;
    ASSERT_TRUE(engine_->release(handles[k]).ok) << i;
    ASSERT_TRUE(engine_->free_tagged(blocks[size_t(i)], stream_).ok) << i;
  }
  EXPECT_EQ("", engine_->check_invariants());
  EXPECT_EQ("", pool_->check_invariants());
}

TEST_F(EngineTest, WasteIsTheRoundingToWholeGranules) {
  start(64 * kMiB);
  void* p = tagged(1, 3 * kMiB + 100);
  EngineStats s = stats();
  EXPECT_EQ(4 * kMiB, s.tagged_bytes);
  EXPECT_EQ(4 * kMiB - (3 * kMiB + 100), s.tagged_waste_bytes);
  ASSERT_TRUE(engine_->free_tagged(p, stream_).ok);
  EXPECT_EQ(0u, stats().tagged_waste_bytes);
  EXPECT_EQ(4 * kMiB - (3 * kMiB + 100), stats().peak_tagged_waste_bytes) << "the peak stays after the free";
  engine_->reset_peaks();
  EXPECT_EQ(0u, stats().peak_tagged_waste_bytes) << "reset to the current value";
}

}  // namespace

namespace {

// An evicted block keeps its address but has no pages: a touch faults, as a GPU kernel
// reading it would raise an illegal address. So nothing can silently read stale memory.
TEST_F(EngineTest, AnEvictedBlockHasNoPagesUnderItsAddress) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        EngineOptions options;
        options.horizon = 0;
        start(8 * kMiB, options);
        engine_->graph_begin();
        void* a = tagged(1);
        pack_cold(a);
        void* b = tagged(2);
        pack_cold(b);
        if (tagged(3) == nullptr || stats().num_evictions != 1) std::_Exit(3);  // not the fault we test
        *static_cast<volatile unsigned char*>(a) = 0;
      },
      ::testing::KilledBySignal(SIGSEGV), "illegal address");
}

}  // namespace

namespace {

// "With horizon >= 2 and copies faster than compute, num_faults == 0": each backward step
// computes (a host function holding the compute stream) long enough for the prefetches
// queued by the unpack before it to land.
void hold_stream(void*) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
  while (std::chrono::steady_clock::now() < until) {
  }
}

TEST_F(EngineTest, PrefetchAheadOfComputeMeansNoFault) {
  EngineOptions options;
  options.horizon = 2;
  start(24 * kMiB, options);  // six blocks: two of them the window
  engine_->graph_begin();
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  for (int i = 0; i < 10; ++i) {
    blocks.push_back(tagged(uint8_t(i * 17 + 3)));
    ASSERT_NE(nullptr, blocks.back());
    handles.push_back(pack_cold(blocks.back()));
  }
  ASSERT_GT(stats().num_evictions, 0u);
  for (int i = 9; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(handles[size_t(i)], stream_).ok);
    ASSERT_CUDA_OK(cudaLaunchHostFunc(stream_, hold_stream, nullptr));  // this layer's backward
    EXPECT_TRUE(holds(blocks[size_t(i)], uint8_t(i * 17 + 3))) << "block " << i;
    ASSERT_TRUE(engine_->release(handles[size_t(i)]).ok);
    ASSERT_TRUE(engine_->free_tagged(blocks[size_t(i)], stream_).ok);
  }
  EngineStats s = stats();
  EXPECT_EQ(0u, s.num_faults);
  EXPECT_GT(s.num_prefetches, 0u);
  EXPECT_LE(s.peak_resident_bytes, 24 * kMiB);
}

// "With no pressure, offloading costs nothing": no copy is made unless memory is needed.
TEST_F(EngineTest, NoPressureNoCopies) {
  start(0);  // the whole card
  engine_->graph_begin();
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(tagged(uint8_t(i)));
    handles.push_back(pack_cold(blocks.back()));
  }
  for (int i = 7; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(handles[size_t(i)], stream_).ok);
    ASSERT_TRUE(engine_->release(handles[size_t(i)]).ok);
    ASSERT_TRUE(engine_->free_tagged(blocks[size_t(i)], stream_).ok);
  }
  EngineStats s = stats();
  EXPECT_EQ(0u, s.bytes_evicted_total);
  EXPECT_EQ(0u, s.bytes_prefetched_total);
  EXPECT_EQ(0u, s.num_faults);
  EXPECT_EQ(0u, s.peak_host_bytes);
}

}  // namespace

namespace {

struct Gate {
  std::atomic<bool> open{false};
  static void wait(void* p) {
    auto* g = static_cast<Gate*>(p);
    while (!g->open.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
};

// A block freed while its eviction copy cannot even start (the copy waits for the cold
// event, queued behind held compute): the free must not lose or corrupt anything, and the
// host buffer must outlive the copy.
TEST_F(EngineTest, FreeWhileTheEvictionIsInFlight) {
  EngineOptions options;
  options.horizon = 0;
  options.soft_limit_bytes = 4 * kMiB;  // evict in the background past one block
  start(64 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  void* b = tagged(2);
  Gate gate;
  ASSERT_CUDA_OK(cudaLaunchHostFunc(stream_, Gate::wait, &gate));  // compute is busy
  const uint64_t hb = engine_->pack(b, stream_);
  ASSERT_TRUE(engine_->mark_cold(hb, stream_).ok);  // cold event behind the held work
  const uint64_t ha = engine_->pack(a, stream_);
  ASSERT_TRUE(engine_->mark_cold(ha, stream_).ok);  // past the soft limit: evictions start
  EngineStats s = stats();
  ASSERT_GT(s.in_flight_bytes, 0u) << "an eviction copy should be waiting for the cold event";
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  gate.open = true;
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  cudaDeviceSynchronize();
  void* c = tagged(3, 16 * kMiB);  // reaps the copies; the memory is whole again
  ASSERT_NE(nullptr, c);
  EXPECT_TRUE(holds(c, 3, 16 * kMiB));
  s = stats();
  EXPECT_EQ(0u, s.in_flight_bytes);
  EXPECT_EQ(0u, s.evicted_bytes);
  EXPECT_EQ(0u, s.host_bytes) << "the host buffers of the freed blocks were returned";
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
}

// A block freed while its fetch may still be copying in (a prefetch just queued): the pool
// must not hand its memory out before the copy is done.
TEST_F(EngineTest, FreeWhileTheFetchMayBeInFlight) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t ha = pack_cold(a);
  void* b = tagged(2);
  pack_cold(b);
  void* c = tagged(3);  // evicts a
  ASSERT_NE(nullptr, c);
  ASSERT_EQ(1u, stats().num_evictions);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_TRUE(engine_->prefetch(ha).ok);
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);  // whatever the copy's progress
  void* d = tagged(4);  // may reuse a's memory: only after the fetch wrote it
  ASSERT_NE(nullptr, d);
  EXPECT_TRUE(holds(d, 4));
  EXPECT_TRUE(holds(b, 2));
  ASSERT_TRUE(engine_->free_tagged(d, stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  cudaDeviceSynchronize();
  void* e = tagged(5, kMiB);
  EXPECT_EQ(0u, stats().host_bytes);
  ASSERT_TRUE(engine_->free_tagged(e, stream_).ok);
}

}  // namespace
