// host_tier_bench: the pinned host tier's placements measured side by side (README, "The
// host tier"). Scenarios: pair_bench.cpp (ns per allocate+free pair) and trace_bench.cpp
// (pinned memory needed for a replayed trace, against its peak of live bytes).
//
// Run with LD_LIBRARY_PATH=build/sim on a machine without a GPU: cudaHostAlloc is then an
// mmap, far cheaper than pinning on a GPU, so figures that include pinning chunks (the
// traces' first pass) are lower bounds; the pair figures pin nothing.
#include <dlfcn.h>

#include <cstdio>
#include <string>

#include "host_tier_bench.h"

namespace host_tier_bench {

namespace {
std::unique_ptr<HostTier> make_best_fit(const HostTierOptions& options) {
  return std::make_unique<HostTier>(options);
}
#ifdef VRAMSWAP_HOST_TIER_BENCH_MIMALLOC
std::unique_ptr<HostTier> make_mimalloc(const HostTierOptions& options) {
  return std::make_unique<HostTier>(options, vramswap::residency::make_mimalloc_arena_placer());
}
#endif
}  // namespace

std::vector<Placement> placements() {
  std::vector<Placement> all = {{"best_fit", &make_best_fit}};
#ifdef VRAMSWAP_HOST_TIER_BENCH_MIMALLOC
  all.push_back({"mimalloc_arena", &make_mimalloc});
#endif
  return all;
}

}  // namespace host_tier_bench

int main(int argc, char** argv) {
  using namespace host_tier_bench;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const std::vector<Placement> all = placements();
  std::string names;
  for (const Placement& p : all) names += (names.empty() ? "" : ", ") + p.name;
  benchmark::AddCustomContext("placements", names);
#ifndef VRAMSWAP_HOST_TIER_BENCH_MIMALLOC
  std::fprintf(stderr,
               "host_tier_bench: built without mimalloc (Debian: libmimalloc-dev): best fit alone\n");
#endif
  int emulated = 0;
  if (auto* fn = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "cudasim_is_emulated"))) {
    emulated = fn();
  }
  benchmark::AddCustomContext("device", emulated ? "cudasim (no GPU)" : "CUDA driver");
  register_pair_benchmarks(all);
  register_trace_benchmarks(all);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
