// residency_bench: what the scenarios share (cycle_bench.cpp, evict_restore_bench.cpp,
// prefetch_bench.cpp; main.cpp runs them).
//
// A Rig is one device pool, the engine on it and one compute stream, made fresh for each
// run of a benchmark function, so every run starts from an empty engine and the counters
// are read as differences of Engine::stats() taken around the timed work.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "pool/device_pool.h"
#include "residency/engine.h"

namespace residency_bench {

using vramswap::pool::DevicePool;
using vramswap::pool::PoolOptions;
using vramswap::residency::Engine;
using vramswap::residency::EngineOptions;
using vramswap::residency::EngineStats;
using vramswap::residency::Status;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

// A pool limited to `limit_bytes` (0: the whole card), its engine and a non-blocking
// compute stream. Torn down in the safe order: stream drained, engine, pool, stream.
struct Rig {
  std::unique_ptr<DevicePool> pool;
  std::unique_ptr<Engine> engine;
  cudaStream_t stream = nullptr;

  // nullptr with *error set when the device, the pool or the engine cannot be made.
  static std::unique_ptr<Rig> make(uint64_t limit_bytes, const EngineOptions& options, std::string* error) {
    auto rig = std::make_unique<Rig>();
    try {
      rig->pool = std::make_unique<DevicePool>(PoolOptions{0, limit_bytes});
      rig->engine = std::make_unique<Engine>(*rig->pool, options);
    } catch (const std::exception& e) {
      *error = e.what();
      return nullptr;
    }
    if (cudaStreamCreateWithFlags(&rig->stream, cudaStreamNonBlocking) != cudaSuccess) {
      *error = "cudaStreamCreateWithFlags failed";
      rig->stream = nullptr;
      return nullptr;
    }
    return rig;
  }

  ~Rig() {
    if (stream) cudaStreamSynchronize(stream);
    engine.reset();
    pool.reset();
    if (stream) cudaStreamDestroy(stream);
  }
};

// Sets `name` to `value` per iteration (the figure benchmark prints is the average).
inline void per_iteration(benchmark::State& state, const char* name, double value) {
  state.counters[name] = benchmark::Counter(value, benchmark::Counter::kAvgIterations);
}

// Sets `name` to `bytes` moved in the timed loop, printed as bytes per second of real time.
inline void rate(benchmark::State& state, const char* name, double bytes) {
  state.counters[name] = benchmark::Counter(bytes, benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

}  // namespace residency_bench
