// planner_bench: the host time of policy::make_plan (src/policy/planner.h) on a generated
// step shaped like a transformer's: a 1.5 GiB block saved first (as VGG-16's first
// activation: Belady's first victim, larger than what mild pressure needs out); then per
// layer, the forward saves ten blocks (the sizes of a GPT-2 small layer at batch 8, sequence
// 1024, in MiB: 12 12 48 48 24 192 192 12 4.5 3.37), each cold right after it is saved; a
// junction allocation of 1.5 GiB; backward uses the blocks last-saved first and releases
// each. 10 us between points, a 55 GB/s copy rate.
//
//   BM_make_plan/<layers>/<limit % of the peak>/<smaller-victim trials>
//
// trials 0 is Belady's victims alone (the plan before the smaller-victim search), 8 the
// default: the ratio of the two at the same layers and limit is what the search costs. A
// plan is made once per step, before it begins; the figure to compare it with is the step.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <iterator>
#include <vector>

#include "policy/planner.h"

namespace {

using vramswap::policy::make_plan;
using vramswap::policy::Plan;
using vramswap::policy::PlanOptions;
using vramswap::policy::RecordedStep;

constexpr uint64_t kMiB = 1 << 20;

struct Generated {
  RecordedStep step;
  uint64_t peak = 0;
};

Generated transformer_step(int layers) {
  static const double kSizes[] = {12, 12, 48, 48, 24, 192, 192, 12, 4.5, 3.37};
  Generated g;
  RecordedStep& s = g.step;
  uint64_t live = 0;
  auto point = [&] {
    s.demand.push_back(live);
    s.time_ns.push_back(10'000 * (s.time_ns.size()));
    g.peak = live > g.peak ? live : g.peak;
    return uint32_t(s.demand.size() - 1);
  };
  for (int l = -1; l < layers; ++l) {
    for (double mib : l < 0 ? std::vector<double>{1536} : std::vector<double>(std::begin(kSizes), std::end(kSizes))) {
      const uint64_t bytes = uint64_t(mib * double(kMiB));
      live += bytes;
      point();  // the allocation
      s.blocks.push_back({bytes, vramswap::policy::kNoPoint, vramswap::policy::kNoPoint});
      point();  // the pack
      s.blocks.back().cold = point();
    }
  }
  live += 1536 * kMiB;  // the junction
  point();
  live -= 1536 * kMiB;
  for (size_t b = s.blocks.size(); b-- > 0;) {
    s.blocks[b].use = point();  // the unpack
    point();                    // the release
    live -= s.blocks[b].bytes;
  }
  return g;
}

void BM_make_plan(benchmark::State& state) {
  const Generated g = transformer_step(int(state.range(0)));
  PlanOptions options;
  options.limit_bytes = g.peak * uint64_t(state.range(1)) / 100;
  options.bytes_per_ns = 55.0;
  options.victim_cost_ns = 100'000;
  options.smaller_victim_trials = int(state.range(2));
  Plan plan;
  for (auto _ : state) {
    plan = make_plan(g.step, options);
    benchmark::DoNotOptimize(plan.planned_bytes);
  }
  state.counters["points"] = double(g.step.demand.size());
  state.counters["victims"] = double(plan.num_victims);
  state.counters["planned_MiB"] = double(plan.planned_bytes) / double(kMiB);
  state.counters["must_leave_MiB"] = double(plan.must_leave_bytes) / double(kMiB);
}
BENCHMARK(BM_make_plan)
    ->ArgsProduct({{12, 48}, {98, 90, 75, 50}, {0, 8}})
    ->ArgNames({"layers", "limit_pct", "trials"})
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
