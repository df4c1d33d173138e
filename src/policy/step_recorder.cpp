// StepRecorder: Note [Recording and following a step] in step_recorder.h.
#include "policy/step_recorder.h"

#include <algorithm>

namespace vramswap::policy {

void StepRecorder::begin_step() {
  if (!enabled_) return;
  if (plan_pending_) plan_next({}, 0);
  active_ = true;
  overflow_ = false;
  step_ = RecordedStep();
  shape_.clear();
  waited_.clear();
  uncovered_max_ = 0;
  following_ = recorded_points_ > 0 && skip_ == 0;
  skipping_ = recorded_points_ > 0 && skip_ > 0;
  if (skip_ > 0) --skip_;
}

uint32_t StepRecorder::new_block(uint64_t bytes, bool cold_from_start) {
  if (!active_ || overflow_) return kNoPoint;
  step_.blocks.push_back({bytes, cold_from_start ? 0u : kNoPoint, kNoPoint});
  return uint32_t(step_.blocks.size() - 1);
}

void StepRecorder::diverge() {
  if (!following_) return;
  following_ = false;
  ++divergences_;
}

uint32_t StepRecorder::point(PointKind kind, uint32_t block, uint64_t bytes, uint64_t demand) {
  if (!active_ || overflow_) return kNoPoint;
  if (step_.demand.size() >= max_points_) {
    overflow_ = true;  // too long to plan: this step goes unrecorded, and unplanned
    diverge();
    return kNoPoint;
  }
  const uint32_t p = uint32_t(step_.demand.size());
  if (kind == PointKind::kAlloc || kind == PointKind::kPack) {
    const Point here{kind, block, bytes};
    const size_t k = shape_.size();
    if (following_ && (k >= recorded_shape_.size() || !(recorded_shape_[k] == here))) diverge();
    shape_.push_back(here);
  }
  step_.demand.push_back(std::max(demand, pressure_));
  pressure_ = 0;
  if (block < step_.blocks.size()) {
    StepBlock& b = step_.blocks[block];
    if (kind == PointKind::kCold && b.cold == kNoPoint) b.cold = p;
    if ((kind == PointKind::kUnpack || kind == PointKind::kRelease) && b.use == kNoPoint) b.use = p;
  }
  return p;
}

const std::vector<uint32_t>& StepRecorder::fetches_after(uint32_t p) const {
  static const std::vector<uint32_t> none;
  return following_ && p < fetches_.size() ? fetches_[p] : none;
}

void StepRecorder::refetch(uint32_t block) {
  if (!following_ || block >= recorded_use_.size()) return;
  if (block < plan_.evict.size() && plan_.evict[block]) {
    const uint32_t at = plan_.fetch_at[block];
    if (at != kNoPoint && at >= step_.demand.size()) return;  // its planned fetch is still to come
  }
  const uint32_t use = recorded_use_[block];
  auto after = [&](uint32_t other) { return use < recorded_use_[other]; };
  const size_t next = step_.demand.size();
  for (size_t p = next; p < fetches_.size() && p < use; ++p) {
    std::vector<uint32_t>& at = fetches_[p];
    if (std::find(at.begin(), at.end(), block) != at.end()) return;
    auto it = std::find_if(at.begin(), at.end(), after);
    if (it != at.end()) {
      at.insert(it, block);
      return;
    }
  }
  if (next < fetches_.size() && next < use) fetches_[next].push_back(block);
}

void StepRecorder::waited(uint64_t bytes, uint64_t under_way, uint64_t fetching) {
  if (!following_ || step_.demand.empty() || bytes <= under_way) return;
  bytes -= under_way;
  if (fetching > 0) uncovered_max_ = std::max(uncovered_max_, bytes);
  const size_t p = step_.demand.size() - 1;
  if (waited_.size() <= p) waited_.resize(p + 1, 0);
  waited_[p] += bytes;
}

void StepRecorder::end_step() {
  if (!active_) return;
  active_ = false;
  if (overflow_) {
    following_ = false;
    plan_pending_ = false;
    recorded_points_ = 0;
    recorded_shape_.clear();
    plan_ = Plan();
    fetches_.clear();
    return;
  }
  ended_planned_ = following_ && shape_.size() == recorded_shape_.size();
  if (ended_planned_) {
    ++planned_steps_;
    // Feedback: what the allocations still waited for is added where they waited.
    if (extra_.size() < waited_.size()) extra_.resize(waited_.size(), 0);
    for (size_t p = 0; p < waited_.size(); ++p) extra_[p] += waited_[p];
    // Note [Room the fetches leave]
    fetch_margin_ = std::max(fetch_margin_, std::min(kFetchRoomFactor * uncovered_max_, limit_ / kFetchRoomShare));
  } else {
    if (following_) ++divergences_;  // the step ended before the recording did
    extra_.clear();
    fetch_margin_ = 0;
    fetch_by_.clear();
    moved_.clear();
    settled_.clear();
    planned_ns_ = 0;
  }
  following_ = false;
  recorded_points_ = step_.demand.size();
  recorded_shape_ = std::move(shape_);
  shape_.clear();
  plan_pending_ = true;
}

void StepRecorder::plan_next(std::vector<uint64_t> time_ns, double bytes_per_ns, const std::vector<LateFetch>& late) {
  if (!plan_pending_) return;
  plan_pending_ = false;
  if (!time_ns.empty()) {
    const uint64_t took = time_ns.back() - time_ns.front();
    if (!ended_planned_) {
      reactive_ns_ = took;
    } else if (reactive_ns_ > 0 && double(took) > 1.02 * double(reactive_ns_)) {
      // The first slower step gets its feedback applied; a second one in a row backs off.
      if (++losses_ >= 2) {
        ++backoffs_;
        skip_ = 1u << std::min<uint32_t>(losses_ - 1, 6);
      }
    } else {
      losses_ = 0;
    }
    if (ended_planned_) move_late_fetches(took, time_ns, late);
  }
  step_.time_ns = std::move(time_ns);
  plan_ = make_plan(step_, PlanOptions{limit_, 0, extra_, bytes_per_ns, kVictimCostNs, 8, fetch_by_, fetch_margin_});
  fetches_.assign(recorded_points_, {});
  std::vector<uint32_t> victims;
  for (uint32_t b = 0; b < plan_.fetch_at.size(); ++b)
    if (plan_.evict[b]) victims.push_back(b);
  std::stable_sort(victims.begin(), victims.end(),
                   [&](uint32_t a, uint32_t b) { return step_.blocks[a].use < step_.blocks[b].use; });
  for (uint32_t b : victims) fetches_[plan_.fetch_at[b]].push_back(b);
  recorded_use_.resize(step_.blocks.size());
  for (size_t b = 0; b < step_.blocks.size(); ++b) recorded_use_[b] = step_.blocks[b].use;
  // The plan's bytes out at each point (a victim from its cold point through the point its
  // fetch follows, or to the end), then the most of them from each point on.
  const size_t n = recorded_points_;
  std::vector<int64_t> delta(n + 1, 0);
  for (uint32_t b : victims) {
    const StepBlock& sb = step_.blocks[b];
    if (sb.cold >= n) continue;
    delta[sb.cold] += int64_t(sb.bytes);
    const size_t until = plan_.fetch_at[b] == kNoPoint ? n : std::min<size_t>(plan_.fetch_at[b] + 1, n);
    delta[until] -= int64_t(sb.bytes);
  }
  out_ahead_.assign(n + 1, 0);
  int64_t level = 0;
  for (size_t p = 0; p < n; ++p) out_ahead_[p] = uint64_t(level += delta[p]);
  for (size_t p = n; p-- > 0;) out_ahead_[p] = std::max(out_ahead_[p], out_ahead_[p + 1]);
}

// Note [Late fetches] in step_recorder.h.
void StepRecorder::move_late_fetches(uint64_t took, const std::vector<uint64_t>& time_ns,
                                     const std::vector<LateFetch>& late) {
  fetch_by_.resize(step_.blocks.size(), kNoPoint);
  settled_.resize(step_.blocks.size(), 0);
  if (!moved_.empty()) {
    // A move copies more out (other victims take the moved one's place): it stays only where
    // the step got faster by it.
    const bool faster = planned_ns_ > 0 && double(took) < 0.999 * double(planned_ns_);
    if (!faster) {
      for (const Move& m : moved_) {
        fetch_by_[m.block] = m.before;
        settled_[m.block] = 1;
      }
      fetch_moves_undone_ += moved_.size();
    }
    moved_.clear();
    if (!faster) return;  // the plan before the moves, as it was
  }
  planned_ns_ = took;
  for (const LateFetch& f : late) {
    if (f.block >= step_.blocks.size() || settled_[f.block] || f.block >= plan_.fetch_at.size()) continue;
    const uint32_t now = plan_.fetch_at[f.block];
    if (now == kNoPoint) continue;  // not one of the plan's fetches
    // The last point the device reached by then.
    const auto it = std::upper_bound(time_ns.begin(), time_ns.end(), f.start_by_ns);
    if (it == time_ns.begin()) continue;
    const uint32_t by = uint32_t(it - time_ns.begin() - 1);
    if (by >= std::min(now, fetch_by_[f.block])) continue;  // it starts by then already
    moved_.push_back({f.block, fetch_by_[f.block]});
    fetch_by_[f.block] = by;
    ++fetch_moves_;
  }
}

std::string StepRecorder::describe() const {
  return std::to_string(recorded_points_) + " points, " + std::to_string(plan_.num_victims) + " victims (" +
         std::to_string(plan_.planned_bytes) + " bytes) for " + std::to_string(plan_.must_leave_bytes) +
         " bytes that must be out at the worst point" +
         (plan_.shortfall_bytes ? ", " + std::to_string(plan_.shortfall_bytes) + " bytes not coverable" : "");
}

}  // namespace vramswap::policy
