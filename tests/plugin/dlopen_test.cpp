// libvramswap.so as its users see it: loaded with dlopen() and called only through the
// symbols of include/vramswap/vramswap.h, found with dlsym(), the way torch's
// CUDAPluggableAllocator and ctypes use it. CUDA calls the test needs (cudaMemcpy, streams)
// are taken from the libcudart the library itself pulled in, so the test links no CUDA
// library. CTest runs each case in its own process (the allocator is per process and
// reads its configuration once) with CUDASIM_DEVICE_MEMORY=1GiB and a VRAMSWAP_LIMIT that
// VRAMSWAP_TEST_EXPECTED_LIMIT states in bytes (see CMakeLists.txt); the cases also pass
// when the whole binary runs in one process.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "vramswap/vramswap.h"

#ifndef VRAMSWAP_LIBRARY_PATH
#error "VRAMSWAP_LIBRARY_PATH must name the built libvramswap.so"
#endif

namespace {

constexpr uint64_t kMiB = 1ull << 20;

// The C ABI, through dlsym.
struct Api {
  decltype(&vramswap_malloc) malloc = nullptr;
  decltype(&vramswap_free) free = nullptr;
  decltype(&vramswap_record_stream) record_stream = nullptr;
  decltype(&vramswap_empty_cache) empty_cache = nullptr;
  decltype(&vramswap_configure) configure = nullptr;
  decltype(&vramswap_last_error) last_error = nullptr;
  decltype(&vramswap_stats_json) stats_json = nullptr;
  decltype(&vramswap_reset_peak_stats) reset_peak_stats = nullptr;
  // From the runtime libvramswap.so depends on.
  decltype(&cudaMemcpy) memcpy = nullptr;
  decltype(&cudaMalloc) cuda_malloc = nullptr;
  decltype(&cudaFree) cuda_free = nullptr;
  decltype(&cudaStreamCreate) stream_create = nullptr;
  decltype(&cudaStreamDestroy) stream_destroy = nullptr;
  decltype(&cudaStreamSynchronize) stream_synchronize = nullptr;
  decltype(&cudaMemsetAsync) memset_async = nullptr;
};

template <typename F>
void find(void* handle, F*& slot, const char* name, std::string* missing) {
  slot = reinterpret_cast<F*>(dlsym(handle, name));
  if (!slot) *missing += std::string(" ") + name;
}

// Loads the library once per process; the handle is never closed (as torch never does).
const Api& api() {
  static const Api loaded = [] {
    Api a;
    void* handle = dlopen(VRAMSWAP_LIBRARY_PATH, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      ADD_FAILURE() << "dlopen(" << VRAMSWAP_LIBRARY_PATH << "): " << dlerror();
      return a;
    }
    std::string missing;
    find(handle, a.malloc, "vramswap_malloc", &missing);
    find(handle, a.free, "vramswap_free", &missing);
    find(handle, a.record_stream, "vramswap_record_stream", &missing);
    find(handle, a.empty_cache, "vramswap_empty_cache", &missing);
    find(handle, a.configure, "vramswap_configure", &missing);
    find(handle, a.last_error, "vramswap_last_error", &missing);
    find(handle, a.stats_json, "vramswap_stats_json", &missing);
    find(handle, a.reset_peak_stats, "vramswap_reset_peak_stats", &missing);
    find(handle, a.memcpy, "cudaMemcpy", &missing);
    find(handle, a.cuda_malloc, "cudaMalloc", &missing);
    find(handle, a.cuda_free, "cudaFree", &missing);
    find(handle, a.stream_create, "cudaStreamCreate", &missing);
    find(handle, a.stream_destroy, "cudaStreamDestroy", &missing);
    find(handle, a.stream_synchronize, "cudaStreamSynchronize", &missing);
    find(handle, a.memset_async, "cudaMemsetAsync", &missing);
    if (!missing.empty()) ADD_FAILURE() << "dlsym found no" << missing;
    return a;
  }();
  return loaded;
}

std::string stats() {
  const Api& a = api();
  size_t n = a.stats_json(nullptr, 0);
  std::string buf(n + 256, '\0');  // slack: the numbers may grow in between
  size_t m = a.stats_json(buf.data(), buf.size());
  EXPECT_LT(m, buf.size());
  buf.resize(std::strlen(buf.c_str()));
  EXPECT_EQ(buf.size(), m);
  return buf;
}

// The first "key":<integer> in `json`: the totals, which come before "devices".
std::optional<uint64_t> number(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\":";
  size_t at = json.find(needle);
  if (at == std::string::npos) return std::nullopt;
  return std::strtoull(json.c_str() + at + needle.size(), nullptr, 10);
}

uint64_t counter(const std::string& key) {
  std::optional<uint64_t> v = number(stats(), key);
  EXPECT_TRUE(v.has_value()) << key << " missing from " << stats();
  return v.value_or(0);
}

std::string last_error() { return api().last_error(); }

uint64_t expected_limit() {
  const char* text = std::getenv("VRAMSWAP_TEST_EXPECTED_LIMIT");
  return text ? std::strtoull(text, nullptr, 10) : 0;
}

// Captures what the calling code writes to file descriptor 2.
class StderrCapture {
 public:
  StderrCapture() {
    std::fflush(stderr);
    char path[] = "/tmp/vramswap_stderr_XXXXXX";
    fd_ = mkstemp(path);
    unlink(path);
    saved_ = dup(STDERR_FILENO);
    dup2(fd_, STDERR_FILENO);
  }
  ~StderrCapture() { restore(); }
  std::string text() {
    restore();
    std::string out;
    char buf[4096];
    lseek(fd_, 0, SEEK_SET);
    for (ssize_t n; (n = read(fd_, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
    return out;
  }

 private:
  void restore() {
    if (saved_ >= 0) {
      std::fflush(stderr);
      dup2(saved_, STDERR_FILENO);
      close(saved_);
      saved_ = -1;
    }
  }
  int fd_ = -1;
  int saved_ = -1;
};

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class Plugin : public ::testing::Test {
 protected:
  void SetUp() override {
    const Api& a = api();
    ASSERT_NE(a.malloc, nullptr);
    ASSERT_NE(a.memcpy, nullptr);
  }
  const Api& a = api();
};

TEST_F(Plugin, MallocAndFreeOnTheDefaultStream) {
  const uint64_t allocs = counter("num_allocs");
  const uint64_t frees = counter("num_frees");
  void* p = a.malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 512, 0u);
  EXPECT_EQ(counter("num_allocs"), allocs + 1);
  EXPECT_GE(counter("allocated_bytes"), kMiB);
  a.free(p, kMiB, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(counter("num_frees"), frees + 1);
}

TEST_F(Plugin, SizeZeroIsNullAndNotAnError) {
  const uint64_t allocs = counter("num_allocs");
  EXPECT_EQ(a.malloc(0, 0, nullptr), nullptr);
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(counter("num_allocs"), allocs);
  a.free(nullptr, 0, 0, nullptr);  // what torch passes back for it
  EXPECT_STREQ(a.last_error(), "");
}

TEST_F(Plugin, WrittenBytesReadBackThroughCudaMemcpy) {
  const size_t n = 3 * kMiB + 123;
  void* p = a.malloc(n, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  std::vector<unsigned char> in(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<unsigned char>(i * 131 + 7);
  ASSERT_EQ(a.memcpy(p, in.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(a.memcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(in, out);
  a.free(p, n, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");
}

TEST_F(Plugin, LiveBlocksDoNotOverlapAndAreAligned) {
  std::vector<std::pair<uintptr_t, size_t>> blocks;
  const size_t sizes[] = {1, 511, 512, 513, 4096, 100000, kMiB, 3 * kMiB + 1, 7};
  for (int round = 0; round < 3; ++round) {
    for (size_t s : sizes) {
      void* p = a.malloc(s, 0, nullptr);
      ASSERT_NE(p, nullptr) << last_error();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 512, 0u);
      blocks.emplace_back(reinterpret_cast<uintptr_t>(p), s);
    }
  }
  std::sort(blocks.begin(), blocks.end());
  for (size_t i = 1; i < blocks.size(); ++i)
    EXPECT_LE(blocks[i - 1].first + blocks[i - 1].second, blocks[i].first) << "blocks " << i - 1 << " and " << i;
  for (auto& [p, s] : blocks) a.free(reinterpret_cast<void*>(p), s, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");
}

TEST_F(Plugin, ForeignPointerFreeIsReported) {
  const uint64_t invalid = counter("num_invalid_frees");
  const uint64_t frees = counter("num_frees");
  int local = 0;
  StderrCapture capture;
  a.free(&local, sizeof local, 0, nullptr);
  const std::string error = last_error();
  EXPECT_NE(error.find("not a pointer vramswap allocated"), std::string::npos) << error;
  EXPECT_EQ(count(capture.text(), "vramswap: warning: free of"), 1u);
  // Memory from the runtime's own cudaMalloc is foreign to vramswap too.
  void* runtime_block = nullptr;
  ASSERT_EQ(a.cuda_malloc(&runtime_block, kMiB), cudaSuccess);
  a.free(runtime_block, kMiB, 0, nullptr);
  EXPECT_NE(last_error().find("not a pointer vramswap allocated"), std::string::npos) << last_error();
  EXPECT_EQ(a.cuda_free(runtime_block), cudaSuccess);  // still the runtime's, untouched
  EXPECT_EQ(counter("num_invalid_frees"), invalid + 2);
  EXPECT_EQ(counter("num_frees"), frees);
}

TEST_F(Plugin, DoubleFreeIsReported) {
  void* p = a.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  a.free(p, 4096, 0, nullptr);
  ASSERT_STREQ(a.last_error(), "");
  const uint64_t frees = counter("num_frees");
  StderrCapture capture;
  a.free(p, 4096, 0, nullptr);
  EXPECT_NE(last_error().find("double free"), std::string::npos) << last_error();
  EXPECT_EQ(count(capture.text(), "vramswap: warning:"), 1u);
  EXPECT_EQ(counter("num_frees"), frees);
  // The next call on this thread starts with a clean last error.
  void* q = a.malloc(4096, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");
  a.free(q, 4096, 0, nullptr);
}

TEST_F(Plugin, InteriorPointerFreeIsReportedAndChangesNothing) {
  void* p = a.malloc(8192, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  a.free(static_cast<char*>(p) + 512, 8192, 0, nullptr);
  EXPECT_NE(last_error(), "");
  a.free(p, 8192, 0, nullptr);  // the block is still live and frees normally
  EXPECT_STREQ(a.last_error(), "");
}

TEST_F(Plugin, LastErrorIsPerThread) {
  int local = 0;
  a.free(&local, sizeof local, 0, nullptr);
  ASSERT_NE(last_error(), "");
  std::string other = "unset";
  std::thread([&] { other = a.last_error(); }).join();
  EXPECT_EQ(other, "");
  EXPECT_NE(last_error(), "");
}

TEST_F(Plugin, InvalidDeviceIsAnError) {
  for (int device : {-1, 7, 1000}) {
    EXPECT_EQ(a.malloc(kMiB, device, nullptr), nullptr);
    EXPECT_NE(last_error().find("device"), std::string::npos) << device << ": " << last_error();
  }
}

TEST_F(Plugin, ConfigureAcceptsValidValues) {
  EXPECT_EQ(a.configure("VRAMSWAP_LOG", "error"), 0) << last_error();
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(a.configure("VRAMSWAP_STATS_FILE", ""), 0) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_LOG", "warn"), 0) << last_error();
}

TEST_F(Plugin, ConfigureRefusesInvalidValues) {
  EXPECT_EQ(a.configure("VRAMSWAP_LIMIT", "12XB"), -1);
  EXPECT_NE(last_error().find("VRAMSWAP_LIMIT='12XB'"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("expected"), std::string::npos) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_LOG", "loud"), -1);
  EXPECT_NE(last_error().find("VRAMSWAP_LOG"), std::string::npos) << last_error();
  EXPECT_EQ(a.configure(nullptr, "1"), -1);
  EXPECT_NE(last_error(), "");
  EXPECT_EQ(a.configure("VRAMSWAP_LOG", nullptr), -1);
  EXPECT_NE(last_error(), "");
}

TEST_F(Plugin, ConfigureRefusesUnknownKeysNamingTheClosest) {
  EXPECT_EQ(a.configure("VRAMSWAP_LIMT", "1GiB"), -1);
  EXPECT_NE(last_error().find("VRAMSWAP_LIMIT"), std::string::npos) << last_error();
  EXPECT_EQ(a.configure("SOMETHING_ELSE", "1"), -1);
  EXPECT_NE(last_error(), "");
}

TEST_F(Plugin, LimitIsFrozenOnceAPoolExists) {
  void* p = a.malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_LIMIT", "128MiB"), -1);
  EXPECT_NE(last_error().find("VRAMSWAP_LIMIT"), std::string::npos) << last_error();
  EXPECT_EQ(counter("device_limit_bytes"), expected_limit());
  // The value in force is accepted as a no-op.
  EXPECT_EQ(a.configure("VRAMSWAP_LIMIT", std::getenv("VRAMSWAP_LIMIT")), 0) << last_error();
  a.free(p, kMiB, 0, nullptr);
}

TEST_F(Plugin, LimitComesFromTheEnvironment) {
  ASSERT_NE(expected_limit(), 0u) << "VRAMSWAP_TEST_EXPECTED_LIMIT is not set";
  void* p = a.malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  const std::string json = stats();
  EXPECT_EQ(number(json, "device_limit_bytes"), expected_limit()) << json;
  a.free(p, kMiB, 0, nullptr);
}

TEST_F(Plugin, StatsJsonHasEveryKeyAndCountersMove) {
  std::string json = stats();
  ASSERT_FALSE(json.empty());
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  const char* keys[] = {"allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                        "device_limit_bytes", "num_allocs", "num_frees", "num_cache_hits",
                        "num_ooms", "num_invalid_frees"};
  for (const char* k : keys) EXPECT_TRUE(number(json, k).has_value()) << k << " in " << json;
  // The totals come in the documented order.
  size_t previous = 0;
  for (const char* k : keys) {
    size_t at = json.find(std::string("\"") + k + "\":");
    EXPECT_GE(at, previous) << k;
    previous = at;
  }
  EXPECT_NE(json.find("\"devices\":["), std::string::npos) << json;

  const uint64_t allocs = counter("num_allocs"), frees = counter("num_frees");
  void* p = a.malloc(2 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  json = stats();
  EXPECT_EQ(number(json, "num_allocs"), allocs + 1);
  EXPECT_GE(number(json, "allocated_bytes").value_or(0), 2 * kMiB);
  EXPECT_GE(number(json, "reserved_bytes").value_or(0), 2 * kMiB);
  EXPECT_GE(number(json, "peak_allocated_bytes").value_or(0), 2 * kMiB);
  EXPECT_NE(json.find("\"devices\":[{\"device\":0,"), std::string::npos) << json;
  a.free(p, 2 * kMiB, 0, nullptr);
  // Freed and allocated again on the same stream: served from the cache.
  const uint64_t hits = counter("num_cache_hits");
  p = a.malloc(2 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(counter("num_cache_hits"), hits + 1);
  a.free(p, 2 * kMiB, 0, nullptr);
  EXPECT_EQ(counter("num_frees"), frees + 2);

  // A buffer that is too small gets "" and the length needed.
  char small[8];
  std::memset(small, 'x', sizeof small);
  size_t needed = a.stats_json(small, sizeof small);
  EXPECT_GT(needed, sizeof small);
  EXPECT_EQ(small[0], '\0');
}

TEST_F(Plugin, ResetPeakStatsLowersThePeakToTheCurrentValue) {
  void* p = a.malloc(8 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  a.free(p, 8 * kMiB, 0, nullptr);
  EXPECT_GE(counter("peak_allocated_bytes"), 8 * kMiB);
  a.reset_peak_stats();
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(counter("peak_allocated_bytes"), counter("allocated_bytes"));
}

TEST_F(Plugin, OutOfMemoryUnderTheLimitIsNullWithAReport) {
  const uint64_t limit = expected_limit();
  ASSERT_NE(limit, 0u);
  const uint64_t ooms = counter("num_ooms");
  const size_t request = static_cast<size_t>(limit) + kMiB;
  StderrCapture capture;
  void* p = a.malloc(request, 0, nullptr);
  const std::string err = capture.text();
  EXPECT_EQ(p, nullptr);
  const std::string error = last_error();
  EXPECT_NE(error.find(std::to_string(request)), std::string::npos) << "the request: " << error;
  const std::string limit_text = std::to_string(limit / kMiB) + " MiB";
  EXPECT_NE(error.find(limit_text), std::string::npos) << "the limit (" << limit_text << "): " << error;
  EXPECT_NE(error.find("VRAMSWAP_LIMIT"), std::string::npos) << error;
  EXPECT_EQ(count(err, "\n"), 1u) << "one line: " << err;
  EXPECT_EQ(count(err, "vramswap: warning: out of memory"), 1u) << err;
  EXPECT_EQ(counter("num_ooms"), ooms + 1);
  // Under the limit, allocation works again afterwards.
  void* q = a.malloc(kMiB, 0, nullptr);
  EXPECT_NE(q, nullptr) << last_error();
  a.free(q, kMiB, 0, nullptr);
}

TEST_F(Plugin, CachedMemoryIsUsedBeforeFailingAtTheLimit) {
  // Fill most of the limit, free it, then ask for another stream: the pool must give back
  // its cache rather than report out of memory.
  const uint64_t limit = expected_limit();
  const size_t big = static_cast<size_t>(limit / 2);
  void* p = a.malloc(big, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  a.free(p, big, 0, nullptr);
  cudaStream_t s = nullptr;
  ASSERT_EQ(a.stream_create(&s), cudaSuccess);
  void* q = a.malloc(static_cast<size_t>(limit - limit / 4), 0, s);
  EXPECT_NE(q, nullptr) << last_error();
  a.free(q, 0, 0, s);
  EXPECT_STREQ(a.last_error(), "");
  a.stream_destroy(s);
}

TEST_F(Plugin, EmptyCacheLowersReservedBytes) {
  void* p = a.malloc(32 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  a.free(p, 32 * kMiB, 0, nullptr);
  const uint64_t before = counter("reserved_bytes");
  EXPECT_GE(before, 32 * kMiB);
  a.empty_cache();
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_LE(counter("reserved_bytes"), before - 32 * kMiB);
  EXPECT_EQ(counter("allocated_bytes"), 0u);
}

TEST_F(Plugin, RecordStreamAndStreamOrderedReuse) {
  cudaStream_t s1 = nullptr, s2 = nullptr;
  ASSERT_EQ(a.stream_create(&s1), cudaSuccess);
  ASSERT_EQ(a.stream_create(&s2), cudaSuccess);
  void* p = a.malloc(kMiB, 0, s1);
  ASSERT_NE(p, nullptr) << last_error();
  a.record_stream(p, s2);
  EXPECT_STREQ(a.last_error(), "");
  ASSERT_EQ(a.memset_async(p, 0x5a, kMiB, s2), cudaSuccess);
  a.free(p, kMiB, 0, s1);
  EXPECT_STREQ(a.last_error(), "");
  // Reused at once on the freeing stream; never handed to s2 while s2's work may be queued.
  void* q = a.malloc(kMiB, 0, s1);
  ASSERT_NE(q, nullptr) << last_error();
  void* r = a.malloc(kMiB, 0, s2);
  ASSERT_NE(r, nullptr) << last_error();
  EXPECT_NE(q, r);
  a.free(q, kMiB, 0, s1);
  a.free(r, kMiB, 0, s2);
  EXPECT_EQ(a.stream_synchronize(s2), cudaSuccess);
  int local = 0;
  a.record_stream(&local, s1);
  EXPECT_NE(last_error().find("not a pointer vramswap allocated"), std::string::npos) << last_error();
  a.stream_destroy(s1);
  a.stream_destroy(s2);
}

TEST_F(Plugin, ManyThreadsAllocateAndFree) {
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      unsigned seed = 12345u + static_cast<unsigned>(t);
      std::vector<void*> live;
      for (int i = 0; i < kRounds; ++i) {
        seed = seed * 1103515245u + 12345u;
        size_t size = 512 + (seed >> 8) % (256 * 1024);
        void* p = a.malloc(size, 0, nullptr);
        if (!p) {
          ++failures[t];
          continue;
        }
        std::memset(p, t, 1);  // cudasim memory is host memory: touch it as a kernel would
        live.push_back(p);
        if (live.size() > 8) {
          a.free(live.front(), 0, 0, nullptr);
          if (a.last_error()[0] != '\0') ++failures[t];
          live.erase(live.begin());
        }
      }
      for (void* p : live) a.free(p, 0, 0, nullptr);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
  EXPECT_EQ(counter("allocated_bytes"), 0u);
}

TEST_F(Plugin, StatsFileIsWrittenAtExit) {
  // A fresh process (threadsafe style re-runs this test in a new process), so that the
  // child is the process that uses the allocator. It inherits the directory through the
  // environment, since it runs this body again from the start.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* inherited = std::getenv("VRAMSWAP_TEST_STATS_DIR");
  std::string dir = inherited ? inherited : "";
  if (dir.empty()) {
    char made[] = "/tmp/vramswap_stats_XXXXXX";
    ASSERT_NE(mkdtemp(made), nullptr);
    dir = made;
    setenv("VRAMSWAP_TEST_STATS_DIR", made, 1);
  }
  const std::string path = dir + "/stats.json";
  EXPECT_EXIT(
      {
        if (api().configure("VRAMSWAP_STATS_FILE", path.c_str()) != 0) std::_Exit(3);
        void* p = api().malloc(kMiB, 0, nullptr);
        if (!p) std::_Exit(4);
        api().free(p, kMiB, 0, nullptr);
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(number(text.str(), "num_allocs"), 1u) << text.str();
  EXPECT_EQ(number(text.str(), "num_frees"), 1u) << text.str();
  std::remove(path.c_str());
  rmdir(dir.c_str());
  unsetenv("VRAMSWAP_TEST_STATS_DIR");
}

// Registered on its own, with VRAMSWAP_LIMIT=12XB in the environment (CMakeLists.txt).
TEST(PluginBadEnvironment, AllocationIsRefusedUntilTheValueIsFixed) {
  const char* limit = std::getenv("VRAMSWAP_LIMIT");
  if (!limit || std::string(limit) != "12XB") GTEST_SKIP() << "needs VRAMSWAP_LIMIT=12XB";
  const Api& a = api();
  ASSERT_NE(a.malloc, nullptr);
  EXPECT_EQ(a.malloc(kMiB, 0, nullptr), nullptr);
  EXPECT_NE(last_error().find("VRAMSWAP_LIMIT='12XB'"), std::string::npos) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_LIMIT", "64MiB"), 0) << last_error();
  void* p = a.malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(number(stats(), "device_limit_bytes"), 64 * kMiB);
  a.free(p, kMiB, 0, nullptr);
}

}  // namespace
