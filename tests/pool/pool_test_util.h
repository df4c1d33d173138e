// Helpers of the DevicePool tests (tests/pool): cudasim's counters, streams, a gate that
// holds a stream, pinned buffers, the bookkeeping of live blocks, and the arithmetic the
// tests use to state what the pool promises (512-byte units, granules touched).
//
// The tests link the toolkit's libcudart.so.13 and libcuda.so.1 (as the plugin does) and
// run on cudasim's. cudasim's own functions (cudasim.h) are not in the toolkit's driver
// stub, so they are looked up with dlsym; a case that needs them skips, saying so, when
// the process does not run on cudasim.
//
// Thread safety: the free functions are thread-safe; each class is used by one thread,
// except StreamGate, whose open() may come from any thread.
#ifndef VRAMSWAP_TESTS_POOL_POOL_TEST_UTIL_H
#define VRAMSWAP_TESTS_POOL_POOL_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_test_util.h"
#include "cuda/device.h"
#include "cudasim.h"
#include "pool/device_pool.h"

namespace vramswap::pool {
// Printed by GoogleTest in failure messages.
inline void PrintTo(const PoolStats& s, std::ostream* os) {
  *os << "{allocated " << s.allocated_bytes << ", reserved " << s.reserved_bytes
      << ", peak_allocated " << s.peak_allocated_bytes << ", peak_reserved "
      << s.peak_reserved_bytes << ", limit " << s.limit_bytes << ", allocs " << s.num_allocs
      << ", frees " << s.num_frees << ", cache_hits " << s.num_cache_hits << ", ooms "
      << s.num_ooms << ", free_blocks " << s.num_free_blocks << ", va " << s.va_reserved_bytes
      << "}";
}
}  // namespace vramswap::pool

namespace pool_test {

using vramswap::pool::DevicePool;
using vramswap::pool::PoolOptions;
using vramswap::pool::PoolStats;
using vramswap::pool::Result;

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;
// The pool's unit of alignment and of block sizes (Note [The pool]).
constexpr size_t kBlockUnit = 512;
// The device every case runs on: CUDASIM_DEVICE_MEMORY=1GiB (tests/pool/CMakeLists.txt).
constexpr uint64_t kCardBytes = uint64_t{1} << 30;

// How long a case waits for something that must happen before it calls it a hang.
constexpr std::chrono::milliseconds kHangTimeout{10000};
// How long a helper thread waits before letting a held stream go, so that the call under
// test has most likely reached the point where it must wait. Nothing is asserted about
// time: when the call is late, the case only checks less.
constexpr std::chrono::milliseconds kLetGoDelay{100};

inline size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }
inline uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }
inline void* offset(void* p, size_t bytes) { return static_cast<unsigned char*>(p) + bytes; }

// The VMM granularity of device 0 (2 MiB on cudasim and on current GPUs).
inline size_t granularity() {
  static const size_t g = vramswap::cuda::device_info(0).granularity;
  return g;
}

// The bytes of the granules that the blocks [address, address + size) touch, counted
// once: what the pool must keep mapped for them (granules are aligned in VA).
inline uint64_t granule_bytes_touched(const std::map<uintptr_t, size_t>& blocks) {
  const uint64_t g = granularity();
  std::set<uint64_t> granules;
  for (const auto& [begin, size] : blocks) {
    for (uint64_t i = begin / g; i <= (begin + size - 1) / g; ++i) granules.insert(i);
  }
  return granules.size() * g;
}

// cudasim's counters, read through dlsym; nullopt when not running on cudasim.
inline std::optional<cudasim_counters> sim_counters(int device = 0) {
  using Fn = int (*)(int, cudasim_counters*);
  static const Fn fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "cudasim_get_counters"));
  if (fn == nullptr) return std::nullopt;
  cudasim_counters c{};
  if (fn(device, &c) != 0) return std::nullopt;
  return c;
}

// Skips the calling case (from its body) when cudasim's counters are not available.
#define SKIP_UNLESS_CUDASIM()                                                         \
  do {                                                                                \
    if (!::pool_test::sim_counters()) GTEST_SKIP() << "needs cudasim's counters (cudasim.h)"; \
  } while (0)

// Which fields of two readings differ, or success when none does.
inline ::testing::AssertionResult same_stats(const PoolStats& a, const PoolStats& b) {
  std::ostringstream diff;
#define VRAMSWAP_STATS_FIELD(f) \
  if (a.f != b.f) diff << " " #f ": " << a.f << " -> " << b.f << ";"
  VRAMSWAP_STATS_FIELD(allocated_bytes);
  VRAMSWAP_STATS_FIELD(reserved_bytes);
  VRAMSWAP_STATS_FIELD(peak_allocated_bytes);
  VRAMSWAP_STATS_FIELD(peak_reserved_bytes);
  VRAMSWAP_STATS_FIELD(limit_bytes);
  VRAMSWAP_STATS_FIELD(num_allocs);
  VRAMSWAP_STATS_FIELD(num_frees);
  VRAMSWAP_STATS_FIELD(num_cache_hits);
  VRAMSWAP_STATS_FIELD(num_ooms);
  VRAMSWAP_STATS_FIELD(num_free_blocks);
  VRAMSWAP_STATS_FIELD(va_reserved_bytes);
#undef VRAMSWAP_STATS_FIELD
  if (diff.str().empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "stats changed:" << diff.str();
}

// True when `text` states `bytes`: as a decimal byte count, or in the largest binary unit
// that divides it into a whole number ("4 MiB", "4MiB", "4.0 MiB", "4.00 MiB", also with
// "MB" or "M"). A report may choose either form.
inline bool mentions_size(const std::string& text, uint64_t bytes) {
  if (text.find(std::to_string(bytes)) != std::string::npos) return true;
  static const char* const kUnits[][3] = {
      {"KiB", "KB", "K"}, {"MiB", "MB", "M"}, {"GiB", "GB", "G"}, {"TiB", "TB", "T"}};
  uint64_t scale = 1024;
  for (const auto& names : kUnits) {
    if (bytes >= scale && bytes % scale == 0) {
      const uint64_t n = bytes / scale;
      for (const char* unit : names) {
        for (const char* fmt : {"%llu %s", "%llu%s", "%llu.0 %s", "%llu.00 %s", "%llu.0%s",
                                "%llu.00%s"}) {
          char buf[64];
          std::snprintf(buf, sizeof buf, fmt, static_cast<unsigned long long>(n), unit);
          if (text.find(buf) != std::string::npos) return true;
        }
      }
    }
    scale *= 1024;
  }
  return false;
}

// A polling wait that cannot hang a case (tests/common/cuda_test_util.h).
inline cudaError_t wait_for_stream(cudaStream_t stream, std::chrono::milliseconds timeout = kHangTimeout) {
  return cuda_test::wait_for_stream(stream, timeout);
}

// A non-blocking stream (no implicit synchronization with the legacy default stream, so a
// synchronous cudaMemcpy of the test never waits for a held stream). Destroyed after its
// work completes.
class Stream {
 public:
  Stream() { status_ = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~Stream() {
    if (status_ == cudaSuccess) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaError_t status() const { return status_; }
  cudaStream_t get() const { return stream_; }
  operator cudaStream_t() const { return stream_; }  // NOLINT: used like the handle

 private:
  cudaStream_t stream_ = nullptr;
  cudaError_t status_;
};

using cuda_test::PinnedBuffer;

// The offset of the first of `n` bytes at `p` that is not `value`, or n when all are.
inline size_t first_mismatch(const unsigned char* p, size_t n, unsigned char value) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != value) return i;
  }
  return n;
}

// cuda_test::StreamGate (tests/common/cuda_test_util.h) with this suite's hang timeout.
class StreamGate : public cuda_test::StreamGate {
 public:
  StreamGate() : cuda_test::StreamGate(kHangTimeout) {}
};

// Opens `gate` from another thread after `delay`, or at once when finished or destroyed:
// a call that must wait for the held stream gets to finish, and one that must not wait is
// not hung by the gate for more than `delay`. fired() says whether the delay ran out (it is
// only information; no case asserts on time).
class LetGoLater : public cuda_test::GateTimer {
 public:
  LetGoLater(StreamGate& gate, std::chrono::milliseconds delay) : GateTimer(gate, delay, OnStop::kOpen) {}
  // Opens the gate now (if the delay has not) and joins the thread.
  void finish() { stop(); }
};

// The live blocks of a case, by address, with the sizes asked for. insert() is where
// "live blocks never overlap" and "512-byte aligned" are checked.
class LiveBlocks {
 public:
  // Records [p, p + size); a failure names the block it overlaps.
  ::testing::AssertionResult insert(void* p, size_t size) {
    const uintptr_t a = address(p);
    if (a % kBlockUnit != 0) {
      return ::testing::AssertionFailure() << "block " << p << " is not 512-byte aligned";
    }
    auto next = blocks_.lower_bound(a);
    if (next != blocks_.end() && next->first < a + size) {
      return ::testing::AssertionFailure() << "block " << p << " +" << size << " overlaps "
                                           << reinterpret_cast<void*>(next->first) << " +"
                                           << next->second;
    }
    if (next != blocks_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second > a) {
        return ::testing::AssertionFailure() << "block " << p << " +" << size << " overlaps "
                                             << reinterpret_cast<void*>(prev->first) << " +"
                                             << prev->second;
      }
    }
    blocks_.emplace(a, size);
    return ::testing::AssertionSuccess();
  }
  void erase(void* p) { blocks_.erase(address(p)); }
  bool empty() const { return blocks_.empty(); }
  size_t count() const { return blocks_.size(); }
  const std::map<uintptr_t, size_t>& map() const { return blocks_; }
  // The pool's allocated_bytes for these blocks: each rounded up to 512 bytes.
  uint64_t rounded_bytes() const {
    uint64_t sum = 0;
    for (const auto& [a, size] : blocks_) sum += round_up(size, kBlockUnit);
    return sum;
  }

 private:
  std::map<uintptr_t, size_t> blocks_;
};

// Fills `size` bytes at device pointer `p` with a pattern derived from `seed` through a
// synchronous copy, reads them back through another, and says whether they survived.
inline ::testing::AssertionResult round_trip(void* p, size_t size, unsigned seed) {
  std::vector<unsigned char> in(size), out(size);
  for (size_t i = 0; i < size; ++i) in[i] = static_cast<unsigned char>((i * 131 + seed * 7 + 1) >> 3);
  cudaError_t e = cudaMemcpy(p, in.data(), size, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) return ::testing::AssertionFailure() << "copy in: " << cudaGetErrorName(e);
  e = cudaMemcpy(out.data(), p, size, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return ::testing::AssertionFailure() << "copy out: " << cudaGetErrorName(e);
  if (in != out) return ::testing::AssertionFailure() << "pattern changed at " << p;
  return ::testing::AssertionSuccess();
}

// Reads `size` bytes at device pointer `p` (synchronous copy) and checks they all equal
// `value`.
inline ::testing::AssertionResult holds_byte(const void* p, size_t size, unsigned char value) {
  std::vector<unsigned char> out(size);
  const cudaError_t e = cudaMemcpy(out.data(), p, size, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return ::testing::AssertionFailure() << "copy out: " << cudaGetErrorName(e);
  const size_t at = first_mismatch(out.data(), size, value);
  if (at != size) {
    return ::testing::AssertionFailure() << "byte " << at << " of block " << p << " is "
                                         << int{out[at]} << ", expected " << int{value};
  }
  return ::testing::AssertionSuccess();
}

// A pool of device 0 with `limit` bytes (0: the card) and one non-blocking stream, for
// the cases of one property each.
class PoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(stream_.status());
    ASSERT_NO_THROW(pool_ = std::make_unique<DevicePool>(PoolOptions{0, limit(), streams_reported(), 0, captures()}));
  }
  void TearDown() override {
    cudaDeviceSynchronize();
    pool_.reset();
  }
  virtual uint64_t limit() const { return 0; }
  virtual bool streams_reported() const { return false; }
  virtual const std::atomic<int>* captures() const { return nullptr; }

  // Allocates on `stream` (default: the case's stream); a failure is recorded with the
  // pool's report and nullptr returned.
  void* allocate(size_t size, cudaStream_t stream) {
    std::string error;
    void* p = pool_->allocate(size, stream, &error);
    if (p == nullptr) ADD_FAILURE() << "allocate(" << size << ") failed: " << error;
    return p;
  }
  void* allocate(size_t size) { return allocate(size, stream_); }

  // Frees on `stream` (default: the case's stream); a refusal is recorded.
  void deallocate(void* p, cudaStream_t stream) {
    const Result r = pool_->deallocate(p, stream);
    EXPECT_TRUE(r.ok) << "deallocate(" << p << ") refused: " << r.message;
  }
  void deallocate(void* p) { deallocate(p, stream_); }

  DevicePool& pool() { return *pool_; }
  PoolStats stats() const { return pool_->stats(); }

  Stream stream_;
  std::unique_ptr<DevicePool> pool_;
};

}  // namespace pool_test

#endif  // VRAMSWAP_TESTS_POOL_POOL_TEST_UTIL_H
