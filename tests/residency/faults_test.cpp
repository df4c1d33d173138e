// The engine's error paths, driven by cudasim's fault injection (cudasim_fail_configure):
// a call either succeeds or changes nothing it reports, no pinned buffer or device page is
// lost, and every block stays readable or restorable. Each case is the reproduction of a
// defect the fault-injected stress test found.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cudasim.h"
#include "engine_test_util.h"

namespace engine_test {
namespace {

class Faults : public EngineFixture {
 protected:
  void SetUp() override {
    configure_ = reinterpret_cast<decltype(configure_)>(dlsym(RTLD_DEFAULT, "cudasim_fail_configure"));
    if (!configure_) GTEST_SKIP() << "needs cudasim's fault injection";
  }
  void TearDown() override {
    if (configure_) configure_(nullptr);
    EngineFixture::TearDown();
  }
  // Fails CUDA calls by cudasim's rules from now on ("" clears them).
  void fail(const char* spec) { ASSERT_EQ(0, configure_(spec)) << spec; }
  ::testing::AssertionResult consistent() {
    const std::string broken = pool_->check_invariants() + engine_->check_invariants();
    if (broken.empty()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << broken;
  }
  int (*configure_)(const char*) = nullptr;
};

// mark_cold used to return -1 when the soft eviction it set off failed, with the block cold
// already: evicted later while the program believed it was still in use.
TEST_F(Faults, MarkColdSucceedsWhenTheEvictionItSetsOffFails) {
  start_soft(64 * kMiB, 2 * kMiB, /*horizon=*/0);
  engine_->graph_begin();
  void* a = tagged(1);
  const uint64_t h = engine_->pack(a, stream_);
  fail("cudaMemcpyAsync:*");
  EXPECT_TRUE(engine_->mark_cold(h, stream_).ok);
  fail("");
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(0u, stats().host_bytes) << "the failed eviction kept its pinned buffer";
  EXPECT_TRUE(consistent());
  ASSERT_TRUE(engine_->unpack(h, stream_).ok);
  EXPECT_TRUE(holds(a, 1));
  ASSERT_TRUE(engine_->release(h).ok);
  ASSERT_TRUE(engine_->free_tagged(a, stream_).ok);
}

// A tagged allocation whose background work failed used to return nullptr with its block
// placed and never freed.
TEST_F(Faults, ATaggedAllocationIsNotLostWhenItsBackgroundWorkFails) {
  start_soft(64 * kMiB, 2 * kMiB, /*horizon=*/0);
  engine_->graph_begin();
  Saved saved = save_cold(1, 1);
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  fail("cudaEventRecord:*");
  std::string error;
  void* b = engine_->allocate_tagged(kBlock, stream_, &error);
  fail("");
  EXPECT_NE(nullptr, b) << error;
  EXPECT_TRUE(consistent());
  EXPECT_EQ(2 * kBlock, stats().tagged_bytes);
  ASSERT_TRUE(engine_->unpack(saved.handles[0], stream_).ok);
  EXPECT_TRUE(holds(saved.blocks[0], 1));
  ASSERT_TRUE(engine_->release(saved.handles[0]).ok);
  ASSERT_TRUE(engine_->free_tagged(saved.blocks[0], stream_).ok);
  if (b) {
    ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  }
  EXPECT_EQ(0u, stats().tagged_bytes);
}

// A fetch whose copy could not be queued used to leave the pages mapped under a block the
// engine still called evicted: no later call could map it, so it could never come back.
TEST_F(Faults, AFetchThatFailsLeavesTheBlockRestorable) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  Saved saved = save_cold(1, 1);
  void* b = tagged(2);
  void* c = tagged(3);  // the first block goes to the host
  ASSERT_NE(nullptr, c);
  ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  ASSERT_GT(stats().evicted_bytes, 0u);
  fail("cudaMemcpyAsync:1");
  const auto refused = engine_->unpack(saved.handles[0], stream_);
  fail("");
  EXPECT_FALSE(refused.ok);
  EXPECT_NE(std::string::npos, refused.message.find("cudaMemcpyAsync")) << refused.message;
  EXPECT_TRUE(consistent());
  ASSERT_TRUE(engine_->unpack(saved.handles[0], stream_).ok) << "the block could not be restored";
  EXPECT_TRUE(holds(saved.blocks[0], 1));
  ASSERT_TRUE(engine_->release(saved.handles[0]).ok);
  ASSERT_TRUE(engine_->free_tagged(saved.blocks[0], stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  EXPECT_TRUE(consistent());
}

// CUDA refusing to unmap a granule used to lose track of it (the mapping was dropped as if
// it were gone). The block stays whole on the host and comes back.
TEST_F(Faults, AnUnmapCudaRefusesLosesNothing) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  Saved saved = save_cold(1, 1);
  void* b = tagged(2);
  fail("cuMemUnmap:2");  // the second granule of the first block refuses to go
  std::string error;
  void* c = engine_->allocate_tagged(kBlock, stream_, &error);
  fail("");
  EXPECT_TRUE(consistent());
  if (c) {
    ASSERT_TRUE(engine_->free_tagged(c, stream_).ok);
  }
  ASSERT_TRUE(engine_->unpack(saved.handles[0], stream_).ok) << "the block could not be restored";
  EXPECT_TRUE(holds(saved.blocks[0], 1));
  ASSERT_TRUE(engine_->release(saved.handles[0]).ok);
  ASSERT_TRUE(engine_->free_tagged(saved.blocks[0], stream_).ok);
  ASSERT_TRUE(engine_->free_tagged(b, stream_).ok);
  EXPECT_TRUE(consistent());
}

// When pinning fails, the out-of-memory report says so and why, instead of showing only
// "evictable" bytes and an empty host tier.
TEST_F(Faults, AnOutOfMemoryReportSaysWhyNothingCouldBeEvicted) {
  EngineOptions options;
  options.horizon = 0;
  start(8 * kMiB, options);
  engine_->graph_begin();
  Saved saved = save_cold(2, 1);
  fail("cudaHostAlloc:*");
  std::string error;
  EXPECT_EQ(nullptr, engine_->allocate_tagged(kBlock, stream_, &error));
  fail("");
  EXPECT_NE(std::string::npos, error.find("no pinned host memory")) << error;
  EXPECT_TRUE(consistent());
  for (int i = 1; i >= 0; --i) {
    ASSERT_TRUE(engine_->unpack(saved.handles[size_t(i)], stream_).ok);
    EXPECT_TRUE(holds(saved.blocks[size_t(i)], uint8_t(1 + i)));
    ASSERT_TRUE(engine_->release(saved.handles[size_t(i)]).ok);
    ASSERT_TRUE(engine_->free_tagged(saved.blocks[size_t(i)], stream_).ok);
  }
}

TEST_F(Faults, ABlockLargerThanTheHostLimitIsSaidToBeUnevictable) {
  EngineOptions options;
  options.horizon = 0;
  options.host_limit_bytes = 2 * kMiB;
  start(8 * kMiB, options);
  engine_->graph_begin();
  Saved saved = save_cold(2, 1);  // 4 MiB each: neither fits a 2 MiB host tier
  std::string error;
  EXPECT_EQ(nullptr, engine_->allocate_tagged(kBlock, stream_, &error));
  EXPECT_NE(std::string::npos, error.find("larger than the host tier's limit")) << error;
  for (int i = 1; i >= 0; --i) {
    ASSERT_TRUE(engine_->release(saved.handles[size_t(i)]).ok);
    ASSERT_TRUE(engine_->free_tagged(saved.blocks[size_t(i)], stream_).ok);
  }
}

}  // namespace
}  // namespace engine_test
