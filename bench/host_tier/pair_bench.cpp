// pair: ns per allocate+free pair of one size on a warm tier, for activation-like sizes
// (1 MiB to 64 MiB), per placement.
//
//   pair/<placement>/<bytes>       an otherwise empty tier (1 and 2 threads; with 2 they share
//                                  the tier, so its mutex is contended)
//   pair_busy/<placement>/<bytes>  a tier that also holds 48 live blocks of mixed sizes (1 to
//                                  64 MiB, fixed seed) with holes between them, as in the
//                                  middle of a step: the placement has real choices to make
//
// The tier is made and warmed (one pair of the size) before timing, so the timed pairs pin
// nothing on their own; counter chunks_pinned says how many chunks the tier pinned during
// the timed loop all the same (mimalloc's cross-thread frees wait for a collection, so a
// full arena can look full until then).
#include <map>
#include <mutex>
#include <random>
#include <string>

#include "host_tier_bench.h"

namespace host_tier_bench {
namespace {

constexpr int kBusyBlocks = 96;  // allocated; every other one is freed again, leaving 48

// The tiers, made once per (scenario, placement) and kept until exit (no teardown order to
// get wrong: the benchmark's threads and the CUDA runtime are gone or going by then).
HostTier* shared_tier(const Placement& placement, bool busy, std::string* error) {
  static std::mutex mu;
  static auto* tiers = new std::map<std::string, std::unique_ptr<HostTier>>;
  std::lock_guard lock(mu);
  const std::string key = placement.name + (busy ? "/busy" : "");
  auto it = tiers->find(key);
  if (it != tiers->end()) return it->second.get();
  HostTierOptions options;
  options.limit_bytes = 16 * kGiB;
  std::unique_ptr<HostTier> tier;
  try {
    tier = placement.make(options);
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
  if (busy) {
    std::mt19937_64 rng(0xb05e);
    std::uniform_real_distribution<double> log2_mib(0.0, 6.0);  // 1 MiB .. 64 MiB
    std::vector<void*> blocks;
    for (int i = 0; i < kBusyBlocks; ++i) {
      const auto bytes = static_cast<size_t>(std::exp2(log2_mib(rng)) * double(kMiB)) / 512 * 512;
      void* p = tier->allocate(bytes, error);
      if (p == nullptr) return nullptr;
      blocks.push_back(p);
    }
    for (size_t i = 0; i < blocks.size(); i += 2) tier->free(blocks[i]);
  }
  return tiers->emplace(key, std::move(tier)).first->second.get();
}

void BM_pair(benchmark::State& state, const Placement& placement, bool busy) {
  std::string error;
  HostTier* tier = shared_tier(placement, busy, &error);
  if (tier == nullptr) {
    state.SkipWithError(("no tier: " + error).c_str());
    return;
  }
  const auto size = static_cast<size_t>(state.range(0));
  void* warm = tier->allocate(size, &error);
  if (warm == nullptr) {
    state.SkipWithError(("warm-up allocation failed: " + error).c_str());
    return;
  }
  tier->free(warm);
  const uint64_t pinned_before = tier->stats().num_chunks_pinned;
  for (auto _ : state) {
    void* p = tier->allocate(size);
    benchmark::DoNotOptimize(p);
    tier->free(p);
  }
  if (state.thread_index() == 0) {
    state.counters["chunks_pinned"] = double(tier->stats().num_chunks_pinned - pinned_before);
  }
  state.SetItemsProcessed(state.iterations());
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int64_t mib : {1, 4, 16, 64}) b->Arg(mib << 20);
  b->UseRealTime();
}

}  // namespace

void register_pair_benchmarks(const std::vector<Placement>& placements) {
  for (const Placement& p : placements) {
    benchmark::RegisterBenchmark(("pair/" + p.name).c_str(), BM_pair, p, false)
        ->Apply(sizes)
        ->Threads(1)
        ->Threads(2);
  }
  for (const Placement& p : placements) {
    benchmark::RegisterBenchmark(("pair_busy/" + p.name).c_str(), BM_pair, p, true)->Apply(sizes);
  }
}

}  // namespace host_tier_bench
