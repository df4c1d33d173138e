// Engine::Impl: the eviction engine's state and what its .cpp files share. Private to
// src/residency; engine.h is the interface and holds the states and rules (Note [Block
// states]); the order of use is policy/use_order.h, the reactive policy policy/reactive.h,
// the plan policy/planner.h.
//
// The engine's mechanics, one concept per file:
//   engine.cpp          the tracker protocol: tagged allocations and frees, pack, mark_cold,
//                       unpack, release, prefetch
//   engine_copies.cpp   copies: an eviction's copy out, fetches (ahead of use, planned,
//                       on demand), shared granules, completing copies
//   engine_reclaim.cpp  giving memory back as the reactive policy (policy/reactive.h)
//                       decides: dropping clean blocks, waiting for evictions, the
//                       prefetches it asks for, the pressure report
//   engine_steps.cpp    recording steps and following their plan (policy/step_recorder.h)
//   engine_inspect.cpp  statistics, peaks, check_invariants
//
// Invariants:
//   * a slot is live iff its block is a live tagged block of the pool; by_addr_ maps the
//     block's address to it;
//   * residency kClean / kEvicted / kFetching <=> the block has a host copy (host !=
//     nullptr), except an evicted block on the disk (disk != kNoDisk), whose host buffer
//     exists only while it is read back ahead of use (`reading`); a block being written to
//     the disk ahead of need (`writing`) is evicted, with its host copy, not on the disk yet;
//     kEvicted <=> it has no pages; kEvicting <=> a D2H copy into `host` is in
//     flight; kClean: the copy landed and the pages are still mapped (both copies valid);
//   * a block is in order_ iff packs > 0 or it is kept, under `key`: the earliest of its
//     packs' keys and, kept, its next use (Note [Kept blocks] in engine.h);
//   * a frozen kept block in use may be clean (its host copy stays valid); every other clean
//     block is cold;
//   * in_flight_ lists exactly the slots in kEvicting or kFetching.
#pragma once

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/units.h"
#include "cuda/error.h"
#include "cuda/event.h"
#include "cuda/stream.h"
#include "cuda/vmm.h"
#include "policy/reactive.h"
#include "policy/step_recorder.h"
#include "policy/use_order.h"
#include "residency/disk_tier.h"
#include "residency/engine.h"
#include "stats/log.h"

namespace vramswap::residency {
namespace detail {

using ReclaimMode = pool::DevicePool::ReclaimMode;

using Residency = policy::BlockState;

// Note [Kept blocks stay addressable] (engine_copies.cpp): a kept block's host copy in host
// memory of the VMM API, mapped at an address of its own (where the copies go) and, while the
// block is evicted, at the block's own granules too, so that a stray access reaches its bytes.
struct HostBacking {
  cuda::PhysicalPages pages;   // host-located, exactly the block's granule span
  cuda::VaReservation va;      // the private address
  cuda::Mapping own;           // pages at va: the block's host copy (Slot::host points here)
  cuda::Mapping at_block;      // pages at the block's granules while its device pages are gone
  void* host() const { return reinterpret_cast<void*>(va.base()); }
};

struct Slot {
  bool live = false;
  uint32_t generation = 1;
  uintptr_t addr = 0;
  uint64_t placed = 0;     // as the pool placed it (DevicePool::placed_size)
  uint64_t requested = 0;  // what the program asked for: the bytes that are copied
  Residency residency = Residency::kResident;
  int packs = 0;
  policy::UseKey key;       // its place in order_
  policy::UseKey pack_key;  // packed: its earliest pack's key
  bool cold = false;
  bool unpacked = false;
  bool cancel = false;  // an eviction in flight whose result is no longer wanted
  cuda::Event cold_event;
  cudaStream_t cold_stream = nullptr;  // where cold_event was recorded
  cuda::Event copy_event;
  void* host = nullptr;
  void* check = nullptr;  // VRAMSWAP_VERIFY: the restored block read back, behind its fetch
  bool pages_kept = false;  // evicted, but a failed fetch could not give its pages back
  // A copy of this block queued on this copy stream (d2h_ or h2d_) whose event could not be
  // recorded: until a later copy on that stream records its own, that copy may still read or
  // write the pages and the host buffer, so both go back only behind the stream (Note [A
  // queued copy cannot be taken back] in engine_copies.cpp). Null: none.
  cudaStream_t unordered_copy = nullptr;
  uint64_t checksum = 0;
  uint32_t step_block = policy::kNoPoint;  // its ordinal in the step being recorded
  bool planned = false;                    // its eviction in flight is the plan's
  uint64_t copy_seq = 0;                   // the order in which its copy in flight was queued
  static constexpr uint64_t kNoDisk = UINT64_MAX;
  uint64_t disk = kNoDisk;                 // evicted and moved on to the disk tier: its extent
                                           // (its host buffer is gone); else kNoDisk
  bool on_disk() const { return disk != kNoDisk; }
  // On the disk, and being read back ahead of use into `host`, a pinned buffer of its own
  // (Note [Reading ahead from the disk] in engine_copies.cpp); null otherwise.
  DiskTier::JobRef reading;
  // Evicted with its host copy, which is being written to the disk ahead of need (Note
  // [Writing ahead to the disk]) into the extent at `write_offset`; null otherwise.
  DiskTier::JobRef writing;
  uint64_t write_offset = 0;
  // start_fetch is bringing it back: its host copy must not move on to the disk meanwhile
  // (making room for it may evict others, and their host buffers may push copies out).
  bool fetch_pending = false;
  // Note [Kept blocks] (engine.h): kept until unkeep or free; `next_use` is where its next use
  // is predicted; `frozen`: its host copy stays valid once made; `fresh_copy`: that copy was
  // made after its last use (a drop then was paid for by a copy); `use_stream`: where it was
  // last unpacked or used.
  bool kept = false;
  bool frozen = false;
  // Kept and packed more than once (forwards before their backward): the keys of its packs
  // after pack_key, the next needed first; each release after a use moves on to the next.
  std::vector<policy::UseKey> later_packs;
  bool fresh_copy = false;
  policy::UseKey next_use;
  cudaStream_t use_stream = nullptr;
  // Its host copy when it has host memory of the VMM API (Note [Kept blocks stay
  // addressable]); then `host`, when set, is backing->host(), which no host tier owns.
  std::unique_ptr<HostBacking> backing;
};

// A host buffer that must outlive a copy still in flight (its block was freed, or queuing
// the rest of its work failed). It goes back once `event` has completed (when there is one)
// and `stream` has no work left (when there is one; or after synchronizing it, when the
// caller waits for everything).
struct Deferred {
  void* host;  // of the host tier, or null
  cuda::Event event;
  cudaStream_t stream = nullptr;
  std::unique_ptr<HostBacking> backing;  // or a kept block's host memory (may be null)
};

constexpr int kDeviceShift = 56;
constexpr int kSlotShift = 32;
constexpr uint64_t kSlotMask = (uint64_t{1} << 24) - 1;

// FNV-1a over 64-bit words (and the tail bytes): cheap enough for a debug mode, and any
// changed byte changes it with overwhelming probability.
// `h`: the checksum of the bytes before `data`, so that a block checksummed in chunks whose
// sizes are multiples of 8 gets the same sum as whole.
inline constexpr uint64_t kChecksumStart = 0xcbf29ce484222325ull;
inline uint64_t checksum(const void* data, size_t n, uint64_t h = kChecksumStart) {
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

}  // namespace detail
using namespace detail;  // this header is the engine's own: its files use these unqualified

// The engine carries out the reactive policy's decisions (policy/reactive.h) as its
// ReactiveEngine: those overrides are the mechanics, the choices are the policy's.
class Engine::Impl : private policy::ReactiveEngine {
 public:
  Impl(pool::DevicePool& pool, const EngineOptions& options);
  // Waits for the copies in flight before the host memory they use goes.
  ~Impl();

  void* allocate_tagged(size_t size, cudaStream_t stream, std::string* error);
  bool is_tagged(const void* ptr) const {
    std::lock_guard lock(tagged_mu_);  // not mu_: a free must not wait behind a reclaim
    return tagged_.count(reinterpret_cast<uintptr_t>(ptr)) == 1;
  }
  std::string pressure_report();
  // The part of pressure_report() on mapped granules whose cold or away blocks cannot free
  // them (Note [Granules that cannot go] in engine_reclaim.cpp); empty when there are none.
  std::string granules_that_cannot_go();
  pool::Result free_tagged(void* ptr, cudaStream_t stream);
  uint64_t pack(const void* ptr, cudaStream_t stream);
  void graph_begin() {
    std::lock_guard lock(mu_);
    ++graph_;
    backward_since_graph_ = false;
    if (st_.num_tracked_blocks == 0) begin_step();
    note_point(policy::PointKind::kGraph, policy::kNoPoint, 0);
  }
  Status mark_cold(uint64_t handle, cudaStream_t stream);
  Status unpack(uint64_t handle, cudaStream_t stream);
  Status release(uint64_t handle);
  Status prefetch(uint64_t handle);
  uint64_t keep(const void* ptr, bool frozen);
  Status use(uint64_t handle, cudaStream_t stream, Engine::UseLane lane);
  Status unkeep(uint64_t handle);
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
        recorder_.waited(bytes, leaving, in_flight_bytes(Residency::kFetching));
        stats::log(stats::LogLevel::kDebug,
                   "device %d: following the plan, an allocation waits for %llu bytes (%llu under way)", device_,
                   static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(leaving));
      }
    }
    const uint64_t before = unmapped_total_;
    host_refusal_.clear();  // the report of an out-of-memory after this says this round's reason
    try {
      return reactive().reclaim(bytes, mode == ReclaimMode::kFull);
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
  // The slot a handle names (packed, or kept), or nullptr with *error set.
  Slot* resolve(uint64_t handle, const char* what, std::string* error);
  // The live tagged block holding `addr`, or UINT32_MAX.
  uint32_t slot_holding(uintptr_t addr) const;
  // Puts a packed or kept block in order_ at the earliest of its pack_key (when packed) and
  // its next_use (when kept); `was_in_order`: it is there now, under s.key.
  void reorder(uint32_t slot, bool was_in_order);
  // unpack's and use's common part: makes the block valid for work queued on `stream`
  // (fetched, or waited for), then in use; the window is prefetched after `cursor`.
  Status bring_in(uint32_t slot, cudaStream_t stream, const policy::UseKey& cursor, const char* what);
  // Records the block's cold event on `stream` and makes it cold (no longer in use). Throws
  // cuda::CudaError, the block unchanged.
  void record_cold(Slot& s, cudaStream_t stream);
  // A kept block's save was released after backward unpacked it: cold again from the work
  // queued so far on the stream it was unpacked on (a failure is logged: it stays in use).
  void cold_after_backward(Slot& s);
  // Its last pack was released or its keep ended: an ordinary block again, brought back
  // first (waiting) when it is on the host. On a refusal nothing changed.
  Status make_ordinary(uint32_t slot, const char* what);
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
  // It covers no granule whole, so giving it up alone frees no page: it goes with the blocks
  // on its granules or not at all. A block below half a granule (Note [Placing for eviction]
  // in device_pool.h), or one placed densely across granules (Note [A step without
  // pressure] there).
  bool shares_granules(const Slot& s) const {
    const uint64_t g = pool_.granularity();
    return s.placed < g / 2 || round_up(s.addr, g) + g > s.addr + s.placed;
  }
  // [*lo, *hi): the granules it touches.
  void granule_span(const Slot& s, uintptr_t* lo, uintptr_t* hi) const {
    const uint64_t g = pool_.granularity();
    *lo = s.addr / g * g;
    *hi = round_up(s.addr + s.placed, g);
  }
  // The soft limit in bytes: the limit when none is set.
  uint64_t soft_limit() const override {
    return options_.soft_limit_bytes > 0 ? options_.soft_limit_bytes : pool_.stats().limit_bytes;
  }
  // The reactive policy for this call (the use order and the plan as they are now).
  policy::Reactive reactive() { return policy::Reactive(order_, options_.horizon, recorder_.following(), *this); }
  // policy::ReactiveEngine: the policy's view of a block, and what it asks the engine to do.
  policy::BlockView view(uint32_t slot) const override {
    const Slot& s = slots_[slot];
    return {s.live, s.residency, s.cold && !stays_on_device(s), s.unpacked, s.cancel,
            recorder_.planned_out(s.step_block), shares_granules(s), s.placed};
  }
  uint64_t unmapped_total() const override { return unmapped_total_; }
  uint64_t leaving_bytes() const override { return in_flight_bytes(Residency::kEvicting); }
  uint64_t clean_bytes() const override { return st_.clean_bytes; }
  bool copies_in_flight() const override { return !in_flight_.empty(); }
  std::vector<std::pair<uint64_t, uint32_t>> queued_evictions() const override;
  bool await_eviction(uint32_t slot, uint64_t seq) override;
  void cancel_eviction(uint32_t slot) override { slots_[slot].cancel = true; }
  bool prefetch(uint32_t slot, bool ahead) override;
  bool fetches_in_flight() const override { return in_flight_bytes(Residency::kFetching) > 0; }
  uint64_t mapped_bytes() const override { return pool_.stats().mapped_bytes; }
  // Starts the D2H copy of a cold resident block. False when the host tier is full.
  bool start_eviction(uint32_t slot) override;
  void evict_after_fetch(uint32_t slot);
  // The plan's victim `slot` starts its copy out: a resident block's (start_eviction), or a
  // kept one's whose fetch is in flight (evict_after_fetch). A failure is logged (`when`
  // says when the copy was to start) and the block stays on the device.
  void start_planned_copy(uint32_t slot, const char* when);
  // Pinned memory for `bytes`; when the host tier is full and there is a disk tier, evicted
  // blocks needed furthest away (never `except`) move on to the disk until it fits (Note
  // [The disk tier] in disk_tier.h). `needed` (for a block needed now): copies in flight are
  // waited for first, and clean blocks give up their host copies last. nullptr with *error
  // set when it cannot.
  void* host_allocate(uint64_t bytes, uint32_t except, std::string* error, bool needed = false);
  // Moves an evicted block's host copy to the disk tier (written, then the host buffer
  // freed). False with *error set when the disk cannot take it (nothing changed).
  bool spill(uint32_t slot, std::string* error);
  // Brings a block on the disk tier back into pinned memory (an evicted block again),
  // waiting: for its read ahead when one is under way, else for a read started now. When no
  // pinned memory can be found for it, *no_room is set and the block stays on the disk (the
  // caller brings it back through the bounce buffer: fetch_through_bounce).
  Status unspill(uint32_t slot, bool* no_room);
  // Note [Blocks larger than the pinned tier]: a pinned buffer for moving `bytes` between
  // the device and the disk in chunks, as large as can be had up to kBounceBytes, making
  // room as host_allocate does for a block needed now; its size in *chunk. nullptr with
  // *error set when even kMinBounceBytes cannot be had.
  void* bounce_allocate(uint64_t bytes, uint32_t except, uint64_t* chunk, std::string* error);
  // Evicts a cold resident block straight to the disk through a bounce buffer, waiting, and
  // gives up its pages: the block is evicted and on the disk. False when the disk or pinned
  // memory refuses: host_refusal_ then says why, after `not_pinned` (why the pinned tier could
  // not take it), and the block is resident as before. Throws cuda::CudaError as
  // start_eviction does.
  bool evict_through_bounce(uint32_t slot, const std::string& not_pinned);
  // Reads a block on the disk, its pages mapped, straight into them through `bounce` (of
  // `chunk` bytes, which it frees), waiting: the block is resident. On failure it stays on the
  // disk with its pages mapped (Slot::pages_kept), and the status says why.
  Status fetch_through_bounce(uint32_t slot, void* bounce, uint64_t chunk);
  // VRAMSWAP_VERIFY: `got`, the checksum of block s as restored, against the one taken when it
  // left; a difference is counted and logged.
  void check_restored(const Slot& s, uint64_t got);
  // Starts reading a block on the disk tier back into `host`, a pinned buffer of its size,
  // without waiting (Note [Reading ahead from the disk]); the block owns the buffer from
  // then on.
  void start_read(uint32_t slot, void* host);
  // A read ahead finished (waiting for it with `wait`): the block is an evicted block with
  // its host copy, or, when the read failed, on the disk as before.
  void finish_read(uint32_t slot, bool wait);
  // Note [Writing ahead to the disk]: starts writing the evicted blocks needed furthest away
  // while the pinned tier has less than a quarter of its limit free (and less than the cold
  // blocks on the device would need), counting what the writes under way will free.
  // Background work: never waits.
  void write_ahead();
  // A write ahead finished (waiting for it with `wait`): the block is on the disk and its
  // host buffer freed; a failed write leaves it as it was. `keep_host`: the block is needed
  // now (a fetch, a free): its host copy stays and the extent is given back.
  void finish_write(uint32_t slot, bool wait, bool keep_host = false);
  // Gives a block's disk extent back (it was freed while on disk).
  void forget_disk_copy(Slot& s);
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
  uint64_t evict_granule(uint32_t slot, const policy::Window& window) override;
  // After a fetch of a small block (below half a granule: it shares its granule) started:
  // starts the fetches of the evicted blocks that lie wholly on the granules it needed, now
  // mapped for it (Note [A shared granule comes back whole]).
  void fetch_granule_mates(uint32_t slot);
  // Completes copies whose events completed (all of them, waiting, with `wait`).
  void complete_copies(bool wait) override;
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
      stats::log(stats::LogLevel::kDebug, "device %d: block %s (%s): %s", device_, format_hex(s.addr).c_str(),
                 format_size(s.requested).c_str(), what);
  }
  // Gives the block's host buffer back: at once, or behind the stream of a copy that may
  // still use it (Slot::unordered_copy).
  // A kept block's host memory of the VMM API stays with it (Note [Kept blocks stay
  // addressable]): only the pointer goes, and the memory too once the block is kept no more.
  void give_back_host(Slot& s) {
    if (s.backing && s.host == s.backing->host()) {
      s.host = nullptr;
      if (!s.kept) release_backing(s, s.unordered_copy);  // unkept while it was away
      return;
    }
    if (s.unordered_copy) deferred_.push_back({s.host, cuda::Event(), s.unordered_copy, nullptr});
    else host_.free(s.host);
    s.host = nullptr;
  }
  // Note [Kept blocks stay addressable] (engine_copies.cpp).
  // It owns its granules: it starts on a granule boundary and its placement covers whole
  // granules, so that no other block can ever be placed on them while it lives.
  bool owns_granules(const Slot& s) const {
    const uint64_t g = pool_.granularity();
    return s.addr % g == 0 && s.placed % g == 0 && s.placed > 0;
  }
  // Where the driver has host VMM, a kept block that does not own its granules is never a
  // victim: given up, it would be an address that faults.
  bool stays_on_device(const Slot& s) const { return s.kept && host_vmm_ && !owns_granules(s); }
  // The block's host copy for an eviction: its host memory of the VMM API, made now when it
  // has none (a kept block that owns its granules, where the driver has host VMM); nullptr
  // when it has none and cannot have it (the host tier is used), with *why set when making it
  // failed.
  void* backing_host(uint32_t slot, std::string* why);
  // Maps the block's host memory at its granules (its device pages are gone). A refusal is
  // logged: the block is then evicted as any block, unaddressable until fetched.
  void address_on_host(Slot& s);
  // Unmaps it from the block's granules before device pages come back there; false with
  // *error set (it stays mapped) when CUDA refuses.
  bool unaddress_on_host(Slot& s, std::string* error);
  // The block no longer needs host memory of its own (freed, unkept, or fetched after an
  // unkeep): it goes, behind `stream` when a copy that may use it was queued there.
  void release_backing(Slot& s, cudaStream_t stream = nullptr);
  // Gives host VMM memory back: its mappings, then its pages. When CUDA refuses a step, what
  // is left goes to unreleased_, tried again as copies complete (a refusal never leaks it).
  void free_backing(std::unique_ptr<HostBacking> b);
  // VRAMSWAP_VERIFY: the checksum of the block's host copy.
  uint64_t host_checksum(const Slot& s);
  // A copy of block s between its pages and `host` (a buffer of the pinned tier) failed
  // after it was queued on `stream` (null: nothing was queued): the buffer goes back behind
  // that stream, and the block remembers it (Note [A queued copy cannot be taken back]).
  void give_back_after_failed_copy(Slot& s, void* host, cudaStream_t stream) {
    if (!stream) {
      host_.free(host);
      return;
    }
    deferred_.push_back({host, cuda::Event(), stream, nullptr});
    s.unordered_copy = stream;
  }
  // A copy queued on `stream` for the block recorded its event: every copy queued there for it
  // before is ordered before that event too.
  void copy_ordered(Slot& s, cudaStream_t stream) {
    if (s.unordered_copy == stream) s.unordered_copy = nullptr;
  }
  // A clean block becomes plainly resident: its host copy is not needed any more.
  void forget_host_copy(Slot& s) {
    give_back_host(s);
    s.residency = Residency::kResident;
    st_.clean_bytes -= s.placed;
  }
  // Gives up a clean block's pages (it becomes evicted); returns the bytes unmapped, which
  // leave out granules it shares with blocks still in use. Throws cuda::CudaError when
  // nothing could be unmapped.
  uint64_t drop(uint32_t slot) override;

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
  // Numbers the kept blocks cold as a step begins (Note [Kept blocks in the plan], engine.h).
  void number_kept_blocks();
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
  std::vector<uint32_t> reading_;  // slots with a read ahead from the disk under way
  std::vector<uint32_t> writing_;  // slots with a write ahead to the disk under way
  uint64_t writing_bytes_ = 0;     // their host bytes
  std::vector<Deferred> deferred_;
  // Why the last eviction could not get pinned memory (the out-of-memory report says it).
  std::string host_refusal_;
  // The disk tier (EngineOptions::disk_dir), or null: none asked for, or disk_refusal_ says
  // why it could not be opened.
  std::unique_ptr<DiskTier> disk_;
  std::string disk_refusal_;
  // The driver can create host memory of the VMM API (cuda::host_vmm_supported): kept blocks
  // stay addressable when evicted (Note [Kept blocks stay addressable]).
  bool host_vmm_ = false;
  uint64_t backed_bytes_ = 0;  // host memory of the VMM API not given back yet
  std::vector<std::unique_ptr<HostBacking>> unreleased_;  // whose release CUDA refused
  policy::UseOrder order_;
  uint64_t graph_ = 1, seq_ = 0;
  // A backward ran since the last graph_begin (or none began yet): a kForward use belongs to
  // the forward about to begin. The last use's key: the next use in its graph and lane
  // takes the next position.
  bool backward_since_graph_ = true;
  policy::UseKey last_use_{0, 0, policy::kForwardLane};
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
  // Note [Blocks larger than the pinned tier]: the bounce buffer's largest and smallest size.
  static constexpr uint64_t kBounceBytes = uint64_t{8} << 20;
  static constexpr uint64_t kMinBounceBytes = uint64_t{64} << 10;
  // Following a plan, every copy back is timed, and the stream that used its block is timed
  // just before waiting for it: which fetches landed late, and whether the copy stream idled
  // before they started (Note [Late fetches] in policy/step_recorder.h).
  struct TimedFetch {
    uint32_t block;  // its ordinal in the step (kNoPoint: none)
    cuda::Event start, end, used;  // `used`: none until the block is used while in flight
  };
  std::vector<TimedFetch> timed_fetches_;
  std::unordered_map<uint32_t, uint32_t> timed_fetch_of_;  // block ordinal -> its latest
  static constexpr size_t kTimedFetches = 4096;  // per step
  static constexpr uint64_t kLateFetchNs = 1000;  // less is noise: no move
  void time_fetch_start(cuda::Event* start);
  void time_fetch_end(const Slot& s, cuda::Event start);
  void time_use_of_fetch(const Slot& s, cudaStream_t stream);
  std::vector<policy::LateFetch> late_fetches(const cuda::Event& first);
  void release_step_timing();
  // Timed points per step: past them, points take the time of the last timed one (a step of
  // a quarter million engine calls would otherwise hold as many CUDA events).
  static constexpr size_t kTimedPoints = size_t(1) << 15;
  double bytes_per_ns_ = 0;  // the D2H rate measured last; 0: none measured yet
  uint64_t unmapped_total_ = 0;  // device bytes freed by completed evictions, ever (reclaim's measure)
  uint64_t copy_seq_ = 0;        // evictions queued, ever (Slot::copy_seq)

  EngineStats st_;
};

}  // namespace vramswap::residency
