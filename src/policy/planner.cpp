// make_plan: Note [Planned eviction] in planner.h.
#include "policy/planner.h"

#include <algorithm>
#include <queue>

namespace vramswap::policy {

Plan make_plan(const RecordedStep& step, const PlanOptions& options) {
  const uint32_t n = uint32_t(step.demand.size());
  const size_t nb = step.blocks.size();
  Plan plan;
  plan.evict.assign(nb, 0);
  plan.fetch_at.assign(nb, kNoPoint);
  if (n == 0) return plan;

  // X(j): the bytes that must be out at point j.
  std::vector<uint64_t> must(n, 0);
  for (uint32_t j = 0; j < n; ++j) {
    const uint64_t extra = j < options.extra.size() ? options.extra[j] : 0;
    const uint64_t need = step.demand[j] + options.margin_bytes + extra;
    must[j] = need > options.limit_bytes ? need - options.limit_bytes : 0;
    if (must[j] > plan.must_leave_bytes) {
      plan.must_leave_bytes = must[j];
      plan.worst_point = j;
    }
  }
  if (plan.must_leave_bytes == 0) return plan;

  // The out range of block b: points (cold, last], last = use - 1 (use kNoPoint: the end).
  // (A use point at or before the cold point, which a recording never holds, leaves no range.)
  auto last_out = [&](const StepBlock& b) -> uint32_t {
    return b.use == kNoPoint || b.use > n ? n - 1 : (b.use == 0 ? 0 : b.use - 1);
  };
  auto may_leave = [&](const StepBlock& b) {
    return b.bytes > 0 && b.cold != kNoPoint && b.use != 0 && uint64_t(b.cold) + 1 <= last_out(b);
  };

  // Victims: Belady, walking forward. Candidates become available the point after they go
  // cold, ordered by their last point out (furthest first).
  std::vector<std::vector<uint32_t>> cold_at(n);
  for (uint32_t b = 0; b < nb; ++b)
    if (may_leave(step.blocks[b])) cold_at[step.blocks[b].cold].push_back(b);
  std::vector<uint64_t> back_at(n + 1, 0);  // bytes of victims whose out range ends before j
  using Candidate = std::pair<uint32_t, uint32_t>;  // (last point out, block)
  std::priority_queue<Candidate> candidates;
  uint64_t out = 0;
  for (uint32_t j = 0; j < n; ++j) {
    out -= back_at[j];
    if (j > 0)
      for (uint32_t b : cold_at[j - 1]) candidates.push({last_out(step.blocks[b]), b});
    while (out < must[j] && !candidates.empty()) {
      const auto [last, b] = candidates.top();
      candidates.pop();
      if (last < j) continue;  // needed again already
      plan.evict[b] = 1;
      out += step.blocks[b].bytes;
      back_at[last + 1] += step.blocks[b].bytes;
    }
    if (out < must[j]) plan.shortfall_bytes = std::max(plan.shortfall_bytes, must[j] - out);
  }

  // Fetches: slack(j) = bytes out at j beyond X(j), with every victim out over its whole
  // range; each victim in order of use takes back what the slack after its fetch allows.
  std::vector<int64_t> slack(n, 0);
  std::vector<uint32_t> victims;
  for (uint32_t b = 0; b < nb; ++b) {
    if (!plan.evict[b]) continue;
    victims.push_back(b);
    const StepBlock& s = step.blocks[b];
    for (uint32_t j = s.cold + 1; j <= last_out(s); ++j) slack[j] += int64_t(s.bytes);
  }
  for (uint32_t j = 0; j < n; ++j) slack[j] -= int64_t(must[j]);
  std::stable_sort(victims.begin(), victims.end(),
                   [&](uint32_t a, uint32_t b) { return last_out(step.blocks[a]) < last_out(step.blocks[b]); });
  for (uint32_t b : victims) {
    const StepBlock& s = step.blocks[b];
    const int64_t bytes = int64_t(s.bytes);
    uint32_t fetch = s.cold;  // no point needs it out: not a victim after all
    for (uint32_t j = last_out(s); j > s.cold; --j) {
      if (slack[j] < bytes) {
        fetch = j;
        break;
      }
    }
    for (uint32_t j = fetch + 1; j <= last_out(s); ++j) slack[j] -= bytes;
    if (fetch == s.cold) {
      plan.evict[b] = 0;
      continue;
    }
    plan.fetch_at[b] = fetch;
    plan.planned_bytes += s.bytes;
    ++plan.num_victims;
  }
  return plan;
}

}  // namespace vramswap::policy
