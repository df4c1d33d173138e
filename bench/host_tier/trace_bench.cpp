// trace: the pinned memory a placement needs for a replayed trace of mixed-size blocks,
// against the trace's peak of live bytes, and the cost per operation.
//
//   trace/<placement>/training  what the host tier sees in training: 12 steps of a
//       transformer-like model, 8 layers saving 6 activations each (0.5 to 64 MiB at full
//       length, scaled by a sequence length drawn per step from 0.4 to 1), 70% of them
//       evicted to the host in forward order; every third step runs two forwards before
//       the backward (gradient accumulation); backward frees last-saved first with a
//       little disorder, and 3% of the blocks outlive their step by 1 to 3 steps
//   trace/<placement>/random    20,000 operations: blocks of 1 to 64 MiB (log-uniform, in
//       512-byte units) and frees of a random live block, 60:40 while fewer than 2 GiB are
//       live and only frees above, so the live bytes climb to 2 GiB and stay about there
//
// Counters (the figure to quote is pinned_per_peak_live, best fit against mimalloc):
//   pinned_per_peak_live  peak pinned bytes while replaying the trace once on an empty tier
//                         (chunks of 256 MiB, no limit in reach) / the trace's peak of
//                         live bytes: 1 is perfect, chunk rounding adds up to one chunk
//   pinned_per_peak_live_2  the same after a second replay on the warm tier
//   usable_per_peak_live  as pinned_per_peak_live, less the bytes the placement can never
//                         use (mimalloc's alignment pad): the placement's own overhead
//   chunk_floor           the least any placement could pin in chunks of 256 MiB (whole
//                         chunks covering the peak) / the peak: pinned_per_peak_live's floor
//   unusable_frac         share of the pinned bytes the placement can never use
//   end_fragmentation     1 - largest free extent / free bytes after the first replay,
//                         with the blocks still live at its end (best fit only; NaN else)
//   ns_per_op_cold/_warm  wall time per operation of the first replay (which pins chunks:
//                         an mmap on cudasim, far cheaper than on a GPU) and of the second
//   refused               allocations refused (expected 0)
//
// Each runs once (Iterations(1)), and --benchmark_repetitions must not be used on them: the
// mimalloc candidate keeps one of the process's 64 arena slots per chunk for good (the two
// traces take about 26), so it cannot be made over and over; past the slots its tier
// refuses to grow, and counter `refused` says so.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "host_tier_bench.h"

namespace host_tier_bench {
namespace {

struct Op {
  bool allocate;
  uint32_t id;     // the block's index in the replay's table
  uint64_t bytes;  // allocations only
};

struct Trace {
  std::string name;
  std::vector<Op> ops;
  uint32_t blocks = 0;
  uint64_t peak_live_bytes = 0;  // sizes rounded to 512, as the tier counts them
};

uint64_t round512(uint64_t v) { return (v + 511) / 512 * 512; }

void finish(Trace& t) {
  std::vector<uint64_t> sizes(t.blocks);
  uint64_t live = 0;
  for (const Op& op : t.ops) {
    if (op.allocate) {
      sizes[op.id] = round512(op.bytes);
      live += sizes[op.id];
      t.peak_live_bytes = std::max(t.peak_live_bytes, live);
    } else {
      live -= sizes[op.id];
    }
  }
}

Trace training_trace() {
  Trace t{"training", {}, 0, 0};
  std::mt19937_64 rng(0x7ace);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double kSavedMiB[] = {16, 48, 16, 16, 64, 0.5};  // per layer, at full length
  constexpr int kLayers = 8;
  constexpr int kSteps = 12;
  struct Deferred {
    uint32_t id;
    int due;
  };
  std::vector<Deferred> deferred;
  for (int step = 0; step < kSteps; ++step) {
    for (auto it = deferred.begin(); it != deferred.end();) {
      if (it->due <= step) {
        t.ops.push_back({false, it->id, 0});
        it = deferred.erase(it);
      } else {
        ++it;
      }
    }
    const double scale = 0.4 + 0.6 * uniform(rng);
    const int forwards = step % 3 == 2 ? 2 : 1;
    std::vector<uint32_t> saved;
    for (int f = 0; f < forwards; ++f) {
      for (int layer = 0; layer < kLayers; ++layer) {
        for (double mib : kSavedMiB) {
          if (uniform(rng) >= 0.7) continue;  // stays resident
          const auto bytes = static_cast<uint64_t>(mib * scale * double(kMiB));
          t.ops.push_back({true, t.blocks, bytes});
          saved.push_back(t.blocks++);
        }
      }
    }
    for (size_t i = saved.size(); i-- > 0;) {
      if (i > 0 && uniform(rng) < 0.15) std::swap(saved[i], saved[i - 1]);
      if (uniform(rng) < 0.03) {
        deferred.push_back({saved[i], step + 1 + static_cast<int>(rng() % 3)});
      } else {
        t.ops.push_back({false, saved[i], 0});
      }
    }
  }
  for (const Deferred& d : deferred) t.ops.push_back({false, d.id, 0});
  finish(t);
  return t;
}

Trace random_trace() {
  Trace t{"random", {}, 0, 0};
  std::mt19937_64 rng(0x4a2d);
  std::uniform_real_distribution<double> log2_mib(0.0, 6.0);
  std::vector<std::pair<uint32_t, uint64_t>> live;
  uint64_t live_bytes = 0;
  constexpr uint64_t kTarget = 2 * kGiB;
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || (live_bytes < kTarget && rng() % 10 < 6)) {
      const uint64_t bytes = static_cast<uint64_t>(std::exp2(log2_mib(rng)) * double(kMiB)) / 512 * 512;
      t.ops.push_back({true, t.blocks, bytes});
      live.push_back({t.blocks++, bytes});
      live_bytes += bytes;
    } else {
      const size_t k = rng() % live.size();
      t.ops.push_back({false, live[k].first, 0});
      live_bytes -= live[k].second;
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (const auto& [id, bytes] : live) t.ops.push_back({false, id, 0});
  finish(t);
  return t;
}

const std::vector<Trace>& traces() {
  static const auto* all = new std::vector<Trace>{training_trace(), random_trace()};
  return *all;
}

// Replays `trace` on `tier` (every trace ends with all its blocks freed); returns the wall
// time in ns. With `end_fragmentation`, reads tier.fragmentation() at the last allocation.
double replay(HostTier& tier, const Trace& trace, std::vector<void*>& slots, uint64_t* refused,
              double* end_fragmentation) {
  const auto start = std::chrono::steady_clock::now();
  // The fragmentation is read at the last allocation, when the most blocks are about.
  size_t last_allocation = 0;
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (trace.ops[i].allocate) last_allocation = i;
  }
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    const Op& op = trace.ops[i];
    if (op.allocate) {
      slots[op.id] = tier.allocate(op.bytes);
      if (slots[op.id] == nullptr) ++*refused;
      if (i == last_allocation && end_fragmentation != nullptr) {
        *end_fragmentation = tier.fragmentation();
      }
    } else {
      tier.free(slots[op.id]);  // nullptr (refused) is a no-op
      slots[op.id] = nullptr;
    }
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
}

void BM_trace(benchmark::State& state, const Placement& placement, const Trace* trace) {
  for (auto _ : state) {
    HostTierOptions options;
    options.limit_bytes = 64 * kGiB;  // out of reach: the placement alone decides what is pinned
    std::unique_ptr<HostTier> tier;
    try {
      tier = placement.make(options);
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
      return;
    }
    std::vector<void*> slots(trace->blocks);
    uint64_t refused = 0;
    double fragmentation = 0;
    const double cold_ns = replay(*tier, *trace, slots, &refused, &fragmentation);
    const HostTierStats first = tier->stats();
    const double warm_ns = replay(*tier, *trace, slots, &refused, nullptr);
    const HostTierStats second = tier->stats();
    state.PauseTiming();
    tier.reset();  // unpinning is not part of the figure
    state.ResumeTiming();

    const auto peak = static_cast<double>(trace->peak_live_bytes);
    const auto ops = static_cast<double>(trace->ops.size());
    state.counters["peak_live_MiB"] = peak / double(kMiB);
    state.counters["pinned_MiB"] = double(first.peak_pinned_bytes) / double(kMiB);
    state.counters["pinned_per_peak_live"] = double(first.peak_pinned_bytes) / peak;
    state.counters["pinned_per_peak_live_2"] = double(second.peak_pinned_bytes) / peak;
    state.counters["usable_per_peak_live"] =
        double(first.peak_pinned_bytes - first.unusable_bytes) / peak;
    const uint64_t chunk = first.chunk_bytes;
    state.counters["chunk_floor"] = double((trace->peak_live_bytes + chunk - 1) / chunk * chunk) / peak;
    state.counters["unusable_frac"] =
        first.peak_pinned_bytes ? double(first.unusable_bytes) / double(first.peak_pinned_bytes) : 0.0;
    state.counters["end_fragmentation"] = fragmentation;
    state.counters["ns_per_op_cold"] = cold_ns / ops;
    state.counters["ns_per_op_warm"] = warm_ns / ops;
    state.counters["refused"] = double(refused);
    state.counters["chunks"] = double(second.num_chunks);
  }
}

}  // namespace

void register_trace_benchmarks(const std::vector<Placement>& placements) {
  for (const Trace& trace : traces()) {
    for (const Placement& p : placements) {
      benchmark::RegisterBenchmark(("trace/" + p.name + "/" + trace.name).c_str(), BM_trace, p, &trace)
          ->Iterations(1)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace host_tier_bench
