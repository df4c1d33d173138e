// pool_bench: the cost of the pool's cached path, in ns per malloc+free pair, beside
// general-purpose host allocators measured in the same run.
//
//   BM_vramswap_pair  DevicePool::allocate + deallocate of one size on the thread's stream,
//                     after one warm-up pair: every timed allocation is a cache hit and
//                     makes no CUDA call (counter mapping_allocs: allocations that had to
//                     map during the run, warm-ups included)
//   BM_mimalloc_pair  mi_malloc + mi_free (the floor DESIGN.md names)
//   BM_glibc_pair     malloc + free of the C library
//   BM_vramswap_remote_free, BM_mimalloc_remote_free: one thread allocates and hands each
//                     block to the other, which frees it (on the same stream for the
//                     pool): ns per block, 2 threads. Autograd's backward thread frees what
//                     the forward's thread allocated this way.
//
// Sizes 512 B to 256 MiB; 1 and 2 threads (with 2, each thread has its own stream and
// both share the pool, so its lock is contended). The figure to quote is the ratio
// BM_vramswap_pair / BM_mimalloc_pair per size and thread count, with the machine.
//
// mimalloc is loaded with dlopen(RTLD_LOCAL), not linked: Debian's libmimalloc.so also
// exports malloc/free, and linking it would replace glibc's malloc in the whole process,
// the glibc baseline and the pool's own bookkeeping included.
//
// Run with LD_LIBRARY_PATH=build/sim on a machine without a GPU; on cudasim the pool's
// device memory is host memory, but the cached path touches neither.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "pool/device_pool.h"

namespace {

using vramswap::pool::DevicePool;
using vramswap::pool::PoolOptions;

constexpr int kMaxThreads = 2;

// The pool and one stream per benchmark thread, made once for the whole run.
struct PoolBench {
  std::unique_ptr<DevicePool> pool;
  cudaStream_t streams[kMaxThreads] = {};
  std::string error;  // why the pool could not be made, if it could not
};

PoolBench& pool_bench() {
  static PoolBench* bench = [] {
    auto* b = new PoolBench;  // lives until exit: no teardown order to get wrong
    try {
      b->pool = std::make_unique<DevicePool>(PoolOptions{});
      for (cudaStream_t& s : b->streams) {
        if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
          throw std::runtime_error("cudaStreamCreateWithFlags failed");
        }
      }
    } catch (const std::exception& e) {
      b->pool.reset();
      b->error = e.what();
    }
    return b;
  }();
  return *bench;
}

void BM_vramswap_pair(benchmark::State& state) {
  PoolBench& bench = pool_bench();
  if (!bench.pool) {
    state.SkipWithError(("no device pool: " + bench.error).c_str());
    return;
  }
  DevicePool& pool = *bench.pool;
  const size_t size = static_cast<size_t>(state.range(0));
  const cudaStream_t stream = bench.streams[state.thread_index() % kMaxThreads];
  const auto before = pool.stats();

  std::string error;
  void* warm = pool.allocate(size, stream, &error);  // maps, if this size is new
  if (warm == nullptr) {
    state.SkipWithError(("warm-up allocation failed: " + error).c_str());
    return;
  }
  pool.deallocate(warm, stream);

  for (auto _ : state) {
    void* p = pool.allocate(size, stream, &error);
    benchmark::DoNotOptimize(p);
    pool.deallocate(p, stream);
  }

  if (state.thread_index() == 0) {
    const auto after = pool.stats();
    state.counters["mapping_allocs"] = static_cast<double>(
        (after.num_allocs - before.num_allocs) - (after.num_cache_hits - before.num_cache_hits));
  }
  state.SetItemsProcessed(state.iterations());
}

using MallocFn = void* (*)(size_t);
using FreeFn = void (*)(void*);

struct Mimalloc {
  MallocFn malloc = nullptr;
  FreeFn free = nullptr;
  std::string error;
};

const Mimalloc& mimalloc() {
  static const Mimalloc m = [] {
    Mimalloc r;
#ifdef VRAMSWAP_BENCH_MIMALLOC_LIBRARY
    void* lib = dlopen(VRAMSWAP_BENCH_MIMALLOC_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libmimalloc.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      r.error = std::string("cannot load mimalloc: ") + dlerror();
      return r;
    }
    r.malloc = reinterpret_cast<MallocFn>(dlsym(lib, "mi_malloc"));
    r.free = reinterpret_cast<FreeFn>(dlsym(lib, "mi_free"));
    if (r.malloc == nullptr || r.free == nullptr) r.error = "mimalloc has no mi_malloc/mi_free";
#else
    r.error = "built without mimalloc (Debian: libmimalloc-dev)";
#endif
    return r;
  }();
  return m;
}

void BM_mimalloc_pair(benchmark::State& state) {
  const Mimalloc& mi = mimalloc();
  if (mi.malloc == nullptr) {
    state.SkipWithError(mi.error.c_str());
    return;
  }
  const size_t size = static_cast<size_t>(state.range(0));
  mi.free(mi.malloc(size));  // warm-up, as for the pool
  for (auto _ : state) {
    void* p = mi.malloc(size);
    benchmark::DoNotOptimize(p);
    mi.free(p);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_glibc_pair(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  std::free(std::malloc(size));
  for (auto _ : state) {
    void* p = std::malloc(size);
    benchmark::DoNotOptimize(p);  // the pointer escapes: the pair cannot be optimized away
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}

// The blocks one thread hands the other (a ring of at most kHanded): the producer waits
// while it is full, the consumer while it is empty. Both threads run the same number of
// iterations, so the ring is empty when a run ends.
constexpr size_t kHanded = 16;
struct Handoff {
  std::atomic<size_t> head{0}, tail{0};  // pushed, popped
  void* ring[kHanded] = {};
  void push(void* p) {
    const size_t h = head.load(std::memory_order_relaxed);
    while (h - tail.load(std::memory_order_acquire) == kHanded) {
    }
    ring[h % kHanded] = p;
    head.store(h + 1, std::memory_order_release);
  }
  void* pop() {
    const size_t t = tail.load(std::memory_order_relaxed);
    while (head.load(std::memory_order_acquire) == t) {
    }
    void* p = ring[t % kHanded];
    tail.store(t + 1, std::memory_order_release);
    return p;
  }
};

template <class Alloc, class Free>
void remote_free_loop(benchmark::State& state, Handoff& handoff, Alloc alloc, Free free) {
  if (state.thread_index() == 0) {
    for (auto _ : state) handoff.push(alloc());
  } else {
    for (auto _ : state) free(handoff.pop());
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_vramswap_remote_free(benchmark::State& state) {
  PoolBench& bench = pool_bench();
  if (!bench.pool) {
    state.SkipWithError(("no device pool: " + bench.error).c_str());
    return;
  }
  static Handoff handoff;
  DevicePool& pool = *bench.pool;
  const size_t size = static_cast<size_t>(state.range(0));
  const cudaStream_t stream = bench.streams[0];  // the producer's: the consumer frees on it
  std::string error;
  remote_free_loop(
      state, handoff,
      [&] {
        void* p = pool.allocate(size, stream, &error);
        if (p == nullptr) std::abort();  // a cached size: cannot fail on an empty pool
        return p;
      },
      [&](void* p) { pool.deallocate(p, stream); });
}

void BM_mimalloc_remote_free(benchmark::State& state) {
  const Mimalloc& mi = mimalloc();
  if (mi.malloc == nullptr) {
    state.SkipWithError(mi.error.c_str());
    return;
  }
  static Handoff handoff;
  const size_t size = static_cast<size_t>(state.range(0));
  remote_free_loop(state, handoff, [&] { return mi.malloc(size); }, [&](void* p) { mi.free(p); });
}

// 512 B (one pool unit), 64 KiB, 4 MiB (two granules), 256 MiB.
void sizes(benchmark::internal::Benchmark* b) {
  for (int64_t size : {int64_t{512}, int64_t{64} << 10, int64_t{4} << 20, int64_t{256} << 20}) {
    b->Arg(size);
  }
  b->Threads(1)->Threads(2)->UseRealTime();
}

BENCHMARK(BM_vramswap_pair)->Apply(sizes);
BENCHMARK(BM_mimalloc_pair)->Apply(sizes);
BENCHMARK(BM_glibc_pair)->Apply(sizes);
BENCHMARK(BM_vramswap_remote_free)->Arg(512)->Arg(64 << 10)->Threads(2)->UseRealTime();
BENCHMARK(BM_mimalloc_remote_free)->Arg(512)->Arg(64 << 10)->Threads(2)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("mimalloc", mimalloc().malloc != nullptr
                                              ? "mi_malloc/mi_free (dlopen)"
                                              : "absent: " + mimalloc().error);
  int emulated = 0;
  if (auto* fn = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "cudasim_is_emulated"))) {
    emulated = fn();
  }
  benchmark::AddCustomContext("device", emulated ? "cudasim (no GPU)" : "CUDA driver");
  if (mimalloc().malloc == nullptr) {
    std::fprintf(stderr, "pool_bench: no mimalloc baseline: %s\n", mimalloc().error.c_str());
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
