// prefetch: does the prefetch window keep backward fed? A backward-like loop over
// kLayers tagged blocks with horizon 2, where each unpack is followed by the layer's
// "compute": a host function on the compute stream that spins kComputeUs (cudasim runs no
// kernels; on cudasim it occupies the stream's worker thread as a kernel occupies the GPU).
//
//   BM_prefetch_hit/<bytes>/pressure:1  limit = kResidentBlocks blocks, so the forward
//                                       evicts most of them and backward must prefetch
//   BM_prefetch_hit/<bytes>/pressure:0  no limit: no copies (the baseline step time)
//
// One iteration is one backward: for each layer, last saved first, unpack; launch the
// compute; release; free_tagged, as the autograd tracker would, then one stream
// synchronize. The forward (allocate_tagged under the limit, a memset as its compute, pack,
// mark_cold) runs before each iteration, untimed. Counters, per iteration (per backward),
// from Engine::stats() differences over the backward only:
//   faults            unpack found the block evicted (nothing prefetched it in time)
//   late_prefetches   unpack found its prefetch still in flight (the compute stream waits)
//   prefetches        fetches started ahead of need
//   evictions         evictions during backward (room made for prefetches)
//   unpack_host_us    host time spent inside unpack (the host was meant to run ahead of
//                     the compute stream; it waits when a prefetch needs pages and the
//                     pool must synchronize the device to unmap blocks freed on the
//                     compute stream)
//   release_host_us   host time spent inside release (release of a block whose fetch is
//                     still in flight waits for that copy)
// The figure to quote is the pressure:1 / pressure:0 time per backward, with the machine.
#include <chrono>
#include <vector>

#include "residency_bench.h"

namespace residency_bench {
namespace {

constexpr int kLayers = 16;
constexpr int kHorizon = 2;
constexpr int kResidentBlocks = 6;  // the limit under pressure: the window and four more
constexpr int kComputeUs = 200;     // one layer's backward

// The layer's compute, run by the compute stream (cudaLaunchHostFunc).
void spin(void*) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kComputeUs);
  while (std::chrono::steady_clock::now() < until) {
  }
}

void BM_prefetch_hit(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  const bool pressure = state.range(1) != 0;
  EngineOptions options;
  options.horizon = kHorizon;
  options.host_limit_bytes = 2 * kLayers * bytes + 256 * kMiB;  // never the bottleneck
  std::string error;
  auto rig = Rig::make(pressure ? kResidentBlocks * bytes : 0, options, &error);
  if (!rig) {
    state.SkipWithError(("no engine: " + error).c_str());
    return;
  }
  Engine& engine = *rig->engine;
  const cudaStream_t stream = rig->stream;
  std::vector<void*> blocks(kLayers);
  std::vector<uint64_t> handles(kLayers);

  auto forward = [&]() -> Status {
    engine.graph_begin();
    for (int i = 0; i < kLayers; ++i) {
      blocks[i] = engine.allocate_tagged(bytes, stream, &error);
      if (!blocks[i]) return {false, "allocate_tagged: " + error};
      if (cudaMemsetAsync(blocks[i], i + 1, bytes, stream) != cudaSuccess) return {false, "cudaMemsetAsync failed"};
      handles[i] = engine.pack(blocks[i], stream);
      if (Status s = engine.mark_cold(handles[i], stream); !s.ok) return s;
    }
    if (cudaStreamSynchronize(stream) != cudaSuccess) return {false, "cudaStreamSynchronize failed"};
    return {};
  };
  double unpack_s = 0, release_s = 0;  // host time inside the calls
  auto backward = [&]() -> Status {
    using clock = std::chrono::steady_clock;
    for (int i = kLayers - 1; i >= 0; --i) {
      const auto t0 = clock::now();
      if (Status s = engine.unpack(handles[i], stream); !s.ok) return s;
      const auto t1 = clock::now();
      if (cudaLaunchHostFunc(stream, spin, nullptr) != cudaSuccess) return {false, "cudaLaunchHostFunc failed"};
      const auto t2 = clock::now();
      if (Status s = engine.release(handles[i]); !s.ok) return s;
      const auto t3 = clock::now();
      unpack_s += std::chrono::duration<double>(t1 - t0).count();
      release_s += std::chrono::duration<double>(t3 - t2).count();
      if (auto r = engine.free_tagged(blocks[i], stream); !r.ok) return {false, "free_tagged: " + r.message};
    }
    if (cudaStreamSynchronize(stream) != cudaSuccess) return {false, "cudaStreamSynchronize failed"};
    return {};
  };

  Status warm = forward();  // warm-up step: pins the host tier, maps the pool's pages
  if (warm.ok) warm = backward();
  if (!warm.ok) {
    state.SkipWithError(warm.message.c_str());
    return;
  }

  unpack_s = release_s = 0;
  EngineStats total;  // sums over the timed backwards
  for (auto _ : state) {
    state.PauseTiming();
    Status s = forward();
    const EngineStats before = engine.stats();
    state.ResumeTiming();
    if (s.ok) s = backward();
    state.PauseTiming();
    const EngineStats after = engine.stats();
    total.num_faults += after.num_faults - before.num_faults;
    total.num_late_prefetches += after.num_late_prefetches - before.num_late_prefetches;
    total.num_prefetches += after.num_prefetches - before.num_prefetches;
    total.num_evictions += after.num_evictions - before.num_evictions;
    state.ResumeTiming();
    if (!s.ok) {
      state.SkipWithError(s.message.c_str());
      break;
    }
  }
  per_iteration(state, "faults", double(total.num_faults));
  per_iteration(state, "late_prefetches", double(total.num_late_prefetches));
  per_iteration(state, "prefetches", double(total.num_prefetches));
  per_iteration(state, "evictions", double(total.num_evictions));
  per_iteration(state, "unpack_host_us", unpack_s * 1e6);
  per_iteration(state, "release_host_us", release_s * 1e6);
}

BENCHMARK(BM_prefetch_hit)
    ->ArgNames({"bytes", "pressure"})
    ->ArgsProduct({{int64_t(2 * kMiB), int64_t(8 * kMiB)}, {1, 0}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace residency_bench
