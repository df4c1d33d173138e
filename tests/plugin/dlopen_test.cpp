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
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <condition_variable>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
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
  decltype(&vramswap_torch_malloc) torch_malloc = nullptr;  // throws: see its test below
  decltype(&vramswap_free) free = nullptr;
  decltype(&vramswap_record_stream) record_stream = nullptr;
  decltype(&vramswap_stream_destroyed) stream_destroyed = nullptr;
  decltype(&vramswap_empty_cache) empty_cache = nullptr;
  decltype(&vramswap_enable_peer_access) enable_peer_access = nullptr;
  decltype(&vramswap_capture_begin) capture_begin = nullptr;
  decltype(&vramswap_capture_end) capture_end = nullptr;
  decltype(&vramswap_configure) configure = nullptr;
  decltype(&vramswap_last_error) last_error = nullptr;
  decltype(&vramswap_stats_json) stats_json = nullptr;
  decltype(&vramswap_reset_peak_stats) reset_peak_stats = nullptr;
  decltype(&vramswap_record_history) record_history = nullptr;
  decltype(&vramswap_snapshot_json) snapshot_json = nullptr;
  decltype(&vramswap_scope_push) scope_push = nullptr;
  decltype(&vramswap_scope_pop) scope_pop = nullptr;
  decltype(&vramswap_pack) pack = nullptr;
  decltype(&vramswap_graph_begin) graph_begin = nullptr;
  decltype(&vramswap_mark_cold) mark_cold = nullptr;
  decltype(&vramswap_unpack) unpack = nullptr;
  decltype(&vramswap_release) release = nullptr;
  decltype(&vramswap_prefetch) prefetch = nullptr;
  decltype(&vramswap_set_cold_probe) set_cold_probe = nullptr;
  decltype(&vramswap_keep) keep = nullptr;
  decltype(&vramswap_use) use = nullptr;
  decltype(&vramswap_unkeep) unkeep = nullptr;
  // From the runtime libvramswap.so depends on.
  decltype(&cudaMemcpy) memcpy = nullptr;
  decltype(&cudaMalloc) cuda_malloc = nullptr;
  decltype(&cudaFree) cuda_free = nullptr;
  decltype(&cudaStreamCreate) stream_create = nullptr;
  decltype(&cudaStreamDestroy) stream_destroy = nullptr;
  decltype(&cudaStreamSynchronize) stream_synchronize = nullptr;
  decltype(&cudaDeviceSynchronize) device_synchronize = nullptr;
  decltype(&cudaMemsetAsync) memset_async = nullptr;
  decltype(&cudaMemcpyAsync) memcpy_async = nullptr;
  decltype(&cudaSetDevice) set_device = nullptr;
  decltype(&cudaGetDeviceCount) device_count = nullptr;
  decltype(&cudaStreamBeginCapture) begin_capture = nullptr;
  decltype(&cudaStreamEndCapture) end_capture = nullptr;
  decltype(&cudaGraphDestroy) graph_destroy = nullptr;
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
    find(handle, a.torch_malloc, "vramswap_torch_malloc", &missing);
    find(handle, a.free, "vramswap_free", &missing);
    find(handle, a.record_stream, "vramswap_record_stream", &missing);
    find(handle, a.stream_destroyed, "vramswap_stream_destroyed", &missing);
    find(handle, a.enable_peer_access, "vramswap_enable_peer_access", &missing);
    find(handle, a.capture_begin, "vramswap_capture_begin", &missing);
    find(handle, a.capture_end, "vramswap_capture_end", &missing);
    find(handle, a.empty_cache, "vramswap_empty_cache", &missing);
    find(handle, a.configure, "vramswap_configure", &missing);
    find(handle, a.last_error, "vramswap_last_error", &missing);
    find(handle, a.stats_json, "vramswap_stats_json", &missing);
    find(handle, a.reset_peak_stats, "vramswap_reset_peak_stats", &missing);
    find(handle, a.record_history, "vramswap_record_history", &missing);
    find(handle, a.snapshot_json, "vramswap_snapshot_json", &missing);
    find(handle, a.scope_push, "vramswap_scope_push", &missing);
    find(handle, a.scope_pop, "vramswap_scope_pop", &missing);
    find(handle, a.pack, "vramswap_pack", &missing);
    find(handle, a.graph_begin, "vramswap_graph_begin", &missing);
    find(handle, a.mark_cold, "vramswap_mark_cold", &missing);
    find(handle, a.unpack, "vramswap_unpack", &missing);
    find(handle, a.release, "vramswap_release", &missing);
    find(handle, a.prefetch, "vramswap_prefetch", &missing);
    find(handle, a.set_cold_probe, "vramswap_set_cold_probe", &missing);
    find(handle, a.keep, "vramswap_keep", &missing);
    find(handle, a.use, "vramswap_use", &missing);
    find(handle, a.unkeep, "vramswap_unkeep", &missing);
    find(handle, a.memcpy, "cudaMemcpy", &missing);
    find(handle, a.cuda_malloc, "cudaMalloc", &missing);
    find(handle, a.cuda_free, "cudaFree", &missing);
    find(handle, a.stream_create, "cudaStreamCreate", &missing);
    find(handle, a.stream_destroy, "cudaStreamDestroy", &missing);
    find(handle, a.stream_synchronize, "cudaStreamSynchronize", &missing);
    find(handle, a.device_synchronize, "cudaDeviceSynchronize", &missing);
    find(handle, a.memset_async, "cudaMemsetAsync", &missing);
    find(handle, a.memcpy_async, "cudaMemcpyAsync", &missing);
    find(handle, a.set_device, "cudaSetDevice", &missing);
    find(handle, a.device_count, "cudaGetDeviceCount", &missing);
    find(handle, a.begin_capture, "cudaStreamBeginCapture", &missing);
    find(handle, a.end_capture, "cudaStreamEndCapture", &missing);
    find(handle, a.graph_destroy, "cudaGraphDestroy", &missing);
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

// What the configuration table's "takes effect" column says: once a pool exists, the keys
// the pools and engines were created with are refused when they would change, the others
// change at once.
TEST_F(Plugin, KeysTakeEffectWhenTheTableSays) {
  void* p = a.malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  const char* verify = std::getenv("VRAMSWAP_VERIFY");
  const std::pair<const char*, const char*> changes[] = {
      {"VRAMSWAP_LIMIT", "77MiB"},   {"VRAMSWAP_SOFT_LIMIT", "77MiB"}, {"VRAMSWAP_HOST_LIMIT", "77MiB"},
      {"VRAMSWAP_HORIZON", "7"},     {"VRAMSWAP_PLAN", "off"},
      {"VRAMSWAP_VERIFY", verify && std::string(verify) == "1" ? "0" : "1"}};
  for (const auto& [key, value] : changes) {
    EXPECT_EQ(a.configure(key, value), -1) << key;
    EXPECT_NE(last_error().find("before the first allocation"), std::string::npos) << key << ": " << last_error();
  }
  EXPECT_EQ(a.configure("VRAMSWAP_MIN_OFFLOAD_BYTES", "128KiB"), 0) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_LOG", "error"), 0) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_STATS_FILE", ""), 0) << last_error();
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

// The keys of the statistics document, in order, as vramswap.h documents them (the words of
// its list outside parentheses): the totals' keys up to "devices".
std::vector<std::string> documented_stats_keys() {
  std::ifstream in(VRAMSWAP_HEADER_PATH);
  std::stringstream text;
  text << in.rdbuf();
  std::string doc = text.str();
  const size_t from = doc.find("Keys, in this order:");
  const size_t to = doc.find("then \"devices\"", from);
  if (from == std::string::npos || to == std::string::npos) return {};
  doc = doc.substr(from + std::strlen("Keys, in this order:"), to - from);
  std::string flat;  // without the comment's '*', line breaks and parenthesized remarks
  int depth = 0;
  for (char c : doc) {
    if (c == '(') ++depth;
    else if (c == ')') --depth;
    else if (depth == 0) flat += c == '*' || c == '\n' ? ' ' : c;
  }
  std::vector<std::string> keys;
  std::string word;
  for (char c : flat + " ") {
    if (std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '_') {
      word += c;
    } else {
      if (word.find('_') != std::string::npos) keys.push_back(word);
      word.clear();
    }
  }
  return keys;
}

// The keys of the totals object of a statistics document, in order (up to "devices").
std::vector<std::string> json_total_keys(const std::string& json) {
  std::vector<std::string> keys;
  for (size_t at = json.find('"'); at != std::string::npos; at = json.find('"', at)) {
    const size_t end = json.find('"', at + 1);
    const std::string key = json.substr(at + 1, end - at - 1);
    if (key == "devices") break;
    keys.push_back(key);
    at = json.find_first_of(",}", end);
  }
  return keys;
}

// The statistics that are the process's, not a device's: they come once, after the totals.
bool is_process_wide(std::string_view key) {
  return key == "num_invalid_frees" || key == "host_wait_ns" || key == "host_vmm_ns" || key == "host_pin_ns" ||
         key == "host_vmm_mapped_bytes" || key == "host_vmm_unmapped_bytes" || key == "host_vmm_created_bytes" ||
         key == "host_vmm_released_bytes" || key == "host_vmm_map_calls" || key == "host_vmm_unmap_calls" ||
         key == "host_vmm_create_calls" || key == "host_vmm_release_calls";
}

// vramswap.h's list of the statistics keys is the document's, in its order: a counter added
// to one is added to the other.
TEST_F(Plugin, StatsKeysAreTheOnesTheHeaderLists) {
  const std::vector<std::string> documented = documented_stats_keys();
  ASSERT_FALSE(documented.empty()) << "no key list found in " << VRAMSWAP_HEADER_PATH;
  EXPECT_EQ(json_total_keys(stats()), documented);
  // Each device's object repeats them but the process-wide ones, and says so.
  std::ifstream in(VRAMSWAP_HEADER_PATH);
  std::stringstream text;
  text << in.rdbuf();
  const size_t per_device = std::count_if(documented.begin(), documented.end(),
                                          [](const std::string& k) { return !is_process_wide(k); });
  const std::string same = "the same " + std::to_string(per_device) + " keys";
  EXPECT_NE(text.str().find(same), std::string::npos) << "vramswap.h should say \"" << same << "\"";
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

// The snapshot in torch's layout (runtime/snapshot_document.h): a live block is in a segment,
// and the history recorded since vramswap_record_history holds its alloc and free with the
// size asked for; a buffer too small gets "" and the length needed.
TEST_F(Plugin, SnapshotJsonHasTheLiveBlockAndTheRecordedHistory) {
  a.record_history(1000);
  EXPECT_STREQ(a.last_error(), "");
  void* p = a.malloc(3 * kMiB + 100, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  auto snapshot = [&] {
    const size_t n = a.snapshot_json(nullptr, 0);
    std::string buf(n + 4096, '\0');
    const size_t m = a.snapshot_json(buf.data(), buf.size());
    EXPECT_LT(m, buf.size());
    buf.resize(std::strlen(buf.c_str()));
    EXPECT_EQ(buf.size(), m);
    return buf;
  };
  const std::string addr = std::to_string(reinterpret_cast<uintptr_t>(p));
  const std::string live = snapshot();
  EXPECT_EQ(0u, live.find(R"({"segments":[{"device":0,)")) << live;
  EXPECT_NE(std::string::npos,
            live.find(R"({"address":)" + addr + R"(,"size":)" + std::to_string(3 * kMiB + 512) +
                      R"(,"requested_size":)" + std::to_string(3 * kMiB + 100) + R"(,"state":"active_allocated")"))
      << live;
  a.free(p, 3 * kMiB + 100, 0, nullptr);
  const std::string after = snapshot();
  for (const char* action : {"alloc", "free_requested", "free_completed"})
    EXPECT_NE(std::string::npos, after.find(R"({"action":")" + std::string(action) + R"(","addr":)" + addr +
                                            R"(,"size":)" + std::to_string(3 * kMiB + 100)))
        << action << " in " << after;
  char small[8];
  std::memset(small, 'x', sizeof small);
  EXPECT_GT(a.snapshot_json(small, sizeof small), sizeof small);
  EXPECT_EQ(small[0], '\0');
  a.record_history(0);
  EXPECT_EQ(std::string::npos, snapshot().find(R"("action")")) << "recording stopped: the events kept go";
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

// vramswap_torch_malloc, the alloc function torch's CUDAPluggableAllocator gets on
// install()'s ctypes path: the same allocation as vramswap_malloc, but a failure throws a
// std::runtime_error carrying the whole report (torch would use a NULL as a tensor's data
// pointer), and size 0 is NULL without a throw.
TEST_F(Plugin, TorchMallocServesWithinTheLimitAndThrowsTheReportPastIt) {
  ASSERT_NE(a.torch_malloc, nullptr);
  const uint64_t limit = expected_limit();
  ASSERT_NE(limit, 0u);

  // Within the limit: a block, as from vramswap_malloc, freed with vramswap_free.
  const uint64_t allocs = counter("num_allocs");
  const uint64_t frees = counter("num_frees");
  void* p = nullptr;
  EXPECT_NO_THROW(p = a.torch_malloc(4 * kMiB, 0, nullptr));
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 512, 0u);
  EXPECT_EQ(counter("num_allocs"), allocs + 1);
  std::vector<unsigned char> in(4 * kMiB, 0x5a), out(4 * kMiB, 0);
  ASSERT_EQ(a.memcpy(p, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(a.memcpy(out.data(), p, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(in, out);
  a.free(p, 4 * kMiB, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(counter("num_frees"), frees + 1);

  // Size 0 (torch allows it): NULL, no exception, no error, nothing counted.
  void* zero = reinterpret_cast<void*>(1);
  EXPECT_NO_THROW(zero = a.torch_malloc(0, 0, nullptr));
  EXPECT_EQ(zero, nullptr);
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(counter("num_allocs"), allocs + 1);

  // Past the limit: std::runtime_error whose what() is the prefix and the whole report,
  // which is also the last error, with the same one warning line vramswap_malloc writes.
  const uint64_t ooms = counter("num_ooms");
  const size_t request = static_cast<size_t>(limit) + kMiB;
  StderrCapture capture;
  std::string what;
  bool threw = false;
  try {
    void* big = a.torch_malloc(request, 0, nullptr);
    ADD_FAILURE() << "no exception; returned " << big << ", last error: " << last_error();
    if (big) a.free(big, request, 0, nullptr);
  } catch (const std::runtime_error& e) {
    threw = true;
    what = e.what();
  } catch (...) {
    ADD_FAILURE() << "threw something other than std::runtime_error";
  }
  const std::string err = capture.text();
  ASSERT_TRUE(threw);
  const std::string report = last_error();
  ASSERT_NE(report, "");
  EXPECT_EQ(what, "vramswap: CUDA out of memory allocating " + std::to_string(request) + " bytes on device 0: " + report);
  const std::string limit_text = std::to_string(limit / kMiB) + " MiB";
  EXPECT_NE(what.find(limit_text), std::string::npos) << "the limit (" << limit_text << "): " << what;
  EXPECT_NE(what.find("VRAMSWAP_LIMIT"), std::string::npos) << what;
  EXPECT_EQ(count(err, "vramswap: warning: out of memory"), 1u) << err;
  EXPECT_EQ(counter("num_ooms"), ooms + 1);

  // The pool is unharmed: allocation works again afterwards, through either entry point.
  void* q = nullptr;
  EXPECT_NO_THROW(q = a.torch_malloc(kMiB, 0, nullptr));
  EXPECT_NE(q, nullptr) << last_error();
  a.free(q, kMiB, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");
}

TEST_F(Plugin, TorchMallocOnAnInvalidDeviceThrowsAFailureThatIsNotOutOfMemory) {
  ASSERT_NE(a.torch_malloc, nullptr);
  try {
    a.torch_malloc(kMiB, 7, nullptr);
    ADD_FAILURE() << "no exception for device 7";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what, "vramswap: allocating 1048576 bytes on device 7 failed: " + last_error());
    EXPECT_NE(last_error().find("device"), std::string::npos) << last_error();
  }
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

// cudasim's stand-in for a kernel that keeps `stream` busy for `ns` (real time: at most
// 10 ms), or nullptr when the process does not run on cudasim.
using SimKernel = int (*)(void*, uint64_t, const char*);
SimKernel sim_kernel() {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return driver ? reinterpret_cast<SimKernel>(dlsym(driver, "cudasim_kernel")) : nullptr;
}

// cudaStreamPerThread is one handle for every thread's own stream. A block freed on it by a
// thread whose work on it is still queued must not go at once to another thread's
// allocation on its own per-thread stream.
TEST_F(Plugin, AFreeOnThePerThreadStreamWaitsForTheFreeingThreadsWork) {
  const SimKernel kernel = sim_kernel();
  if (!kernel) GTEST_SKIP() << "needs cudasim's kernel to keep a stream busy";
  constexpr size_t n = 4 * kMiB;
  void* first = nullptr;
  std::mutex mu;
  std::condition_variable changed;
  bool freed = false, done = false;
  std::thread a_thread([&] {
    first = a.malloc(n, 0, cudaStreamPerThread);
    ASSERT_NE(first, nullptr) << last_error();
    // The runtime call first makes the device's context current on this thread, as the
    // kernel (a driver-level call) needs.
    EXPECT_EQ(a.memset_async(first, 0x11, n, cudaStreamPerThread), cudaSuccess);
    EXPECT_EQ(kernel(cudaStreamPerThread, 10'000'000, "slow"), 0);
    EXPECT_EQ(a.memset_async(first, 0xaa, n, cudaStreamPerThread), cudaSuccess);
    a.free(first, n, 0, cudaStreamPerThread);
    EXPECT_STREQ(a.last_error(), "");
    std::unique_lock lock(mu);
    freed = true;
    changed.notify_all();
    changed.wait(lock, [&] { return done; });  // keeps its stream's work alive meanwhile
    a.stream_synchronize(cudaStreamPerThread);
  });
  {
    std::unique_lock lock(mu);
    changed.wait(lock, [&] { return freed; });
  }
  void* second = a.malloc(n, 0, cudaStreamPerThread);
  ASSERT_NE(second, nullptr) << last_error();
  EXPECT_EQ(a.memset_async(second, 0x55, n, cudaStreamPerThread), cudaSuccess);
  EXPECT_EQ(a.stream_synchronize(cudaStreamPerThread), cudaSuccess);
  {
    std::lock_guard lock(mu);
    done = true;
    changed.notify_all();
  }
  a_thread.join();
  std::vector<unsigned char> out(n, 0);
  ASSERT_EQ(a.memcpy(out.data(), second, n, cudaMemcpyDeviceToHost), cudaSuccess);
  const auto wrong = std::count_if(out.begin(), out.end(), [](unsigned char c) { return c != 0x55; });
  EXPECT_EQ(wrong, 0) << "bytes of the block written by the other thread's queued work after it was reused"
                      << (first == second ? " (same block)" : "");
  a.free(second, n, 0, cudaStreamPerThread);
}

// A free must order reuse after the stream the block was allocated on; when the program has
// destroyed that stream (announcing it with vramswap_stream_destroyed: vramswap must not name
// a destroyed handle to CUDA, and cudasim stops a program that does), the free still happens
// exactly once: counted once, and a second free is reported as a double free, never
// subtracted again (allocated_bytes used to wrap).
TEST_F(Plugin, AFreeAfterTheAllocationStreamWasDestroyedCountsOnce) {
  cudaStream_t gone = nullptr, other = nullptr;
  ASSERT_EQ(a.stream_create(&gone), cudaSuccess);
  ASSERT_EQ(a.stream_create(&other), cudaSuccess);
  const uint64_t before = counter("allocated_bytes");
  void* p = a.malloc(kMiB, 0, gone);
  ASSERT_NE(p, nullptr) << last_error();
  a.stream_destroyed(gone);
  EXPECT_STREQ(a.last_error(), "");
  ASSERT_EQ(a.stream_destroy(gone), cudaSuccess);
  a.free(p, kMiB, 0, other);
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(counter("allocated_bytes"), before);
  a.free(p, kMiB, 0, other);
  EXPECT_NE(last_error().find("double free"), std::string::npos) << last_error();
  EXPECT_EQ(counter("allocated_bytes"), before);
  a.stream_destroy(other);
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
  // {rank} is RANK's value (each process of a distributed run writes its own file).
  const std::string path = dir + "/stats-3.json";
  const std::string named = dir + "/stats-{rank}.json";
  EXPECT_EXIT(
      {
        setenv("RANK", "3", 1);
        if (api().configure("VRAMSWAP_STATS_FILE", named.c_str()) != 0) std::_Exit(3);
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

TEST_F(Plugin, StatsJsonHasTheEngineKeysInTotalsAndPerDevice) {
  void* p = a.malloc(kMiB, 0, nullptr);  // a device, so that "devices" has an object
  ASSERT_NE(p, nullptr) << last_error();
  const std::string json = stats();
  const char* keys[] = {"num_ooms",
                        "resident_bytes",
                        "peak_resident_bytes",
                        "tagged_bytes",
                        "evictable_bytes",
                        "clean_bytes",
                        "evicted_bytes",
                        "in_flight_bytes",
                        "host_bytes",
                        "peak_host_bytes",
                        "bytes_evicted_total",
                        "bytes_prefetched_total",
                        "num_evictions",
                        "num_prefetches",
                        "num_faults",
                        "num_late_prefetches",
                        "num_clean_reuses",
                        "num_verify_failures",
                        "tagged_waste_bytes",
                        "peak_tagged_waste_bytes",
                        "num_tracked_blocks",
                        "num_planned_steps",
                        "num_plan_divergences",
                        "num_plan_backoffs",
                        "num_plan_fetch_moves",
                        "num_plan_fetch_moves_undone",
                        "planned_bytes_d2h",
                        "num_invalid_frees",
                        "host_wait_ns",
                        "host_vmm_ns",
                        "host_pin_ns",
                        "host_vmm_mapped_bytes",
                        "host_vmm_unmapped_bytes",
                        "host_vmm_created_bytes",
                        "host_vmm_released_bytes",
                        "host_vmm_map_calls",
                        "host_vmm_unmap_calls",
                        "host_vmm_create_calls",
                        "host_vmm_release_calls"};
  const size_t devices = json.find("\"devices\":[");
  ASSERT_NE(devices, std::string::npos) << json;
  const std::string device0 = json.substr(devices);
  size_t previous = 0, previous_in_device = 0;
  for (const char* k : keys) {
    const std::string needle = std::string("\"") + k + "\":";
    const size_t at = json.find(needle);
    ASSERT_NE(at, std::string::npos) << k << " in " << json;
    EXPECT_LT(at, devices) << k << " is a total";
    EXPECT_GE(at, previous) << k << " is out of order";
    previous = at;
    if (is_process_wide(k)) continue;
    const size_t in_device = device0.find(needle);
    EXPECT_NE(in_device, std::string::npos) << k << " per device: " << device0;
    EXPECT_GE(in_device, previous_in_device) << k << " is out of order per device";
    previous_in_device = in_device;
  }
  EXPECT_GE(number(json, "resident_bytes").value_or(0), kMiB) << "the pool's mapped memory";
  EXPECT_EQ(number(json, "tagged_bytes"), 0u) << "nothing was allocated in a scope";
  a.free(p, kMiB, 0, nullptr);
}

// ---- Offloading through the C ABI: scope, pack, mark_cold, unpack, release ----------------
//
// Registered with VRAMSWAP_LIMIT=64MiB (VRAMSWAP_TEST_EXPECTED_LIMIT says so) on a 1 GiB
// cudasim device, again with VRAMSWAP_VERIFY=1, and under CUDASIM_CHAOS seeds
// (CMakeLists.txt). Blocks are 8 MiB, four whole 2 MiB granules: no page rounding.

constexpr size_t kBlock = 8 * kMiB;

// The bytes block `index` holds: distinct per block and per position.
std::vector<unsigned char> block_pattern(size_t index) {
  std::vector<unsigned char> v(kBlock);
  uint32_t x = 0x9e3779b9u * static_cast<uint32_t>(index + 1);
  for (size_t i = 0; i < v.size(); ++i) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    v[i] = static_cast<unsigned char>(x);
  }
  return v;
}

class PluginOffload : public Plugin {
 protected:
  void SetUp() override {
    Plugin::SetUp();
    ASSERT_NE(a.pack, nullptr);
    limit_ = expected_limit();
    ASSERT_NE(limit_, 0u) << "VRAMSWAP_TEST_EXPECTED_LIMIT is not set";
    ASSERT_EQ(a.stream_create(&stream_), cudaSuccess);
    a.empty_cache();  // nothing cached from an earlier case of this process
  }
  void TearDown() override {
    while (depth_ > 0) pop();
    if (stream_) a.stream_destroy(stream_);
  }
  void push() {
    a.scope_push();
    ++depth_;
  }
  int device_ = 0;  // where forward() and backward() allocate and free
  void pop() {
    a.scope_pop();
    --depth_;
  }

  // The per-device value of `key` for `device` (0 by default).
  std::optional<uint64_t> device_counter(const std::string& key, int device = 0) {
    const std::string json = stats();
    const size_t at = json.find("{\"device\":" + std::to_string(device) + ",");
    if (at == std::string::npos) return std::nullopt;
    return number(json.substr(at, json.find('}', at) - at), key);
  }

  // Forward: `n` tagged blocks of kBlock, each filled with its pattern on stream_, packed
  // and marked cold there. Checks after each allocation that residency stayed within the
  // limit.
  void forward(size_t n, std::vector<void*>* blocks, std::vector<uint64_t>* handles,
               std::vector<std::vector<unsigned char>>* patterns) {
    push();
    a.graph_begin();
    for (size_t i = 0; i < n; ++i) {
      void* p = a.malloc(kBlock, device_, stream_);
      ASSERT_NE(p, nullptr) << "block " << i << ": " << last_error() << "\n" << stats();
      patterns->push_back(block_pattern(i));
      ASSERT_EQ(a.memcpy_async(p, patterns->back().data(), kBlock, cudaMemcpyHostToDevice, stream_), cudaSuccess);
      const uint64_t h = a.pack(p, stream_);
      ASSERT_NE(h, 0u) << "block " << i << " was allocated in a scope and is " << kBlock << " bytes";
      EXPECT_STREQ(a.last_error(), "");
      ASSERT_EQ(a.mark_cold(h, stream_), 0) << last_error();
      EXPECT_STREQ(a.last_error(), "");
      blocks->push_back(p);
      handles->push_back(h);
      EXPECT_LE(device_counter("resident_bytes", device_).value_or(UINT64_MAX), limit_) << "after block " << i;
    }
    pop();
  }

  // Backward: last packed first, each unpacked on stream_, read back on stream_ after the
  // unpack and compared byte for byte, then released and freed.
  void backward(std::vector<void*>& blocks, std::vector<uint64_t>& handles,
                const std::vector<std::vector<unsigned char>>& patterns) {
    std::vector<unsigned char> out(kBlock);
    for (size_t i = blocks.size(); i-- > 0;) {
      ASSERT_EQ(a.unpack(handles[i], stream_), 0) << "block " << i << ": " << last_error() << "\n" << stats();
      EXPECT_STREQ(a.last_error(), "");
      std::fill(out.begin(), out.end(), 0);
      ASSERT_EQ(a.memcpy_async(out.data(), blocks[i], kBlock, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
      ASSERT_EQ(a.stream_synchronize(stream_), cudaSuccess);
      const auto mismatch = std::mismatch(out.begin(), out.end(), patterns[i].begin());
      EXPECT_TRUE(mismatch.first == out.end())
          << "block " << i << " differs at byte " << (mismatch.first - out.begin()) << " of " << kBlock;
      ASSERT_EQ(a.release(handles[i]), 0) << last_error();
      a.free(blocks[i], kBlock, device_, stream_);
      ASSERT_STREQ(a.last_error(), "") << "block " << i;
      EXPECT_LE(device_counter("resident_bytes", device_).value_or(UINT64_MAX), limit_) << "after block " << i;
    }
    blocks.clear();
    handles.clear();
  }

  void expect_nothing_tagged_left() {
    const std::string json = stats();
    EXPECT_EQ(number(json, "tagged_bytes"), 0u) << json;
    EXPECT_EQ(number(json, "host_bytes"), 0u) << json;
    EXPECT_EQ(number(json, "evicted_bytes"), 0u) << json;
    EXPECT_EQ(number(json, "in_flight_bytes"), 0u) << json;
    EXPECT_EQ(number(json, "num_tracked_blocks"), 0u) << json;
    EXPECT_EQ(number(json, "tagged_waste_bytes"), 0u) << json;
    EXPECT_EQ(number(json, "num_verify_failures"), 0u) << json;
  }

  uint64_t limit_ = 0;
  cudaStream_t stream_ = nullptr;
  int depth_ = 0;
};

// An out-of-memory when little of the live memory can be offloaded says why: the blocks
// below VRAMSWAP_MIN_OFFLOAD_BYTES, and the variable that changes that. When most of it is
// tagged (offload could take it, were it cold), the report does not say it.
TEST_F(PluginOffload, OutOfMemoryWithLittleTaggedNamesTheThreshold) {
  // Blocks of `size` on stream_ until one is refused (at most twice what the limit holds).
  auto until_refused = [&](size_t size) {
    std::vector<void*> blocks;
    for (size_t i = 0; i < 2 * limit_ / size; ++i) {
      void* p = a.malloc(size, 0, stream_);
      if (!p) break;
      blocks.push_back(p);
    }
    return blocks;
  };
  push();
  const size_t kSmall = 32 * 1024;  // below the default threshold of 64 KiB
  std::vector<void*> small = until_refused(kSmall);
  const std::string error = last_error();
  ASSERT_LT(small.size(), 2 * limit_ / kSmall) << "no out-of-memory";
  EXPECT_NE(error.find("VRAMSWAP_MIN_OFFLOAD_BYTES (64 KiB)"), std::string::npos) << error;
  EXPECT_NE(error.find(" are in " + std::to_string(small.size()) + " blocks smaller than that"), std::string::npos)
      << error;
  EXPECT_NE(error.find("Only 0 B of the "), std::string::npos) << error;
  // The value it suggests is below the one in force, and a valid setting.
  EXPECT_NE(error.find("a smaller VRAMSWAP_MIN_OFFLOAD_BYTES (for example 16KiB)"), std::string::npos) << error;
  for (void* p : small) a.free(p, kSmall, 0, stream_);

  // Most of the live memory in large blocks allocated outside any scope (backward's
  // gradients, parameters): the threshold is not why, and the report does not suggest it.
  pop();
  void* one_small = a.malloc(kSmall, 0, stream_);
  ASSERT_NE(one_small, nullptr) << last_error();
  std::vector<void*> outside = until_refused(kBlock);
  const std::string large = last_error();
  ASSERT_LT(outside.size(), 2 * limit_ / kBlock) << "no out-of-memory";
  EXPECT_NE(large.find("allocated outside any offload scope"), std::string::npos) << large;
  EXPECT_EQ(large.find("a smaller VRAMSWAP_MIN_OFFLOAD_BYTES"), std::string::npos) << large;
  EXPECT_NE(large.find("vramswap.offload_optimizer"), std::string::npos) << "what can take it instead: " << large;
  for (void* p : outside) a.free(p, kBlock, 0, stream_);
  a.free(one_small, kSmall, 0, stream_);
  push();

  std::vector<void*> tagged = until_refused(kBlock);  // in use, never cold: not evictable, but tagged
  const std::string full = last_error();
  ASSERT_LT(tagged.size(), 2 * limit_ / kBlock) << "no out-of-memory";
  EXPECT_EQ(full.find("VRAMSWAP_MIN_OFFLOAD_BYTES"), std::string::npos) << full;
  for (void* p : tagged) a.free(p, kBlock, 0, stream_);
}

TEST_F(PluginOffload, ForwardBackwardUnderTheLimitRestoresEveryByte) {
  const size_t n = 2 * limit_ / kBlock;  // twice what fits: 16 blocks under 64 MiB
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks, &handles, &patterns));

  // Blocks past the limit could be placed only because cold ones were evicted.
  std::string json = stats();
  EXPECT_GT(number(json, "num_evictions").value_or(0), 0u) << json;
  EXPECT_GT(number(json, "evicted_bytes").value_or(0), 0u) << json;
  EXPECT_GE(number(json, "bytes_evicted_total").value_or(0), n * kBlock - limit_) << json;
  EXPECT_EQ(number(json, "tagged_bytes"), n * kBlock) << json;
  EXPECT_EQ(number(json, "num_tracked_blocks"), n) << json;
  EXPECT_LE(number(json, "peak_resident_bytes").value_or(UINT64_MAX), limit_) << json;
  EXPECT_GT(number(json, "host_bytes").value_or(0), 0u) << json;
  // Per device, the same.
  EXPECT_GT(device_counter("num_evictions").value_or(0), 0u);
  EXPECT_EQ(device_counter("tagged_bytes"), n * kBlock);

  ASSERT_NO_FATAL_FAILURE(backward(blocks, handles, patterns));
  json = stats();
  EXPECT_GT(number(json, "num_prefetches").value_or(0), 0u) << json;
  EXPECT_GT(number(json, "bytes_prefetched_total").value_or(0), 0u) << json;
  EXPECT_LE(number(json, "peak_resident_bytes").value_or(UINT64_MAX), limit_) << json;
  expect_nothing_tagged_left();
}

// Where a slow step's host time went: waiting for the device, CUDA's VMM calls, pinning.
// An allocation past the limit unmaps the pages of the evictions that make room and maps
// its own, and the host tier pins memory for the copies.
TEST_F(PluginOffload, HostTimeInLongCudaCallsIsCounted) {
  const std::string before = stats();
  const size_t n = 2 * limit_ / kBlock;
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks, &handles, &patterns));
  const std::string after = stats();
  for (const char* key : {"host_vmm_ns", "host_pin_ns"}) {
    ASSERT_TRUE(number(before, key).has_value()) << key << " in " << before;
    EXPECT_GT(number(after, key).value_or(0), *number(before, key)) << key << ": " << after;
  }
  // Whether an allocation had to wait depends on whether its evictions had landed
  // (Promises.WaitingForTheDeviceIsCountedAsHostWaitTime holds the device to see it).
  ASSERT_TRUE(number(before, "host_wait_ns").has_value()) << before;
  EXPECT_GE(number(after, "host_wait_ns").value_or(0), *number(before, "host_wait_ns")) << after;
  ASSERT_NO_FATAL_FAILURE(backward(blocks, handles, patterns));
  expect_nothing_tagged_left();
}

// What the VMM time bought, in bytes and calls: a forward of twice the limit gives pages to
// at least the limit's worth of addresses (cuMemMap), creates pages (cuMemCreate) and takes
// pages away from the evicted blocks' addresses (cuMemUnmap); what was created and not
// released (cuMemRelease: spare pages of a run's size that a run of another size needed room
// for) is the pool's reserved memory. Every byte figure is a whole number of 2 MiB granules,
// and each call covers at least one (a run covers several: Note [Runs]); on a GPU the calls,
// not the bytes, are what costs host time.
TEST_F(PluginOffload, BytesGivenAndTakenPagesAreCounted) {
  const std::string before = stats();
  const size_t n = 2 * limit_ / kBlock;
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks, &handles, &patterns));
  const std::string after = stats();
  auto grew = [&](const char* key) {
    const std::optional<uint64_t> b = number(before, key), a = number(after, key);
    EXPECT_TRUE(b && a) << key << " in " << after;
    if (!b || !a) return uint64_t(0);
    EXPECT_EQ(*a % (2u << 20), 0u) << key << ": " << after;
    return *a - *b;
  };
  EXPECT_GE(grew("host_vmm_mapped_bytes"), limit_) << after;
  const uint64_t created = grew("host_vmm_created_bytes"), released = grew("host_vmm_released_bytes");
  EXPECT_GT(created, released) << after;
  EXPECT_EQ(created - released, grew("reserved_bytes")) << after;
  EXPECT_GT(grew("host_vmm_unmapped_bytes"), 0u) << after;
  for (const auto& [calls, bytes] : {std::pair{"host_vmm_map_calls", "host_vmm_mapped_bytes"},
                                     std::pair{"host_vmm_unmap_calls", "host_vmm_unmapped_bytes"},
                                     std::pair{"host_vmm_create_calls", "host_vmm_created_bytes"},
                                     std::pair{"host_vmm_release_calls", "host_vmm_released_bytes"}}) {
    const std::optional<uint64_t> c0 = number(before, calls), c1 = number(after, calls);
    const std::optional<uint64_t> b0 = number(before, bytes), b1 = number(after, bytes);
    ASSERT_TRUE(c0 && c1 && b0 && b1) << calls << " in " << after;
    EXPECT_LE(*c1 - *c0, (*b1 - *b0) / (2u << 20)) << calls << ": a call covers at least one granule: " << after;
    if (*b1 > *b0) {
      EXPECT_GT(*c1 - *c0, 0u) << calls << ": bytes moved with no call counted: " << after;
    }
  }
  // The blocks of a forward past the limit are mapped as runs once pages change place: fewer
  // mappings than granules mapped.
  EXPECT_LT(*number(after, "host_vmm_map_calls") - *number(before, "host_vmm_map_calls"),
            grew("host_vmm_mapped_bytes") / (2u << 20))
      << after;
  ASSERT_NO_FATAL_FAILURE(backward(blocks, handles, patterns));
  expect_nothing_tagged_left();
}

// A capture reported with vramswap_capture_begin (as torch's begin-allocate-to-pool hook
// does under vramswap.install()): an allocation that would need the device synchronized
// (the blocks another stream freed) is refused rather than break the global-mode capture on
// a third stream, and served once vramswap_capture_end says it is over. An end without a
// begin, and a device out of range, are refused with a message.
TEST_F(PluginOffload, AReportedCaptureIsNeverBrokenByADeviceSynchronization) {
  std::vector<void*> cached;
  for (uint64_t bytes = 0; bytes + kBlock <= limit_; bytes += kBlock) {
    void* p = a.malloc(kBlock, 0, stream_);
    ASSERT_NE(p, nullptr) << last_error();
    cached.push_back(p);
  }
  for (void* p : cached) a.free(p, kBlock, 0, stream_);  // all cached for stream_
  cudaStream_t other = nullptr, capturing = nullptr;
  ASSERT_EQ(a.stream_create(&other), cudaSuccess);
  ASSERT_EQ(a.stream_create(&capturing), cudaSuccess);
  ASSERT_EQ(a.capture_begin(0), 0) << last_error();
  ASSERT_EQ(a.begin_capture(capturing, cudaStreamCaptureModeGlobal), cudaSuccess);
  void* p = a.malloc(2 * kBlock, 0, other);
  EXPECT_EQ(p, nullptr) << "served by synchronizing the device during the capture";
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(a.end_capture(capturing, &graph), cudaSuccess) << "the capture was broken";
  EXPECT_NE(graph, nullptr);
  if (graph != nullptr) a.graph_destroy(graph);
  if (p != nullptr) a.free(p, 2 * kBlock, 0, other);
  ASSERT_EQ(a.capture_end(0), 0) << last_error();
  p = a.malloc(2 * kBlock, 0, other);
  EXPECT_NE(p, nullptr) << last_error();
  if (p != nullptr) a.free(p, 2 * kBlock, 0, other);
  EXPECT_EQ(a.capture_end(0), -1);
  EXPECT_NE(std::string(a.last_error()).find("no capture had begun"), std::string::npos) << last_error();
  EXPECT_EQ(a.capture_begin(-1), -1);
  EXPECT_NE(std::string(a.last_error()).find("expected devices 0 to 63"), std::string::npos) << last_error();
  ASSERT_EQ(a.stream_destroy(other), cudaSuccess);
  ASSERT_EQ(a.stream_destroy(capturing), cudaSuccess);
}

// Several devices (issue 15): each has its own pool, limit and engine. Registered with
// CUDASIM_DEVICE_COUNT=2 (".two_devices"); skips with one device. A block on device 0 stays
// there, untouched, while a forward of twice the limit on device 1 is evicted and restored
// on device 1 alone, and the statistics say which device did what.
class PluginTwoDevices : public PluginOffload {
 protected:
  void SetUp() override {
    PluginOffload::SetUp();
    int n = 0;
    ASSERT_EQ(a.device_count(&n), cudaSuccess);
    if (n < 2) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2 (ctest's .two_devices sets it)";
  }
};

TEST_F(PluginTwoDevices, EachDeviceEvictsAndRestoresItsOwnBlocks) {
  // Device 0: one block, its bytes known.
  std::vector<unsigned char> zero_pattern = block_pattern(99), out(kBlock);
  void* on_zero = a.malloc(kBlock, 0, nullptr);
  ASSERT_NE(on_zero, nullptr) << last_error();
  ASSERT_EQ(a.memcpy(on_zero, zero_pattern.data(), kBlock, cudaMemcpyHostToDevice), cudaSuccess);
  const uint64_t zero_evictions = device_counter("num_evictions", 0).value_or(0);

  // Device 1: a forward of twice the limit, on a stream of device 1.
  ASSERT_EQ(a.set_device(1), cudaSuccess);
  cudaStream_t stream_one = nullptr;
  ASSERT_EQ(a.stream_create(&stream_one), cudaSuccess);
  std::swap(stream_, stream_one);
  device_ = 1;
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  ASSERT_NO_FATAL_FAILURE(forward(2 * limit_ / kBlock, &blocks, &handles, &patterns));
  EXPECT_GT(device_counter("num_evictions", 1).value_or(0), 0u) << stats();
  EXPECT_EQ(device_counter("num_evictions", 0).value_or(0), zero_evictions) << "device 0 gave up nothing";
  EXPECT_LE(device_counter("peak_resident_bytes", 1).value_or(UINT64_MAX), limit_) << stats();
  ASSERT_NO_FATAL_FAILURE(backward(blocks, handles, patterns));
  EXPECT_GT(device_counter("num_prefetches", 1).value_or(0), 0u) << stats();
  std::swap(stream_, stream_one);
  ASSERT_EQ(a.stream_destroy(stream_one), cudaSuccess);
  ASSERT_EQ(a.set_device(0), cudaSuccess);

  // Device 0's block kept its bytes; both devices' invariants hold.
  ASSERT_EQ(a.memcpy(out.data(), on_zero, kBlock, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(out == zero_pattern) << "device 0's block changed";
  a.free(on_zero, kBlock, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(number(stats(), "tagged_bytes"), 0u) << stats();
}

// Peer access through the C ABI: device 1 is granted access to device 0's blocks, those
// mapped before the call and after it, and a stream of device 1 copies them (without the
// grant cudasim stops the process: plugin_preload_peer_copy_without_access_faults). Devices
// out of range are refused with a message.
TEST_F(PluginTwoDevices, APeerGrantedAccessCopiesTheBlocks) {
  const std::vector<unsigned char> first = block_pattern(31), second = block_pattern(32);
  void* before = a.malloc(kBlock, 0, nullptr);
  ASSERT_NE(before, nullptr) << last_error();
  ASSERT_EQ(a.memcpy(before, first.data(), kBlock, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(a.enable_peer_access(1, 0), 0) << last_error();
  EXPECT_EQ(a.enable_peer_access(1, 0), 0) << "twice costs nothing";
  void* after = a.malloc(kBlock, 0, nullptr);
  ASSERT_NE(after, nullptr) << last_error();
  ASSERT_EQ(a.memcpy(after, second.data(), kBlock, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(a.set_device(1), cudaSuccess);
  cudaStream_t one = nullptr;
  ASSERT_EQ(a.stream_create(&one), cudaSuccess);
  void* both = a.malloc(2 * kBlock, 1, one);
  ASSERT_NE(both, nullptr) << last_error();
  ASSERT_EQ(a.memcpy_async(both, before, kBlock, cudaMemcpyDeviceToDevice, one), cudaSuccess);
  ASSERT_EQ(a.memcpy_async(static_cast<char*>(both) + kBlock, after, kBlock, cudaMemcpyDeviceToDevice, one),
            cudaSuccess);
  ASSERT_EQ(a.stream_synchronize(one), cudaSuccess);
  std::vector<unsigned char> out(kBlock);
  ASSERT_EQ(a.memcpy(out.data(), both, kBlock, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(out == first);
  ASSERT_EQ(a.memcpy(out.data(), static_cast<char*>(both) + kBlock, kBlock, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(out == second);
  a.free(both, 2 * kBlock, 1, one);
  ASSERT_EQ(a.stream_destroy(one), cudaSuccess);
  ASSERT_EQ(a.set_device(0), cudaSuccess);
  a.free(before, kBlock, 0, nullptr);
  a.free(after, kBlock, 0, nullptr);
  EXPECT_STREQ(a.last_error(), "");

  EXPECT_EQ(a.enable_peer_access(-1, 0), -1);
  EXPECT_NE(std::string(a.last_error()).find("device -1"), std::string::npos) << last_error();
  EXPECT_EQ(a.enable_peer_access(0, 64), -1);
  EXPECT_NE(std::string(a.last_error()).find("expected devices 0 to 63"), std::string::npos) << last_error();
}

// An unpack that finds no memory to bring its block back (every resident block is in use:
// unpacked and not released) is the program's out-of-memory, as an allocation's is: -2, a
// report of what holds the memory, counted in num_ooms; the block stays on the host, and
// the same unpack succeeds once memory is freed. (A plain -1 with "refused by the limit"
// before, which the tracker raised as a RuntimeError, not torch's OutOfMemoryError.)
TEST_F(PluginOffload, AnUnpackWithNoMemoryLeftIsAnOutOfMemoryThatCanBeRetried) {
  const size_t n = 2 * limit_ / kBlock;
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks, &handles, &patterns));
  const uint64_t ooms = counter("num_ooms");
  size_t refused = n;
  for (size_t i = n; i-- > 0;) {  // backward's order, nothing released
    const int rc = a.unpack(handles[i], stream_);
    if (rc == 0) continue;
    ASSERT_EQ(rc, -2) << "block " << i << ": " << last_error();
    const std::string error = last_error();
    EXPECT_NE(error.find("cannot bring block"), std::string::npos) << error;
    EXPECT_NE(error.find("out of memory on device 0"), std::string::npos) << error;
    EXPECT_NE(error.find("Limit 64 MiB"), std::string::npos) << error;
    // What holds the memory, as an allocation's report says (the report ended at the pool's
    // "raise VRAMSWAP_LIMIT." before).
    EXPECT_NE(error.find("Offload: "), std::string::npos) << error;
    EXPECT_NE(error.find(" on the host"), std::string::npos) << error;
    EXPECT_EQ(counter("num_ooms"), ooms + 1);
    refused = i;
    break;
  }
  ASSERT_LT(refused, n) << "every block came back while all were held: the limit held nothing";
  // Free the unpacked blocks (those after `refused`) one by one until it comes back.
  std::vector<unsigned char> out(kBlock);
  size_t freed = n;
  int rc = -2;
  while (rc == -2 && freed > refused + 1) {
    --freed;
    ASSERT_EQ(a.release(handles[freed]), 0) << last_error();
    a.free(blocks[freed], kBlock, 0, stream_);
    rc = a.unpack(handles[refused], stream_);
  }
  ASSERT_EQ(rc, 0) << last_error();
  ASSERT_EQ(a.memcpy_async(out.data(), blocks[refused], kBlock, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(a.stream_synchronize(stream_), cudaSuccess);
  EXPECT_TRUE(out == patterns[refused]) << "the refused block came back with its bytes";
  for (size_t i = refused + 1; i < freed; ++i) {  // unpacked earlier, still held
    ASSERT_EQ(a.release(handles[i]), 0) << last_error();
    a.free(blocks[i], kBlock, 0, stream_);
  }
  ASSERT_EQ(a.release(handles[refused]), 0) << last_error();
  a.free(blocks[refused], kBlock, 0, stream_);
  blocks.resize(refused);
  handles.resize(refused);
  patterns.resize(refused);
  ASSERT_NO_FATAL_FAILURE(backward(blocks, handles, patterns));
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, WithNoPressureNothingIsCopied) {
  const size_t n = limit_ / kBlock / 2;  // half the limit, below the 90% soft limit
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  a.reset_peak_stats();
  const std::string before = stats();
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks, &handles, &patterns));
  ASSERT_NO_FATAL_FAILURE(backward(blocks, handles, patterns));
  const std::string json = stats();
  for (const char* key : {"num_evictions", "bytes_evicted_total", "bytes_prefetched_total", "num_prefetches",
                          "num_faults"})
    EXPECT_EQ(number(json, key), number(before, key)) << key << ": " << json;
  EXPECT_EQ(number(json, "peak_host_bytes"), 0u) << json;
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, TwoForwardsBeforeTheirBackwards) {
  // Gradient accumulation: forward A, forward B, backward A, backward B; each forward
  // alone fills the limit.
  const size_t n = limit_ / kBlock;
  std::vector<void*> blocks_a, blocks_b;
  std::vector<uint64_t> handles_a, handles_b;
  std::vector<std::vector<unsigned char>> patterns_a, patterns_b;
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks_a, &handles_a, &patterns_a));
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks_b, &handles_b, &patterns_b));
  EXPECT_GT(counter("num_evictions"), 0u);
  ASSERT_NO_FATAL_FAILURE(backward(blocks_a, handles_a, patterns_a));
  ASSERT_NO_FATAL_FAILURE(backward(blocks_b, handles_b, patterns_b));
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, FreeOfEvictedBlocksDropsTheirHostCopies) {
  const size_t n = limit_ / kBlock + 4;
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks, &handles, &patterns));
  ASSERT_GT(counter("evicted_bytes"), 0u) << stats();
  ASSERT_GT(counter("host_bytes"), 0u) << stats();
  // Block 0 was saved first, so backward needs it last: Belady's first victim.
  a.free(blocks[0], kBlock, 0, stream_);
  EXPECT_STREQ(a.last_error(), "");
  for (size_t i = 1; i < n; ++i) {  // still packed and cold, some on the host: freed anyway
    a.free(blocks[i], kBlock, 0, stream_);
    EXPECT_STREQ(a.last_error(), "") << "block " << i;
  }
  // Evictions started in the background may still be copying into host buffers of the
  // freed blocks: those buffers are returned once the copies are done.
  ASSERT_EQ(a.device_synchronize(), cudaSuccess);
  // The handles died with their blocks.
  for (uint64_t h : handles) EXPECT_EQ(a.unpack(h, stream_), -1);
  expect_nothing_tagged_left();
  // Their device pages went back to the pool: the whole limit can be allocated again.
  std::vector<void*> again;
  for (size_t i = 0; i < limit_ / kBlock; ++i) {
    void* p = a.malloc(kBlock, 0, stream_);
    ASSERT_NE(p, nullptr) << i << ": " << last_error();
    again.push_back(p);
  }
  for (void* p : again) a.free(p, kBlock, 0, stream_);
}

TEST_F(PluginOffload, OutOfMemoryWhenNothingIsColdIsNullWithAReport) {
  push();
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  const uint64_t ooms = counter("num_ooms");
  const uint64_t evictions = counter("num_evictions");
  StderrCapture capture;
  void* refused = reinterpret_cast<void*>(1);
  for (size_t i = 0; i <= limit_ / kBlock; ++i) {
    void* p = a.malloc(kBlock, 0, stream_);
    if (!p) {
      refused = p;
      break;
    }
    blocks.push_back(p);
    const uint64_t h = a.pack(p, stream_);  // packed, never cold: not evictable
    ASSERT_NE(h, 0u);
    handles.push_back(h);
  }
  const std::string err = capture.text();
  const std::string error = last_error();
  EXPECT_EQ(refused, nullptr) << "the limit holds " << limit_ / kBlock << " blocks and none is cold";
  EXPECT_EQ(blocks.size(), limit_ / kBlock);
  EXPECT_NE(error.find(std::to_string(kBlock)), std::string::npos) << "the request: " << error;
  EXPECT_NE(error.find(std::to_string(limit_ / kMiB) + " MiB"), std::string::npos) << "the limit: " << error;
  EXPECT_EQ(count(err, "vramswap: warning: out of memory"), 1u) << err;
  EXPECT_EQ(counter("num_ooms"), ooms + 1);
  EXPECT_EQ(counter("num_evictions"), evictions);
  // Once one is cold, the same request succeeds by evicting it.
  ASSERT_EQ(a.mark_cold(handles[0], stream_), 0) << last_error();
  void* p = a.malloc(kBlock, 0, stream_);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(counter("num_evictions"), evictions + 1);
  // Released without an unpack, the evicted block comes back first (nothing is lost): that
  // needs the room the new block takes, so it goes first.
  a.free(p, kBlock, 0, stream_);
  for (uint64_t h : handles) EXPECT_EQ(a.release(h), 0) << last_error();
  for (void* b : blocks) a.free(b, kBlock, 0, stream_);
  EXPECT_STREQ(a.last_error(), "");
  pop();
  expect_nothing_tagged_left();
}

// ---- The cold probe --------------------------------------------------------------------
//
// What the test's probe saw and what it marks: handles to mark cold at its next call.
struct ProbeRecord {
  std::vector<uint64_t> to_mark;
  int calls = 0, depth = 0, max_depth = 0;
  int device = -1;
  cudaStream_t stream = nullptr;
  bool allocate_inside = false;  // the probe itself allocates (under the same pressure)
};
ProbeRecord g_probe;

size_t record_probe(int device, struct CUstream_st* stream) {
  const Api& a = api();
  ++g_probe.calls;
  g_probe.max_depth = std::max(g_probe.max_depth, ++g_probe.depth);
  g_probe.device = device;
  g_probe.stream = stream;
  if (g_probe.allocate_inside)
    if (void* p = a.malloc(kBlock, device, stream)) a.free(p, kBlock, device, stream);
  size_t marked = 0;
  for (uint64_t h : g_probe.to_mark) marked += a.mark_cold(h, stream) == 0;
  g_probe.to_mark.clear();
  --g_probe.depth;
  return marked;
}

// Fills the limit with tagged blocks, each packed and none cold (what a forward holds at
// the moment the program dropped its last reference to some of them: no hook runs then).
void fill_packed(const Api& a, cudaStream_t stream, uint64_t limit, std::vector<void*>* blocks,
                 std::vector<uint64_t>* handles) {
  for (size_t i = 0; i < limit / kBlock; ++i) {
    void* p = a.malloc(kBlock, 0, stream);
    ASSERT_NE(p, nullptr) << i << ": " << last_error();
    blocks->push_back(p);
    handles->push_back(a.pack(p, stream));
    ASSERT_NE(handles->back(), 0u);
  }
}

// A block can become cold between two calls of the tracker (the program's last reference
// went away; no hook sees that). An allocation that finds memory short asks the tracker's
// probe to mark such blocks before it evicts or fails: it succeeds, with no out-of-memory
// counted, and the probe was told the allocation's device and stream.
TEST_F(PluginOffload, AnAllocationThatFindsMemoryShortAsksTheColdProbe) {
  ASSERT_NE(a.set_cold_probe, nullptr);
  push();
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  ASSERT_NO_FATAL_FAILURE(fill_packed(a, stream_, limit_, &blocks, &handles));
  const uint64_t ooms = counter("num_ooms");
  g_probe = {};
  g_probe.to_mark = {handles[0], handles[1]};
  a.set_cold_probe(&record_probe);
  EXPECT_STREQ(a.last_error(), "");
  void* p = a.malloc(kBlock, 0, stream_);
  a.set_cold_probe(nullptr);
  ASSERT_NE(p, nullptr) << "the probe marked two blocks cold: " << last_error();
  EXPECT_GE(g_probe.calls, 1);
  EXPECT_EQ(g_probe.device, 0);
  EXPECT_EQ(g_probe.stream, stream_);
  EXPECT_EQ(counter("num_ooms"), ooms);
  EXPECT_GE(counter("num_evictions"), 1u);
  a.free(p, kBlock, 0, stream_);
  for (uint64_t h : handles) EXPECT_EQ(a.release(h), 0) << last_error();
  for (void* b : blocks) a.free(b, kBlock, 0, stream_);
  EXPECT_STREQ(a.last_error(), "");
  pop();
  // An eviction of the second block may still be copying into its host buffer: returned
  // once the copy is done.
  ASSERT_EQ(a.device_synchronize(), cudaSuccess);
  expect_nothing_tagged_left();
}

// Memory that is not short never calls the probe; once removed it is never called; an
// allocation the probe makes does not call it again (the probe may use the whole C ABI).
TEST_F(PluginOffload, TheColdProbeRunsOnlyUnderPressureAndNeverWithinItself) {
  ASSERT_NE(a.set_cold_probe, nullptr);
  g_probe = {};
  a.set_cold_probe(&record_probe);
  push();
  void* p = a.malloc(kBlock, 0, stream_);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(g_probe.calls, 0) << "no pressure";
  a.free(p, kBlock, 0, stream_);
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  ASSERT_NO_FATAL_FAILURE(fill_packed(a, stream_, limit_, &blocks, &handles));
  g_probe.allocate_inside = true;
  EXPECT_EQ(a.malloc(kBlock, 0, stream_), nullptr) << "nothing is cold";
  EXPECT_GE(g_probe.calls, 1);
  EXPECT_EQ(g_probe.max_depth, 1) << "the probe's own allocation called it again";
  const std::string error = last_error();
  EXPECT_NE(error.find("out of memory"), std::string::npos) << error;
  a.set_cold_probe(nullptr);
  const int calls = g_probe.calls;
  EXPECT_EQ(a.malloc(kBlock, 0, stream_), nullptr);
  EXPECT_EQ(g_probe.calls, calls) << "removed";
  for (uint64_t h : handles) EXPECT_EQ(a.release(h), 0) << last_error();
  for (void* b : blocks) a.free(b, kBlock, 0, stream_);
  pop();
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, OnlyLargeEnoughAllocationsInsideAScopeAreTagged) {
  void* outside = a.malloc(kBlock, 0, stream_);
  ASSERT_NE(outside, nullptr) << last_error();
  EXPECT_EQ(a.pack(outside, stream_), 0u) << "allocated outside any scope";
  EXPECT_STREQ(a.last_error(), "") << "not offloadable is not an error";
  push();
  void* small = a.malloc(64 * 1024 - 512, 0, stream_);  // below VRAMSWAP_MIN_OFFLOAD_BYTES (64 KiB)
  void* exact = a.malloc(64 * 1024, 0, stream_);        // at it
  ASSERT_NE(small, nullptr) << last_error();
  ASSERT_NE(exact, nullptr) << last_error();
  EXPECT_EQ(a.pack(small, stream_), 0u);
  EXPECT_STREQ(a.last_error(), "");
  const uint64_t h = a.pack(exact, stream_);
  EXPECT_NE(h, 0u);
  EXPECT_EQ(counter("tagged_bytes"), 64 * 1024) << "below half a granule: placed in 512-byte units";
  EXPECT_EQ(counter("tagged_waste_bytes"), 0u);
  // Half a granule or more, under a limit: whole granules of its own.
  void* big = a.malloc(kMiB, 0, stream_);
  ASSERT_NE(big, nullptr) << last_error();
  const uint64_t hb = a.pack(big, stream_);
  EXPECT_NE(hb, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big) % (2 * kMiB), 0u) << "a larger tagged block starts on its own granule";
  // An address inside the block names it too, with the same handle (a second reference).
  EXPECT_EQ(a.pack(static_cast<char*>(exact) + 4096, stream_), h);
  EXPECT_EQ(counter("tagged_bytes"), 64 * 1024 + 2 * kMiB) << "one whole granule for the larger one";
  EXPECT_EQ(counter("tagged_waste_bytes"), kMiB);
  EXPECT_EQ(counter("peak_tagged_waste_bytes"), kMiB);
  EXPECT_EQ(a.release(hb), 0) << last_error();
  // Neither foreign memory nor NULL is offloadable.
  int local = 0;
  EXPECT_EQ(a.pack(&local, stream_), 0u);
  EXPECT_EQ(a.pack(nullptr, stream_), 0u);
  EXPECT_STREQ(a.last_error(), "");
  pop();
  EXPECT_EQ(a.release(h), 0) << last_error();
  EXPECT_EQ(a.release(h), 0) << "two packs, two references: " << last_error();
  EXPECT_EQ(a.release(h), -1) << "the third release is one too many";
  a.free(small, 0, 0, stream_);
  a.free(exact, 0, 0, stream_);
  a.free(big, 0, 0, stream_);
  a.free(outside, 0, 0, stream_);
  EXPECT_STREQ(a.last_error(), "");
  expect_nothing_tagged_left();
}

// Kept blocks through the C API (Note [Kept blocks] in src/residency/engine.h): a handle no
// release ends, used and marked cold again; bad calls refused with what was wrong.
TEST_F(PluginOffload, AKeptBlockIsUsedAgainUntilUnkeptAndBadCallsSayWhy) {
  void* outside = a.malloc(kBlock, 0, stream_);
  ASSERT_NE(outside, nullptr) << last_error();
  EXPECT_EQ(a.keep(outside, 1), 0u) << "allocated outside any scope: not offloadable";
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(a.keep(nullptr, 1), 0u);
  push();
  void* p = a.malloc(kBlock, 0, stream_);
  pop();
  ASSERT_NE(p, nullptr) << last_error();
  const uint64_t h = a.keep(p, 1);
  ASSERT_NE(h, 0u);
  EXPECT_EQ(a.keep(static_cast<char*>(p) + 4096, 1), h) << "an address inside names the same block";
  EXPECT_EQ(counter("kept_bytes"), kBlock);
  EXPECT_EQ(a.mark_cold(h, stream_), 0) << last_error();
  for (int step = 0; step < 3; ++step) {
    EXPECT_EQ(a.use(h, stream_, VRAMSWAP_USE_FORWARD), 0) << last_error();
    EXPECT_EQ(a.mark_cold(h, stream_), 0) << last_error();
  }
  EXPECT_EQ(a.use(h, stream_, 7), -1);
  EXPECT_NE(last_error().find("lane 7"), std::string::npos) << last_error();
  EXPECT_EQ(a.unpack(h, stream_), -1) << "kept, not packed";
  EXPECT_NE(last_error().find("not packed"), std::string::npos) << last_error();
  EXPECT_EQ(a.release(h), -1) << "nothing to release";
  EXPECT_EQ(a.unkeep(h), 0) << last_error();
  EXPECT_EQ(counter("kept_bytes"), 0u);
  EXPECT_EQ(a.use(h, stream_, VRAMSWAP_USE_AFTER_BACKWARD), -1) << "unkept: the handle ended";
  EXPECT_NE(last_error().find("stale"), std::string::npos) << last_error();
  EXPECT_EQ(a.unkeep(h), -1);
  a.free(p, 0, 0, stream_);
  a.free(outside, 0, 0, stream_);
  EXPECT_STREQ(a.last_error(), "");
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, ScopesNestAndBelongToTheirThread) {
  push();
  push();
  pop();
  EXPECT_STREQ(a.last_error(), "");
  void* inner = a.malloc(kBlock, 0, stream_);  // one scope still open
  ASSERT_NE(inner, nullptr) << last_error();
  EXPECT_NE(a.pack(inner, stream_), 0u);
  // Another thread has no scope open: its allocations are not tagged.
  void* other = nullptr;
  uint64_t other_handle = 1;
  std::thread([&] {
    other = a.malloc(kBlock, 0, nullptr);
    other_handle = a.pack(other, nullptr);
  }).join();
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(other_handle, 0u);
  pop();
  void* after = a.malloc(kBlock, 0, stream_);
  ASSERT_NE(after, nullptr) << last_error();
  EXPECT_EQ(a.pack(after, stream_), 0u) << "every scope is closed";
  a.free(inner, 0, 0, stream_);  // freed while packed: its handle dies with it
  a.free(other, 0, 0, nullptr);
  a.free(after, 0, 0, stream_);
  EXPECT_STREQ(a.last_error(), "");
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, ScopePopWithoutPushIsAnError) {
  a.scope_pop();
  const std::string error = last_error();
  EXPECT_NE(error.find("vramswap_scope_pop"), std::string::npos) << error;
  EXPECT_NE(error.find("no offload scope"), std::string::npos) << error;
  // Nothing changed: a scope opened now is closed by one pop.
  a.scope_push();
  EXPECT_STREQ(a.last_error(), "");
  a.scope_pop();
  EXPECT_STREQ(a.last_error(), "");
  void* p = a.malloc(kBlock, 0, stream_);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(a.pack(p, stream_), 0u) << "the depth did not go below 0";
  a.free(p, 0, 0, stream_);
}

// Every call of the protocol with handle `h` fails, naming `expected` in its message.
void expect_refused(const Api& a, uint64_t h, cudaStream_t s, const std::string& expected) {
  SCOPED_TRACE("handle " + std::to_string(h));
  EXPECT_EQ(a.mark_cold(h, s), -1);
  EXPECT_NE(last_error().find(expected), std::string::npos) << last_error();
  EXPECT_EQ(a.unpack(h, s), -1);
  EXPECT_NE(last_error().find(expected), std::string::npos) << last_error();
  EXPECT_EQ(a.prefetch(h), -1);
  EXPECT_NE(last_error().find(expected), std::string::npos) << last_error();
  EXPECT_EQ(a.release(h), -1);
  EXPECT_NE(last_error().find(expected), std::string::npos) << last_error();
}

std::string hex(uint64_t v) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(v));
  return text;
}

TEST_F(PluginOffload, StaleHandlesAreRefusedWithAMessage) {
  push();
  void* p = a.malloc(kBlock, 0, stream_);
  ASSERT_NE(p, nullptr) << last_error();
  pop();
  const uint64_t first = a.pack(p, stream_);
  ASSERT_NE(first, 0u);
  ASSERT_EQ(a.release(first), 0) << last_error();
  expect_refused(a, first, stream_, hex(first));  // after release
  EXPECT_NE(last_error().find("stale"), std::string::npos) << last_error();
  // Packed again: a new handle, and the old one stays dead.
  const uint64_t second = a.pack(p, stream_);
  ASSERT_NE(second, 0u);
  EXPECT_NE(second, first);
  EXPECT_EQ(a.mark_cold(first, stream_), -1);
  ASSERT_EQ(a.mark_cold(second, stream_), 0) << last_error();
  a.free(p, kBlock, 0, stream_);
  ASSERT_STREQ(a.last_error(), "");
  expect_refused(a, second, stream_, hex(second));  // after free
  EXPECT_NE(last_error().find("stale"), std::string::npos) << last_error();
  // A new block at the same address does not revive the old handles.
  push();
  void* q = a.malloc(kBlock, 0, stream_);
  pop();
  ASSERT_NE(q, nullptr) << last_error();
  const uint64_t third = a.pack(q, stream_);
  ASSERT_NE(third, 0u);
  expect_refused(a, second, stream_, hex(second));
  EXPECT_EQ(a.release(third), 0) << last_error();
  a.free(q, kBlock, 0, stream_);
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, ZeroAndGarbageHandlesAreRefusedWithAMessage) {
  expect_refused(a, 0, stream_, "handle 0");
  // Before any tagged block exists, and after one does (slot 0 is then taken).
  for (int round = 0; round < 2; ++round) {
    for (uint64_t garbage : {uint64_t{0xdeadbeef}, uint64_t{0x00ffffff12345678}, uint64_t{0xff00000000000001},
                             uint64_t{0x0100000100000001}, UINT64_MAX}) {
      expect_refused(a, garbage, stream_, hex(garbage));
    }
    if (round == 0) {
      push();
      void* p = a.malloc(kBlock, 0, stream_);
      pop();
      ASSERT_NE(p, nullptr) << last_error();
      const uint64_t h = a.pack(p, stream_);
      ASSERT_NE(h, 0u);
      expect_refused(a, h + 1, stream_, hex(h + 1));  // the right slot, a wrong generation
      EXPECT_EQ(a.unpack(h, stream_), 0) << "the real handle still works: " << last_error();
      EXPECT_EQ(a.release(h), 0) << last_error();
      a.free(p, kBlock, 0, stream_);
    }
  }
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, PrefetchBringsAnEvictedBlockBackAhead) {
  const size_t n = limit_ / kBlock + 2;
  std::vector<void*> blocks;
  std::vector<uint64_t> handles;
  std::vector<std::vector<unsigned char>> patterns;
  ASSERT_NO_FATAL_FAILURE(forward(n, &blocks, &handles, &patterns));
  ASSERT_GT(counter("evicted_bytes"), 0u);
  // Free the newest blocks (as if backward used them), then hint block 0 back.
  for (size_t i = n; i-- > n - 4;) {
    EXPECT_EQ(a.release(handles[i]), 0) << last_error();
    a.free(blocks[i], kBlock, 0, stream_);
  }
  blocks.resize(n - 4);
  handles.resize(n - 4);
  patterns.resize(n - 4);
  const uint64_t prefetches = counter("num_prefetches");
  EXPECT_EQ(a.prefetch(handles[0]), 0) << last_error();
  EXPECT_EQ(counter("num_prefetches"), prefetches + 1) << stats();
  ASSERT_NO_FATAL_FAILURE(backward(blocks, handles, patterns));
  expect_nothing_tagged_left();
}

TEST_F(PluginOffload, EngineOptionsComeFromTheConfiguration) {
  if (stats().find("\"devices\":[]") == std::string::npos)
    GTEST_SKIP() << "device 0's pool and engine were created by an earlier case of this process";
  ASSERT_EQ(a.configure("VRAMSWAP_LOG", "info"), 0) << last_error();
  StderrCapture capture;
  void* p = a.malloc(kMiB, 0, stream_);  // creates device 0's pool and engine
  const std::string err = capture.text();
  ASSERT_EQ(a.configure("VRAMSWAP_LOG", "warn"), 0) << last_error();
  ASSERT_NE(p, nullptr) << last_error();
  // 90% of 64 MiB, rounded down; the verify registration sets VRAMSWAP_VERIFY=1.
  const char* verify = std::getenv("VRAMSWAP_VERIFY");
  const std::string expected = std::string("device 0: eviction engine created, soft limit 57.59 MiB, host limit ") +
                               "the default, horizon 4, verify " + (verify && verify[0] == '1' ? "on" : "off");
  EXPECT_NE(err.find(expected), std::string::npos) << err;
  a.free(p, kMiB, 0, stream_);
}

TEST_F(PluginOffload, EngineSettingsFreezeWithThePoolButMinOffloadBytesDoesNot) {
  void* p = a.malloc(kMiB, 0, stream_);  // a pool and its engine exist from here on
  ASSERT_NE(p, nullptr) << last_error();
  struct Change {
    const char* key;
    const char* value;
  };
  for (Change c : {Change{"VRAMSWAP_SOFT_LIMIT", "50%"}, Change{"VRAMSWAP_HOST_LIMIT", "1GiB"},
                   Change{"VRAMSWAP_HORIZON", "8"}, Change{"VRAMSWAP_VERIFY", "1"}, Change{"VRAMSWAP_VERIFY", "0"}}) {
    const char* in_force = std::getenv("VRAMSWAP_VERIFY");
    if (std::string(c.key) == "VRAMSWAP_VERIFY" && (in_force ? in_force : std::string("0")) == c.value) {
      EXPECT_EQ(a.configure(c.key, c.value), 0) << "the value in force is accepted: " << last_error();
      continue;
    }
    EXPECT_EQ(a.configure(c.key, c.value), -1) << c.key;
    EXPECT_NE(last_error().find(std::string(c.key) + " cannot change"), std::string::npos) << last_error();
  }
  EXPECT_EQ(a.configure("VRAMSWAP_SOFT_LIMIT", "90%"), 0) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_HORIZON", "4"), 0) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_HOST_LIMIT", ""), 0) << last_error();
  // VRAMSWAP_MIN_OFFLOAD_BYTES applies to the next allocation.
  ASSERT_EQ(a.configure("VRAMSWAP_MIN_OFFLOAD_BYTES", "16MiB"), 0) << last_error();
  push();
  void* below = a.malloc(kBlock, 0, stream_);
  pop();
  ASSERT_EQ(a.configure("VRAMSWAP_MIN_OFFLOAD_BYTES", "1MiB"), 0) << last_error();
  push();
  void* above = a.malloc(kBlock, 0, stream_);
  pop();
  ASSERT_NE(below, nullptr) << last_error();
  ASSERT_NE(above, nullptr) << last_error();
  EXPECT_EQ(a.pack(below, stream_), 0u) << "8 MiB is below a 16 MiB threshold";
  const uint64_t h = a.pack(above, stream_);
  EXPECT_NE(h, 0u);
  EXPECT_EQ(a.release(h), 0) << last_error();
  for (void* b : {p, below, above}) a.free(b, 0, 0, stream_);
  EXPECT_STREQ(a.last_error(), "");
  expect_nothing_tagged_left();
}

// Registered on its own, with VRAMSWAP_LIMIT=12XB in the environment (CMakeLists.txt).
// A limit below one allocation granule would refuse every allocation as "out of memory"; it
// is a configuration error that says so, naming the variable and what is accepted.
TEST(PluginTinyLimit, ALimitBelowOneGranuleIsAConfigurationError) {
  const char* limit = std::getenv("VRAMSWAP_LIMIT");
  if (!limit || std::string(limit) != "1MiB") GTEST_SKIP() << "needs VRAMSWAP_LIMIT=1MiB";
  const Api& a = api();
  ASSERT_NE(a.malloc, nullptr);
  EXPECT_EQ(a.malloc(4096, 0, nullptr), nullptr);
  const std::string error = last_error();
  EXPECT_NE(error.find("VRAMSWAP_LIMIT"), std::string::npos) << error;
  EXPECT_NE(error.find("granularity"), std::string::npos) << error;
  EXPECT_EQ(error.find("out of memory"), std::string::npos) << error;
}

TEST(PluginBadEnvironment, AllocationIsRefusedUntilTheValueIsFixed) {
  const char* limit = std::getenv("VRAMSWAP_LIMIT");
  if (!limit || std::string(limit) != "12XB") GTEST_SKIP() << "needs VRAMSWAP_LIMIT=12XB";
  const Api& a = api();
  ASSERT_NE(a.malloc, nullptr);
  EXPECT_EQ(a.malloc(kMiB, 0, nullptr), nullptr);
  EXPECT_NE(last_error().find("VRAMSWAP_LIMIT='12XB'"), std::string::npos) << last_error();
  // torch's entry point throws the same refusal, not as out of memory; size 0 never throws.
  ASSERT_NE(a.torch_malloc, nullptr);
  try {
    a.torch_malloc(kMiB, 0, nullptr);
    ADD_FAILURE() << "vramswap_torch_malloc did not throw under VRAMSWAP_LIMIT=12XB";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("vramswap: allocating 1048576 bytes on device 0 failed: ", 0), 0u) << what;
    EXPECT_NE(what.find("VRAMSWAP_LIMIT='12XB'"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(EXPECT_EQ(a.torch_malloc(0, 0, nullptr), nullptr));
  // Size 0 is never an error (vramswap.h), even while a value is refused.
  EXPECT_EQ(a.malloc(0, 0, nullptr), nullptr);
  EXPECT_STREQ(a.last_error(), "");
  EXPECT_EQ(a.configure("VRAMSWAP_LIMIT", "64MiB"), 0) << last_error();
  void* p = a.malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(number(stats(), "device_limit_bytes"), 64 * kMiB);
  a.free(p, kMiB, 0, nullptr);
}

// vramswap.h: setting a key to a valid value clears a refused environment value of that key,
// and VRAMSWAP_CONF sets the keys its items name. The first version cleared only an entry
// keyed VRAMSWAP_CONF: configure returned 0 and every allocation still failed naming
// VRAMSWAP_LIMIT='12XB'.
TEST(PluginBadEnvironment, AValidConfItemClearsTheRefusedVariable) {
  const char* limit = std::getenv("VRAMSWAP_LIMIT");
  if (!limit || std::string(limit) != "12XB") GTEST_SKIP() << "needs VRAMSWAP_LIMIT=12XB";
  const Api& a = api();
  ASSERT_NE(a.malloc, nullptr);
  EXPECT_EQ(a.malloc(kMiB, 0, nullptr), nullptr);
  EXPECT_EQ(a.configure("VRAMSWAP_CONF", "horizon:2"), 0) << last_error();
  EXPECT_EQ(a.malloc(kMiB, 0, nullptr), nullptr) << "an item of another key clears nothing";
  EXPECT_NE(last_error().find("VRAMSWAP_LIMIT='12XB'"), std::string::npos) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_CONF", "limit:64MiB,limit:32MiB"), -1) << "a key given twice";
  EXPECT_NE(last_error().find("given twice"), std::string::npos) << last_error();
  EXPECT_EQ(a.configure("VRAMSWAP_CONF", "limit:64MiB,horizon:2"), 0) << last_error();
  void* p = a.malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(number(stats(), "device_limit_bytes"), 64 * kMiB);
  a.free(p, kMiB, 0, nullptr);
}

}  // namespace
