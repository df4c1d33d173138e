// evict_restore: the engine's copy path, in bytes per second, beside plain copies of the
// same bytes in the same run.
//
// Every pass moves kPassBytes (256 MiB) each way, in blocks of 8 MiB or 64 MiB:
//
//   BM_evict_restore/<bytes>       graph_begin; pack + mark_cold every block; Engine::reclaim
//                                  of all of them (what the pool calls under pressure: D2H on
//                                  the engine's copy stream into the host tier, waited for,
//                                  pages unmapped); unpack every block in backward order
//                                  (horizon 0, so each is a fault: pages mapped again, H2D on
//                                  the other copy stream, the compute stream waits); the
//                                  compute stream synchronized; release every block
//   BM_memcpy_round_trip/<bytes>   cudaMemcpyAsync D2H then H2D of the same blocks between
//                                  device memory (pool blocks, mapped throughout) and one
//                                  cudaMallocHost buffer, all on one stream, one synchronize
//   BM_memcpy_unmap_map_round_trip/<bytes>
//                                  the same copies with the pool's unmap_block / map_block of
//                                  every block between them: the VMM work the engine must do,
//                                  without the engine's bookkeeping
//
// Counters bytes_evicted / bytes_restored (engine) and bytes_d2h / bytes_h2d (baselines)
// are rates over real time. The figure to quote is BM_evict_restore's bytes_per_second
// over BM_memcpy_round_trip's, per block size, with the machine. The blocks are filled by a
// memset on the compute stream before each pass, outside the timed region.
//
// On cudasim a copy is a memcpy on a worker thread and mapping pages again means fresh page
// faults on first touch, so BM_memcpy_unmap_map_round_trip separates the emulator's VMM cost
// from the engine's own; on a GPU the copies run on copy engines at PCIe speed.
#include <vector>

#include "residency_bench.h"

namespace residency_bench {
namespace {

constexpr uint64_t kPassBytes = 256 * kMiB;  // per direction, per pass

bool fill(const std::vector<void*>& blocks, size_t bytes, cudaStream_t stream) {
  for (size_t i = 0; i < blocks.size(); ++i)
    if (cudaMemsetAsync(blocks[i], int(i + 1), bytes, stream) != cudaSuccess) return false;
  return cudaStreamSynchronize(stream) == cudaSuccess;
}

void BM_evict_restore(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  const size_t n = kPassBytes / bytes;
  EngineOptions options;
  options.horizon = 0;  // every unpack of an evicted block is a fault: the copy path alone
  options.host_limit_bytes = 2 * kPassBytes;
  std::string error;
  auto rig = Rig::make(0, options, &error);
  if (!rig) {
    state.SkipWithError(("no engine: " + error).c_str());
    return;
  }
  Engine& engine = *rig->engine;
  const cudaStream_t stream = rig->stream;
  std::vector<void*> blocks(n);
  for (void*& p : blocks) {
    p = engine.allocate_tagged(bytes, stream, &error);
    if (!p) {
      state.SkipWithError(("allocate_tagged: " + error).c_str());
      return;
    }
  }
  std::vector<uint64_t> handles(n);

  auto pass = [&]() -> Status {
    engine.graph_begin();
    for (size_t i = 0; i < n; ++i) {
      handles[i] = engine.pack(blocks[i], stream);
      if (Status s = engine.mark_cold(handles[i], stream); !s.ok) return s;
    }
    const uint64_t freed = engine.reclaim(kPassBytes);
    if (freed < kPassBytes)
      return {false, "reclaim freed " + std::to_string(freed) + " of " + std::to_string(kPassBytes) + " bytes"};
    for (size_t i = n; i-- > 0;)
      if (Status s = engine.unpack(handles[i], stream); !s.ok) return s;
    if (cudaStreamSynchronize(stream) != cudaSuccess) return {false, "cudaStreamSynchronize failed"};
    for (size_t i = 0; i < n; ++i)
      if (Status s = engine.release(handles[i]); !s.ok) return s;
    return {};
  };

  // Warm-up pass: pins the host tier's chunks, fills the event pool, makes the spare pages.
  if (!fill(blocks, bytes, stream)) {
    state.SkipWithError("fill failed");
    return;
  }
  if (Status s = pass(); !s.ok) {
    state.SkipWithError(s.message.c_str());
    return;
  }

  const EngineStats before = engine.stats();
  for (auto _ : state) {
    state.PauseTiming();
    const bool filled = fill(blocks, bytes, stream);
    state.ResumeTiming();
    if (!filled) {
      state.SkipWithError("fill failed");
      break;
    }
    if (Status s = pass(); !s.ok) {
      state.SkipWithError(s.message.c_str());
      break;
    }
  }
  const EngineStats after = engine.stats();
  const double evicted = double(after.bytes_evicted_total - before.bytes_evicted_total);
  const double restored = double(after.bytes_prefetched_total - before.bytes_prefetched_total);
  rate(state, "bytes_evicted", evicted);
  rate(state, "bytes_restored", restored);
  per_iteration(state, "faults", double(after.num_faults - before.num_faults));
  state.SetBytesProcessed(int64_t(evicted + restored));
}

// The baselines: pool blocks (the engine's kind of device memory) and one pinned buffer.
void memcpy_round_trip(benchmark::State& state, bool unmap_map) {
  const auto bytes = static_cast<size_t>(state.range(0));
  const size_t n = kPassBytes / bytes;
  std::string error;
  auto rig = Rig::make(0, EngineOptions{}, &error);
  if (!rig) {
    state.SkipWithError(("no pool: " + error).c_str());
    return;
  }
  DevicePool& pool = *rig->pool;
  const cudaStream_t stream = rig->stream;
  std::vector<void*> blocks(n);
  for (void*& p : blocks) {
    p = pool.allocate_offloadable(bytes, stream, &error);  // unmap_block works on it
    if (!p) {
      state.SkipWithError(("allocate_offloadable: " + error).c_str());
      return;
    }
  }
  char* host = nullptr;
  if (cudaMallocHost(reinterpret_cast<void**>(&host), kPassBytes) != cudaSuccess) {
    state.SkipWithError("cudaMallocHost failed");
    return;
  }

  auto pass = [&]() -> std::string {
    for (size_t i = 0; i < n; ++i)
      if (cudaMemcpyAsync(host + i * bytes, blocks[i], bytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess)
        return "cudaMemcpyAsync D2H failed";
    if (unmap_map) {
      if (cudaStreamSynchronize(stream) != cudaSuccess) return "cudaStreamSynchronize failed";
      for (void* p : blocks)
        if (auto r = pool.unmap_block(p); !r.ok) return r.message;
      for (void* p : blocks)
        if (auto r = pool.map_block(p, vramswap::pool::DevicePool::MapWait::kSynchronize); !r.ok) return r.message;
    }
    for (size_t i = 0; i < n; ++i)
      if (cudaMemcpyAsync(blocks[i], host + i * bytes, bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess)
        return "cudaMemcpyAsync H2D failed";
    if (cudaStreamSynchronize(stream) != cudaSuccess) return "cudaStreamSynchronize failed";
    return {};
  };

  std::string failure;
  if (!fill(blocks, bytes, stream)) failure = "fill failed";
  if (failure.empty()) failure = pass();  // warm-up: touches the pinned buffer
  int64_t passes = 0;
  if (failure.empty()) {
    for (auto _ : state) {
      state.PauseTiming();
      const bool filled = fill(blocks, bytes, stream);
      state.ResumeTiming();
      failure = filled ? pass() : "fill failed";
      if (!failure.empty()) break;
      ++passes;
    }
  }
  if (!failure.empty()) state.SkipWithError(failure.c_str());
  cudaFreeHost(host);
  rate(state, "bytes_d2h", double(passes) * double(kPassBytes));
  rate(state, "bytes_h2d", double(passes) * double(kPassBytes));
  state.SetBytesProcessed(passes * int64_t(2 * kPassBytes));
}

void BM_memcpy_round_trip(benchmark::State& state) { memcpy_round_trip(state, false); }
void BM_memcpy_unmap_map_round_trip(benchmark::State& state) { memcpy_round_trip(state, true); }

void block_sizes(benchmark::internal::Benchmark* b) {
  b->Arg(int64_t(8 * kMiB))->Arg(int64_t(64 * kMiB))->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_evict_restore)->Apply(block_sizes);
BENCHMARK(BM_memcpy_round_trip)->Apply(block_sizes);
BENCHMARK(BM_memcpy_unmap_map_round_trip)->Apply(block_sizes);

}  // namespace
}  // namespace residency_bench
