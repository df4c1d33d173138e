// DevicePool::Impl: the pool's state and what its .cpp files share. Private to src/pool;
// device_pool.h is the interface and holds the policy (Note [The pool]).
//
// The pool's mechanics, one concept per file:
//   device_pool.cpp    the entry points: allocating (quick lists, the slow path), freeing
//                      (events for the other streams that used a block), record_stream
//   thread_caches.cpp  the hot path's per-thread caches (Note [Thread caches])
//   placement.cpp      where a block goes: best fit per stream tag, placing for eviction,
//                      and a freed block merged back into the free index (the coalescing
//                      free list, free_list.h, which the host tier keeps too)
//   granules.cpp       physical pages: runs of granules mapped and unmapped, spare pages,
//                      an offloadable block's pages given up and taken back, peers
//   stream_order.cpp   reuse over time: pending frees, promotions, retiring blocks cached
//                      for a stream by synchronizing it (or the device), destroyed streams
//   pressure.cpp       memory short: the relief steps in order, empty_cache, the report
//   inspect.cpp        statistics, the census, the memory view, check_invariants
//
// Invariants (checked by the tests through the public API):
//   * blocks_ tiles the reservation exactly: every byte belongs to one block, in address
//     order, each 512-byte aligned and a multiple of 512 bytes;
//   * a block is in exactly one state: live (handed out), pending (freed, waiting for
//     events), or free (in free_[tag]); only free blocks are ever merged or split;
//   * two adjacent free blocks never share a tag (they would have been merged);
//   * every granule under a live or pending block is mapped unless the block is away
//     (offloadable, given up by unmap_block); a granule is unmapped only when every block
//     touching it is free with tag kAnyStream or live and away;
//   * a mapped granule belongs to exactly one run (consecutive granules mapped from one
//     handle of physical pages, Note [Runs]), and is unmapped with the whole run;
//   * reserved_ is mapped_ plus the spare pages' bytes (spare_bytes_);
//   * live_on_[kind][g] counts the live blocks of each kind (ordinary, offloadable)
//     touching granule g.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "config/units.h"
#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/event.h"
#include "cuda/stream.h"
#include "cuda/vmm.h"
#include "pool/device_pool.h"
#include "pool/free_list.h"
#include "pool/lent_table.h"
#include "pool/thread_cache.h"

namespace vramswap::pool {
namespace detail {


// Blocks are aligned to and sized in this unit: CUDA's own allocation alignment, and
// what kernels using vector loads expect.
constexpr uint64_t kAlignment = 512;

// The tag of a free block that any stream may reuse (any_stream() in the header).
inline const cudaStream_t kAnyStream = any_stream();

// kQuick: freed on its tag's stream with nothing else to wait for, and kept whole, unmerged,
// in quick_ for the next allocation of the same rounded size on that stream: the common
// case of a training step (the same shapes every iteration) served in O(1).
// kRetiring: a free block withheld (out of the free index, never merged) while
// synchronize_and_retire() waits with the lock released; free for any stream after it. It
// needs no pages: it may lie over granules an eviction unmapped.
enum class State { kFree, kLive, kPending, kQuick, kRetiring };

// At most this many blocks per (stream, size) stay in a quick list; more are merged into
// the free index, so that the lists cannot hold a large share of the pool unmerged.
constexpr size_t kQuickPerSize = 32;

// find_fit's searches for a place on occupied, then on mapped, granules look at this many
// free blocks each at most (the slow path stays bounded when none qualifies).
constexpr size_t kMappedFitLooks = 64;
// Note [A step's addresses]: the most large allocations of a step whose places are kept for
// the next one.
constexpr size_t kStepAddresses = size_t(1) << 16;

struct Block {
  uint64_t size = 0;
  State state = State::kFree;
  cudaStream_t tag = kAnyStream;       // free: who may reuse it; live: the allocation stream
  std::vector<cudaStream_t> also_on;   // live: streams added by record_stream
  bool offloadable = false;            // live: allocate_offloadable's (an engine's tagged block)
  bool away = false;                   // live or pending offloadable block whose contents are
                                       // elsewhere (unmap_block): its granules may be unmapped
  uint64_t serial = 0;                 // free, tagged with a stream: the latest release in it
                                       // (deallocate_to_any's promotion checks it)
  uint64_t requested = 0;              // live or pending, allocated while the history records:
                                       // the size asked for (0: not recorded)
  ThreadCache* owner = nullptr;        // live: the thread cache it is lent to (Note [Thread
                                       // caches]); null: the pool's
};

// Each thread's caches, one per pool it used (keyed by the pool's id, never reused). When
// the thread exits, its caches are marked orphaned: the pool empties them at its next slow
// allocation. The thread-local pointers are trivially destructible, so that a free during
// the thread's (or the process's) teardown, after the reaper ran, finds no cache and takes
// the pool's path instead of touching a destroyed object.
struct ThreadCaches {
  std::vector<std::pair<uint64_t, std::shared_ptr<ThreadCache>>> entries;
  ThreadCache* find(uint64_t id) const {
    for (const auto& [key, cache] : entries)
      if (key == id) return cache.get();
    return nullptr;
  }
};
extern thread_local ThreadCaches* tls_caches;  // (thread_caches.cpp)
extern thread_local bool tls_caches_gone;      // the thread is exiting: no cache any more
extern std::atomic<uint64_t> next_pool_id;     // the next pool's id

struct QuickKey {
  cudaStream_t stream;
  uint64_t size;
  bool offloadable;  // freed by a block of that kind, taken back by one of the same kind, while
                     // the pool places for eviction (Impl::quick_kind)
  bool operator==(const QuickKey&) const = default;
};
struct QuickKeyHash {
  size_t operator()(const QuickKey& k) const {
    return (std::hash<uintptr_t>()(reinterpret_cast<uintptr_t>(k.stream)) * 31 + std::hash<uint64_t>()(k.size)) * 2 +
           k.offloadable;
  }
};

constexpr uint64_t kUnmapped = UINT64_MAX;

// Each mapped granule belongs to a run: consecutive granules mapped, at once, from one handle
// of physical pages (Note [Runs]). The run's head (its first granule) holds the pages and
// the mapping.
struct Granule {
  uint64_t head = kUnmapped;  // the first granule of its run; kUnmapped: not mapped
  uint64_t count = 0;         // at the head: the run's length in granules
  cuda::PhysicalPages pages;  // at the head: the run's pages
  cuda::Mapping mapping;      // at the head; declared after pages: unmapped before they are released
};

// Freed blocks waiting for events: they become free with `tag_after` once every event has
// completed. Pending blocks are never merged, so their addresses stay valid keys.
struct Pending {
  std::vector<uintptr_t> addrs;
  std::vector<cuda::Event> events;
  cudaStream_t tag_after;
  uint64_t serial = 0;  // the order of the frees (Impl::next_serial_)
};



}  // namespace detail
using namespace detail;  // this header is the pool's own: its files use these unqualified

class DevicePool::Impl {
 public:
  explicit Impl(const PoolOptions& options);
  ~Impl() {
    for (auto& cache : caches_) cache->dead.store(true, std::memory_order_release);
  }

  void* allocate(size_t size, cudaStream_t stream, std::string* error);
  Result deallocate(void* ptr, cudaStream_t stream);
  Result record_stream(void* ptr, cudaStream_t stream);
  Result stream_destroyed(cudaStream_t stream);
  Result grant_peer(int peer);
  void* allocate_offloadable(size_t size, cudaStream_t stream, std::string* error, uint64_t* placed);
  Result unmap_block(void* ptr, bool* partly, uint64_t* freed);
  Result map_block(void* ptr, MapWait wait, cudaStream_t stream);
  Result deallocate_to_any(void* ptr, cudaStream_t stream);
  void set_reclaimer(Reclaimer r) {
    std::unique_lock lock(mu_);
    // A call in progress runs a copy of the old reclaimer with no lock held: wait for it, so
    // that its owner (the engine) may be destroyed once this returns.
    reclaimer_idle_.wait(lock, [&] { return reclaimer_calls_ == 0; });
    reclaimer_ = std::move(r);
  }
  uint64_t granularity() const { return granularity_; }
  uint64_t placed_size(uint64_t size) const {
    const uint64_t rounded = round_up(size, kAlignment);
    return rounded < granularity_ / 2 ? rounded : round_up(size, granularity_);
  }
  void empty_cache();
  PoolStats stats() const;
  void begin_step() {
    std::lock_guard lock(mu_);
    if (steps_begun_ < 2) ++steps_begun_;  // Note [A step without pressure]
    stepping_ = true;
    step_before_ = std::move(step_now_);
    step_now_.clear();
  }
  uint64_t take_allocated_high() {
    std::lock_guard lock(mu_);
    const uint64_t now = allocated_ - cached_in_threads();
    const uint64_t high = std::max(allocated_high_, now);
    allocated_high_ = now;
    return high;
  }
  std::string check_invariants() const;
  void record_history(size_t max_entries) {
    std::lock_guard lock(mu_);
    history_.reset(max_entries);
    if (max_entries > 0) caches_off();  // the fast path records nothing
  }
  MemoryView memory_view() const;
  Census live_below(uint64_t bytes) const;
  bool shares_granule_with_ordinary(const void* ptr) const {
    std::lock_guard lock(mu_);
    auto b = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
    if (b == blocks_.end() || b->second.state != State::kLive) return false;
    for (uint64_t g = granule_index(b->first), last = granule_index(b->first + b->second.size - 1); g <= last; ++g)
      if (live_on_[0][g] != 0) return true;
    return false;
  }
  void reset_peaks();
  bool owns(const void* ptr) const { return va_.contains(reinterpret_cast<uintptr_t>(ptr)); }
  int device() const { return device_; }

  void count_out_of_memory() {
    std::lock_guard lock(mu_);
    ++num_ooms_;
  }

 private:
  using BlockIt = std::map<uintptr_t, Block>::iterator;

  // Free-block index.
  void index_insert(BlockIt b) { free_[b->second.tag].emplace(b->second.size, b->first); }
  void index_erase(BlockIt b) {
    auto it = free_.find(b->second.tag);
    it->second.erase({b->second.size, b->first});
    if (it->second.empty()) free_.erase(it);
  }
  // Makes `b` free with `tag`, merged with free neighbours of the same tag; `serial`: the
  // release's serial when a promotion names it (0: a fresh one).
  void release_block(BlockIt b, cudaStream_t tag, uint64_t serial = 0);
  // The best-fitting free block for `size` usable on `stream` by a block of kind
  // `offloadable`, or end(); *start: where in it the block goes. The block must hold `size`
  // bytes that touch no granule closed_to() it (unless not `strict`; it may start at the
  // next granule when its first one is closed), with `aligned` start on a granule boundary,
  // and, small and offloadable while grouping(), lie within one granule. While grouping(), a
  // place that needs no granule without live blocks is preferred, then one that needs no
  // new mapping (Note [Placing for eviction]).
  BlockIt find_fit(uint64_t size, cudaStream_t stream, bool offloadable, bool aligned, uintptr_t* start,
                   bool strict = true);
  // The part [*lo, *hi) of the free block at `addr` of `size` bytes that a block of kind
  // `offloadable` on `stream` may use under find_fit's rules (`strict` as there); false when
  // none.
  bool usable_part(uintptr_t addr, uint64_t size, cudaStream_t stream, bool offloadable, bool strict, uintptr_t* lo,
                   uintptr_t* hi) const;
  // The place under find_fit's rules for a block of `size` whose granules need the fewest new
  // mappings (*missing: how many), the smallest free block winning a tie, or end(); like
  // find_fit's searches on mapped granules, it looks at kMappedFitLooks free blocks per tag
  // at most (Note [Placing on mapped pages]).
  BlockIt find_mapped_fit(uint64_t size, cudaStream_t stream, bool offloadable, bool aligned, uintptr_t* start,
                          bool strict, uint64_t* missing);
  // Note [A step's addresses]: the place the step before gave the same allocation, when it
  // is free for this block under find_fit's rules (`strict` as there), or end().
  BlockIt find_step_place(uint64_t key, uint64_t size, cudaStream_t stream, bool offloadable, bool aligned,
                          uintptr_t* start, bool strict);
  // Note [A step's addresses]: `p` was allocated for `size` bytes (a large block while a step
  // runs: the next step's allocation in its order tries the same place).
  void note_step_address(void* p, size_t size) {
    if (!p || !stepping_ || size < granularity_ / 2 || step_now_.size() >= kStepAddresses) return;
    step_now_.emplace_back(round_up(size, kAlignment), reinterpret_cast<uintptr_t>(p));
  }
  bool mapped(uint64_t g) const { return granules_[g].head != kUnmapped; }
  // The granules [*lo, *end) that [addr, addr+size) covers whole (none: *lo >= *end).
  void whole_granules(uintptr_t addr, uint64_t size, uint64_t* lo, uint64_t* end) const {
    *lo = granule_index(round_up(addr, granularity_));
    *end = granule_index(addr + size - (addr + size - va_.base()) % granularity_);
  }
  // How many granules under [addr, addr+size) are unmapped.
  uint64_t unmapped_in(uintptr_t addr, uint64_t size) const {
    uint64_t n = 0;
    for (uint64_t g = granule_index(addr), last = granule_index(addr + size - 1); g <= last; ++g)
      n += mapped(g) ? 0 : 1;
    return n;
  }
  // True when mapping `granules` more would take the pages of idle cached granules (no
  // spare pages, the limit reached): each run then costs an unmap as well as a map.
  bool pages_scarce(uint64_t granules) const {
    return spare_bytes_ + (limit_ > reserved_ ? limit_ - reserved_ : 0) < granules * granularity_;
  }
  // Note [A step without pressure] in device_pool.h: a whole step ran with no block given up
  // and no mapping refused, and none has been since.
  bool relaxed() const { return steps_begun_ >= 2 && !remapping_ && !pressed_; }
  // Whether blocks are placed for eviction (Note [Placing for eviction] in device_pool.h):
  // once the pool has been refused memory; else, unless relaxed(), under a limit below the
  // card or past half its limit.
  bool grouping() const {
    return pressed_ || (!relaxed() && (limit_ < card_bytes_ || 2 * reserved_ >= limit_));
  }
  // True when a new block of kind `offloadable` on `stream` must not touch granule `g`
  // (always false unless grouping()).
  bool closed_to(uint64_t g, bool offloadable, cudaStream_t stream) const {
    if (!grouping()) return false;
    if (!offloadable) return live_on_[1][g] != 0;
    auto open = open_.find(stream);
    return !(open != open_.end() && open->second == g) && (live_on_[0][g] != 0 || live_on_[1][g] != 0);
  }
  // Counts the block of `size` at `addr` on its granules in live_on_[row]: +1 or -1.
  void count_on_granules(uintptr_t addr, uint64_t size, int row, int delta);
  // The kind a quick list keeps a block of kind `offloadable` under: its own while the pool
  // places for eviction (Note [Placing for eviction]: a block is taken back only by one of
  // its kind), else one for both, so that with no pressure an allocation takes the block
  // freed last of its size and stream whatever either's kind, as with nothing tagged
  // (tagging costs no memory).
  bool quick_kind(bool offloadable) const { return offloadable && grouping(); }
  // The quick path of allocate(): a block quick-listed for (stream, rounded), or nullptr.
  void* take_quick(uint64_t rounded, cudaStream_t stream, bool offloadable);
  // Puts the freed block on its quick list for `stream` (the last freed is taken first);
  // false, nothing changed, when that list is full.
  bool push_quick(BlockIt b, cudaStream_t stream);
  // True when `block` needs no pages under it: free for any stream, or live and away (a
  // pending block, or one free for a stream, may still be touched by queued work).
  static bool needs_no_pages(const Block& block);
  // True when no block touching granule `g` needs its pages (needs_no_pages).
  bool granule_idle(uint64_t g) const { return range_idle(g, 1); }
  // The same for granules [g, g + count).
  bool range_idle(uint64_t g, uint64_t count) const;
  // The runs of more than one granule that a block at [addr, addr+size) would cut: those
  // holding its first or last granule that reach past the granules it covers whole.
  template <class F>
  void for_each_cut_run(uintptr_t addr, uint64_t size, F&& f) const {
    const uint64_t first = granule_index(addr), last = granule_index(addr + size - 1);
    uint64_t whole_lo = 0, whole_end = 0;
    whole_granules(addr, size, &whole_lo, &whole_end);
    uint64_t seen = kUnmapped;
    for (uint64_t g : {first, last}) {
      if (!mapped(g)) continue;
      const uint64_t head = granules_[g].head, n = granules_[head].count;
      if (n < 2 || head == seen) continue;
      seen = head;
      if (head < whole_lo || head + n > whole_end) f(head, n);
    }
  }
  // True when a block at [addr, addr+size) would cut a run some block still needs: it
  // could then never be unmapped while either lives (Note [Runs]).
  bool cuts_busy_run(uintptr_t addr, uint64_t size) const {
    bool busy = false;
    for_each_cut_run(addr, size, [&](uint64_t head, uint64_t n) { busy = busy || !range_idle(head, n); });
    return busy;
  }
  // Unmaps the runs a block at [addr, addr+size) would cut (all idle: cuts_busy_run), so
  // that the runs mapped for it are its own. False when CUDA refused.
  bool unmap_cut_runs(uintptr_t addr, uint64_t size);
  // The common slow path of allocate() and allocate_offloadable().
  // With `aligned`, the block starts on a granule boundary.
  void* allocate_slow(size_t size, uint64_t rounded, cudaStream_t stream, bool offloadable, bool aligned,
                      std::unique_lock<std::mutex>& lock, std::string* error);
  // Maps every unmapped granule under [addr, addr+size). False (with *why, and *lacking:
  // the bytes missing, all the new ones when the device is full), and nothing newly
  // mapped, when the limit would be passed or the device is full.
  bool map_range(uintptr_t addr, uint64_t size, std::string* why, uint64_t* lacking);
  // Unmaps whole runs whose granules no live, pending or stream-tagged free block touches
  // (range_idle), none of them in [keep_first, keep_last] (none by default), the highest
  // first, until at least `count` granules went; their pages become spare (still owned).
  // Returns how many granules (Note [Taking only the pages needed]).
  uint64_t unmap_unused(uint64_t count, uint64_t keep_first = UINT64_MAX, uint64_t keep_last = 0);
  // Unmaps the run whose head is `head`, its pages becoming spare. Throws cuda::CudaError,
  // with the run still mapped and counted. The caller holds a context scope of the device.
  void unmap_run(uint64_t head);
  // Releases every spare page back to the driver.
  void release_spare();
  // Releases spare pages, those not marked in `keep` (same length as spare_; empty: none
  // kept), until at least `bytes` went or none is left to release. Returns the bytes.
  uint64_t release_spare_for(uint64_t bytes, const std::vector<bool>& keep);
  // Adds pages to the spare list / takes spare_[i] out of it, spare_bytes_ kept in step.
  void push_spare(cuda::PhysicalPages pages) {
    spare_bytes_ += pages.size();
    spare_.push_back(std::move(pages));
  }
  cuda::PhysicalPages take_spare(size_t i) {
    cuda::PhysicalPages pages = std::move(spare_[i]);
    spare_.erase(spare_.begin() + std::ptrdiff_t(i));
    spare_bytes_ -= pages.size();
    return pages;
  }
  // Pages map_range() took and could not use: created ones are released (kept as spare
  // when CUDA refuses), recycled ones go back to the spare list.
  void give_back(cuda::PhysicalPages pages, bool was_spare);
  // Checks pending events: blocks whose events all completed become free, and (with
  // `promote`) promoted blocks (deallocate_to_any) whose event completed become free for
  // any stream.
  void poll_pending(bool promote = true);
  // The allocations' check: pending frees, and promotions only while grouping(). With no
  // pressure a promotion would only let other streams reuse the block; whether its event
  // has completed when the next allocation looks depends on how far the GPU (or cudasim's
  // stream threads) got, and a promoted block merges with its free neighbours, so best fit
  // would place later blocks differently from run to run (the CNN of test_vramswap_run,
  // with no limit: a peak of 158 or 162 MiB; 150 on every run with this).
  void poll_before_allocating() {
    const bool promote = !promotions_.empty() && grouping();
    if (!pending_.empty() || promote) poll_pending(promote);
    // Unpolled, they would pile up (an event each): drop, with no query, those whose block
    // was reused or merged into a later release since, at doubling sizes (amortized O(1)).
    if (!promote && promotions_.size() >= promotions_checked_ * 2 + 64) {
      drop_stale_promotions();
      promotions_checked_ = promotions_.size();
    }
  }
  // The promotion's block, still free as that release left it, or end().
  struct Promotion;
  BlockIt promoted_block(const Promotion& p);
  // Releases the promotions whose block is no longer free as their release left it.
  void drop_stale_promotions();
  // poll_pending() when a freed block waits for an event (the slow paths' cheap check).
  void poll_if_waiting() {
    if (waiting()) poll_pending();
  }
  // A freed block waits for an event.
  bool waiting() const { return !pending_.empty() || !promotions_.empty(); }
  // Waits (lock released) for the streams whose cached blocks are retired, then makes those
  // blocks, free under a stream tag when it started, reusable by any stream. With `only` a
  // stream (one known to be alive), synchronizes just that stream and retires just its
  // blocks. Otherwise every tag's: each tagged stream is synchronized when the program
  // reports the streams it destroys (streams_reported_: every stream named is alive), else
  // the device, where device_synchronization_allowed(caller) (`caller`: the stream asking,
  // if any; a device synchronization invalidates captures). Events are not recorded on the freeing
  // streams now: they may have been destroyed since the free. A capturing stream is never
  // synchronized: its blocks keep their tag. False when nothing was retired.
  bool synchronize_and_retire(std::unique_lock<std::mutex>& lock, cudaStream_t only,
                              cudaStream_t caller = kAnyStream);
  // Note [Blocks another synchronization holds]: when other threads' synchronize_and_retire
  // calls hold free blocks (and `round`, the caller's count of waits so far, is below the
  // bound), waits until one of them ends and returns true: the caller tries again.
  bool await_held_blocks(std::unique_lock<std::mutex>& lock, int round);
  // stream_destroyed()'s last step, `stream` synchronized and no other call naming it: every
  // block, free list, cache, pending free and promotion that names it names it no more (Note
  // [A destroyed stream is forgotten] in stream_order.cpp).
  void forget_stream(cudaStream_t stream);
  // The device may be synchronized on behalf of `caller`: no capture is reported underway
  // (PoolOptions::captures) and `caller` is not capturing (any stream capturing on the device
  // would be invalidated, in every capture mode).
  bool device_synchronization_allowed(cudaStream_t caller) const;
  // Merges every quick-listed and thread-cached block into the free index (slow paths need
  // the whole picture).
  void flush_quick();
  // The live block starting at `ptr`, or end() with *refusal saying why not (foreign,
  // double free, interior pointer).
  BlockIt find_live(void* ptr, Result* refusal);
  // The streams besides `except` that used a live block (allocation and record_stream's).
  static std::vector<cudaStream_t> users_besides(const Block& block, cudaStream_t except);
  // Records an event on each stream, all or none: false (with *why, and no event kept) when
  // one cannot be recorded.
  bool record_events(const std::vector<cudaStream_t>& streams, std::vector<cuda::Event>* events, std::string* why);
  // Counts a live block as freed.
  void count_free(BlockIt b);
  // Makes a freed block pending behind `events`; it becomes free with `tag_after` once they
  // have completed.
  void hold_back(BlockIt b, std::vector<cuda::Event> events, cudaStream_t tag_after);
  // deallocate() and deallocate_to_any(): the block goes back for `stream` (with `to_any`,
  // for every stream once an event recorded now completes). Nothing changes on a refusal.
  Result free_behind(void* ptr, cudaStream_t stream, bool to_any);
  // The free's fallback when an event cannot be recorded: synchronizes the device (lock
  // released), then frees the block for any stream. False with *result unchanged when the
  // synchronization failed or was not made (the freeing `stream` captures: see
  // device_synchronization_allowed; the block stays live), or set when the block is no
  // longer live.
  bool free_after_device_synchronization(void* ptr, cudaStream_t stream, std::unique_lock<std::mutex>& lock,
                                         Result* result);
  // Waits (lock released) for the events of the oldest free still pending (a pending block
  // or a promotion), then frees what has become reusable. One at a time: waiting for every
  // pending free at once, a fetch into memory one of them would have freed waited for the
  // last (a block freed while its copy to the host was in flight: 10 ms at gpt-small-v10k's
  // junction). The callers repeat it while it helps.
  void drain_pending(std::unique_lock<std::mutex>& lock);
  // The escalation under pressure, each measure costlier than the one before: unmap
  // unused cached granules (spare pages); the reclaimer's measures that need no wait
  // (pages of blocks whose copies to the host have landed); wait for pending frees'
  // events; synchronize the allocating stream so the blocks it freed become usable by
  // any stream (their granules can then be unmapped); synchronize the device so other
  // streams' cached blocks become usable; the reclaimer starting more copies and
  // waiting for them. None unmaps anything: map_range() takes the pages of unused granules
  // it needs (Note [Taking only the pages needed]). False when the measure
  // cannot help (nothing pending, nothing tagged by another stream, no reclaimer or it
  // freed nothing).
  enum class Relief {
    kUnusedGranules,
    kReclaimNoWait,
    kDrainPending,
    kSynchronizeStream,
    kSynchronize,
    kReclaim
  };
  bool relieve(Relief relief, uint64_t bytes, cudaStream_t stream, std::unique_lock<std::mutex>& lock);
  bool call_reclaimer(uint64_t bytes, ReclaimMode mode, cudaStream_t stream, std::unique_lock<std::mutex>& lock);
  void* take(BlockIt b, uintptr_t start, uint64_t size, cudaStream_t stream, bool offloadable, bool mapped_new);
  std::string oom_report(size_t requested, uint64_t rounded, const std::string& why) const;
  // Note [Why nothing fits] (pressure.cpp): why a block of `size` (a kind `offloadable` on
  // `stream`) finds no place within the limit, by bytes or by granules, for the out-of-memory
  // report ("" when neither explains it). `at`: an away block's address, whose pages are to be
  // mapped there (map_block); 0: a new block, anywhere.
  std::string why_nothing_fits(uint64_t size, cudaStream_t stream, bool offloadable, uintptr_t at = 0);
  uint64_t granule_index(uintptr_t addr) const { return (addr - va_.base()) / granularity_; }

  const int device_;
  const bool streams_reported_;
  const std::atomic<int>* const captures_;
  uint64_t peers_ = 0;  // devices granted access to every mapping (PoolOptions::peers, grant_peer)
  uint64_t granularity_ = 0;
  uint64_t card_bytes_ = 0;
  uint64_t limit_ = 0;
  cuda::VaReservation va_;
  cuda::EventPool events_;

  mutable std::mutex mu_;
  std::map<uintptr_t, Block> blocks_;
  std::map<cudaStream_t, FreeIndex> free_;  // per tag (pool/free_list.h)
  std::vector<Granule> granules_;
  // Per granule, the live blocks touching it: [0] ordinary, [1] offloadable (closed_to).
  std::vector<uint32_t> live_on_[2];
  // Per stream, the granule its last small offloadable block ended on: the one granule
  // already holding blocks where its next may go while grouping().
  std::unordered_map<cudaStream_t, uint64_t> open_;
  // Note [A step without pressure]: begin_step() calls, counted up to 2 (a whole step ran).
  uint64_t steps_begun_ = 0;
  bool pressed_ = false;  // a mapping was refused (the limit, or the device was full)
  // Pages change place from now on: a mapping was refused, or a block was given up
  // (unmap_block). Maps runs from then on (Note [Runs]).
  bool remapping_ = false;
  std::vector<Pending> pending_;
  // deallocate_to_any's blocks: free on their stream at once, free for any stream once the
  // event completes, if no later release has merged into them (Block::serial).
  struct Promotion {
    uintptr_t addr;
    uint64_t serial;
    cudaStream_t tag;
    cuda::Event event;
  };
  std::vector<Promotion> promotions_;
  size_t promotions_checked_ = 0;  // promotions_.size() after the last drop_stale_promotions()
  uint64_t next_serial_ = 0;
  std::unordered_map<QuickKey, std::vector<BlockIt>, QuickKeyHash> quick_;
  uint64_t quick_blocks_ = 0;
  std::vector<cuda::PhysicalPages> spare_;  // owned pages mapped nowhere, of any run's size
  uint64_t spare_bytes_ = 0;                 // their bytes
  uint64_t mapped_top_ = 0;                  // no granule from this index up has ever been mapped
  uint64_t away_blocks_ = 0;                 // blocks whose `away` is set
  uint64_t mapped_ = 0;                      // bytes of mapped granules
  uint64_t peak_mapped_ = 0;
  Reclaimer reclaimer_;
  int reclaimer_calls_ = 0;                  // calls of reclaimer_ in progress (lock released)
  std::condition_variable reclaimer_idle_;   // notified when reclaimer_calls_ drops to 0
  // Streams synchronize_and_retire() names to CUDA or holds the cached blocks of with the lock
  // released (one entry per call), and the condition stream_destroyed() waits on until its
  // stream is not among them: the program must not destroy a stream the pool is about to
  // name, and its blocks must be back to be forgotten (Note [A destroyed stream is forgotten]).
  std::vector<cudaStream_t> syncing_;
  std::condition_variable synced_;
  // Calls of synchronize_and_retire() in progress that hold free blocks out of the index, and
  // how many such calls have ended: an allocation short of memory waits for those under way
  // before it reports an out-of-memory (await_held_blocks).
  uint64_t holding_syncs_ = 0, held_syncs_ended_ = 0;

  uint64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
  uint64_t allocated_high_ = 0;  // the highest allocated_ since take_allocated_high()
  // Note [A step's addresses]: once begin_step() was called, the large allocations of the
  // step now and of the one before, (size rounded to 512 bytes, address) in order.
  bool stepping_ = false;
  std::vector<std::pair<uint64_t, uintptr_t>> step_now_, step_before_;
  uint64_t num_allocs_ = 0, num_frees_ = 0, num_cache_hits_ = 0, num_ooms_ = 0;
  // Note [Memory history] (history.h). cause_: why runs are mapped or unmapped now (an
  // eviction's unmap_block, a fetch's map_block, or neither).
  History history_;
  TraceEvent::Cause cause_ = TraceEvent::Cause::kNone;
  // cause_ set to `now` for the runs mapped or unmapped while it lives.
  class CauseScope {
   public:
    CauseScope(TraceEvent::Cause& cause, TraceEvent::Cause now) : cause_(cause) { cause_ = now; }
    ~CauseScope() { cause_ = TraceEvent::Cause::kNone; }
    CauseScope(const CauseScope&) = delete;
    CauseScope& operator=(const CauseScope&) = delete;

   private:
    TraceEvent::Cause& cause_;
  };

  // Note [Thread caches]. id_: this pool's key in each thread's caches. caches_on_: the fast
  // path may be taken (cleared for good by caches_off()). caches_: every cache registered,
  // under mu_.
  // lent_: each lent block's cache by address, read without mu_ by a free from another
  // thread (lent_table.h). retired_: caches emptied for good, kept so that a stale entry of
  // lent_ never names a destroyed cache.
  const uint64_t id_ = next_pool_id.fetch_add(1);
  std::atomic<bool> caches_on_{true};
  std::vector<std::shared_ptr<ThreadCache>> caches_;
  std::unique_ptr<LentTable> lent_;
  std::vector<std::shared_ptr<ThreadCache>> retired_;
  ThreadCache* own_cache() const {
    const ThreadCaches* t = tls_caches;
    return t ? t->find(id_) : nullptr;
  }
  ThreadCache* own_cache_or_make();
  // The calling thread's cached bytes (under its cache's lock: another thread's free of a
  // block lent to it adds to them).
  uint64_t own_cached() const {
    ThreadCache* c = own_cache();
    return c ? c->cached_bytes_now() : 0;
  }
  // Every cache's cached bytes (each locked in turn).
  uint64_t cached_in_threads() const;
  // Gives the pool `c`'s blocks back: its cached ones freed for their streams, its live ones
  // the pool's again (freed the slow way), and its counters (the cache is dropped next).
  void empty_thread_cache(ThreadCache& c);
  // Moves every thread's cached blocks to the pool's quick lists (a full list releases the
  // block, as a free would); the caches stay on. On a miss, before take_quick, and by
  // flush_quick (Note [Thread caches]).
  void caches_to_quick();
  // `c`'s cached blocks (c locked) back to the pool: onto the quick lists where `to_quick`
  // and there is room, else freed for their streams.
  void take_cached(ThreadCache& c, bool to_quick);
  // Moves every thread's cached blocks of (stream, rounded) to the quick list of that key
  // before a block of that key freed through the pool joins it (an offloadable block, which
  // no cache holds): the list then keeps the order of the frees, the last freed on top, as
  // with no caches.
  void key_to_quick(cudaStream_t stream, uint64_t rounded);
  // A cached block of `c` (c locked) is the pool's again: onto its quick list where
  // `to_quick` and there is room, else freed for its stream.
  void uncache(uintptr_t addr, uint64_t rounded, cudaStream_t stream, bool to_quick);
  // The block is lent to no cache any more (lent_ forgets it).
  void unlend(BlockIt b) {
    if (b->second.owner == nullptr) return;
    lent_->clear(b->first);
    b->second.owner = nullptr;
  }
  // Lends the block at `p` (just allocated) to the calling thread's cache.
  void lend(void* p, uint64_t rounded, cudaStream_t stream);
  // Empties every cache and clears caches_on_: the pool is as it was with no thread caches.
  void caches_off();
  // Turns the caches off once the pool places for eviction, remaps or records its history
  // (their rules and records need every block in the pool's own hands), or would reach half
  // its limit with `more` bytes mapped.
  // Also empties the caches of threads that exited (reap_orphans).
  void check_caches(uint64_t more) {
    if (!caches_on_.load(std::memory_order_relaxed)) return;
    if (grouping() || remapping_ || history_.recording() || 2 * (reserved_ + more) >= limit_) caches_off();
    else reap_orphans();
  }
  // Empties the caches of threads that exited, and retires them.
  void reap_orphans();
  // Keeps an emptied cache for as long as the pool lives (a free on another thread may
  // still find it in lent_), with its tables' memory given back.
  void retire(std::shared_ptr<ThreadCache> c);
  static uintptr_t stream_id(cudaStream_t s) { return s == kAnyStream ? 0 : reinterpret_cast<uintptr_t>(s); }
  void* traced_alloc(void* p, size_t size, cudaStream_t stream) {
    note_step_address(p, size);
    if (p && history_.recording()) {
      blocks_.at(reinterpret_cast<uintptr_t>(p)).requested = size;
      history_.add(TraceEvent::Action::kAlloc, reinterpret_cast<uintptr_t>(p), size, stream_id(stream));
    }
    return p;
  }
  // The size a free of `b` is traced with: the one its alloc was (torch's trace pairs them).
  static uint64_t traced_size(const Block& b) { return b.requested ? b.requested : b.size; }
  void trace_oom(size_t size, cudaStream_t stream) {
    history_.add(TraceEvent::Action::kOom, 0, size, stream_id(stream), TraceEvent::Cause::kNone,
                 limit_ > reserved_ ? limit_ - reserved_ : 0);
  }
};

}  // namespace vramswap::pool
