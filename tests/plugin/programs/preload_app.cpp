// A plain CUDA program, written as if vramswap did not exist: it is linked to the CUDA
// toolkit's libcudart.so.13 (no RPATH) and uses cudaMalloc, cudaMallocAsync, cudaMemcpy,
// cudaFree, cudaFreeAsync and cudaMemGetInfo. tests/plugin/check_preload.py runs it on
// cudasim with and without LD_PRELOAD=libvramswap_preload.so and checks what it printed,
// its exit status, its stderr and the VRAMSWAP_STATS_FILE it left.
//
// Output lines (stdout): "preload_app: start" (first thing in main), "meminfo free=F
// total=T" (before any allocation), "preload_app: ok" (every check held). Options:
// --oom BYTES   also ask cudaMalloc for BYTES (before any stream is created) and require
//               cudaErrorMemoryAllocation.
// --big BYTES   at the end, after its streams were destroyed and everything was freed, ask
//               cudaMalloc for BYTES and require success (an allocator must give back memory
//               it cached for a stream that no longer exists).
// --offload N   also run a forward/backward of N blocks of 8 MiB through vramswap's C ABI,
//               found with dlsym in the process (so only under the preload): cudaMalloc
//               inside vramswap_scope_push/pop, a pattern per block by cudaMemcpy,
//               vramswap_pack and vramswap_mark_cold; then, last block first,
//               vramswap_unpack, cudaMemcpy back and compare, vramswap_release, cudaFree.
//               Prints "offload: ok" when every byte came back.
// --legacy-reuse  a block written on the legacy stream behind a slow kernel, freed there
//               with cudaFreeAsync(p, 0), then a cudaMalloc and a write on a non-blocking
//               stream: the new block must not be one the legacy stream's queued work still
//               writes. Prints "legacy reuse: ok" when the non-blocking stream's bytes stayed.
// --capture     under a 64 MiB limit: 56 MiB freed on one stream (cached for it), one block
//               freed on another stream than its own (its reuse waits for an event); then,
//               while a third stream captures in the global mode (torch.cuda.graph's mode),
//               a 48 MiB cudaMallocAsync on it that needs the first stream's pages, a memset
//               captured into the graph, the capture's end. Prints "capture: ok" when the
//               capture ended with a graph and launching it wrote the block.
// --peer        with two devices: a block allocated on device 0, peer access enabled from
//               device 1 (cudaDeviceEnablePeerAccess(0, 0)), a second block allocated on
//               device 0 after that, then a stream of device 1 copies both into a device-1
//               block. Prints "peer: ok" when every byte arrived.
// --peer-without-access  the same copies without enabling peer access (the copy on device
//               1's stream must fault).
// --destroyed-free-stream N  N times: a block allocated and written on stream O, freed on
//               stream S (S waits for O's write first, as CUDA requires), S destroyed, then
//               vramswap_empty_cache (found with dlsym, so only under the preload), O
//               destroyed. An allocator that still names S afterwards stops the program on
//               cudasim. Prints "destroyed free stream: ok".
// --stream-threads T  T threads, each making rounds of: two streams created (its own and
//               a second one), blocks allocated and written on its own stream and freed there,
//               or on the second stream after an event (their reuse waits for the first
//               stream), some read back and compared, vramswap_empty_cache now and then; both
//               streams destroyed at the end of the round while the other threads carry on.
//               A fixed seed per thread. Prints "stream threads: ok".
// Exit status: 0 when every check held, 1 otherwise (the failed check is on stderr).
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// Exported by libcudart.so.13; a program built with --default-stream per-thread calls these.
extern "C" cudaError_t cudaMallocAsync_ptsz(void** ptr, size_t size, cudaStream_t stream);
extern "C" cudaError_t cudaFreeAsync_ptsz(void* ptr, cudaStream_t stream);

namespace {

int failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "preload_app: check failed at line %d: %s\n", __LINE__, #cond); \
      ++failures;                                                                    \
    }                                                                                \
  } while (0)

#define CHECK_CUDA(expr)                                                             \
  do {                                                                               \
    cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "preload_app: %s failed at line %d: %s\n", #expr, __LINE__, \
                   cudaGetErrorName(e_));                                            \
      ++failures;                                                                    \
    }                                                                                \
  } while (0)

std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 131u + seed);
  return v;
}

// vramswap's C ABI as an unchanged program reaches it: looked up in the process, where
// libvramswap_preload.so defines it. The types are vramswap.h's.
struct Offload {
  void (*scope_push)() = nullptr;
  void (*scope_pop)() = nullptr;
  uint64_t (*pack)(const void*, cudaStream_t) = nullptr;
  void (*graph_begin)() = nullptr;
  int (*mark_cold)(uint64_t, cudaStream_t) = nullptr;
  int (*unpack)(uint64_t, cudaStream_t) = nullptr;
  int (*release)(uint64_t) = nullptr;
  const char* (*last_error)() = nullptr;

  template <typename F>
  static void find(F*& slot, const char* name) {
    slot = reinterpret_cast<F*>(dlsym(RTLD_DEFAULT, name));
  }
  bool load() {
    find(scope_push, "vramswap_scope_push");
    find(scope_pop, "vramswap_scope_pop");
    find(pack, "vramswap_pack");
    find(graph_begin, "vramswap_graph_begin");
    find(mark_cold, "vramswap_mark_cold");
    find(unpack, "vramswap_unpack");
    find(release, "vramswap_release");
    find(last_error, "vramswap_last_error");
    return scope_push && scope_pop && pack && graph_begin && mark_cold && unpack && release && last_error;
  }
};

// The forward/backward of --offload (see the top of the file), on the legacy default stream.
void offload(size_t blocks) {
  constexpr size_t kBlock = 8 << 20;
  Offload v;
  if (!v.load()) {
    std::fprintf(stderr, "preload_app: vramswap's C ABI is not in the process (run it under the preload)\n");
    ++failures;
    return;
  }
  std::vector<void*> ptrs(blocks, nullptr);
  std::vector<uint64_t> handles(blocks, 0);
  v.scope_push();
  v.graph_begin();
  for (size_t i = 0; i < blocks; ++i) {
    CHECK_CUDA(cudaMalloc(&ptrs[i], kBlock));
    if (!ptrs[i]) {
      std::fprintf(stderr, "preload_app: offload block %zu: %s\n", i, v.last_error());
      break;
    }
    CHECK_CUDA(cudaMemcpy(ptrs[i], pattern(kBlock, unsigned(i)).data(), kBlock, cudaMemcpyHostToDevice));
    handles[i] = v.pack(ptrs[i], nullptr);
    CHECK(handles[i] != 0);
    CHECK(v.mark_cold(handles[i], nullptr) == 0);
  }
  v.scope_pop();
  CHECK(v.last_error()[0] == '\0');
  std::vector<unsigned char> out(kBlock);
  for (size_t i = blocks; i-- > 0;) {
    if (!ptrs[i]) continue;
    CHECK(v.unpack(handles[i], nullptr) == 0);
    CHECK_CUDA(cudaMemcpy(out.data(), ptrs[i], kBlock, cudaMemcpyDeviceToHost));
    CHECK(out == pattern(kBlock, unsigned(i)));
    CHECK(v.release(handles[i]) == 0);
    CHECK_CUDA(cudaFree(ptrs[i]));
  }
  // A block allocated outside the scope is an ordinary one.
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, kBlock));
  CHECK(v.pack(d, nullptr) == 0);
  CHECK_CUDA(cudaFree(d));
  if (failures == 0) std::printf("offload: ok\n");
}

// --legacy-reuse (see the top of the file). The slow kernel is cudasim's (found with dlsym;
// on a GPU the memset alone is usually still queued): it keeps the legacy stream busy so
// that its memset runs after the program's later write on the non-blocking stream, if that
// write landed in the same memory.
void legacy_reuse() {
  constexpr size_t kBytes = 4 << 20;
  using Kernel = int (*)(void*, uint64_t, const char*);
  auto kernel = reinterpret_cast<Kernel>(dlsym(RTLD_DEFAULT, "cudasim_kernel"));
  void* first = nullptr;
  CHECK_CUDA(cudaMalloc(&first, kBytes));
  if (kernel) CHECK(kernel(nullptr, 10'000'000, "slow") == 0);
  CHECK_CUDA(cudaMemsetAsync(first, 0xaa, kBytes, nullptr));
  CHECK_CUDA(cudaFreeAsync(first, nullptr));
  void* second = nullptr;
  CHECK_CUDA(cudaMalloc(&second, kBytes));
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK_CUDA(cudaMemsetAsync(second, 0x55, kBytes, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> out(kBytes, 0);
  CHECK_CUDA(cudaMemcpy(out.data(), second, kBytes, cudaMemcpyDeviceToHost));
  const size_t wrong = size_t(std::count_if(out.begin(), out.end(), [](unsigned char c) { return c != 0x55; }));
  std::printf("legacy reuse: %s (same address: %s, %zu of %zu bytes overwritten)\n", wrong ? "FAILED" : "ok",
              first == second ? "yes" : "no", wrong, kBytes);
  CHECK(wrong == 0);
  CHECK_CUDA(cudaStreamDestroy(s));
  CHECK_CUDA(cudaFree(second));
}

// --capture (see the top of the file). Nothing here synchronizes the device: a device
// synchronization while a stream captures invalidates the capture in every mode, and so
// would the allocator's, were it to make one.
void capture_at_the_limit() {
  constexpr size_t kMiB = 1 << 20;
  cudaStream_t a = nullptr, b = nullptr, c = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
  std::vector<void*> cached(7, nullptr);
  for (void*& p : cached) {
    CHECK_CUDA(cudaMallocAsync(&p, 8 * kMiB, a));
    if (p) CHECK_CUDA(cudaMemsetAsync(p, 0x11, 8 * kMiB, a));
  }
  for (size_t i = 0; i + 1 < cached.size(); ++i) CHECK_CUDA(cudaFreeAsync(cached[i], a));
  CHECK_CUDA(cudaFreeAsync(cached.back(), b));  // allocated on a: its reuse waits for a's event
  CHECK_CUDA(cudaStreamBeginCapture(c, cudaStreamCaptureModeGlobal));
  void* p = nullptr;
  const cudaError_t allocated = cudaMallocAsync(&p, 48 * kMiB, c);
  CHECK_CUDA(allocated);
  if (p) CHECK_CUDA(cudaMemsetAsync(p, 0x3c, 48 * kMiB, c));
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(c, &graph);
  std::printf("capture: allocation %s, end %s, graph %s\n", cudaGetErrorName(allocated), cudaGetErrorName(ended),
              graph ? "yes" : "none");
  CHECK(ended == cudaSuccess);
  CHECK(graph != nullptr);
  bool written = false;
  if (graph && p) {
    cudaGraphExec_t exec = nullptr;
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    if (exec) {
      CHECK_CUDA(cudaGraphLaunch(exec, c));
      CHECK_CUDA(cudaStreamSynchronize(c));
      std::vector<unsigned char> out(48 * kMiB, 0);
      CHECK_CUDA(cudaMemcpy(out.data(), p, out.size(), cudaMemcpyDeviceToHost));
      written = std::all_of(out.begin(), out.end(), [](unsigned char x) { return x == 0x3c; });
      CHECK(written);
      CHECK_CUDA(cudaGraphExecDestroy(exec));
    }
  }
  if (graph) CHECK_CUDA(cudaGraphDestroy(graph));
  if (p) CHECK_CUDA(cudaFreeAsync(p, c));
  CHECK_CUDA(cudaStreamSynchronize(c));
  for (cudaStream_t s : {a, b, c}) CHECK_CUDA(cudaStreamDestroy(s));
  if (written && failures == 0) std::printf("capture: ok\n");
}

// --peer, --peer-without-access (see the top of the file).
void peer_copy(bool enable) {
  constexpr size_t kBytes = 4 << 20;
  int count = 0;
  CHECK_CUDA(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::fprintf(stderr, "preload_app: --peer needs two devices, found %d\n", count);
    ++failures;
    return;
  }
  CHECK_CUDA(cudaSetDevice(0));
  void* before = nullptr;
  CHECK_CUDA(cudaMalloc(&before, kBytes));
  CHECK_CUDA(cudaMemcpy(before, pattern(kBytes, 21).data(), kBytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaSetDevice(1));
  if (enable) CHECK_CUDA(cudaDeviceEnablePeerAccess(0, 0));
  CHECK_CUDA(cudaSetDevice(0));
  void* after = nullptr;  // mapped once peer access was enabled
  CHECK_CUDA(cudaMalloc(&after, kBytes));
  CHECK_CUDA(cudaMemcpy(after, pattern(kBytes, 22).data(), kBytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaSetDevice(1));
  cudaStream_t s1 = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  void* both = nullptr;
  CHECK_CUDA(cudaMalloc(&both, 2 * kBytes));
  if (before && after && both && s1) {
    CHECK_CUDA(cudaMemcpyAsync(both, before, kBytes, cudaMemcpyDeviceToDevice, s1));
    CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(both) + kBytes, after, kBytes, cudaMemcpyDeviceToDevice, s1));
    CHECK_CUDA(cudaStreamSynchronize(s1));
    std::vector<unsigned char> out(kBytes);
    CHECK_CUDA(cudaMemcpy(out.data(), both, kBytes, cudaMemcpyDeviceToHost));
    const bool first = out == pattern(kBytes, 21);
    CHECK_CUDA(cudaMemcpy(out.data(), static_cast<char*>(both) + kBytes, kBytes, cudaMemcpyDeviceToHost));
    const bool second = out == pattern(kBytes, 22);
    CHECK(first);
    CHECK(second);
    if (first && second && failures == 0) std::printf("peer: ok\n");
  }
  CHECK_CUDA(cudaFree(both));
  CHECK_CUDA(cudaStreamDestroy(s1));
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaFree(before));
  CHECK_CUDA(cudaFree(after));
}

// vramswap_empty_cache as an unchanged program reaches it (see Offload), or null.
using EmptyCache = void (*)();
EmptyCache find_empty_cache() {
  auto f = reinterpret_cast<EmptyCache>(dlsym(RTLD_DEFAULT, "vramswap_empty_cache"));
  if (!f) {
    std::fprintf(stderr, "preload_app: vramswap_empty_cache is not in the process (run it under the preload)\n");
    ++failures;
  }
  return f;
}

// --destroyed-free-stream (see the top of the file).
void destroyed_free_stream(size_t iterations) {
  constexpr size_t kBytes = 1 << 20;
  EmptyCache empty_cache = find_empty_cache();
  if (!empty_cache) return;
  for (size_t i = 0; i < iterations && failures == 0; ++i) {
    cudaStream_t o = nullptr, s = nullptr;
    cudaEvent_t written = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&o, cudaStreamNonBlocking));
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));
    void* p = nullptr;
    CHECK_CUDA(cudaMallocAsync(&p, kBytes, o));
    if (p) CHECK_CUDA(cudaMemsetAsync(p, 0x4e, kBytes, o));
    CHECK_CUDA(cudaEventRecord(written, o));
    CHECK_CUDA(cudaStreamWaitEvent(s, written, 0));
    if (p) CHECK_CUDA(cudaFreeAsync(p, s));
    CHECK_CUDA(cudaStreamDestroy(s));
    empty_cache();
    CHECK_CUDA(cudaEventDestroy(written));
    CHECK_CUDA(cudaStreamDestroy(o));
  }
  if (failures == 0) std::printf("destroyed free stream: ok\n");
}

// --stream-threads (see the top of the file).
void stream_threads(size_t threads) {
  constexpr int kRounds = 4, kOps = 48;
  constexpr size_t kLive = 3;  // blocks a thread keeps before freeing the oldest
  EmptyCache empty_cache = find_empty_cache();
  if (!empty_cache) return;
  std::vector<int> wrong(threads, 0);
  std::vector<std::thread> workers;
  for (size_t t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      unsigned seed = 7919u * unsigned(t + 1);
      auto next = [&seed](unsigned n) {
        seed = seed * 1103515245u + 12345u;
        return (seed >> 8) % n;
      };
      std::vector<unsigned char> out;
      for (int round = 0; round < kRounds; ++round) {
        cudaStream_t own = nullptr, second = nullptr;
        cudaEvent_t done = nullptr;
        if (cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking) != cudaSuccess ||
            cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking) != cudaSuccess ||
            cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
          ++wrong[t];
          return;
        }
        std::vector<std::pair<void*, size_t>> live;
        auto free_oldest = [&] {
          auto [p, n] = live.front();
          live.erase(live.begin());
          if (next(2) == 0) {
            if (cudaFreeAsync(p, own) != cudaSuccess) ++wrong[t];
            return;
          }
          // Freed on the second stream once the first's work on it is done: vramswap holds it
          // behind an event on the first stream, then keeps it for the second.
          if (cudaEventRecord(done, own) != cudaSuccess || cudaStreamWaitEvent(second, done, 0) != cudaSuccess ||
              cudaFreeAsync(p, second) != cudaSuccess)
            ++wrong[t];
        };
        for (int op = 0; op < kOps; ++op) {
          const size_t n = 4096 * (1 + next(1024));  // 4 KiB to 4 MiB
          const auto value = static_cast<unsigned char>(next(256));
          void* p = nullptr;
          if (cudaMallocAsync(&p, n, own) != cudaSuccess || !p) {
            ++wrong[t];
            continue;
          }
          if (cudaMemsetAsync(p, value, n, own) != cudaSuccess) ++wrong[t];
          if (next(4) == 0) {  // read back on the same stream: nobody else may have written it
            out.assign(n, 0);
            if (cudaMemcpyAsync(out.data(), p, n, cudaMemcpyDeviceToHost, own) != cudaSuccess ||
                cudaStreamSynchronize(own) != cudaSuccess ||
                std::any_of(out.begin(), out.end(), [value](unsigned char c) { return c != value; }))
              ++wrong[t];
          }
          live.emplace_back(p, n);
          if (live.size() > kLive) free_oldest();
          if (next(16) == 0) empty_cache();
        }
        while (!live.empty()) free_oldest();
        // The program is done with both streams (the second may still hold frees waiting on
        // the first): destroyed while the other threads go on allocating and emptying.
        if (cudaStreamDestroy(second) != cudaSuccess || cudaStreamDestroy(own) != cudaSuccess ||
            cudaEventDestroy(done) != cudaSuccess)
          ++wrong[t];
      }
    });
  }
  for (auto& w : workers) w.join();
  empty_cache();
  for (size_t t = 0; t < threads; ++t) {
    if (wrong[t] != 0) std::fprintf(stderr, "preload_app: stream thread %zu: %d failed calls or checks\n", t, wrong[t]);
    CHECK(wrong[t] == 0);
  }
  if (failures == 0) std::printf("stream threads: ok\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::printf("preload_app: start\n");
  std::fflush(stdout);
  unsigned long long oom_bytes = 0, big_bytes = 0, offload_blocks = 0, destroyed_free_iterations = 0,
                     threads = 0;
  bool reuse_after_legacy_free = false, capture = false, peer = false, peer_without_access = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--legacy-reuse") reuse_after_legacy_free = true;
    if (std::string(argv[i]) == "--capture") capture = true;
    if (std::string(argv[i]) == "--peer") peer = true;
    if (std::string(argv[i]) == "--peer-without-access") peer_without_access = true;
    if (std::string(argv[i]) == "--oom" && i + 1 < argc) oom_bytes = std::strtoull(argv[++i], nullptr, 10);
    if (std::string(argv[i]) == "--big" && i + 1 < argc) big_bytes = std::strtoull(argv[++i], nullptr, 10);
    if (std::string(argv[i]) == "--offload" && i + 1 < argc) offload_blocks = std::strtoull(argv[++i], nullptr, 10);
    if (std::string(argv[i]) == "--destroyed-free-stream" && i + 1 < argc)
      destroyed_free_iterations = std::strtoull(argv[++i], nullptr, 10);
    if (std::string(argv[i]) == "--stream-threads" && i + 1 < argc) threads = std::strtoull(argv[++i], nullptr, 10);
  }

  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::printf("meminfo free=%zu total=%zu\n", free_bytes, total_bytes);
  CHECK(free_bytes <= total_bytes);

  // Synchronous allocations, round trips through device memory.
  const size_t sizes[] = {1 << 20, (5 << 20) + 3, 512, 1, 12345};
  std::vector<std::pair<uintptr_t, size_t>> blocks;
  std::vector<void*> ptrs;
  for (size_t n : sizes) {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, n));
    CHECK(d != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(d) % 256 == 0);  // what CUDA promises
    std::vector<unsigned char> in = pattern(n, static_cast<unsigned>(n)), out(n, 0);
    CHECK_CUDA(cudaMemcpy(d, in.data(), n, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));
    CHECK(in == out);
    blocks.emplace_back(reinterpret_cast<uintptr_t>(d), n);
    ptrs.push_back(d);
  }
  std::sort(blocks.begin(), blocks.end());
  for (size_t i = 1; i < blocks.size(); ++i) CHECK(blocks[i - 1].first + blocks[i - 1].second <= blocks[i].first);

  if (oom_bytes) {
    void* d = nullptr;
    cudaError_t e = cudaMalloc(&d, oom_bytes);
    std::printf("oom: %s\n", cudaGetErrorName(e));
    CHECK(e == cudaErrorMemoryAllocation);
    CHECK(d == nullptr);
    cudaGetLastError();
  }

  // Device to device.
  {
    const size_t n = 1 << 20;
    std::vector<unsigned char> in = pattern(n, 99), out(n, 0);
    CHECK_CUDA(cudaMemcpy(ptrs[0], in.data(), n, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(ptrs[1], ptrs[0], n, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaMemcpy(out.data(), ptrs[1], n, cudaMemcpyDeviceToHost));
    CHECK(in == out);
  }

  size_t free_after = 0, total_after = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_after, &total_after));
  CHECK(total_after == total_bytes);
  CHECK(free_after < free_bytes);

  // Size 0: a null pointer and success. cudaFree(nullptr): success.
  void* none = reinterpret_cast<void*>(1);
  CHECK_CUDA(cudaMalloc(&none, 0));
  CHECK(none == nullptr);
  CHECK_CUDA(cudaFree(nullptr));

  // Stream-ordered allocation on a stream, and on the per-thread default stream.
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreate(&s));
  {
    const size_t n = 2 << 20;
    void* d = nullptr;
    CHECK_CUDA(cudaMallocAsync(&d, n, s));
    CHECK(d != nullptr);
    std::vector<unsigned char> out(n, 0);
    CHECK_CUDA(cudaMemsetAsync(d, 0x7b, n, s));
    CHECK_CUDA(cudaMemcpyAsync(out.data(), d, n, cudaMemcpyDeviceToHost, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    CHECK(std::all_of(out.begin(), out.end(), [](unsigned char c) { return c == 0x7b; }));
    CHECK_CUDA(cudaFreeAsync(d, s));
    // Reallocated on the same stream after its free: stream order makes it safe at once.
    void* again = nullptr;
    CHECK_CUDA(cudaMallocAsync(&again, n, s));
    CHECK(again != nullptr);
    CHECK_CUDA(cudaFreeAsync(again, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
  }
  {
    void* d = nullptr;
    CHECK_CUDA(cudaMallocAsync_ptsz(&d, 4096, nullptr));
    CHECK(d != nullptr);
    CHECK_CUDA(cudaMemsetAsync(d, 1, 4096, cudaStreamPerThread));
    CHECK_CUDA(cudaFreeAsync_ptsz(d, nullptr));
    CHECK_CUDA(cudaStreamSynchronize(cudaStreamPerThread));
  }
  // A block still live when the stream it was allocated on is destroyed, freed afterwards
  // on another stream (CUDA allows it): the free must not name the destroyed stream to CUDA
  // (undefined behaviour on a GPU; cudasim stops the program). The preload's
  // cudaStreamDestroy tells vramswap first.
  void* outlives = nullptr;
  CHECK_CUDA(cudaMallocAsync(&outlives, 1 << 20, s));
  CHECK_CUDA(cudaMemsetAsync(outlives, 0x5c, 1 << 20, s));
  // The free below is ordered on another stream: the program's own work on s must be done
  // first (without the preload, the real cudaFreeAsync would free it under the memset).
  CHECK_CUDA(cudaStreamSynchronize(s));
  cudaStream_t later = nullptr;  // created first: a stream created after may take s's address
  CHECK_CUDA(cudaStreamCreate(&later));
  CHECK_CUDA(cudaStreamDestroy(s));
  CHECK_CUDA(cudaFreeAsync(outlives, later));
  CHECK_CUDA(cudaStreamDestroy(later));

  for (void* d : ptrs) CHECK_CUDA(cudaFree(d));

  // A double free is an error, with or without vramswap.
  {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, 4096));
    CHECK_CUDA(cudaFree(d));
    CHECK(cudaFree(d) == cudaErrorInvalidValue);
    cudaGetLastError();  // the runtime's sticky-free error state, if any
  }

  if (offload_blocks) offload(offload_blocks);
  if (reuse_after_legacy_free) legacy_reuse();
  if (capture) capture_at_the_limit();
  if (peer || peer_without_access) peer_copy(peer);
  if (destroyed_free_iterations) destroyed_free_stream(destroyed_free_iterations);
  if (threads) stream_threads(threads);

  if (big_bytes) {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, big_bytes));
    CHECK(d != nullptr);
    CHECK_CUDA(cudaFree(d));
  }

  if (failures == 0) std::printf("preload_app: ok\n");
  return failures == 0 ? 0 : 1;
}
