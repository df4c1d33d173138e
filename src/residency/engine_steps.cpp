// Recording steps and following their plan (Note [Recording and following a step] in
// policy/step_recorder.h): step boundaries, each engine call as a point with its time on
// the device, the plan made for the next step with the measured copy rate, and the plan's
// fetches started at their points.
#include "residency/engine_impl.h"

namespace vramswap::residency {

void Engine::Impl::begin_step() {
  pool_.begin_step();  // Note [A step's addresses] in pool/placement.cpp
  if (!recorder_.enabled()) return;
  if (recorder_.active()) end_step();  // the step before ends where this one begins
  plan_next_step();
  pool_.take_allocated_high();  // the demand is counted from here
  recorder_.begin_step();
  number_kept_blocks();
  stats::log(stats::LogLevel::kDebug, "device %d: a step begins: %s", device_,
             recorder_.following() ? "it follows the plan"
             : recorder_.backing_off() ? "the watermarks decide (the plan is backing off), and it is recorded"
                                       : "the watermarks decide, and it is recorded");
}

// Kept blocks cold as the step begins are blocks of the step, cold from its first point and
// needed at their first use; the plan's victims among them start their copies now, the one
// needed furthest first (the order the plan counts them in).
void Engine::Impl::number_kept_blocks() {
  if (!recorder_.active()) return;
  std::vector<uint32_t> victims;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    Slot& s = slots_[slot];
    if (!s.live || !s.kept || !s.cold || s.packs > 0 || s.step_block != policy::kNoPoint) continue;
    s.step_block = recorder_.new_block(s.placed, true);
    if (s.step_block == policy::kNoPoint) break;
    if (step_slots_.size() <= s.step_block) step_slots_.resize(s.step_block + 1, UINT32_MAX);
    step_slots_[s.step_block] = slot;
    if (recorder_.planned_victim(s.step_block) && s.residency == Residency::kResident) victims.push_back(slot);
  }
  auto use = [&](uint32_t slot) {
    const uint32_t u = recorder_.recorded_use(slots_[slot].step_block);
    return u == policy::kNoPoint ? UINT64_MAX : uint64_t(u);
  };
  std::stable_sort(victims.begin(), victims.end(), [&](uint32_t a, uint32_t b) { return use(a) > use(b); });
  for (uint32_t slot : victims) start_planned_copy(slot, "of a kept block as a step begins");
}

void Engine::Impl::end_step() {
  recorder_.end_step();
  // A kept block numbered at the step's start is numbered again at the next.
  for (uint32_t b = 0; b < step_slots_.size(); ++b) {
    const uint32_t slot = step_slots_[b];
    if (slot < slots_.size() && slots_[slot].live && slots_[slot].kept && slots_[slot].packs == 0 &&
        slots_[slot].step_block == b)
      slots_[slot].step_block = policy::kNoPoint;
  }
  step_slots_.clear();
  due_fetches_.clear();
}

void Engine::Impl::note_point(policy::PointKind kind, uint32_t block, uint64_t bytes, cudaStream_t timed_on) {
  if (!recorder_.active()) return;
  const bool following = recorder_.following();
  const uint32_t p = recorder_.point(kind, block, bytes, pool_.take_allocated_high());
  if (following && !recorder_.following())
    stats::log(stats::LogLevel::kDebug, "device %d: the step diverges from the recorded one at point %u (kind %d, "
               "block %u, %llu bytes): the watermarks decide for the rest of it", device_, p, int(kind), block,
               static_cast<unsigned long long>(bytes));
  if (p == policy::kNoPoint) return;
  if (timed_on && timed_on != pool::any_stream() && point_events_.size() < kTimedPoints) {
    // The point's time on the device. Best effort: a plan without times still works.
    try {
      cuda::Event e = timed_.acquire();
      e.record(timed_on);
      point_events_.emplace_back(p, std::move(e));
    } catch (const std::exception& e) {
      stats::log(stats::LogLevel::kDebug, "device %d: timing a point failed: %s", device_, e.what());
    }
  }
  if (recorder_.following()) follow_fetches(p, timed_on);
}

void Engine::Impl::plan_next_step() {
  std::vector<uint64_t> times;
  std::vector<policy::LateFetch> late;
  if (recorder_.plan_pending()) {
    try {
      // The copy rate from the timed copies that have landed: one still running (a copy the
      // step started for the next one) is not waited for, which would hold the host at the
      // step's start until the copy engine caught up.
      uint64_t bytes = 0, ns = 0;
      for (const TimedCopy& c : timed_copies_) {
        if (!c.end.query()) continue;
        bytes += c.bytes;
        ns += cuda::elapsed_ns(c.start, c.end);
      }
      if (bytes > 0 && ns > 0) bytes_per_ns_ = double(bytes) / double(ns);
      if (!point_events_.empty() && bytes_per_ns_ > 0) {
        point_events_.back().second.synchronize();  // the last point: all of them have completed
        times.assign(recorder_.recorded_points(), 0);
        const cuda::Event& first = point_events_.front().second;
        uint64_t t = 0;
        size_t k = 0;
        for (uint32_t p = 0; p < times.size(); ++p) {
          for (; k < point_events_.size() && point_events_[k].first == p; ++k)
            t = std::max(t, cuda::elapsed_ns(first, point_events_[k].second));
          times[p] = t;
        }
        late = late_fetches(first);
      }
    } catch (const std::exception& e) {
      stats::log(stats::LogLevel::kDebug, "device %d: reading the step's times failed: %s (planning without them)",
                 device_, e.what());
      times.clear();
      late.clear();
    }
    recorder_.plan_next(std::move(times), bytes_per_ns_, late);
    stats::log(stats::LogLevel::kDebug, "device %d: plan: %s, copy rate %.1f GB/s; %zu fetches late with the copy "
               "stream idle before them", device_, recorder_.describe().c_str(), bytes_per_ns_, late.size());
  }
  release_step_timing();
}

void Engine::Impl::release_step_timing() {
  for (auto& [p, e] : point_events_) timed_.release(std::move(e));
  point_events_.clear();
  for (TimedCopy& c : timed_copies_) {
    timed_.release(std::move(c.start));
    timed_.release(std::move(c.end));
  }
  timed_copies_.clear();
  for (TimedFetch& f : timed_fetches_) {
    timed_.release(std::move(f.start));
    timed_.release(std::move(f.end));
    if (f.used) timed_.release(std::move(f.used));
  }
  timed_fetches_.clear();
  timed_fetch_of_.clear();
}

// Note [Late fetches] in policy/step_recorder.h. Best effort: a timing that fails times
// nothing, and the fetch goes on.
void Engine::Impl::time_fetch_start(cuda::Event* start) {
  // Every copy back is timed (a block outside the step too: the copy stream was busy then).
  if (!recorder_.following() || timed_fetches_.size() >= kTimedFetches) return;
  try {
    cuda::Event e = timed_.acquire();
    e.record(h2d_.get());
    *start = std::move(e);
  } catch (const std::exception& e) {
    stats::log(stats::LogLevel::kDebug, "device %d: timing a fetch failed: %s", device_, e.what());
  }
}

void Engine::Impl::time_fetch_end(const Slot& s, cuda::Event start) {
  if (!start) return;
  try {
    cuda::Event end = timed_.acquire();
    end.record(h2d_.get());
    if (s.step_block != policy::kNoPoint) timed_fetch_of_[s.step_block] = uint32_t(timed_fetches_.size());
    timed_fetches_.push_back({s.step_block, std::move(start), std::move(end), cuda::Event()});
  } catch (const std::exception& e) {
    timed_.release(std::move(start));
    stats::log(stats::LogLevel::kDebug, "device %d: timing a fetch failed: %s", device_, e.what());
  }
}

void Engine::Impl::time_use_of_fetch(const Slot& s, cudaStream_t stream) {
  if (!stream || stream == pool::any_stream()) return;
  const auto it = timed_fetch_of_.find(s.step_block);
  if (it == timed_fetch_of_.end() || timed_fetches_[it->second].used) return;
  try {
    cuda::Event e = timed_.acquire();
    e.record(stream);
    timed_fetches_[it->second].used = std::move(e);
  } catch (const std::exception& e) {
    stats::log(stats::LogLevel::kDebug, "device %d: timing a use failed: %s", device_, e.what());
  }
}

// The fetches that landed after their block's stream got to its use, although the copy
// stream idled before they started: each should have started earlier by the lesser of the
// two (it would have landed that much sooner, the copies before it unchanged).
std::vector<policy::LateFetch> Engine::Impl::late_fetches(const cuda::Event& first) {
  std::vector<policy::LateFetch> late;
  uint64_t copies_done = 0;  // when the copies back before this one had all landed
  for (TimedFetch& f : timed_fetches_) {
    if (!f.end.query()) continue;  // still running (not used in the step): not waited for
    const uint64_t start = cuda::elapsed_ns(first, f.start), end = cuda::elapsed_ns(first, f.end);
    if (f.used && f.block != policy::kNoPoint) {
      const uint64_t used = cuda::elapsed_ns(first, f.used);
      if (end > used && start > copies_done) {
        const uint64_t earlier = std::min(end - used, start - copies_done);
        if (earlier >= kLateFetchNs) late.push_back({f.block, start - earlier});
      }
    }
    copies_done = std::max(copies_done, end);
  }
  return late;
}

// The plan's fetches due after point `p`, and those due earlier that found no memory then:
// into memory free now or behind pending frees' events, never by giving anything up (the
// plan says memory is there; when it is not, a later point, the prefetch window or the
// unpack brings the block back). Failures are logged: the call that made the point stands.
void Engine::Impl::follow_fetches(uint32_t p, cudaStream_t stream) {
  const size_t fresh = due_fetches_.size();
  for (uint32_t b : recorder_.fetches_after(p)) due_fetches_.push_back(b);
  if (due_fetches_.empty()) return;
  try {
    size_t kept = 0;
    for (size_t i = 0; i < due_fetches_.size(); ++i) {
      const uint32_t b = due_fetches_[i];
      const uint32_t slot = b < step_slots_.size() ? step_slots_[b] : UINT32_MAX;
      if (slot >= slots_.size() || !slots_[slot].live || slots_[slot].step_block != b) continue;  // gone
      if (slots_[slot].residency != Residency::kEvicted) continue;  // on the device, or coming
      // At its own point, the plan's fetch may also wait for the caller's stream, so that the
      // blocks it freed (the memory the plan counts on) can be unmapped; a retry does not.
      const bool own_point = i >= fresh && stream && stream != pool::any_stream();
      if (start_fetch(slot, own_point ? Fetch::kPlanned : Fetch::kHint, stream).ok) {
        ++st_.num_prefetches;
      } else {
        due_fetches_[kept++] = b;
      }
    }
    due_fetches_.resize(kept);
  } catch (const std::exception& e) {
    stats::log(stats::LogLevel::kWarn, "a planned fetch on device %d failed: %s (the block stays on the host and "
               "is fetched when unpacked)", device_, e.what());
  }
}

void Engine::Impl::end_step_if_done() {
  // A step that is not known to be complete ends when the next one begins (begin_step).
  if (recorder_.active() && st_.num_tracked_blocks == 0 && recorder_.complete()) end_step();
}

}  // namespace vramswap::residency
