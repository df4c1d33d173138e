// The fixture the residency::Engine tests share: a limited pool and its engine on cudasim,
// tagged blocks filled with a pattern by copies on a compute stream (as kernels would write
// them), read back and checked after an unpack, and the tracker's pack + mark_cold.
//
// Thread safety: one test thread.
#ifndef VRAMSWAP_TESTS_RESIDENCY_ENGINE_TEST_UTIL_H
#define VRAMSWAP_TESTS_RESIDENCY_ENGINE_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_test_util.h"
#include "pool/device_pool.h"
#include "residency/engine.h"

namespace engine_test {

using vramswap::pool::DevicePool;
using vramswap::pool::PoolOptions;
using vramswap::residency::Engine;
using vramswap::residency::EngineOptions;
using vramswap::residency::EngineStats;

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kBlock = 4 * kMiB;  // two granules

// Whether the driver is cudasim in virtual time, where every time the engine measures is
// the same run after run; in real time a copy's events also time its worker's scheduling, on
// a loaded machine tens of milliseconds.
using cuda_test::virtual_time;

class EngineFixture : public ::testing::Test {
 protected:
  // A pool limited to `limit` bytes and its engine.
  void start(uint64_t limit, EngineOptions options = {}) {
    if (options.host_limit_bytes == 0) options.host_limit_bytes = 512 * kMiB;
    pool_ = std::make_unique<DevicePool>(PoolOptions{0, limit});
    make_engine(options);
    ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  // Creates engine_ over pool_; a fixture that must watch the creation overrides it.
  virtual void make_engine(const EngineOptions& options) { engine_ = std::make_unique<Engine>(*pool_, options); }
  void TearDown() override { stop(); }
  // Undoes start(): the engine, its pool and the stream go (a test may start() again).
  void stop() {
    if (stream_) cudaStreamSynchronize(stream_);
    engine_.reset();
    pool_.reset();
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  // A tagged block filled with `seed`'s pattern by a copy on the compute stream.
  void* tagged(uint8_t seed, size_t size = kBlock) {
    std::string error;
    void* p = engine_->allocate_tagged(size, stream_, &error);
    EXPECT_NE(nullptr, p) << error;
    if (!p) return nullptr;
    std::vector<uint8_t> pattern(size);
    for (size_t i = 0; i < size; ++i) pattern[i] = uint8_t(seed + i * 7);
    EXPECT_EQ(cudaSuccess, cudaMemcpyAsync(p, pattern.data(), size, cudaMemcpyHostToDevice, stream_));
    EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream_));
    return p;
  }
  // Reads the block back on the compute stream (after an unpack) and checks the pattern.
  ::testing::AssertionResult holds(void* p, uint8_t seed, size_t size = kBlock) {
    std::vector<uint8_t> back(size);
    if (cudaMemcpyAsync(back.data(), p, size, cudaMemcpyDeviceToHost, stream_) != cudaSuccess ||
        cudaStreamSynchronize(stream_) != cudaSuccess)
      return ::testing::AssertionFailure() << "the copy back failed";
    for (size_t i = 0; i < size; ++i)
      if (back[i] != uint8_t(seed + i * 7))
        return ::testing::AssertionFailure() << "byte " << i << " is " << int(back[i]) << ", expected "
                                             << int(uint8_t(seed + i * 7));
    return ::testing::AssertionSuccess();
  }
  uint64_t pack_cold(void* p) {
    uint64_t h = engine_->pack(p, stream_);
    EXPECT_NE(0u, h);
    EXPECT_TRUE(engine_->mark_cold(h, stream_).ok);
    return h;
  }
  // A forward saving `n` tagged blocks of `size` one after another: block i filled with the
  // pattern of seed + i, packed and marked cold.
  struct Saved {
    std::vector<void*> blocks;
    std::vector<uint64_t> handles;
  };
  Saved save_cold(int n, uint8_t seed, size_t size = kBlock) {
    Saved saved;
    for (int i = 0; i < n; ++i) {
      saved.blocks.push_back(tagged(uint8_t(seed + i), size));
      saved.handles.push_back(pack_cold(saved.blocks.back()));
    }
    return saved;
  }
  // save_cold() of `n` blocks, then one more block (seed + n) packed and not marked cold: in
  // use, it keeps a granule it shares with them mapped.
  Saved save_cold_beside_one_in_use(int n, uint8_t seed, size_t size) {
    Saved saved = save_cold(n, seed, size);
    saved.blocks.push_back(tagged(uint8_t(seed + n), size));
    saved.handles.push_back(engine_->pack(saved.blocks.back(), stream_));
    EXPECT_NE(0u, saved.handles.back());
    return saved;
  }
  // Backward over save_cold()'s blocks: each unpacked, last saved first, and checked to hold
  // its pattern.
  void unpack_all(const Saved& saved, uint8_t seed, size_t size = kBlock) {
    for (size_t i = saved.blocks.size(); i-- > 0;) {
      const auto unpacked = engine_->unpack(saved.handles[i], stream_);
      ASSERT_TRUE(unpacked.ok) << i << ": " << unpacked.message;
      EXPECT_TRUE(holds(saved.blocks[i], uint8_t(seed + i), size)) << "block " << i;
    }
  }
  // Each block released and freed, last saved first.
  void release_all(const Saved& saved) {
    for (size_t i = saved.blocks.size(); i-- > 0;) {
      ASSERT_TRUE(engine_->release(saved.handles[i]).ok) << i;
      ASSERT_TRUE(engine_->free_tagged(saved.blocks[i], stream_).ok) << i;
    }
  }
  // A pool of `limit` bytes whose engine copies cold blocks out past `soft` bytes.
  void start_soft(uint64_t limit, uint64_t soft, int horizon) {
    EngineOptions options;
    options.soft_limit_bytes = soft;
    options.horizon = horizon;
    start(limit, options);
  }
  EngineStats stats() { return engine_->stats(); }

  std::unique_ptr<DevicePool> pool_;
  std::unique_ptr<Engine> engine_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace engine_test

#endif  // VRAMSWAP_TESTS_RESIDENCY_ENGINE_TEST_UTIL_H
