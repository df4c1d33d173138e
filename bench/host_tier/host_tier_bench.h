// host_tier_bench: what the scenarios share (pair_bench.cpp, trace_bench.cpp, main.cpp).
//
// Every scenario runs once per placement, in the same process and run: best fit (what
// ships) and the mimalloc arena candidate when the build has it (vramswap_host_tier_mimalloc).
// A scenario registers its benchmarks per placement, named "<scenario>/<placement>/...".
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "residency/host_tier.h"

namespace host_tier_bench {

using vramswap::residency::HostTier;
using vramswap::residency::HostTierOptions;
using vramswap::residency::HostTierStats;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

struct Placement {
  std::string name;
  // A tier with this placement; throws when the placement cannot be made.
  std::unique_ptr<HostTier> (*make)(const HostTierOptions& options);
};

// The placements this build can measure, best fit first.
std::vector<Placement> placements();

void register_pair_benchmarks(const std::vector<Placement>& placements);
void register_trace_benchmarks(const std::vector<Placement>& placements);

}  // namespace host_tier_bench
