// The eviction engine's mechanics. The states and rules are Note [Block states] in
// engine.h; the order of use is policy/use_order.h.
//
// Invariants:
//   * a slot is live iff its block is a live tagged block of the pool; by_addr_ maps the
//     block's address to it;
//   * residency kClean / kEvicted / kFetching <=> the block has a host copy (host !=
//     nullptr); kEvicted <=> it has no pages; kEvicting <=> a D2H copy into `host` is in
//     flight; kClean: the copy landed and the pages are still mapped (both copies valid);
//   * a block is in order_ iff packs > 0, under `key`;
//   * in_flight_ lists exactly the slots in kEvicting or kFetching.
#include "residency/engine.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "config/units.h"
#include "cuda/error.h"
#include "cuda/event.h"
#include "cuda/stream.h"
#include "policy/step_recorder.h"
#include "policy/use_order.h"
#include "stats/log.h"

namespace vramswap::residency {
namespace {

using ReclaimMode = pool::DevicePool::ReclaimMode;

enum class Residency { kResident, kEvicting, kClean, kEvicted, kFetching };

struct Slot {
  bool live = false;
  uint32_t generation = 1;
  uintptr_t addr = 0;
  uint64_t placed = 0;     // as the pool placed it (DevicePool::placed_size)
  uint64_t requested = 0;  // what the program asked for: the bytes that are copied
  Residency residency = Residency::kResident;
  int packs = 0;
  policy::UseKey key;
  bool cold = false;
  bool unpacked = false;
  bool cancel = false;  // an eviction in flight whose result is no longer wanted
  cuda::Event cold_event;
  cudaStream_t cold_stream = nullptr;  // where cold_event was recorded
  cuda::Event copy_event;
  void* host = nullptr;
  void* check = nullptr;  // VRAMSWAP_VERIFY: the restored block read back, behind its fetch
  bool pages_kept = false;  // evicted, but a failed fetch could not give its pages back
  uint64_t checksum = 0;
  uint32_t step_block = policy::kNoPoint;  // its ordinal in the step being recorded
  bool planned = false;                    // its eviction in flight is the plan's
  uint64_t copy_seq = 0;                   // the order in which its copy in flight was queued
};

// A host buffer that must outlive a copy still in flight (its block was freed, or queuing
// the rest of its work failed). With no event, it goes back once the copy stream has no
// work left (or after synchronizing it, when the caller waits for everything).
struct Deferred {
  void* host;
  cuda::Event event;
  cudaStream_t stream = nullptr;
};

constexpr int kDeviceShift = 56;
constexpr int kSlotShift = 32;
constexpr uint64_t kSlotMask = (uint64_t{1} << 24) - 1;

// FNV-1a over 64-bit words (and the tail bytes): cheap enough for a debug mode, and any
// changed byte changes it with overwhelming probability.
uint64_t checksum(const void* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

class Engine::Impl {
 public:
  Impl(pool::DevicePool& pool, const EngineOptions& options);

  void* allocate_tagged(size_t size, cudaStream_t stream, std::string* error);
  bool is_tagged(const void* ptr) const {
    std::lock_guard lock(tagged_mu_);  // not mu_: a free must not wait behind a reclaim
    return tagged_.count(reinterpret_cast<uintptr_t>(ptr)) == 1;
  }
  std::string pressure_report();
  pool::Result free_tagged(void* ptr, cudaStream_t stream);
  uint64_t pack(const void* ptr, cudaStream_t stream);
  void graph_begin() {
    std::lock_guard lock(mu_);
    ++graph_;
    if (st_.num_tracked_blocks == 0) begin_step();
    note_point(policy::PointKind::kGraph, policy::kNoPoint, 0);
  }
  Status mark_cold(uint64_t handle, cudaStream_t stream);
  Status unpack(uint64_t handle, cudaStream_t stream);
  Status release(uint64_t handle);
  Status prefetch(uint64_t handle);
  uint64_t reclaim(uint64_t bytes, ReclaimMode mode, cudaStream_t stream) {
    probe_cold(stream);
    cuda::RelaxedCaptureScope relaxed;
    std::lock_guard lock(mu_);
    if (mode == ReclaimMode::kFull && recorder_.active()) {
      // The pool's own measures did not suffice: what it would own now with nothing evicted
      // (the limit it is at, what it still lacks, the evicted blocks) is the step's real
      // demand here, the pool's overhead included. Following a plan, the plan fell short.
      const uint64_t unmapped = st_.evicted_bytes - std::min(st_.evicted_bytes, in_flight_bytes(Residency::kFetching));
      recorder_.pressure(pool_.stats().limit_bytes + bytes + unmapped);
      if (recorder_.following()) {
        const uint64_t leaving = in_flight_bytes(Residency::kEvicting);
        recorder_.waited(bytes, leaving);
        stats::log(stats::LogLevel::kDebug,
                   "device %d: following the plan, an allocation waits for %llu bytes (%llu under way)", device_,
                   static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(leaving));
      }
    }
    const uint64_t before = unmapped_total_;
    host_refusal_.clear();  // the report of an out-of-memory after this says this round's reason
    try {
      return reclaim_locked(bytes, mode);
    } catch (const std::exception& e) {
      // The allocation that asked goes on with what was freed (its out-of-memory report, if
      // it comes to that, says why eviction stopped); every step was undone or completed.
      host_refusal_ = std::string("eviction failed: ") + e.what();
      stats::log(stats::LogLevel::kWarn, "reclaiming memory on device %d failed: %s", device_, e.what());
      return unmapped_total_ - before;
    }
  }
  // Asks the tracker's probe (EngineOptions::cold_probe) to mark what went cold since it
  // last looked, before victims are chosen. Not under mu_ (the probe calls mark_cold), and
  // never from within the probe (an allocation it makes may come back here).
  void probe_cold(cudaStream_t stream) {
    static thread_local bool probing = false;
    if (!options_.cold_probe || probing) return;
    probing = true;
    try {
      const uint64_t marked = options_.cold_probe(stream == pool::any_stream() ? nullptr : stream);
      if (marked > 0)
        stats::log(stats::LogLevel::kDebug, "device %d: memory is short: the tracker marked %llu block(s) cold",
                   device_, static_cast<unsigned long long>(marked));
    } catch (...) {
      // The probe is the tracker's: a failure there leaves blocks in use, which is safe.
    }
    probing = false;
  }
  EngineStats stats();
  std::string check_invariants();
  void reset_peaks();
  void detach() { pool_.set_reclaimer(nullptr); }
  void trim_host() {
    std::lock_guard lock(mu_);
    complete_copies(false);
    host_.trim();
  }

 private:
  // The slot a handle names, or nullptr with *error set.
  Slot* resolve(uint64_t handle, const char* what, std::string* error);
  uint64_t handle_of(uint32_t slot) const {
    return (uint64_t(device_) << kDeviceShift) | (uint64_t(slot) << kSlotShift) | slots_[slot].generation;
  }
  static uint32_t slot_of(uint64_t handle) { return uint32_t((handle >> kSlotShift) & kSlotMask); }
  // Records a block the pool placed (`placed` bytes) for an allocation of `size` bytes
  // (the strong guarantee: on an exception nothing is recorded).
  void register_block(void* p, size_t size, uint64_t placed);
  // Work a call does for later, after its own succeeded: landed copies, soft eviction.
  // A failure is logged, never returned: the call's result stands.
  void background(const char* after);
  // A block below half a granule shares its granules with others (Note [Placing for
  // eviction] in device_pool.h); [*lo, *hi): the granules it touches.
  bool shares_granules(const Slot& s) const { return s.placed < pool_.granularity() / 2; }
  void granule_span(const Slot& s, uintptr_t* lo, uintptr_t* hi) const {
    const uint64_t g = pool_.granularity();
    *lo = s.addr / g * g;
    *hi = round_up(s.addr + s.placed, g);
  }
  // The soft limit in bytes: the limit when none is set.
  uint64_t soft_limit() const {
    return options_.soft_limit_bytes > 0 ? options_.soft_limit_bytes : pool_.stats().limit_bytes;
  }
  bool evictable(uint32_t slot, const std::set<uint32_t>& window) const {
    const Slot& s = slots_[slot];
    return s.live && s.residency == Residency::kResident && s.cold && !s.unpacked && !window.count(slot);
  }
  std::set<uint32_t> window_set() const {
    auto w = order_.window(options_.horizon);
    return {w.begin(), w.end()};
  }
  // A clean block the prefetch window keeps: not one the plan being followed wants out now
  // (the window is the reactive policy's; following, it stands aside for the plan's victims,
  // else the reactive policy evicts a block the plan keeps in a victim's place).
  bool kept_clean(uint32_t slot, const std::set<uint32_t>& window) const {
    return window.count(slot) && !recorder_.planned_out(slots_[slot].step_block);
  }
  // Starts the D2H copy of a cold resident block. False when the host tier is full.
  bool start_eviction(uint32_t slot);
  // How a fetch finds memory. kNeeded (a fault, a release): evicts others, waiting, when
  // memory is short. kPrefetch (the window): memory free now or behind pending frees'
  // events, else clean blocks needed later; it starts evictions for next time but never
  // waits for them. kAhead (past the window): memory free now only; nothing is given up.
  // kHint (vramswap_prefetch, and a planned fetch retried): memory free now or behind pending
  // frees' events; nothing is given up or evicted for it. kPlanned (a planned fetch at its
  // own point): as kHint, and the caller's stream may be synchronized so that the blocks it
  // freed become usable.
  // kKept: the pages are still mapped (Slot::pages_kept).
  enum class Fetch { kNeeded, kPrefetch, kAhead, kHint, kPlanned, kKept };
  // Maps the block's pages again and starts the H2D copy. `stream` (kPlanned only): the
  // caller's stream, which the pool may synchronize for the memory.
  Status start_fetch(uint32_t slot, Fetch kind, cudaStream_t stream = nullptr);
  // make_room's victim `slot`, a small block: evicts it with every evictable block on its
  // granules when that frees them (every other tagged block there is away or leaving, no
  // ordinary block lives there), and returns the bytes that will free; else evicts nothing
  // and returns 0 (Note [A shared granule goes as a whole]).
  uint64_t evict_granule(uint32_t slot, const std::set<uint32_t>& window);
  // After a fetch of a small block (below half a granule: it shares its granule) started:
  // starts the fetches of the evicted blocks that lie wholly on the granules it needed, now
  // mapped for it (Note [A shared granule comes back whole]).
  void fetch_granule_mates(uint32_t slot);
  // With no fetch in flight: the next evicted block past the window, if memory below the
  // soft limit is free for it now (nothing is given up or waited for). See Note [Fetch ahead].
  void fetch_ahead();
  // Completes copies whose events completed (all of them, waiting, with `wait`).
  void complete_copies(bool wait);
  void finish(uint32_t slot);
  // The bytes of the copies under way in one direction (kEvicting: those not cancelled).
  uint64_t in_flight_bytes(Residency direction) const {
    uint64_t n = 0;
    for (uint32_t slot : in_flight_) {
      const Slot& s = slots_[slot];
      if (s.residency == direction && !(direction == Residency::kEvicting && s.cancel)) n += s.placed;
    }
    return n;
  }
  // One line at VRAMSWAP_LOG=debug: what happened to block `s` (a cold mark, a copy either
  // way, a drop, an unpack's outcome).
  void debug(const char* what, const Slot& s) const {
    if (stats::log_enabled(stats::LogLevel::kDebug))
      stats::log(stats::LogLevel::kDebug, "device %d: block %s (%s): %s", device_, hex(s.addr).c_str(),
                 format_size(s.requested).c_str(), what);
  }
  // A clean block becomes plainly resident: its host copy is not needed any more.
  void forget_host_copy(Slot& s) {
    host_.free(s.host);
    s.host = nullptr;
    s.residency = Residency::kResident;
    st_.clean_bytes -= s.placed;
  }
  // Starts evictions of Belady victims until `bytes` more are on their way out; returns the
  // bytes started. With `window_too`, blocks kept for the prefetch window are victims as
  // well (reclaim's last resort).
  uint64_t start_victims(uint64_t bytes, uint32_t except, bool window_too = false);
  // Unmaps clean blocks, needed furthest away first, until `bytes` were freed; returns the
  // bytes freed. `window_too` as for start_victims.
  uint64_t drop_clean(uint64_t bytes, uint32_t except, bool window_too = false);
  // Belady's rule over clean and evictable blocks together: from the block needed furthest
  // away, drops clean blocks (at once) and starts the eviction of evictable ones, until
  // those and the evictions in flight make `bytes`. Returns the bytes freed now (dropped).
  uint64_t make_room(uint64_t bytes, uint32_t except, bool window_too = false);
  // Waits for the evictions under way one at a time, in the order they were queued (the order
  // the copy engine runs them), giving up blocks as they land clean (drop_clean), until
  // `bytes` have been freed. Waiting for all of them, an allocation that needed one block's
  // room waited for every planned eviction queued ahead (38 ms of copies on gpt-small-v10k
  // at 75%).
  void await_evictions(uint64_t bytes, uint32_t except, bool window_too);
  // Gives up a clean block's pages (it becomes evicted); returns the bytes unmapped, which
  // leave out granules it shares with blocks still in use. Throws cuda::CudaError when
  // nothing could be unmapped.
  uint64_t drop(uint32_t slot);
  // Frees at least `bytes` of device memory as Engine::reclaim. Returns the bytes freed.
  uint64_t reclaim_locked(uint64_t bytes, ReclaimMode mode, uint32_t except = UINT32_MAX);

  void maybe_soft_evict();
  // Note [Recording and following a step] (policy/step_recorder.h): a new step, a point of
  // it (then the plan's fetches due after it), and its end once nothing is tracked.
  void begin_step();
  // The plan for the step about to begin, from the one that ended, with the device's times
  // of its points and the copy rate measured on its evictions.
  void plan_next_step();
  // `timed_on`: a stream that is not capturing, where the point's time is taken (mark_cold
  // and unpack: the times the plan needs are when blocks go cold and when backward reaches
  // them; the other points take the time of the point before). Null: untimed.
  void note_point(policy::PointKind kind, uint32_t block, uint64_t bytes, cudaStream_t timed_on = nullptr);
  void follow_fetches(uint32_t point, cudaStream_t stream);
  // Ends the step being recorded (end_step_if_done: once the plan's step is complete and
  // nothing is tracked).
  void end_step();
  void end_step_if_done();
  void untrack(Slot& s, uint32_t slot);
  void drop_deferred(bool wait);
  void update_peaks();

  pool::DevicePool& pool_;
  const EngineOptions options_;
  const int device_;
  cuda::Stream d2h_, h2d_;
  // Streams that only wait, one per direction: a block freed while its copy is in flight is
  // reused after an event the pool records on one of them, behind a wait for that block's
  // own copy (not on the copy stream, whose tail may be many copies later).
  cuda::Stream d2h_done_, h2d_done_;
  cuda::EventPool events_;
  HostTier host_;

  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::map<uintptr_t, uint32_t> by_addr_;
  // The live tagged blocks' addresses again, under their own lock, for is_tagged().
  mutable std::mutex tagged_mu_;
  std::set<uintptr_t> tagged_;
  std::vector<uint32_t> in_flight_;
  std::vector<Deferred> deferred_;
  // Why the last eviction could not get pinned memory (the out-of-memory report says it).
  std::string host_refusal_;
  policy::UseOrder order_;
  uint64_t graph_ = 1, seq_ = 0;
  policy::StepRecorder recorder_;
  std::vector<uint32_t> step_slots_;   // the step's block ordinals -> slots
  std::vector<uint32_t> due_fetches_;  // ordinals whose planned fetch found no memory yet
  // The step's clock: a timed event at each point that has a stream, and timed copies (the
  // copy rate), read when the next step's plan is made.
  cuda::EventPool timed_;
  std::vector<std::pair<uint32_t, cuda::Event>> point_events_;
  struct TimedCopy {
    cuda::Event start, end;
    uint64_t bytes;
  };
  std::vector<TimedCopy> timed_copies_;
  static constexpr size_t kTimedCopies = 16;  // per step
  // Timed points per step: past them, points take the time of the last timed one (a step of
  // a quarter million engine calls would otherwise hold as many CUDA events).
  static constexpr size_t kTimedPoints = size_t(1) << 15;
  double bytes_per_ns_ = 0;  // the D2H rate measured last; 0: none measured yet
  uint64_t unmapped_total_ = 0;  // device bytes freed by completed evictions, ever (reclaim's measure)
  uint64_t copy_seq_ = 0;        // evictions queued, ever (Slot::copy_seq)

  EngineStats st_;
};

Engine::Impl::Impl(pool::DevicePool& pool, const EngineOptions& options)
    : pool_(pool),
      options_(options),
      device_(pool.device()),
      d2h_(cuda::Stream::create(pool.device())),
      h2d_(cuda::Stream::create(pool.device(), cuda::greatest_priority(pool.device()))),
      d2h_done_(cuda::Stream::create(pool.device())),
      h2d_done_(cuda::Stream::create(pool.device())),
      events_(pool.device()),
      host_(HostTierOptions{options.host_limit_bytes, 0, pool.device()}),
      recorder_(options.plan, pool.stats().limit_bytes),
      timed_(pool.device(), true) {}

void Engine::Impl::update_peaks() {
  st_.peak_host_bytes = std::max(st_.peak_host_bytes, host_.used_bytes());
}

void* Engine::Impl::allocate_tagged(size_t size, cudaStream_t stream, std::string* error) {
  cuda::RelaxedCaptureScope relaxed;
  // The pool may call reclaim() (our lock) from here: not under mu_.
  uint64_t placed = 0;
  void* p = pool_.allocate_offloadable(size, stream, error, &placed);
  if (!p) {
    if (!error->empty()) *error += " " + pressure_report();
    return nullptr;
  }
  std::lock_guard lock(mu_);
  try {
    register_block(p, size, placed);
  } catch (...) {
    // Not registered: the block goes back, so that a failed allocation holds nothing.
    pool_.deallocate(p, pool::any_stream());
    throw;
  }
  note_point(policy::PointKind::kAlloc, policy::kNoPoint, slots_[by_addr_.at(reinterpret_cast<uintptr_t>(p))].placed);
  background("a tagged allocation");
  update_peaks();
  return p;
}

void Engine::Impl::register_block(void* p, size_t size, uint64_t placed) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
  } else {
    slots_.emplace_back();
    slot = uint32_t(slots_.size() - 1);
    free_slots_.push_back(slot);
  }
  by_addr_[addr] = slot;
  try {
    std::lock_guard tlock(tagged_mu_);
    tagged_.insert(addr);
  } catch (...) {
    by_addr_.erase(addr);
    throw;
  }
  free_slots_.pop_back();  // nothing below throws
  Slot& s = slots_[slot];
  s.live = true;
  s.addr = addr;
  s.requested = size;
  s.placed = placed;
  s.residency = Residency::kResident;
  st_.tagged_bytes += s.placed;
  st_.tagged_waste_bytes += s.placed - s.requested;
  st_.peak_tagged_waste_bytes = std::max(st_.peak_tagged_waste_bytes, st_.tagged_waste_bytes);
}

void Engine::Impl::background(const char* after) {
  try {
    complete_copies(false);
    maybe_soft_evict();
  } catch (const std::exception& e) {
    // Background work only: the call that triggered it succeeded. Every step is undone on
    // failure (the blocks concerned stay where they were), so nothing is lost.
    stats::log(stats::LogLevel::kWarn, "background eviction after %s on device %d failed: %s", after, device_,
               e.what());
  }
}

void Engine::Impl::untrack(Slot& s, uint32_t slot) {
  if (s.packs > 0) {
    order_.erase(s.key, slot);
    --st_.num_tracked_blocks;
  }
  s.packs = 0;
  s.cold = false;
  s.unpacked = false;
  s.step_block = policy::kNoPoint;
  if (s.cold_event) events_.release(std::move(s.cold_event));
  ++s.generation;  // every handle of this block is stale from now on
}

pool::Result Engine::Impl::free_tagged(void* ptr, cudaStream_t stream) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  auto it = by_addr_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == by_addr_.end()) return {false, "not a live tagged block"};
  const uint32_t slot = it->second;
  try {
    complete_copies(false);
  } catch (const std::exception&) {
    // A copy whose completion cannot be read now is handled as still in flight below.
  }
  Slot& s = slots_[slot];
  const bool copying = s.residency == Residency::kEvicting || s.residency == Residency::kFetching;
  // A copy still reads or writes the block: the pool must not reuse it before that copy is
  // done (record_stream on a stream that waits for the copy's event), and the host buffers
  // must outlive the copy. Recorded on the copy stream itself, the reuse would wait for
  // every copy queued after this one: on gpt-1.3b-flash at half its peak, an allocation of
  // backward waited 190 ms for the planned fetches queued behind a block it had freed.
  if (copying) {
    const bool out = s.residency == Residency::kEvicting;
    cudaStream_t after = out ? d2h_done_.get() : h2d_done_.get();
    try {
      cuda::wait_event(after, s.copy_event);
    } catch (const cuda::CudaError&) {
      after = out ? d2h_.get() : h2d_.get();  // later than needed, never too early
    }
    pool_.record_stream(ptr, after);
  }
  // Its granules are likely wanted soon by a prefetch on the copy stream: free it behind an
  // event, not behind the next device synchronization. The pool first: if it refuses, the
  // engine has changed nothing and the handle stays valid.
  // A block placed with others (below half a granule) goes back as any block does (its stream's quick list, when
  // nothing waits): tagging changes no placement.
  pool::Result freed = s.placed < pool_.granularity() ? pool_.deallocate(ptr, stream)
                                                      : pool_.deallocate_to_any(ptr, stream);
  if (!freed.ok) return freed;
  switch (s.residency) {
    case Residency::kResident:
      break;
    case Residency::kClean:
      forget_host_copy(s);
      break;
    case Residency::kEvicted:
      host_.free(s.host);
      st_.evicted_bytes -= s.placed;
      break;
    case Residency::kEvicting:
    case Residency::kFetching:
      deferred_.push_back({s.host, std::move(s.copy_event)});
      if (s.check) deferred_.push_back({s.check, cuda::Event(), h2d_.get()});
      std::erase(in_flight_, slot);
      st_.in_flight_bytes -= s.placed;
      if (s.residency == Residency::kFetching) st_.evicted_bytes -= s.placed;
      break;
  }
  s.host = nullptr;
  s.check = nullptr;
  untrack(s, slot);
  s.live = false;
  s.residency = Residency::kResident;
  by_addr_.erase(it);
  {
    std::lock_guard tlock(tagged_mu_);
    tagged_.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  free_slots_.push_back(slot);
  st_.tagged_bytes -= s.placed;
  st_.tagged_waste_bytes -= s.placed - s.requested;
  end_step_if_done();
  return {};
}

uint64_t Engine::Impl::pack(const void* ptr, cudaStream_t stream) {
  (void)stream;  // the save is ordered by the caller; pack queues no work
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard lock(mu_);
  auto it = by_addr_.upper_bound(addr);
  if (it == by_addr_.begin()) return 0;
  --it;
  const uint32_t slot = it->second;
  Slot& s = slots_[slot];
  if (addr - s.addr >= s.placed) return 0;
  const policy::UseKey key{graph_, ++seq_};
  if (s.packs == 0) {
    s.key = key;
    order_.insert(key, slot);
    ++st_.num_tracked_blocks;
  } else if (policy::needed_before(key, s.key)) {
    // Saved again: needed at the earliest of its saves (the latest one, in backward).
    order_.erase(s.key, slot);
    s.key = key;
    order_.insert(key, slot);
  }
  ++s.packs;
  if (recorder_.active() && s.step_block == policy::kNoPoint) {
    s.step_block = recorder_.new_block(s.placed);
    if (s.step_block != policy::kNoPoint) {
      if (step_slots_.size() <= s.step_block) step_slots_.resize(s.step_block + 1, UINT32_MAX);
      step_slots_[s.step_block] = slot;
    }
  }
  note_point(policy::PointKind::kPack, s.step_block, s.placed);
  return handle_of(slot);
}

Slot* Engine::Impl::resolve(uint64_t handle, const char* what, std::string* error) {
  const uint32_t slot = slot_of(handle);
  const uint32_t generation = uint32_t(handle);
  if (handle == 0) {
    *error = std::string(what) + ": handle 0 names no block (pack returned 0: the block is not offloadable)";
    return nullptr;
  }
  if (int(handle >> kDeviceShift) != device_ || slot >= slots_.size()) {
    *error = std::string(what) + ": handle " + hex(handle) + " was not given out by vramswap";
    return nullptr;
  }
  Slot& s = slots_[slot];
  if (!s.live || s.generation != generation || s.packs == 0) {
    *error = std::string(what) + ": handle " + hex(handle) +
             " is stale: its block was released or freed since it was packed";
    return nullptr;
  }
  return &s;
}

Status Engine::Impl::mark_cold(uint64_t handle, cudaStream_t stream) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "mark_cold", &error);
  if (!s) return {false, error};
  const std::string block = "mark_cold: block " + hex(s->addr);
  try {
    if (cuda::is_capturing(stream))
      return {false, block + ": its stream is capturing a CUDA graph, where the point of no use cannot be "
                             "recorded; the block stays in use (not evictable)"};
    // Recorded before anything changes: a failure leaves the block as it was (not cold).
    if (!s->cold_event) s->cold_event = events_.acquire();
    s->cold_event.record(stream);  // everything that could still touch the block is before it
  } catch (const cuda::CudaError& e) {
    return {false, block + ": " + e.what() + "; the block stays in use (not evictable)"};
  }
  s->cold = true;
  s->cold_stream = stream;
  s->unpacked = false;
  debug("cold", *s);
  note_point(policy::PointKind::kCold, s->step_block, 0, stream);
  if (recorder_.planned_victim(s->step_block) && s->residency == Residency::kResident) {
    // The plan's victim: its copy starts now, while the copy engine is idle; its pages stay
    // mapped (clean) until an allocation needs them.
    try {
      if (start_eviction(slot_of(handle))) s->planned = true;
    } catch (const std::exception& e) {
      stats::log(stats::LogLevel::kWarn, "planned eviction after mark_cold on device %d failed: %s (the block "
                 "stays on the device)", device_, e.what());
    }
  }
  background("mark_cold");
  return {};
}

Status Engine::Impl::unpack(uint64_t handle, cudaStream_t stream) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "unpack", &error);
  if (!s) return {false, error};
  const uint32_t slot = slot_of(handle);
  bool capturing = false;
  try {
    capturing = cuda::is_capturing(stream);
    complete_copies(false);
  } catch (const cuda::CudaError& e) {
    return {false, "unpack of block " + hex(s->addr) + ": " + e.what()};
  }
  switch (s->residency) {
    case Residency::kResident:
      break;
    case Residency::kEvicting:
      s->cancel = true;  // its pages are still mapped and hold the data
      break;
    case Residency::kClean:  // never given up: no copy back at all
      ++st_.num_clean_reuses;
      debug("unpacked while clean (no copy back)", *s);
      forget_host_copy(*s);
      break;
    case Residency::kEvicted: {
      if (capturing)
        return {false, "unpack of an evicted block (" + hex(s->addr) +
                           ") on a stream that is capturing a CUDA graph: it cannot be fetched now"};
      ++st_.num_faults;
      Status r = start_fetch(slot, Fetch::kNeeded);
      if (!r.ok) return r;
      break;
    }
    case Residency::kFetching:
      if (!s->copy_event.query()) {
        ++st_.num_late_prefetches;
        debug("unpacked while its fetch is in flight (late)", *s);
      }
      break;
  }
  s = &slots_[slot];
  // Valid for work queued on `stream` from now on: after the fetch, or, for a block that
  // never left, after the work queued on the stream that marked it cold (the last writes).
  try {
    const cuda::Event* after = nullptr;
    if (s->residency == Residency::kFetching) after = &s->copy_event;
    else if (s->cold && s->cold_event && s->cold_stream != stream) after = &s->cold_event;
    if (after && capturing) {
      after->synchronize();  // an event from outside the capture cannot join it: wait here
    } else if (after) {
      cuda::wait_event(stream, *after);
    }
  } catch (const cuda::CudaError& e) {
    return {false, "unpack of block " + hex(s->addr) + ": ordering the stream after its data failed: " + e.what() +
                       "; the block is on the device, call unpack again"};
  }
  s->unpacked = true;
  s->cold = false;
  order_.set_cursor(s->key);
  note_point(policy::PointKind::kUnpack, s->step_block, 0, capturing ? nullptr : stream);
  // Prefetch the window; make room for it by giving up what is needed furthest away. A victim
  // the plan being followed still wants out is left to its planned fetch: fetched sooner, it
  // takes memory the plan counts on, and the allocations there evict beyond the plan.
  if (options_.horizon > 0) {
    try {
      for (uint32_t next : order_.window(options_.horizon)) {
        Slot& n = slots_[next];
        if (recorder_.planned_out(n.step_block)) continue;
        if (n.residency == Residency::kEvicting) {
          n.cancel = true;
        } else if (n.residency == Residency::kEvicted) {
          if (!start_fetch(next, Fetch::kPrefetch).ok) break;  // make_room started evictions for next time
          ++st_.num_prefetches;
        }
      }
      // Following a plan, its fetches are scheduled; fetching ahead would take memory the
      // plan counts on.
      if (in_flight_bytes(Residency::kFetching) == 0 && !recorder_.following()) fetch_ahead();
    } catch (const std::exception& e) {
      stats::log(stats::LogLevel::kWarn, "prefetch after an unpack on device %d failed: %s (the blocks concerned "
                 "stay on the host and are fetched when unpacked)", device_, e.what());
    }
  }
  update_peaks();
  return {};
}

Status Engine::Impl::release(uint64_t handle) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "release", &error);
  if (!s) return {false, error};
  const uint32_t slot = slot_of(handle);
  note_point(policy::PointKind::kRelease, s->step_block, 0);
  if (s->packs > 1) {
    --s->packs;
    return {};
  }
  // It becomes an ordinary block again: resident. Released without an unpack (backward did
  // not need it) it may be on the host: bring it back first, waiting, so that nothing is
  // lost; if that is refused the block stays packed and the handle valid.
  if (s->residency == Residency::kEvicting) s->cancel = true;
  if (s->residency == Residency::kClean) forget_host_copy(*s);
  if (s->residency == Residency::kEvicted) {
    Status r = start_fetch(slot, Fetch::kNeeded);
    if (!r.ok) return {false, "release: " + r.message + "; the block stays packed, its handle valid"};
  }
  // A fetch still in flight: an unpacked block's stream already waits for it; a block that
  // was never unpacked has no reader ordered after the fetch, so wait here.
  if (slots_[slot].residency == Residency::kFetching && !slots_[slot].unpacked) {
    try {
      slots_[slot].copy_event.synchronize();
      complete_copies(false);
    } catch (const cuda::CudaError& e) {
      return {false, "release: waiting for the fetch of block " + hex(slots_[slot].addr) + " failed: " + e.what() +
                         "; the block stays packed, its handle valid"};
    }
  }
  untrack(slots_[slot], slot);
  end_step_if_done();
  return {};
}

Status Engine::Impl::prefetch(uint64_t handle) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "prefetch", &error);
  if (!s) return {false, error};
  const uint32_t slot = slot_of(handle);
  complete_copies(false);
  if (s->residency == Residency::kEvicting) s->cancel = true;
  if (s->residency != Residency::kEvicted) return {};  // on the device (a clean block too)
  Status r = start_fetch(slot, Fetch::kHint);
  if (r.ok) ++st_.num_prefetches;
  return r;
}

bool Engine::Impl::start_eviction(uint32_t slot) {
  Slot& s = slots_[slot];
  if (s.requested > host_.limit_bytes()) {
    host_refusal_ = "block " + hex(s.addr) + " (" + format_size(s.requested) +
                    ") is larger than the host tier's limit (VRAMSWAP_HOST_LIMIT, " + format_size(host_.limit_bytes()) +
                    "): it can never be evicted";
    return false;
  }
  std::string error;
  void* host = host_.allocate(s.requested, &error);
  if (!host) {
    host_refusal_ = "no pinned host memory for block " + hex(s.addr) + " (" + format_size(s.requested) + "): " + error;
    return false;
  }
  cuda::Event copied;
  bool queued = false;
  try {
    copied = events_.acquire();
    cuda::wait_event(d2h_.get(), s.cold_event);
    // A few copies of each recorded step are timed: the copy rate the plan needs.
    const bool timing = recorder_.active() && timed_copies_.size() < kTimedCopies && s.requested >= (1u << 20);
    cuda::Event t0, t1;
    if (timing) {
      t0 = timed_.acquire();
      t0.record(d2h_.get());
    }
    cuda::copy_async(host, reinterpret_cast<void*>(s.addr), s.requested, d2h_.get());
    queued = true;
    copied.record(d2h_.get());
    if (timing) {
      t1 = timed_.acquire();
      t1.record(d2h_.get());
      timed_copies_.push_back({std::move(t0), std::move(t1), s.requested});
    }
  } catch (const cuda::CudaError& e) {
    // Nothing left the device: the block stays resident and cold. Its host buffer goes back
    // once nothing queued can write it any more.
    if (copied) events_.release(std::move(copied));
    if (queued) deferred_.push_back({host, cuda::Event(), d2h_.get()});
    else host_.free(host);
    throw;
  }
  s.copy_event = std::move(copied);
  s.host = host;
  s.cancel = false;
  s.residency = Residency::kEvicting;
  s.copy_seq = ++copy_seq_;
  in_flight_.push_back(slot);
  st_.in_flight_bytes += s.placed;
  update_peaks();
  debug("copy out started", s);
  return true;
}

// Note [Fetch ahead]
// ------------------
// Backward starts with the blocks saved last, which are resident; the window (the next
// `horizon` blocks) reaches the first evicted one only later, so under heavy eviction the
// H2D engine idled for the first part of backward while backward was freeing memory.
// When no fetch is in flight, the nearest evicted block past the window is fetched into
// memory that is free now, below the soft limit: one at a time, so that it keeps the copy
// engine busy without filling memory ahead of backward's own allocations.
void Engine::Impl::fetch_ahead() {
  const uint64_t soft = soft_limit();
  order_.each_after_cursor([&](uint32_t next) {
    const Slot& n = slots_[next];
    if (n.residency != Residency::kEvicted) return true;
    if (pool_.stats().mapped_bytes + n.placed <= soft && start_fetch(next, Fetch::kAhead).ok) ++st_.num_prefetches;
    return false;
  });
}

Status Engine::Impl::start_fetch(uint32_t slot, Fetch kind, cudaStream_t stream) {
  Slot& s = slots_[slot];
  using MapWait = pool::DevicePool::MapWait;
  void* const addr = reinterpret_cast<void*>(s.addr);
  pool::Result mapped;
  if (s.pages_kept) kind = Fetch::kKept;
  switch (kind) {
    case Fetch::kKept:  // a failed fetch left the pages mapped: nothing to map
      s.pages_kept = false;
      break;
    case Fetch::kAhead:
      mapped = pool_.map_block(addr, MapWait::kNone);
      break;
    case Fetch::kHint:
      mapped = pool_.map_block(addr, MapWait::kPendingFrees);
      break;
    case Fetch::kPlanned:  // the plan says the memory is there: the caller's stream's cache too
      mapped = pool_.map_block(addr, MapWait::kStream, stream);
      break;
    case Fetch::kPrefetch:
      // Never synchronizes the device: memory free at once or freed behind an event (a tagged
      // block freed by backward), waiting for that event; else clean blocks needed later.
      mapped = pool_.map_block(addr, MapWait::kPendingFrees);
      if (!mapped.ok && make_room(s.placed, slot) > 0) mapped = pool_.map_block(addr, MapWait::kPendingFrees);
      break;
    case Fetch::kNeeded:
      mapped = pool_.map_block(addr, MapWait::kSynchronize);
      if (!mapped.ok) {
        reclaim_locked(s.placed, ReclaimMode::kFull, slot);
        mapped = pool_.map_block(addr, MapWait::kSynchronize);
      }
      break;
  }
  if (!mapped.ok) {
    // Needed now and refused for want of memory: the program's out-of-memory (the caller
    // raises it as one), counted as the pool counts its own.
    const bool out_of_memory = kind == Fetch::kNeeded && mapped.out_of_memory;
    if (out_of_memory) pool_.count_out_of_memory();
    return {false,
            "cannot bring block " + hex(s.addr) + " (" + format_size(s.placed) + ") back to the device: " +
                mapped.message,
            out_of_memory};
  }
  void* check = nullptr;
  cuda::Event copied;
  try {
    copied = events_.acquire();
    cuda::copy_async(addr, s.host, s.requested, h2d_.get());
    if (options_.verify) {
      // Read the restored block back before anyone can use it (readers wait for the event
      // recorded after this): a later check would see the program's own writes.
      std::string error;
      check = host_.allocate(s.requested, &error);
      if (check) cuda::copy_async(check, addr, s.requested, h2d_.get());
    }
    copied.record(h2d_.get());
  } catch (const cuda::CudaError& e) {
    // The block stays on the host, unmapped as it was, so that a later call can try again.
    if (copied) events_.release(std::move(copied));
    const bool quiet = cuda::synchronize_stream(h2d_.get());
    if (check) {
      if (quiet) host_.free(check);
      else deferred_.push_back({check, cuda::Event(), h2d_.get()});
    }
    // Unmapped again once no copy can touch the pages; else they stay, and the next fetch
    // uses them as they are.
    bool partly = false;
    if (!quiet || (!pool_.unmap_block(addr, &partly).ok && !partly)) s.pages_kept = true;
    return {false, "cannot bring block " + hex(s.addr) + " back to the device: " + e.what() +
                       "; it stays on the host (a later unpack tries again)"};
  }
  static constexpr const char* kWhy[] = {"fetch started (needed now: a fault)", "fetch started (prefetch window)",
                                         "fetch started (ahead of the window)", "fetch started (hint)",
                                         "fetch started (planned)", "fetch started (pages kept)"};
  debug(kWhy[int(kind)], s);
  s.copy_event = std::move(copied);
  s.check = check;
  s.residency = Residency::kFetching;
  in_flight_.push_back(slot);
  st_.in_flight_bytes += s.placed;
  st_.bytes_prefetched_total += s.requested;
  if (kind != Fetch::kAhead) fetch_granule_mates(slot);
  return {};
}

// Note [A shared granule goes as a whole]
// ----------------------------------------
// Evicting one small block of a shared granule frees nothing while another block on it is
// in use: make_room counted its bytes as covered anyway, stopped short, and copied out
// blocks whose pages stayed. A small victim now takes its granule with it: when every other
// tagged block on the granules it touches is evictable (cold, outside the window), away,
// leaving, or copied out (clean: dropped with the others), and no ordinary block lives
// there, all the evictable ones start their copies together and the granules' bytes count
// as covered; otherwise none moves (the granule is not a victim yet) and the next
// candidate is looked at.
uint64_t Engine::Impl::evict_granule(uint32_t slot, const std::set<uint32_t>& window) {
  const Slot& s = slots_[slot];
  if (pool_.shares_granule_with_ordinary(reinterpret_cast<void*>(s.addr))) return 0;
  uintptr_t lo, hi;
  granule_span(s, &lo, &hi);
  std::vector<uint32_t> group;
  // A block starting before `lo` may run onto it: start the walk at the one before.
  auto it = by_addr_.lower_bound(lo);
  if (it != by_addr_.begin()) --it;
  for (; it != by_addr_.end() && it->first < hi; ++it) {
    const Slot& m = slots_[it->second];
    if (!m.live || m.addr + m.placed <= lo) continue;
    if (evictable(it->second, window)) {
      group.push_back(it->second);
    } else if (!(m.residency == Residency::kEvicted || (m.residency == Residency::kEvicting && !m.cancel) ||
                 (m.residency == Residency::kClean && !window.count(it->second)))) {
      return 0;  // in use, in the window or fetching: the page stays
    }
  }
  for (uint32_t m : group)
    if (!start_eviction(m)) return 0;  // the host tier is full: what started frees later
  return hi - lo;
}

// Note [A shared granule comes back whole]
// ----------------------------------------
// Small tagged blocks saved one after another share granules (Note [Placing for eviction]
// in device_pool.h); a granule's pages go only when all of them are away, so they leave
// together, and backward needs them back together. When the first of them is fetched the
// granule is mapped for it anyway: the others' copies start with it (as fetches ahead:
// kAhead maps nothing new, and they are counted as prefetches), so that backward finds them
// on their way instead of faulting one by one. A block that runs onto a granule the fetch did
// not map waits for its own fetch.
void Engine::Impl::fetch_granule_mates(uint32_t slot) {
  const Slot& s = slots_[slot];
  if (!shares_granules(s)) return;
  // Fetched early, the others hold the granule until the last of them is used, where alone
  // it would go between their uses: only below the soft limit, as fetches ahead.
  if (pool_.stats().mapped_bytes > soft_limit()) return;
  uintptr_t lo, hi;
  granule_span(s, &lo, &hi);
  std::vector<uint32_t> mates;
  for (auto it = by_addr_.lower_bound(lo); it != by_addr_.end() && it->first < hi; ++it) {
    const Slot& m = slots_[it->second];
    if (it->second != slot && m.live && m.residency == Residency::kEvicted && !m.pages_kept && m.addr + m.placed <= hi)
      mates.push_back(it->second);
  }
  for (uint32_t m : mates)
    if (start_fetch(m, Fetch::kAhead).ok) ++st_.num_prefetches;
}

void Engine::Impl::finish(uint32_t slot) {
  Slot& s = slots_[slot];
  st_.in_flight_bytes -= s.placed;
  const bool planned = s.planned;
  s.planned = false;
  if (s.residency == Residency::kEvicting) {
    if (s.cancel) {  // wanted again before the copy ended: it never left
      host_.free(s.host);
      s.host = nullptr;
      s.residency = Residency::kResident;
      debug("eviction cancelled (used again before its copy landed)", s);
    } else {  // clean: its pages go when memory is needed (drop)
      if (options_.verify) s.checksum = checksum(s.host, s.requested);
      if (planned) st_.planned_bytes_d2h += s.requested;
      s.residency = Residency::kClean;
      debug(planned ? "copied out, clean (a planned victim)" : "copied out, clean", s);
      st_.clean_bytes += s.placed;
      st_.bytes_evicted_total += s.requested;
      ++st_.num_evictions;
    }
  } else {  // a fetch
    if (s.check) {
      // The readback queued behind the fetch (start_fetch) has landed with it.
      const uint64_t got = checksum(s.check, s.requested);
      host_.free(s.check);
      s.check = nullptr;
      if (got != s.checksum) {
        ++st_.num_verify_failures;
        stats::log_always(stats::LogLevel::kError,
                          ("VRAMSWAP_VERIFY: block " + hex(s.addr) + " (" + std::to_string(s.requested) +
                           " bytes) on device " + std::to_string(device_) +
                           " came back different from what was evicted (checksum " + hex(got) + ", expected " +
                           hex(s.checksum) + ")")
                              .c_str());
      }
    }
    host_.free(s.host);
    s.host = nullptr;
    s.residency = Residency::kResident;
    st_.evicted_bytes -= s.placed;
    debug("fetch landed, resident", s);
  }
  events_.release(std::move(s.copy_event));
}

void Engine::Impl::complete_copies(bool wait) {
  drop_deferred(wait);
  for (size_t i = 0; i < in_flight_.size();) {
    const uint32_t slot = in_flight_[i];
    Slot& s = slots_[slot];
    if (wait) s.copy_event.synchronize();
    else if (!s.copy_event.query()) {
      ++i;
      continue;
    }
    in_flight_[i] = in_flight_.back();
    in_flight_.pop_back();
    finish(slot);
  }
}

void Engine::Impl::drop_deferred(bool wait) {
  for (size_t i = 0; i < deferred_.size();) {
    Deferred& d = deferred_[i];
    // Without an event, a call that must not wait only asks whether the stream is idle: a
    // synchronization here made every engine call wait for the whole fetch queue behind a
    // freed block's VRAMSWAP_VERIFY readback.
    const bool done = d.event ? (wait ? (d.event.synchronize(), true) : d.event.query())
                              : (wait ? cuda::synchronize_stream(d.stream) : cuda::stream_done(d.stream));
    if (!done) {
      ++i;
      continue;
    }
    host_.free(d.host);
    if (d.event) events_.release(std::move(d.event));
    deferred_[i] = std::move(deferred_.back());
    deferred_.pop_back();
  }
}

uint64_t Engine::Impl::start_victims(uint64_t bytes, uint32_t except, bool window_too) {
  const std::set<uint32_t> window = window_too ? std::set<uint32_t>() : window_set();
  uint64_t started = 0;
  order_.each_furthest_first([&](uint32_t slot) {
    if (started >= bytes) return false;
    if (slot == except || !evictable(slot, window)) return true;
    if (!start_eviction(slot)) return false;  // the host tier is full
    started += slots_[slot].placed;
    return true;
  });
  return started;
}

uint64_t Engine::Impl::drop(uint32_t slot) {
  Slot& s = slots_[slot];
  bool partly = false;
  uint64_t freed = 0;
  pool::Result r = pool_.unmap_block(reinterpret_cast<void*>(s.addr), &partly, &freed);
  if (!r.ok && !partly) throw cuda::CudaError("eviction of " + hex(s.addr) + ": " + r.message, CUDA_ERROR_UNKNOWN);
  // Unmapped, or partly: the host copy is whole, and a fetch maps what is missing.
  s.residency = Residency::kEvicted;
  debug(r.ok ? "evicted (pages given up)" : "evicted (pages partly given up)", s);
  recorder_.refetch(s.step_block);  // a block the plan keeps: its fetch joins the plan's
  // The granules freed now: those it shares with a block still in use stay mapped (they go
  // with the last of their blocks), and ones it shares with blocks already away go now.
  unmapped_total_ += freed;
  st_.clean_bytes -= s.placed;
  st_.evicted_bytes += s.placed;
  if (!r.ok) throw cuda::CudaError("eviction of " + hex(s.addr) + ": " + r.message, CUDA_ERROR_UNKNOWN);
  return freed;
}

uint64_t Engine::Impl::drop_clean(uint64_t bytes, uint32_t except, bool window_too) {
  if (st_.clean_bytes == 0) return 0;
  const std::set<uint32_t> window = window_too ? std::set<uint32_t>() : window_set();
  uint64_t dropped = 0;
  order_.each_furthest_first([&](uint32_t slot) {
    if (dropped >= bytes) return false;
    if (slot == except || slots_[slot].residency != Residency::kClean || kept_clean(slot, window)) return true;
    dropped += drop(slot);
    return true;
  });
  return dropped;
}

uint64_t Engine::Impl::make_room(uint64_t bytes, uint32_t except, bool window_too) {
  const std::set<uint32_t> window = window_too ? std::set<uint32_t>() : window_set();
  uint64_t covered = in_flight_bytes(Residency::kEvicting);  // evictions under way free pages too
  const uint64_t unmapped_before = unmapped_total_;
  order_.each_furthest_first([&](uint32_t slot) {
    if (covered >= bytes) return false;
    if (slot == except) return true;
    Slot& s = slots_[slot];
    if (s.residency == Residency::kClean && !kept_clean(slot, window)) {
      covered += drop(slot);  // what it freed: a granule shared with a block in use stays
    } else if (!evictable(slot, window)) {
      return true;  // not a victim
    } else if (shares_granules(s)) {
      covered += evict_granule(slot, window);
    } else if (!start_eviction(slot)) {
      return true;  // the host tier is full: only clean blocks help
    } else {
      covered += s.placed;
    }
    return true;
  });
  return unmapped_total_ - unmapped_before;
}

uint64_t Engine::Impl::reclaim_locked(uint64_t bytes, ReclaimMode mode, uint32_t except) {
  const uint64_t unmapped_before = unmapped_total_;
  auto freed = [&] { return unmapped_total_ - unmapped_before; };
  // Copies that already landed first: an eviction that completed leaves a clean block to
  // drop at once; a fetch that completed makes its block resident, and it may be a victim
  // by now (the window moved on while it was in flight).
  complete_copies(false);
  if (recorder_.following()) {
    // The plan's victims, copied out since they went cold, are what it gives up at once; no
    // eviction starts beyond the plan before the pool has tried its own measures (the
    // forward's cached blocks, once the stream is synchronized: waiting for queued work
    // costs less than two copies over the bus). An allocation that must wait gives them up
    // first as well: Belady's rule over clean and evictable blocks together copies out a
    // block needed later than a victim of the plan, which only wants its pages unmapped.
    drop_clean(bytes, except);
    if (mode == ReclaimMode::kNoWait || freed() >= bytes) return freed();
  }
  make_room(bytes - freed(), except);
  if (mode == ReclaimMode::kNoWait) return freed();
  // Rounds 0 and 1 spare the prefetch window; waiting for round 0's copies may land fetches
  // whose blocks are victims for round 1. Round 2 is the last resort before an out-of-memory:
  // it takes blocks kept for the prefetch window too (they come back late, as faults, but
  // the step goes on).
  bool landed = true;  // copies may have landed since victims were last looked for
  for (int round = 0; round < 3 && freed() < bytes; ++round) {
    const bool window_too = round == 2;
    if (!landed && !window_too) continue;
    if (round > 0) make_room(bytes - freed(), except, window_too);
    landed = !in_flight_.empty();
    if (landed && freed() < bytes) {  // (make_room may have dropped enough clean blocks)
      // The evictions first, oldest first, as far as needed; then fetches too (a block that
      // lands may be a victim by now), which free nothing themselves.
      await_evictions(bytes - freed(), except, window_too);
      if (freed() < bytes) {
        complete_copies(true);
        drop_clean(bytes - freed(), except, window_too);
      }
    }
  }
  return freed();
}

void Engine::Impl::await_evictions(uint64_t bytes, uint32_t except, bool window_too) {
  const uint64_t unmapped_before = unmapped_total_;
  auto freed = [&] { return unmapped_total_ - unmapped_before; };
  std::vector<std::pair<uint64_t, uint32_t>> queued;  // (copy_seq, slot)
  for (uint32_t slot : in_flight_)
    if (slots_[slot].residency == Residency::kEvicting) queued.emplace_back(slots_[slot].copy_seq, slot);
  std::sort(queued.begin(), queued.end());
  for (const auto& [seq, slot] : queued) {
    if (freed() >= bytes) return;
    Slot& s = slots_[slot];
    if (s.residency != Residency::kEvicting || s.copy_seq != seq) continue;  // reaped meanwhile
    s.copy_event.synchronize();
    complete_copies(false);  // reaps it, and whatever else has landed
    if (freed() < bytes) drop_clean(bytes - freed(), except, window_too);
  }
}

void Engine::Impl::begin_step() {
  if (!recorder_.enabled()) return;
  if (recorder_.active()) end_step();  // the step before ends where this one begins
  plan_next_step();
  pool_.take_allocated_high();  // the demand is counted from here
  recorder_.begin_step();
  stats::log(stats::LogLevel::kDebug, "device %d: a step begins: %s", device_,
             recorder_.following() ? "it follows the plan"
             : recorder_.backing_off() ? "the watermarks decide (the plan is backing off), and it is recorded"
                                       : "the watermarks decide, and it is recorded");
}

void Engine::Impl::end_step() {
  recorder_.end_step();
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
  if (recorder_.plan_pending()) {
    try {
      uint64_t bytes = 0, ns = 0;
      for (const TimedCopy& c : timed_copies_) {
        c.end.synchronize();
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
      }
    } catch (const std::exception& e) {
      stats::log(stats::LogLevel::kDebug, "device %d: reading the step's times failed: %s (planning without them)",
                 device_, e.what());
      times.clear();
    }
    recorder_.plan_next(std::move(times), bytes_per_ns_);
    stats::log(stats::LogLevel::kDebug, "device %d: plan: %s, copy rate %.1f GB/s", device_,
               recorder_.describe().c_str(), bytes_per_ns_);
  }
  for (auto& [p, e] : point_events_) timed_.release(std::move(e));
  point_events_.clear();
  for (TimedCopy& c : timed_copies_) {
    timed_.release(std::move(c.start));
    timed_.release(std::move(c.end));
  }
  timed_copies_.clear();
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

void Engine::Impl::maybe_soft_evict() {
  // Following a plan, its evictions replace the watermark's: copies made for the watermark
  // would be bytes the plan does not need out.
  if (options_.soft_limit_bytes == 0 || recorder_.following()) return;
  // Clean blocks count as gone: their pages are given up at once when memory is needed.
  const uint64_t mapped = pool_.stats().mapped_bytes;
  const uint64_t resident = mapped - std::min(mapped, st_.clean_bytes);
  const uint64_t leaving = in_flight_bytes(Residency::kEvicting);
  if (resident <= options_.soft_limit_bytes + leaving) return;
  start_victims(resident - options_.soft_limit_bytes - leaving, UINT32_MAX);
}

std::string Engine::Impl::pressure_report() {
  const EngineStats s = stats();
  const pool::PoolStats ps = pool_.stats();
  const uint64_t untagged = ps.allocated_bytes > s.tagged_bytes ? ps.allocated_bytes - s.tagged_bytes : 0;
  const uint64_t tagged_resident = s.tagged_bytes > s.evicted_bytes ? s.tagged_bytes - s.evicted_bytes : 0;
  return "Offload: " + format_size(tagged_resident) + " tagged and resident, " + format_size(untagged) +
         " untagged, " + format_size(s.evictable_bytes) + " evictable (cold, outside the prefetch window of " +
         std::to_string(options_.horizon) + "), " + format_size(s.clean_bytes) + " copied out but still mapped, " +
         format_size(s.in_flight_bytes) + " in flight, " + format_size(s.evicted_bytes) + " on the host; host tier " +
         format_size(s.host_bytes) + " used of " + format_size(host_.limit_bytes()) + "." +
         (host_refusal_.empty() ? "" : " Eviction stopped: " + host_refusal_ + ".");  // the latest reason
}

EngineStats Engine::Impl::stats() {
  std::lock_guard lock(mu_);
  complete_copies(false);  // copies that have completed count as done
  EngineStats s = st_;
  s.num_planned_steps = recorder_.num_planned_steps();
  s.num_plan_divergences = recorder_.num_divergences();
  s.num_plan_backoffs = recorder_.num_backoffs();
  const pool::PoolStats ps = pool_.stats();
  s.resident_bytes = ps.mapped_bytes;
  s.peak_resident_bytes = ps.peak_mapped_bytes;
  s.host_bytes = host_.used_bytes();
  s.peak_host_bytes = std::max(s.peak_host_bytes, s.host_bytes);
  const std::set<uint32_t> window = window_set();
  for (uint32_t slot = 0; slot < slots_.size(); ++slot)
    if (evictable(slot, window)) s.evictable_bytes += slots_[slot].placed;
  return s;
}

std::string Engine::Impl::check_invariants() {
  std::lock_guard lock(mu_);
  std::vector<std::string> broken;
  auto expect = [&](bool holds, const std::string& what) {
    if (!holds && broken.size() < 16) broken.push_back(what);
  };
  EngineStats sum;
  size_t live = 0, copying = 0;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    const Slot& s = slots_[slot];
    if (!s.live) {
      expect(!s.host && !s.check, "free slot " + std::to_string(slot) + " holds a host buffer");
      continue;
    }
    ++live;
    const std::string block = "block " + hex(s.addr);
    auto at = by_addr_.find(s.addr);
    expect(at != by_addr_.end() && at->second == slot, block + " is missing from the address map");
    {
      std::lock_guard tlock(tagged_mu_);
      expect(tagged_.count(s.addr) == 1, block + " is missing from the tagged set");
    }
    sum.tagged_bytes += s.placed;
    sum.tagged_waste_bytes += s.placed - s.requested;
    const bool host = s.residency != Residency::kResident;
    expect((s.host != nullptr) == host, block + (host ? " has no host buffer" : " holds a host buffer it does not need"));
    expect(!s.check || s.residency == Residency::kFetching, block + " holds a verify buffer with no fetch");
    if (s.residency == Residency::kClean) sum.clean_bytes += s.placed;
    if (s.residency == Residency::kEvicted || s.residency == Residency::kFetching) sum.evicted_bytes += s.placed;
    if (s.residency == Residency::kEvicting || s.residency == Residency::kFetching) {
      ++copying;
      sum.in_flight_bytes += s.placed;
      expect(std::count(in_flight_.begin(), in_flight_.end(), slot) == 1, block + " has a copy nobody watches");
      expect(bool(s.copy_event), block + " has a copy with no event");
    }
    if (s.packs > 0) ++sum.num_tracked_blocks;
    expect(!s.cold || bool(s.cold_event), block + " is cold with no cold event");
  }
  expect(by_addr_.size() == live, "the address map holds " + std::to_string(by_addr_.size()) + " blocks for " +
                                      std::to_string(live) + " live ones");
  expect(in_flight_.size() == copying, "in_flight lists " + std::to_string(in_flight_.size()) + " copies for " +
                                           std::to_string(copying));
  auto same = [&](uint64_t counted, uint64_t added, const char* name) {
    expect(counted == added, std::string(name) + " is " + std::to_string(counted) + " but the blocks add up to " +
                                 std::to_string(added));
  };
  same(st_.tagged_bytes, sum.tagged_bytes, "tagged_bytes");
  same(st_.tagged_waste_bytes, sum.tagged_waste_bytes, "tagged_waste_bytes");
  same(st_.clean_bytes, sum.clean_bytes, "clean_bytes");
  same(st_.evicted_bytes, sum.evicted_bytes, "evicted_bytes");
  same(st_.in_flight_bytes, sum.in_flight_bytes, "in_flight_bytes");
  same(st_.num_tracked_blocks, sum.num_tracked_blocks, "num_tracked_blocks");
  std::string text;
  for (const std::string& b : broken) text += (text.empty() ? "" : "; ") + b;
  return text;
}

void Engine::Impl::reset_peaks() {
  std::lock_guard lock(mu_);
  st_.peak_host_bytes = host_.used_bytes();
  st_.peak_tagged_waste_bytes = st_.tagged_waste_bytes;
}

Engine::Engine(pool::DevicePool& pool, const EngineOptions& options)
    : impl_(std::make_unique<Impl>(pool, options)) {
  pool.set_reclaimer([impl = impl_.get()](uint64_t bytes, ReclaimMode mode, cudaStream_t stream) {
    return impl->reclaim(bytes, mode, stream);
  });
}
Engine::~Engine() { impl_->detach(); }
void* Engine::allocate_tagged(size_t size, cudaStream_t stream, std::string* error) {
  return impl_->allocate_tagged(size, stream, error);
}
bool Engine::is_tagged(const void* ptr) const { return impl_->is_tagged(ptr); }
pool::Result Engine::free_tagged(void* ptr, cudaStream_t stream) { return impl_->free_tagged(ptr, stream); }
uint64_t Engine::pack(const void* ptr, cudaStream_t stream) { return impl_->pack(ptr, stream); }
void Engine::graph_begin() { impl_->graph_begin(); }
Status Engine::mark_cold(uint64_t h, cudaStream_t stream) { return impl_->mark_cold(h, stream); }
Status Engine::unpack(uint64_t h, cudaStream_t stream) { return impl_->unpack(h, stream); }
Status Engine::release(uint64_t h) { return impl_->release(h); }
Status Engine::prefetch(uint64_t h) { return impl_->prefetch(h); }
uint64_t Engine::reclaim(uint64_t bytes, ReclaimMode mode, cudaStream_t stream) {
  return impl_->reclaim(bytes, mode, stream);
}
EngineStats Engine::stats() const { return impl_->stats(); }
void Engine::trim_host() { impl_->trim_host(); }
std::string Engine::pressure_report() const { return impl_->pressure_report(); }
void Engine::reset_peaks() { impl_->reset_peaks(); }
std::string Engine::check_invariants() const { return impl_->check_invariants(); }
int Engine::handle_device(uint64_t handle) { return handle == 0 ? -1 : int(handle >> kDeviceShift); }

}  // namespace vramswap::residency
