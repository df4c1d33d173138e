// DevicePool: blocks over one VA reservation, granules mapped on demand, stream-ordered
// reuse. The policy is "Note [The pool]" in device_pool.h; this file is its mechanics.
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
#include "pool/device_pool.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
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
#include "pool/thread_cache.h"

namespace vramswap::pool {
namespace {

// Blocks are aligned to and sized in this unit: CUDA's own allocation alignment, and
// what kernels using vector loads expect.
constexpr uint64_t kAlignment = 512;

// The tag of a free block that any stream may reuse (any_stream() in the header).
const cudaStream_t kAnyStream = any_stream();

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
thread_local ThreadCaches* tls_caches = nullptr;
thread_local bool tls_caches_gone = false;  // the thread is exiting: no cache any more
struct ThreadCachesReaper {
  bool armed = false;
  ~ThreadCachesReaper() {
    tls_caches_gone = true;
    if (tls_caches == nullptr) return;
    for (auto& [id, cache] : tls_caches->entries) cache->orphaned.store(true, std::memory_order_release);
    delete std::exchange(tls_caches, nullptr);
  }
};
thread_local ThreadCachesReaper tls_reaper;
std::atomic<uint64_t> next_pool_id{1};

struct QuickKey {
  cudaStream_t stream;
  uint64_t size;
  bool offloadable;  // freed by a block of that kind, taken back by one of the same kind
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

std::string pointer_name(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

}  // namespace

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
  // Whether blocks are placed for eviction (Note [Placing for eviction] in device_pool.h):
  // under a limit below the card, once the pool has been refused memory, or past half its
  // limit.
  bool grouping() const { return limit_ < card_bytes_ || pressed_ || 2 * reserved_ >= limit_; }
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
  // The quick path of allocate(): a block quick-listed for (stream, rounded), or nullptr.
  void* take_quick(uint64_t rounded, cudaStream_t stream, bool offloadable);
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
  // The device may be synchronized on behalf of `caller`: no capture is reported underway
  // (PoolOptions::captures) and `caller` is not capturing (any stream capturing on the device
  // would be invalidated, in every capture mode).
  bool device_synchronization_allowed(cudaStream_t caller) const;
  // Merges every quick-listed block into the free index (slow paths need the whole picture).
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
  std::map<cudaStream_t, std::set<std::pair<uint64_t, uintptr_t>>> free_;
  std::vector<Granule> granules_;
  // Per granule, the live blocks touching it: [0] ordinary, [1] offloadable (closed_to).
  std::vector<uint32_t> live_on_[2];
  // Per stream, the granule its last small offloadable block ended on: the one granule
  // already holding blocks where its next may go while grouping().
  std::unordered_map<cudaStream_t, uint64_t> open_;
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
  // Streams synchronize_and_retire() is synchronizing with the lock released (one entry per
  // call), and the condition stream_destroyed() waits on until its stream is not among them:
  // the program must not destroy a stream the pool is about to name.
  std::vector<cudaStream_t> syncing_;
  std::condition_variable synced_;

  uint64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
  uint64_t allocated_high_ = 0;  // the highest allocated_ since take_allocated_high()
  uint64_t num_allocs_ = 0, num_frees_ = 0, num_cache_hits_ = 0, num_ooms_ = 0;
  // Note [Memory history] (history.h). cause_: why runs are mapped or unmapped now (an
  // eviction's unmap_block, a fetch's map_block, or neither).
  History history_;
  TraceEvent::Cause cause_ = TraceEvent::Cause::kNone;

  // Note [Thread caches]. id_: this pool's key in each thread's caches. caches_on_: the fast
  // path may be taken (cleared for good by caches_off()). caches_: every cache registered,
  // under mu_.
  const uint64_t id_ = next_pool_id.fetch_add(1);
  std::atomic<bool> caches_on_{true};
  std::vector<std::shared_ptr<ThreadCache>> caches_;
  ThreadCache* own_cache() const {
    const ThreadCaches* t = tls_caches;
    return t ? t->find(id_) : nullptr;
  }
  ThreadCache* own_cache_or_make();
  // The calling thread's cached bytes: read without its lock, which only the owner (us) and
  // holders of mu_ (us) write.
  uint64_t own_cached() const {
    const ThreadCache* c = own_cache();
    return c ? c->cached_bytes : 0;
  }
  // Every cache's cached bytes (each locked in turn).
  uint64_t cached_in_threads() const;
  // Gives the pool `c`'s cached blocks back (freed for their streams); with `disown`, its
  // live blocks too (the pool's again, freed the slow way), and its counters (the cache is
  // dropped next).
  void empty_thread_cache(ThreadCache& c, bool disown);
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
  // Empties the caches of threads that exited, and drops them.
  void reap_orphans();
  static uintptr_t stream_id(cudaStream_t s) { return s == kAnyStream ? 0 : reinterpret_cast<uintptr_t>(s); }
  void* traced_alloc(void* p, size_t size, cudaStream_t stream) {
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

DevicePool::Impl::Impl(const PoolOptions& options)
    : device_(options.device),
      streams_reported_(options.streams_reported),
      captures_(options.captures),
      peers_(options.peers & ~(uint64_t(1) << (options.device & 63))),
      events_(options.device) {
  cuda::DeviceInfo info = cuda::device_info(device_);
  if (!info.vmm_supported)
    throw cuda::CudaError("device " + std::to_string(device_) + " does not support CUDA virtual memory management",
                          CUDA_ERROR_NOT_SUPPORTED);
  granularity_ = info.granularity;
  card_bytes_ = info.total_bytes;
  limit_ = options.limit_bytes == 0 ? card_bytes_ : std::min(options.limit_bytes, card_bytes_);
  // Twice the card: room for fragmentation of addresses, which cost nothing until mapped.
  const uint64_t va_size = round_up(2 * card_bytes_, granularity_);
  {
    cuda::ContextScope scope(device_);
    va_ = cuda::VaReservation(va_size, granularity_);
  }
  granules_.resize(va_size / granularity_);
  for (auto& counts : live_on_) counts.assign(granules_.size(), 0);
  index_insert(blocks_.emplace(va_.base(), Block{va_size, State::kFree, kAnyStream, {}}).first);
}

DevicePool::Impl::BlockIt DevicePool::Impl::find_fit(uint64_t size, cudaStream_t stream, bool offloadable,
                                                     bool aligned, uintptr_t* start, bool strict) {
  // While placing for eviction, for a small block (below half a granule) a place that
  // occupies no granule without live blocks comes first, then one on mapped granules: a
  // small block put at the start of a free range over unmapped granules (or on a cached,
  // idle granule) pins a page of its own while a hole on an occupied one waits. Those
  // searches are bounded; then the first fit by size. (A larger block fills most of what it
  // maps; tried for every size, the benchmark's rows moved both ways, geometric mean of
  // step/bound 1.076 to 1.081; for small blocks only, 1.072.)
  const int first_pass = grouping() && size < granularity_ / 2 ? 0 : 2;
  for (int pass = first_pass; pass < 3; ++pass) {
    auto acceptable = [&](uintptr_t a) {
      if (cuts_busy_run(a, size)) return false;
      if (pass == 2) return true;
      for (uint64_t g = granule_index(a), last = granule_index(a + size - 1); g <= last; ++g)
        if (!mapped(g) || (pass == 0 && live_on_[0][g] == 0 && live_on_[1][g] == 0)) return false;
      return true;
    };
    BlockIt best = blocks_.end();
    uint64_t best_size = UINT64_MAX;
    size_t looked = 0;
    for (cudaStream_t tag : {stream, kAnyStream}) {
      auto it = free_.find(tag);
      if (it == free_.end()) continue;
      for (auto fit = it->second.lower_bound({size, 0}); fit != it->second.end() && fit->first < best_size; ++fit) {
        if (pass < 2 && ++looked > kMappedFitLooks) break;
        uintptr_t lo = 0, hi = 0;
        if (!usable_part(fit->second, fit->first, stream, offloadable, strict, &lo, &hi)) continue;
        if (aligned) lo = round_up(lo, granularity_);
        // A small offloadable block placed for eviction lies within one granule: fetching it
        // back then needs one page, not two.
        else if (offloadable && grouping() && granule_index(lo) != granule_index(lo + size - 1))
          lo = round_up(lo + 1, granularity_);
        if (hi <= lo || hi - lo < size) continue;
        if (!acceptable(lo)) {
          // The range's last granule may be acceptable where its first is not: the block
          // goes at the end instead (within one granule, or aligned, as above).
          const uintptr_t end_start = hi - size;
          const bool keeps_rules = aligned ? end_start % granularity_ == 0
                                           : !(offloadable && granule_index(end_start) != granule_index(hi - 1));
          if (!keeps_rules || !acceptable(end_start)) continue;
          lo = end_start;
        }
        best_size = fit->first;
        best = blocks_.find(fit->second);
        *start = lo;
        break;
      }
    }
    if (best != blocks_.end()) return best;
  }
  return blocks_.end();
}

bool DevicePool::Impl::usable_part(uintptr_t addr, uint64_t size, cudaStream_t stream, bool offloadable,
                                   bool strict, uintptr_t* lo, uintptr_t* hi) const {
  // Only the free block's first and last granules can hold live blocks (the rest lie
  // inside it); a granule closed to this block is left out.
  *lo = addr;
  *hi = addr + size;
  if (strict && closed_to(granule_index(*lo), offloadable, stream))
    *lo = va_.base() + (granule_index(*lo) + 1) * granularity_;
  if (strict && *hi > *lo && closed_to(granule_index(*hi - 1), offloadable, stream))
    *hi = va_.base() + granule_index(*hi - 1) * granularity_;
  return *hi > *lo;
}

// Note [Placing on mapped pages]
// -------------------------------
// Best fit chooses by size alone. At the limit, the hole it picks is often one whose pages
// were given up (an evicted block freed, a cached granule unmapped for another request)
// while a larger cached block still has its pages mapped: the block then maps a fresh
// granule for each it covers, taking the pages of idle cached ones, which the next
// request's best fit may pick again. A training step at 90% of its peak so mapped and
// unmapped ~2,650 granules a step where its evictions moved 288; on a GPU each costs
// cuMemMap + cuMemSetAccess and cuMemUnmap, on the allocating thread (~40 + 25 us on an idle
// H100, more on a busy one: cuda/host_time.h). So when a block of half a granule or more
// cannot be given new pages without taking a cached granule's (pages_scarce), the place
// needing the fewest new mappings among the free blocks find_fit looks at is compared with
// best fit's, and taken when it saves at least half the block's granules: a smaller saving
// is not worth the larger free block it splits (tried with any saving: a replayed LM step
// spent its cached holes on blocks of a few granules and waited 27 ms more for fetches).
// Not while a block is away (evicted, not yet back): the fetches that bring it back take
// the pages of blocks the program's stream freed, which only a synchronization of that
// stream frees for them, and best fit's places at the limit have the allocation make it
// (kSynchronizeStream); placed on the mapped pages instead, allocations stopped making it,
// and fetches waited (GPT-2 small at 75%: first step 131 -> 150 ms; a replayed LM step
// 154 -> 181 ms). Tried and not kept: promoting large frees (deallocate_to_any's event) so
// that fetches could take those pages anyway: fetches ahead then filled memory backward
// needed (VGG-16 at batch 128 and 75%: 1.017 -> 1.175 of the bound).
// With CUDASIM_HOST_COSTS=h100, `vramswap bench all`'s geometric mean of step/bound went from
// 3.34 to 3.11 (GPT-2 small at 90%: 4.60 to 2.36, ~2,850 granules mapped and unmapped a step
// to ~2,130); without host costs 1.0361 to 1.0384 at warm-up 2 (no row within 1.05 of the
// bound left it; VGG-16 at batch 128 and 75% 1.017 -> 1.044) and 1.0384 to 1.0365 at warm-up 1.
DevicePool::Impl::BlockIt DevicePool::Impl::find_mapped_fit(uint64_t size, cudaStream_t stream, bool offloadable,
                                                            bool aligned, uintptr_t* start, bool strict,
                                                            uint64_t* missing) {
  BlockIt best = blocks_.end();
  uint64_t best_missing = UINT64_MAX, best_size = UINT64_MAX;
  std::vector<uint32_t> unmapped_below;  // per granule of the part looked at: unmapped ones before it
  for (cudaStream_t tag : {stream, kAnyStream}) {
    auto it = free_.find(tag);
    if (it == free_.end()) continue;
    size_t looked = 0;
    for (auto fit = it->second.lower_bound({size, 0}); fit != it->second.end() && best_missing > 0; ++fit) {
      if (++looked > kMappedFitLooks) break;
      uintptr_t lo = 0, hi = 0;
      if (!usable_part(fit->second, fit->first, stream, offloadable, strict, &lo, &hi)) continue;
      if (aligned) lo = round_up(lo, granularity_);
      if (hi <= lo || hi - lo < size) continue;
      // No granule at or above mapped_top_ is mapped: a place starting there needs all new.
      const uint64_t g_lo = granule_index(lo);
      if (g_lo >= mapped_top_) continue;
      const uintptr_t last_start = std::min(hi - size, va_.base() + mapped_top_ * granularity_);
      const uint64_t g_hi = granule_index(last_start + size - 1);
      unmapped_below.assign(g_hi - g_lo + 2, 0);
      for (uint64_t g = g_lo; g <= g_hi; ++g)
        unmapped_below[g - g_lo + 1] = unmapped_below[g - g_lo] + (mapped(g) ? 0 : 1);
      // The block may start at the part's start or at any granule boundary after it.
      auto consider = [&](uintptr_t s) {
        if (cuts_busy_run(s, size)) return;
        const uint64_t m =
            unmapped_below[granule_index(s + size - 1) - g_lo + 1] - unmapped_below[granule_index(s) - g_lo];
        if (m < best_missing || (m == best_missing && fit->first < best_size)) {
          best_missing = m;
          best_size = fit->first;
          best = blocks_.find(fit->second);
          *start = s;
        }
      };
      consider(lo);
      for (uintptr_t s = va_.base() + (g_lo + 1) * granularity_; s <= last_start && best_missing > 0;
           s += granularity_)
        consider(s);
    }
  }
  *missing = best_missing;
  return best;
}

void DevicePool::Impl::count_on_granules(uintptr_t addr, uint64_t size, int row, int delta) {
  std::vector<uint32_t>& counts = live_on_[row];
  for (uint64_t g = granule_index(addr), last = granule_index(addr + size - 1); g <= last; ++g) counts[g] += delta;
}

bool DevicePool::Impl::needs_no_pages(const Block& block) {
  return (block.state == State::kFree && block.tag == kAnyStream) || (block.state == State::kLive && block.away);
}

bool DevicePool::Impl::range_idle(uint64_t g, uint64_t count) const {
  const uintptr_t start = va_.base() + g * granularity_, end = start + count * granularity_;
  auto b = blocks_.upper_bound(start);
  if (b != blocks_.begin()) --b;  // the block holding the granule's first byte
  for (; b != blocks_.end() && b->first < end; ++b)
    if (!needs_no_pages(b->second)) return false;
  return true;
}

// Note [Runs]
// -----------
// On a GPU the VMM calls cost per call, not per byte: cuMemMap + cuMemSetAccess +
// cuMemUnmap of one handle took 62-98 us whether it held 1 or 256 granules of 2 MiB, where
// one cuMemSetAccess over 256 granules mapped from a handle each took 6-12 ms (H100,
// tests/gpu/vmm_cost.py, 2026-11-26). With one handle per granule, a training step at 80%
// of its peak, remapping 13.8 GiB, spent 472 ms of host time in those calls (the step took
// 791 ms where torch's took 391). So once pages change place (a mapping was refused, or a
// block was given up: remapping_), map_range maps each stretch of consecutive unmapped
// granules it needs as one run: one handle of physical pages (a spare one of exactly that
// size when there is one, else a new one), one cuMemMap, one cuMemSetAccess. Spare pages
// keep their size: as many bytes of spare pages no run of this call can use are released
// (cuMemRelease) as new ones are created, so that what the pool holds does not grow with
// pages of a shape nothing asks for; past the limit, idle runs are unmapped as well.
//
// A run can only be unmapped whole: cuMemUnmap refuses part of a mapping, and cuMemMap maps
// a handle from its start only. So a run must never hold the pages of two blocks that live
// apart. The granules a block covers only in part, at its ends, which a neighbour may share,
// are runs of their own; and no block is placed so that it cuts a run (takes part of it, or
// reaches into it with a granule it covers only in part) while a block still needs any of
// that run's pages (cuts_busy_run: a live or pending block, or one free only for its stream,
// whose work may still be queued). A run no block needs is unmapped before a block cuts it
// (unmap_cut_runs), so that the block's pages are its own. Tried without that rule, the
// blocks placed into the runs of blocks freed just before them kept those runs mapped long
// after (an activation beside a cached temporary, each holding half a run): evictions freed
// nothing (a replayed GPT-1.3B step on its card moved 55 -> 89 GB), and with runs of at most
// 8 granules GPT-2 small at 90% ran out of memory. Before pages first change place one
// granule is one run, as it always was: with runs from the start, the rule kept blocks out
// of their stream's cached memory and a limit above the peak grew to the limit and evicted
// (GPT-2 small-v10k at 112%, 466 MB in its first step); letting blocks cut runs until then
// left shared runs that ran the pool out of memory later (GPT-2 small at 75%). A block given
// up starts them too: a step whose plan evicts early enough may never meet the limit.
// What those first steps mapped stays one granule a run until it is unmapped, one call a
// granule: GPT-2 small at 90% with cudasim's H100 host costs is 1.32x its bound after two
// warm-up steps and still unmaps hundreds of such granules a step after six.
bool DevicePool::Impl::map_range(uintptr_t addr, uint64_t size, std::string* why, uint64_t* lacking) {
  const uint64_t first = granule_index(addr), last = granule_index(addr + size - 1);
  if (unmapped_in(addr, size) == 0) return true;
  // The runs to map: each stretch of unmapped granules, its granules at the block's ends
  // that the block covers in part split off.
  struct Run {
    uint64_t first, count;
    size_t spare = SIZE_MAX;  // the index in spare_ of the pages it takes, or SIZE_MAX: new
  };
  std::vector<Run> runs;
  uint64_t whole_lo = 0, whole_end = 0;
  whole_granules(addr, size, &whole_lo, &whole_end);
  auto whole = [&](uint64_t g) { return g >= whole_lo && g < whole_end; };
  for (uint64_t g = first; g <= last;) {
    if (mapped(g)) {
      ++g;
      continue;
    }
    uint64_t h = g + 1;
    if (whole(g))
      while (h <= last && !mapped(h) && whole(h) && remapping_) ++h;
    runs.push_back({g, h - g});
    g = h;
  }
  // Spare pages of a run's size are taken first; what none fits is created.
  uint64_t created = 0;
  std::vector<bool> taken;
  auto match = [&] {
    taken.assign(spare_.size(), false);
    created = 0;
    for (Run& r : runs) {
      r.spare = SIZE_MAX;
      for (size_t i = 0; i < spare_.size(); ++i)
        if (!taken[i] && spare_[i].size() == r.count * granularity_) {
          taken[i] = true;
          r.spare = i;
          break;
        }
      if (r.spare == SIZE_MAX) created += r.count * granularity_;
    }
  };
  match();
  // Spare pages no run here can use give way to the new ones: kept, they would only add to
  // what the pool holds (reserved) for pages of a shape nothing asks for now.
  if (created > 0 && release_spare_for(created, taken) > 0) match();
  if (created > 0 && reserved_ + created > limit_) {
    const uint64_t over = (reserved_ + created - limit_ + granularity_ - 1) / granularity_;
    unmap_unused(over, first, last);
    match();
    if (reserved_ + created > limit_ && release_spare_for(reserved_ + created - limit_, taken) > 0) match();
  }
  if (reserved_ + created > limit_) {  // refuse before mapping anything
    *why = "the limit";
    pressed_ = remapping_ = true;
    *lacking = reserved_ + created - limit_;
    return false;
  }
  cuda::ContextScope scope(device_);
  // The spare pages the runs take, out of spare_ (highest index first, so that the others'
  // indexes hold).
  std::vector<cuda::PhysicalPages> pages_of(runs.size());
  {
    std::vector<std::pair<size_t, size_t>> by_index;  // (spare index, run)
    for (size_t r = 0; r < runs.size(); ++r)
      if (runs[r].spare != SIZE_MAX) by_index.emplace_back(runs[r].spare, r);
    std::sort(by_index.rbegin(), by_index.rend());
    for (auto [i, r] : by_index) pages_of[r] = take_spare(i);
  }
  std::vector<std::pair<uint64_t, bool>> mapped_now;  // the runs this call mapped: (head, pages were spare)
  for (size_t r = 0; r < runs.size(); ++r) {
    const Run& run = runs[r];
    const bool recycled = run.spare != SIZE_MAX;
    try {
      cuda::PhysicalPages pages = std::move(pages_of[r]);
      if (!recycled) {
        pages = cuda::PhysicalPages(device_, run.count * granularity_);
        reserved_ += pages.size();
      }
      try {
        granules_[run.first].mapping = cuda::Mapping(va_.base() + run.first * granularity_, pages, peers_);
      } catch (...) {
        give_back(std::move(pages), recycled);
        throw;
      }
      granules_[run.first].pages = std::move(pages);
      granules_[run.first].count = run.count;
      for (uint64_t g = run.first; g < run.first + run.count; ++g) granules_[g].head = run.first;
      mapped_top_ = std::max(mapped_top_, run.first + run.count);
      mapped_now.emplace_back(run.first, recycled);
      history_.add(TraceEvent::Action::kSegmentMap, va_.base() + run.first * granularity_, run.count * granularity_, 0,
                   cause_);
      mapped_ += run.count * granularity_;
    } catch (const cuda::CudaError& e) {
      // The device is full: undo this call, so that a refused request leaves the device as
      // it found it for its other users (recycled pages go back to the spare list).
      for (auto [head, was_spare] : mapped_now) {
        try {
          unmap_run(head);
        } catch (const cuda::CudaError&) {
          continue;  // CUDA refused: it stays mapped, counted, an unused run unmapped later
        }
        give_back(take_spare(spare_.size() - 1), was_spare);  // the pages unmap_run made spare
      }
      for (size_t k = r + 1; k < runs.size(); ++k)
        if (pages_of[k]) push_spare(std::move(pages_of[k]));
      if (!e.out_of_memory()) throw;
      *why = "the device's free memory";
      pressed_ = remapping_ = true;
      *lacking = created;  // how much the device lacks is not known
      return false;
    }
  }
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  peak_mapped_ = std::max(peak_mapped_, mapped_);
  return true;
}

void DevicePool::Impl::give_back(cuda::PhysicalPages pages, bool was_spare) {
  if (!was_spare) {
    try {
      const uint64_t bytes = pages.size();
      pages.release();
      reserved_ -= bytes;
      return;
    } catch (const cuda::CudaError&) {
      // CUDA refused: kept as spare (still reserved), released again by release_spare().
    }
  }
  push_spare(std::move(pages));
}

bool DevicePool::Impl::unmap_cut_runs(uintptr_t addr, uint64_t size) {
  std::vector<uint64_t> heads;
  for_each_cut_run(addr, size, [&](uint64_t head, uint64_t n) {
    if (range_idle(head, n)) heads.push_back(head);  // a busy one is never cut (cuts_busy_run)
  });
  if (heads.empty()) return true;
  cuda::ContextScope scope(device_);
  for (uint64_t head : heads) {
    try {
      unmap_run(head);
    } catch (const cuda::CudaError&) {
      return false;
    }
  }
  return true;
}

void DevicePool::Impl::unmap_run(uint64_t head) {
  Granule& h = granules_[head];
  h.mapping.unmap();
  const uint64_t count = h.count;
  history_.add(TraceEvent::Action::kSegmentUnmap, va_.base() + head * granularity_, count * granularity_, 0, cause_);
  push_spare(std::move(h.pages));
  for (uint64_t g = head; g < head + count; ++g) granules_[g].head = kUnmapped;
  h.count = 0;
  mapped_ -= count * granularity_;
}

// Note [Taking only the pages needed]
// ------------------------------------
// At the limit, a range to map takes its pages from granules nothing uses (cached free
// blocks', unmapped for it), as many as it lacks and no more. Every measure of the
// escalation (relieve) used to end by unmapping every unused granule of the pool: the next
// allocations then found their cached free memory unmapped and mapped it again, so that
// a training step at 90% of its peak mapped ~5,000 granules and unmapped ~4,000 where its
// evictions moved 288. On a GPU each run given pages costs cuMemMap + cuMemSetAccess
// (~30-40 us) and each unmapped a cuMemUnmap (~20-25 us), on the allocating thread
// (cuda/host_time.h, CUDASIM_HOST_COSTS), whatever its length (Note [Runs]). Runs go whole,
// so up to a run less one granule more than asked for may go. The highest go first: the
// lowest hold what is placed first and reused most. (Tried: the smallest idle run that
// covers what is missing, else the largest; with cudasim's H100 costs the geometric mean of
// step/bound moved 1.802 -> 1.792 with rows both ways, GPT-2 small at 75% 1.03 -> 1.09.)
uint64_t DevicePool::Impl::unmap_unused(uint64_t count, uint64_t keep_first, uint64_t keep_last) {
  uint64_t done = 0;
  std::unique_ptr<cuda::ContextScope> scope;
  for (uint64_t g = std::min<uint64_t>(mapped_top_, granules_.size()); g-- > 0 && done < count;) {
    if (!mapped(g)) continue;
    const uint64_t head = granules_[g].head, n = granules_[head].count;
    g = head;  // the loop goes on below the run
    if ((head <= keep_last && head + n > keep_first) || !range_idle(head, n)) continue;
    if (!scope) scope = std::make_unique<cuda::ContextScope>(device_);
    try {
      unmap_run(head);
    } catch (const cuda::CudaError&) {
      continue;  // CUDA refused: the run stays mapped (and counted), to be tried again later
    }
    done += n;
  }
  return done;
}

void DevicePool::Impl::release_spare() { release_spare_for(UINT64_MAX, {}); }

uint64_t DevicePool::Impl::release_spare_for(uint64_t bytes, const std::vector<bool>& keep) {
  uint64_t released = 0;
  if (spare_.empty()) return 0;
  cuda::ContextScope scope(device_);
  // One at a time: pages CUDA refuses to release stay spare (and counted), tried again later.
  for (size_t i = spare_.size(); i-- > 0 && released < bytes;) {
    if (i < keep.size() && keep[i]) continue;
    const uint64_t size = spare_[i].size();
    try {
      spare_[i].release();
    } catch (const cuda::CudaError&) {
      continue;
    }
    spare_.erase(spare_.begin() + std::ptrdiff_t(i));
    spare_bytes_ -= size;
    reserved_ -= size;
    released += size;
  }
  return released;
}

void DevicePool::Impl::release_block(BlockIt b, cudaStream_t tag, uint64_t serial) {
  b->second.state = State::kFree;
  b->second.owner = nullptr;
  b->second.tag = tag;
  b->second.also_on.clear();
  if (b->second.away) --away_blocks_;
  b->second.away = false;  // a free block's contents are no one's
  // Every release to a stream gets a fresh serial, and a merged block carries the latest:
  // only that release's promotion event (the latest on the stream, so it covers the
  // others) may hand it to any stream. A release with no promotion thus blocks older ones.
  b->second.serial = tag == kAnyStream ? 0 : serial != 0 ? serial : ++next_serial_;
  if (b != blocks_.begin()) {
    auto prev = std::prev(b);
    if (prev->second.state == State::kFree && prev->second.tag == tag) {
      index_erase(prev);
      prev->second.size += b->second.size;
      prev->second.serial = std::max(prev->second.serial, b->second.serial);
      blocks_.erase(b);
      b = prev;
    }
  }
  auto next = std::next(b);
  if (next != blocks_.end() && next->second.state == State::kFree && next->second.tag == tag) {
    index_erase(next);
    b->second.size += next->second.size;
    b->second.serial = std::max(b->second.serial, next->second.serial);
    blocks_.erase(next);
  }
  index_insert(b);
}

DevicePool::Impl::BlockIt DevicePool::Impl::promoted_block(const Promotion& p) {
  auto b = blocks_.upper_bound(p.addr);
  if (b == blocks_.begin()) return blocks_.end();
  --b;  // the block that holds the freed address now
  const bool still = b->second.state == State::kFree && b->second.tag == p.tag && b->second.serial == p.serial &&
                     p.addr < b->first + b->second.size;
  return still ? b : blocks_.end();
}

void DevicePool::Impl::drop_stale_promotions() {
  for (size_t i = 0; i < promotions_.size();) {
    if (promoted_block(promotions_[i]) != blocks_.end()) {
      ++i;
      continue;
    }
    events_.release(std::move(promotions_[i].event));
    promotions_[i] = std::move(promotions_.back());
    promotions_.pop_back();
  }
}

void DevicePool::Impl::poll_pending(bool promote) {
  for (size_t i = 0; promote && i < promotions_.size();) {
    Promotion& p = promotions_[i];
    if (!p.event.query()) {
      ++i;
      continue;
    }
    if (BlockIt b = promoted_block(p); b != blocks_.end()) {
      index_erase(b);
      release_block(b, kAnyStream);
    }
    events_.release(std::move(p.event));
    promotions_[i] = std::move(promotions_.back());
    promotions_.pop_back();
  }
  for (size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    bool done = std::all_of(p.events.begin(), p.events.end(), [](const cuda::Event& e) { return e.query(); });
    if (!done) {
      ++i;
      continue;
    }
    for (auto& e : p.events) events_.release(std::move(e));
    for (uintptr_t addr : p.addrs) {
      const BlockIt b = blocks_.find(addr);
      history_.add(TraceEvent::Action::kFreeCompleted, addr, traced_size(b->second), stream_id(p.tag_after));
      b->second.requested = 0;
      release_block(b, p.tag_after);
    }
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
}

bool DevicePool::Impl::device_synchronization_allowed(cudaStream_t caller) const {
  if (captures_ && captures_->load(std::memory_order_acquire) > 0) return false;
  return caller == kAnyStream || cuda::outside_capture(caller);
}

bool DevicePool::Impl::synchronize_and_retire(std::unique_lock<std::mutex>& lock, cudaStream_t only,
                                              cudaStream_t caller) {
  flush_quick();
  std::vector<std::pair<uintptr_t, cudaStream_t>> retiring;  // (block, tag before)
  std::vector<cudaStream_t> tags;
  for (auto it = free_.begin(); it != free_.end();) {
    const cudaStream_t tag = it->first;
    if (tag == kAnyStream || (only != kAnyStream && tag != only)) {
      ++it;
      continue;
    }
    tags.push_back(tag);
    for (auto& [size, addr] : it->second) {
      blocks_.at(addr).state = State::kRetiring;
      retiring.emplace_back(addr, tag);
    }
    it = free_.erase(it);
  }
  const bool each = only == kAnyStream && streams_reported_;
  if (each) syncing_.insert(syncing_.end(), tags.begin(), tags.end());
  lock.unlock();
  std::vector<cudaStream_t> done;  // the tags whose queued work has completed
  bool synchronized = false;
  if (only != kAnyStream) {
    synchronized = cuda::synchronize_stream(only);  // false while it captures
    if (synchronized) done.push_back(only);
  } else if (streams_reported_) {
    for (cudaStream_t t : tags)
      if (cuda::synchronize_stream(t)) done.push_back(t);
    synchronized = !done.empty();
  } else if (device_synchronization_allowed(caller) && cuda::synchronize_device(device_)) {
    synchronized = true;
    done = tags;
  }
  lock.lock();
  if (each) {
    for (cudaStream_t t : tags) syncing_.erase(std::find(syncing_.begin(), syncing_.end(), t));
    synced_.notify_all();
  }
  for (auto& [addr, tag] : retiring)
    release_block(blocks_.find(addr), std::find(done.begin(), done.end(), tag) != done.end() ? kAnyStream : tag);
  if (!synchronized) return false;
  poll_pending();  // events recorded before the synchronization may have completed
  return true;
}

void DevicePool::Impl::drain_pending(std::unique_lock<std::mutex>& lock) {
  std::vector<cudaEvent_t> waits;
  uint64_t oldest = UINT64_MAX;
  for (auto& p : pending_) oldest = std::min(oldest, p.serial);
  for (auto& p : promotions_) oldest = std::min(oldest, p.serial);
  for (auto& p : pending_)
    if (p.serial == oldest)
      for (auto& e : p.events) waits.push_back(e.get());
  for (auto& p : promotions_)
    if (p.serial == oldest) waits.push_back(p.event.get());
  lock.unlock();
  cuda::synchronize_events(waits);  // an event recycled meanwhile only makes this wait longer
  lock.lock();
  poll_pending();
}

bool DevicePool::Impl::call_reclaimer(uint64_t bytes, ReclaimMode mode, cudaStream_t stream,
                                      std::unique_lock<std::mutex>& lock) {
  if (!reclaimer_) return false;
  Reclaimer reclaim = reclaimer_;
  ++reclaimer_calls_;
  lock.unlock();
  uint64_t freed = 0;
  try {
    freed = reclaim(bytes, mode, stream);
  } catch (...) {
    lock.lock();
    if (--reclaimer_calls_ == 0) reclaimer_idle_.notify_all();
    throw;
  }
  lock.lock();
  if (--reclaimer_calls_ == 0) reclaimer_idle_.notify_all();
  if (freed == 0) return false;
  poll_if_waiting();
  flush_quick();
  return true;
}

bool DevicePool::Impl::relieve(Relief relief, uint64_t bytes, cudaStream_t stream,
                               std::unique_lock<std::mutex>& lock) {
  caches_off();  // under pressure every block is the pool's (Note [Thread caches])
  switch (relief) {
    case Relief::kUnusedGranules:
      poll_if_waiting();
      flush_quick();
      break;
    case Relief::kReclaimNoWait:
      if (!call_reclaimer(bytes, ReclaimMode::kNoWait, stream, lock)) return false;
      break;
    case Relief::kDrainPending:
      if (pending_.empty() && promotions_.empty()) return false;
      drain_pending(lock);
      break;
    case Relief::kSynchronizeStream:
      // The allocating stream is alive (the caller is queueing work on it), so it can be
      // synchronized; other streams cannot (see Note [The pool]).
      flush_quick();
      if (stream == kAnyStream || !free_.count(stream) || !synchronize_and_retire(lock, stream)) return false;
      break;
    case Relief::kSynchronize: {
      flush_quick();
      bool tagged = false;
      for (auto& [tag, set] : free_) tagged |= tag != kAnyStream;
      if (!tagged || !synchronize_and_retire(lock, kAnyStream, stream)) return false;
      break;
    }
    case Relief::kReclaim:
      if (!call_reclaimer(bytes, ReclaimMode::kFull, stream, lock)) return false;
      break;
  }
  return true;
}

void DevicePool::Impl::flush_quick() {
  if (ThreadCache* c = own_cache(); c && c->cached_blocks > 0) empty_thread_cache(*c, false);
  if (quick_blocks_ == 0) return;
  for (auto& [key, list] : quick_)
    for (BlockIt b : list) release_block(b, key.stream);
  quick_.clear();
  quick_blocks_ = 0;
}

// Note [Thread caches]
// --------------------
// The hot path (an allocation of a size the thread freed before, on the same stream) takes
// no pool lock. Each thread has a cache per pool (thread_cache.h) to which the pool *lends*
// the ordinary blocks the thread allocates: the pool still counts them allocated (live, with
// their granules), and the cache knows each one's size and stream. The thread's free of a
// lent block on its own stream moves it to the cache's list for (stream, size), the thread's
// next allocation of that size on that stream takes it back: each with the cache's own lock,
// which no other thread takes unless the pool asks, so threads share no cache line. These
// are exactly the quick lists' rules (Note [The pool] in device_pool.h), per thread: at most
// kQuickPerSize blocks per (stream, size), the last freed first; the thread's first
// allocation that its cache cannot serve empties the cache into the free index (with the
// pool's quick lists), so that best fit sees its cached blocks. What the caches hold,
// counted in statistics, is subtracted from the pool's allocated bytes when read.
//
// Everything else goes through the pool under its mutex as before: a free on another stream,
// or of a block another thread allocated (the pool takes it back from that thread's cache:
// disown), record_stream (the block goes back to the pool), offloadable blocks, the free of
// a block the cache has no room for (released, as a full quick list releases it). A free of
// a block cached by some thread is a double free and is refused, as ever.
//
// Caches are an optimization for a pool with memory to spare: once the pool places for
// eviction (grouping()), remaps pages, records its history, or would reach half its limit,
// caches_off() empties every cache and the pool never lends again; its placement rules,
// pressure measures and records then see every block as they always did. A single thread
// gets the same blocks in the same places as from the pool's quick lists; with several
// threads, a thread's cached blocks are seen by best fit only once it misses (or under
// pressure), and the peak of allocated bytes may count other threads' cached blocks as
// allocated (it never misses a peak).
ThreadCache* DevicePool::Impl::own_cache_or_make() {
  if (ThreadCache* c = own_cache()) return c;
  if (tls_caches_gone) return nullptr;  // the thread is exiting
  tls_reaper.armed = true;              // constructs it: its destructor runs at the thread's exit
  if (tls_caches == nullptr) tls_caches = new ThreadCaches;
  auto cache = std::make_shared<ThreadCache>();
  auto& entries = tls_caches->entries;
  std::erase_if(entries, [](const auto& e) { return e.second->dead.load(std::memory_order_acquire); });
  entries.emplace_back(id_, cache);
  caches_.push_back(cache);
  return cache.get();
}

uint64_t DevicePool::Impl::cached_in_threads() const {
  uint64_t bytes = 0;
  for (const auto& c : caches_) {
    c->lock();
    bytes += c->cached_bytes;
    c->unlock();
  }
  return bytes;
}

void DevicePool::Impl::empty_thread_cache(ThreadCache& c, bool disown) {
  c.lock();
  c.drain_cached([&](uintptr_t addr, uint64_t rounded, cudaStream_t stream) {
    BlockIt b = blocks_.find(addr);
    allocated_ -= rounded;
    count_on_granules(addr, rounded, 0, -1);
    release_block(b, stream);
  });
  if (disown) {
    c.drain_live([&](uintptr_t addr) { blocks_.find(addr)->second.owner = nullptr; });
    num_allocs_ += std::exchange(c.allocs, 0);
    num_cache_hits_ += std::exchange(c.hits, 0);
    num_frees_ += std::exchange(c.frees, 0);
  }
  c.unlock();
}

void DevicePool::Impl::lend(void* p, uint64_t rounded, cudaStream_t stream) {
  ThreadCache* c = own_cache_or_make();
  if (c == nullptr) return;  // the thread is exiting: the block stays the pool's
  c->lock();
  c->add_live(reinterpret_cast<uintptr_t>(p), rounded, stream);
  c->unlock();
  blocks_.find(reinterpret_cast<uintptr_t>(p))->second.owner = c;
}

void DevicePool::Impl::caches_off() {
  caches_on_.store(false, std::memory_order_release);
  for (auto& c : caches_) {
    empty_thread_cache(*c, true);
    c->dead.store(true, std::memory_order_release);  // its thread drops it at its next registration
  }
  caches_.clear();
}

void DevicePool::Impl::reap_orphans() {
  for (size_t i = 0; i < caches_.size();) {
    if (!caches_[i]->orphaned.load(std::memory_order_acquire)) {
      ++i;
      continue;
    }
    empty_thread_cache(*caches_[i], true);
    caches_[i] = std::move(caches_.back());
    caches_.pop_back();
  }
}

void* DevicePool::Impl::take(BlockIt b, uintptr_t start, uint64_t size, cudaStream_t stream, bool offloadable,
                             bool mapped_new) {
  index_erase(b);
  {  // split off the part before `start`
    const uint64_t head = start - b->first;
    if (head) {
      Block rest{b->second.size - head, State::kFree, b->second.tag, {}};
      rest.serial = b->second.serial;
      b->second.size = head;
      index_insert(b);
      b = blocks_.emplace(b->first + head, rest).first;
    }
  }
  if (b->second.size > size) {  // split: the rest stays free under the same tag
    Block rest{b->second.size - size, State::kFree, b->second.tag, {}};
    rest.serial = b->second.serial;  // untouched since that release: its promotion still holds
    b->second.size = size;
    index_insert(blocks_.emplace(b->first + size, rest).first);
  }
  b->second.state = State::kLive;
  b->second.tag = stream;
  b->second.offloadable = offloadable;
  b->second.away = false;
  count_on_granules(b->first, size, offloadable, +1);
  if (offloadable && size < granularity_ / 2) open_[stream] = granule_index(b->first + size - 1);
  allocated_ += size;
  const uint64_t in_use = allocated_ - own_cached();  // Note [Thread caches]
  peak_allocated_ = std::max(peak_allocated_, in_use);
  allocated_high_ = std::max(allocated_high_, in_use);
  ++num_allocs_;
  if (!mapped_new) ++num_cache_hits_;
  return reinterpret_cast<void*>(b->first);
}

void* DevicePool::Impl::take_quick(uint64_t rounded, cudaStream_t stream, bool offloadable) {
  auto q = quick_.find({stream, rounded, offloadable});
  if (q == quick_.end() || q->second.empty()) return nullptr;
  BlockIt b = q->second.back();
  // The other kind may have come to its granules since it was freed.
  if (closed_to(granule_index(b->first), offloadable, stream) ||
      closed_to(granule_index(b->first + rounded - 1), offloadable, stream))
    return nullptr;
  if (cuts_busy_run(b->first, rounded)) return nullptr;
  q->second.pop_back();
  --quick_blocks_;
  b->second.state = State::kLive;
  b->second.offloadable = offloadable;
  b->second.away = false;
  count_on_granules(b->first, rounded, offloadable, +1);
  if (offloadable) open_[stream] = granule_index(b->first + rounded - 1);
  allocated_ += rounded;
  const uint64_t in_use = allocated_ - own_cached();  // Note [Thread caches]
  peak_allocated_ = std::max(peak_allocated_, in_use);
  allocated_high_ = std::max(allocated_high_, in_use);
  ++num_allocs_;
  ++num_cache_hits_;
  return reinterpret_cast<void*>(b->first);
}

void* DevicePool::Impl::allocate(size_t size, cudaStream_t stream, std::string* error) {
  error->clear();
  if (size == 0) return nullptr;
  // The hot path: the thread's own cache (Note [Thread caches]).
  if (caches_on_.load(std::memory_order_acquire) && size <= va_.size()) {
    if (ThreadCache* c = own_cache()) {
      c->lock();
      const uintptr_t p = c->take(stream, round_up(size, kAlignment));
      c->unlock();
      if (p) return reinterpret_cast<void*>(p);
    }
  }
  std::unique_lock lock(mu_);
  if (size > va_.size()) {
    ++num_ooms_;
    trace_oom(size, stream);
    *error = oom_report(size, size, "the pool's address range");
    return nullptr;
  }
  const uint64_t rounded = round_up(size, kAlignment);
  check_caches(rounded);
  poll_before_allocating();
  void* p = nullptr;
  const ThreadCache* own = own_cache();
  if (quick_blocks_ || (own && own->cached_blocks > 0)) {
    p = take_quick(rounded, stream, false);
    // A miss: merge the quick lists (and this thread's cache) so that best fit sees every
    // cached block.
    if (!p) flush_quick();
  }
  if (!p) p = allocate_slow(size, rounded, stream, false, false, lock, error);
  if (p && caches_on_.load(std::memory_order_relaxed)) lend(p, rounded, stream);
  return traced_alloc(p, size, stream);
}

void* DevicePool::Impl::allocate_offloadable(size_t size, cudaStream_t stream, std::string* error,
                                             uint64_t* placed) {
  error->clear();
  if (placed) *placed = 0;
  if (size == 0) return nullptr;
  std::unique_lock lock(mu_);
  if (size > va_.size() - granularity_) {
    ++num_ooms_;
    trace_oom(size, stream);
    *error = oom_report(size, size, "the pool's address range");
    return nullptr;
  }
  check_caches(round_up(size, kAlignment));
  poll_before_allocating();
  uint64_t rounded = round_up(size, kAlignment);  // the block's size, whichever path takes it
  void* p = nullptr;
  if (rounded < granularity_ / 2) {
    // Below half a granule: placed as allocate() places any block (its quick lists
    // included), so that tagging costs no memory (under the rules of closed_to()).
    if (quick_blocks_) p = take_quick(rounded, stream, true);
    if (!p) {
      flush_quick();
      p = allocate_slow(size, rounded, stream, true, false, lock, error);
    }
  } else {
    // Larger: whole granules of its own while placing for eviction (its eviction frees all
    // of it), else densely, as allocate() would place it (nothing is evicted).
    flush_quick();
    const bool own = grouping();
    if (own) rounded = placed_size(size);
    p = allocate_slow(size, rounded, stream, true, own, lock, error);
  }
  if (p && placed) *placed = rounded;
  return traced_alloc(p, size, stream);
}

void* DevicePool::Impl::allocate_slow(size_t size, uint64_t rounded, cudaStream_t stream, bool offloadable,
                                      bool aligned, std::unique_lock<std::mutex>& lock, std::string* error) {
  std::string why;
  // What the reclaimer is asked for: what the last refused mapping lacked, so that it gives
  // up no more than needed (every block it gives up must come back later).
  uint64_t lacking = rounded;
  constexpr Relief kSteps[] = {Relief::kUnusedGranules,     Relief::kReclaimNoWait,   Relief::kDrainPending,
                               Relief::kSynchronizeStream, Relief::kSynchronize, Relief::kReclaim};
  // A place for the block (find_fit's, `strict` as there) mapped and taken, or nullptr.
  auto place = [&](bool strict) -> void* {
    uintptr_t start = 0;
    BlockIt b = find_fit(rounded, stream, offloadable, aligned, &start, strict);
    // Note [Placing on mapped pages]
    const uint64_t granules = (rounded + granularity_ - 1) / granularity_;
    if (b != blocks_.end() && rounded >= granularity_ / 2 && grouping() && pages_scarce(granules + !aligned) &&
        away_blocks_ == 0) {
      const uint64_t missing = unmapped_in(start, rounded);
      uintptr_t other = 0;
      uint64_t other_missing = 0;
      BlockIt c = find_mapped_fit(rounded, stream, offloadable, aligned, &other, strict, &other_missing);
      if (c != blocks_.end() && other_missing < missing && 2 * (missing - other_missing) >= granules) {
        b = c;
        start = other;
      }
    }
    if (b == blocks_.end()) {
      why = "the pool's address range";
      return nullptr;
    }
    const uint64_t reserved_before = reserved_;
    if (!unmap_cut_runs(start, rounded)) {
      why = "CUDA's refusal to unmap";
      return nullptr;
    }
    if (!map_range(start, rounded, &why, &lacking)) return nullptr;
    return take(b, start, rounded, stream, offloadable, reserved_ != reserved_before);
  };
  for (size_t step = 0; step <= std::size(kSteps); ++step) {
    if (step > 0 && !relieve(kSteps[step - 1], lacking, stream, lock)) continue;
    if (void* p = place(true)) return p;
    if (step > 0 && kSteps[step - 1] == Relief::kDrainPending && waiting()) --step;  // the next oldest
  }
  // Placing for eviction is a preference, never a reason to fail: any hole on the mapped
  // granules, closed ones included, before an out-of-memory.
  if (grouping())
    if (void* p = place(false)) return p;
  ++num_ooms_;
  trace_oom(size, stream);
  *error = oom_report(size, rounded, why);
  return nullptr;
}

Result DevicePool::Impl::unmap_block(void* ptr, bool* partly, uint64_t* freed) {
  if (partly) *partly = false;
  if (freed) *freed = 0;
  std::lock_guard lock(mu_);
  auto b = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (b == blocks_.end() || b->second.state != State::kLive || !b->second.offloadable)
    return {false, "unmap of " + pointer_name(ptr) + ": not a live offloadable block"};
  if (b->second.away) return {false, "unmap of " + pointer_name(ptr) + ": already given up (unmapped)"};
  caches_off();  // pages are remapped from now on (Note [Thread caches])
  cuda::ContextScope scope(device_);
  b->second.away = true;  // so that granule_idle() sees its own granules as free of it
  remapping_ = true;
  ++away_blocks_;
  uint64_t done = 0;
  for (uint64_t g = granule_index(b->first), last = granule_index(b->first + b->second.size - 1); g <= last; ++g) {
    if (!mapped(g)) continue;
    const uint64_t head = granules_[g].head, n = granules_[head].count;
    g = head + n - 1;  // the loop goes on after the run
    if (!range_idle(head, n)) continue;  // shared with a block that needs it
    try {
      cause_ = TraceEvent::Cause::kEvict;
      unmap_run(head);
      cause_ = TraceEvent::Cause::kNone;
    } catch (const cuda::CudaError& e) {
      cause_ = TraceEvent::Cause::kNone;
      // That run stays mapped. The block counts as away once any granule went (a later
      // map_block maps what is missing); with none gone nothing changed.
      b->second.away = done > 0;
      if (done == 0) --away_blocks_;
      if (partly) *partly = done > 0;
      if (freed) *freed = done * granularity_;
      return {false, "unmap of " + pointer_name(ptr) + ": " + e.what()};
    }
    done += n;
  }
  if (freed) *freed = done * granularity_;
  return {};
}

Result DevicePool::Impl::map_block(void* ptr, MapWait wait, cudaStream_t stream) {
  std::unique_lock lock(mu_);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  auto b = blocks_.find(addr);
  if (b == blocks_.end() || b->second.state != State::kLive || !b->second.offloadable || !b->second.away)
    return {false, "map of " + pointer_name(ptr) + ": not a live offloadable block that was given up (unmap_block)"};
  const uint64_t size = b->second.size;
  caches_off();
  std::string why;
  // The pool's own measures, as for an allocation (no reclaim: the caller is the
  // reclaimer's owner), as far as `wait` allows.
  const Relief last = wait == MapWait::kStream ? Relief::kSynchronizeStream : Relief::kSynchronize;
  const Relief kSteps[] = {Relief::kUnusedGranules, Relief::kDrainPending, last};
  const size_t steps = wait == MapWait::kSynchronize || wait == MapWait::kStream ? 3
                       : wait == MapWait::kPendingFrees                           ? 2
                                                                                  : 1;
  for (size_t step = 0; step <= steps; ++step) {
    if (step > 0 && !relieve(kSteps[step - 1], size, wait == MapWait::kStream ? stream : kAnyStream, lock)) continue;
    uint64_t lacking = 0;
    cause_ = TraceEvent::Cause::kFetch;
    bool done = false;
    try {
      done = map_range(addr, size, &why, &lacking);
    } catch (...) {
      cause_ = TraceEvent::Cause::kNone;
      throw;
    }
    cause_ = TraceEvent::Cause::kNone;
    if (done) {
      blocks_.at(addr).away = false;
      --away_blocks_;
      return {};
    }
    if (step > 0 && kSteps[step - 1] == Relief::kDrainPending && waiting()) --step;  // the next oldest
  }
  return {false, "map of " + pointer_name(ptr) + " (" + format_size(size) + "): refused by " + why + ": " +
                     oom_report(size, size, why),
          true};
}

DevicePool::Impl::BlockIt DevicePool::Impl::find_live(void* ptr, Result* refusal) {
  auto b = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (b != blocks_.end() && b->second.state == State::kLive) return b;
  if (!owns(ptr)) *refusal = {false, "free of " + pointer_name(ptr) + ": not a pointer vramswap allocated"};
  else if (b != blocks_.end()) *refusal = {false, "free of " + pointer_name(ptr) + ": already freed (double free)"};
  else
    *refusal = {false, "free of " + pointer_name(ptr) +
                           ": not the start of a block vramswap handed out (an interior or stale pointer)"};
  return blocks_.end();
}

std::vector<cudaStream_t> DevicePool::Impl::users_besides(const Block& block, cudaStream_t except) {
  // A free that names no stream (kAnyStream) comes after a synchronization of everything
  // the program queued; only streams named by record_stream (the engine's copy streams
  // among them) are still waited for. kAnyStream itself is never a stream to wait on.
  std::vector<cudaStream_t> users = block.also_on;
  if (except != kAnyStream) users.push_back(block.tag);
  std::erase(users, except);
  std::erase(users, kAnyStream);
  std::sort(users.begin(), users.end());
  users.erase(std::unique(users.begin(), users.end()), users.end());
  return users;
}

bool DevicePool::Impl::record_events(const std::vector<cudaStream_t>& streams, std::vector<cuda::Event>* events,
                                     std::string* why) {
  try {
    for (cudaStream_t s : streams) {
      cuda::Event e = events_.acquire();
      try {
        e.record(s);
      } catch (...) {
        events_.release(std::move(e));
        throw;
      }
      events->push_back(std::move(e));
    }
    return true;
  } catch (const cuda::CudaError& e) {
    for (auto& event : *events) events_.release(std::move(event));
    events->clear();
    *why = e.what();
    return false;
  }
}

void DevicePool::Impl::count_free(BlockIt b) {
  allocated_ -= b->second.size;
  count_on_granules(b->first, b->second.size, b->second.offloadable, -1);
  ++num_frees_;
}

void DevicePool::Impl::hold_back(BlockIt b, std::vector<cuda::Event> events, cudaStream_t tag_after) {
  b->second.state = State::kPending;
  b->second.also_on.clear();
  pending_.push_back(Pending{{b->first}, std::move(events), tag_after, ++next_serial_});
}

bool DevicePool::Impl::free_after_device_synchronization(void* ptr, cudaStream_t stream,
                                                         std::unique_lock<std::mutex>& lock, Result* result) {
  if (!device_synchronization_allowed(stream)) return false;
  lock.unlock();
  const bool synchronized = cuda::synchronize_device(device_);
  lock.lock();
  BlockIt b = find_live(ptr, result);  // another thread may have freed it meanwhile
  if (b == blocks_.end() || !synchronized) return false;
  count_free(b);
  history_.add(TraceEvent::Action::kFreeRequested, b->first, traced_size(b->second), stream_id(stream));
  history_.add(TraceEvent::Action::kFreeCompleted, b->first, traced_size(b->second), stream_id(stream));
  b->second.requested = 0;
  release_block(b, kAnyStream);
  return true;
}

Result DevicePool::Impl::free_behind(void* ptr, cudaStream_t stream, bool to_any) {
  if (!ptr) return {};
  std::unique_lock lock(mu_);
  Result result;
  BlockIt b = find_live(ptr, &result);
  if (b == blocks_.end()) return result;
  // A block lent to a thread's cache comes back to the pool; one cached there was freed
  // already (Note [Thread caches]).
  bool own_cache_full = false;
  if (ThreadCache* owner = b->second.owner) {
    owner->lock();
    const bool live = owner->disown(b->first);
    owner->unlock();
    if (!live) return {false, "free of " + pointer_name(ptr) + ": already freed (double free)"};
    b->second.owner = nullptr;
    own_cache_full = owner == own_cache();  // its own thread's free that its cache had no room for
  }
  // Work queued before the free on every stream that used the block must finish before
  // another stream reuses it. The freeing stream orders reuse on itself; any other stream
  // that used the block (the allocation stream, record_stream's) gets an event now. Events
  // are recorded before anything changes, so a refusal leaves the block live and counted.
  std::vector<cudaStream_t> others = users_besides(b->second, stream);
  const bool promote = to_any && stream != kAnyStream;
  if (promote) others.push_back(stream);  // alone: a promotion; else behind all, then any stream
  std::vector<cuda::Event> events;
  std::string why;
  if (!record_events(others, &events, &why)) {
    // A stream that used the block takes no event (the program destroyed it, or CUDA
    // refused): order reuse after everything on the device instead.
    if (free_after_device_synchronization(ptr, stream, lock, &result)) return {};
    if (!result.ok) return result;
    return {false, "free of " + pointer_name(ptr) + ": its reuse cannot be ordered after the streams that used it (" +
                       why + "), and synchronizing device " + std::to_string(device_) +
                       " failed too; the block stays allocated"};
  }
  count_free(b);
  Block& block = b->second;
  history_.add(TraceEvent::Action::kFreeRequested, b->first, traced_size(block), stream_id(stream));
  const bool promotion = promote && others.size() == 1 && others.front() == stream;
  if (events.empty() || promotion) {  // reusable now by the freeing stream; else once the events complete
    history_.add(TraceEvent::Action::kFreeCompleted, b->first, traced_size(block), stream_id(stream));
    block.requested = 0;
  }
  if (promotion) {
    // Reusable at once by the freeing stream (its later work is ordered after the free, as
    // for deallocate()), and by any stream once the event recorded now completes.
    const uintptr_t addr = b->first;
    const uint64_t serial = ++next_serial_;
    release_block(b, stream, serial);
    promotions_.push_back({addr, serial, stream, std::move(events.front())});
  } else if (!events.empty()) {
    hold_back(b, std::move(events), to_any ? kAnyStream : stream);
  } else if (auto& list = quick_[{stream, block.size, block.offloadable}];
             !to_any && !block.away && !(block.offloadable && block.size >= granularity_ / 2) &&  // own span
             !own_cache_full && list.size() < kQuickPerSize) {
    block.state = State::kQuick;
    block.tag = stream;
    block.also_on.clear();
    list.push_back(b);
    ++quick_blocks_;
  } else {
    release_block(b, stream);
  }
  return {};
}

Result DevicePool::Impl::deallocate(void* ptr, cudaStream_t stream) {
  // The hot path: a block lent to this thread's cache, freed on its own stream (Note
  // [Thread caches]).
  if (ptr && caches_on_.load(std::memory_order_acquire)) {
    if (ThreadCache* c = own_cache()) {
      c->lock();
      const bool cached = c->give(reinterpret_cast<uintptr_t>(ptr), stream);
      c->unlock();
      if (cached) return {};
    }
  }
  return free_behind(ptr, stream, false);
}

Result DevicePool::Impl::deallocate_to_any(void* ptr, cudaStream_t stream) { return free_behind(ptr, stream, true); }

Result DevicePool::Impl::record_stream(void* ptr, cudaStream_t stream) {
  std::lock_guard lock(mu_);
  auto b = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (b == blocks_.end() || b->second.state != State::kLive)
    return {false, "record_stream on " + pointer_name(ptr) +
                       ": not a live block vramswap allocated"};
  if (ThreadCache* owner = b->second.owner) {
    // Used by another stream now: the pool's again (its free needs an event).
    owner->lock();
    const bool live = owner->disown(b->first);
    owner->unlock();
    if (!live)
      return {false, "record_stream on " + pointer_name(ptr) + ": not a live block vramswap allocated (freed)"};
    b->second.owner = nullptr;
  }
  if (stream != b->second.tag && std::find(b->second.also_on.begin(), b->second.also_on.end(), stream) ==
                                     b->second.also_on.end())
    b->second.also_on.push_back(stream);
  return {};
}

Result DevicePool::Impl::stream_destroyed(cudaStream_t stream) {
  if (stream == kAnyStream || stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
    return {};  // the default streams are never destroyed
  std::unique_lock lock(mu_);
  // Another thread may be synchronizing it (its cached blocks being retired): the stream must
  // outlive that call.
  synced_.wait(lock, [&] { return std::find(syncing_.begin(), syncing_.end(), stream) == syncing_.end(); });
  open_.erase(stream);
  for (auto& c : caches_) empty_thread_cache(*c, true);  // every block the pool's to retag
  flush_quick();
  auto names = [&](const Block& b) {
    return b.state == State::kLive &&
           (b.tag == stream || std::find(b.also_on.begin(), b.also_on.end(), stream) != b.also_on.end());
  };
  bool known = free_.count(stream) > 0;
  for (const Pending& p : pending_) known = known || p.tag_after == stream;
  for (const Promotion& p : promotions_) known = known || p.tag == stream;
  for (auto it = blocks_.begin(); !known && it != blocks_.end(); ++it) known = names(it->second);
  if (!known) return {};
  // Its queued work done, nothing needs to wait on it: the blocks it freed go to any stream
  // (synchronize_and_retire), and the events already recorded on it have completed.
  if (!synchronize_and_retire(lock, stream))
    return {false, "the stream about to be destroyed could not be synchronized on device " + std::to_string(device_) +
                       "; the blocks it used keep waiting on it"};
  for (auto& [addr, b] : blocks_) {
    if (b.state != State::kLive) continue;
    if (b.tag == stream) b.tag = kAnyStream;
    std::erase(b.also_on, stream);
  }
  // Blocks still waiting for other streams' events would become free for it: for any.
  for (Pending& p : pending_)
    if (p.tag_after == stream) p.tag_after = kAnyStream;
  return {};
}

Result DevicePool::Impl::grant_peer(int peer) {
  if (peer < 0 || peer >= 64 || peer == device_) return {};  // a pool's own device has access
  const uint64_t bit = uint64_t(1) << peer;
  std::lock_guard lock(mu_);
  if (peers_ & bit) return {};
  for (uint64_t g = 0; g < mapped_top_; ++g) {
    if (granules_[g].head != g || !granules_[g].mapping) continue;
    try {
      granules_[g].mapping.grant(peer);
    } catch (const cuda::CudaError& e) {
      return {false, "granting device " + std::to_string(peer) + " access to device " + std::to_string(device_) +
                         "'s memory at " + pointer_name(reinterpret_cast<void*>(va_.base() + g * granularity_)) +
                         " failed: " + e.what()};
    }
  }
  peers_ |= bit;
  return {};
}

void DevicePool::Impl::empty_cache() {
  std::unique_lock lock(mu_);
  poll_pending();
  for (auto& c : caches_) empty_thread_cache(*c, false);
  flush_quick();
  synchronize_and_retire(lock, kAnyStream);
  unmap_unused(UINT64_MAX);
  release_spare();
}

PoolStats DevicePool::Impl::stats() const {
  std::lock_guard lock(mu_);
  PoolStats s;
  // What the threads' caches did and hold (Note [Thread caches]).
  for (const auto& c : caches_) {
    c->lock();
    s.allocated_bytes -= c->cached_bytes;  // unsigned: wraps back below with allocated_ added
    s.num_allocs += c->allocs;
    s.num_cache_hits += c->hits;
    s.num_frees += c->frees;
    s.num_free_blocks += c->cached_blocks;
    c->unlock();
  }
  s.allocated_bytes += allocated_;
  s.reserved_bytes = reserved_;
  s.mapped_bytes = mapped_;
  s.peak_mapped_bytes = peak_mapped_;
  s.spare_bytes = spare_bytes_;
  s.peak_allocated_bytes = peak_allocated_;
  s.peak_reserved_bytes = peak_reserved_;
  s.limit_bytes = limit_;
  s.num_allocs += num_allocs_;
  s.num_frees += num_frees_;
  s.num_cache_hits += num_cache_hits_;
  s.num_ooms = num_ooms_;
  for (auto& [key, set] : free_) s.num_free_blocks += set.size();
  s.num_free_blocks += quick_blocks_;
  s.va_reserved_bytes = va_.size();
  return s;
}

DevicePool::Census DevicePool::Impl::live_below(uint64_t bytes) const {
  std::lock_guard lock(mu_);
  Census c;
  for (const auto& [addr, b] : blocks_) {
    if (b.state != State::kLive) continue;
    if (b.offloadable) c.offloadable_bytes += b.size;
    if (b.size < bytes) {
      ++c.blocks;
      c.bytes += b.size;
    }
  }
  return c;
}

DevicePool::MemoryView DevicePool::Impl::memory_view() const {
  std::lock_guard lock(mu_);
  MemoryView v;
  for (uint64_t g = 0; g < mapped_top_; ++g) {
    if (!mapped(g)) continue;
    const uintptr_t addr = va_.base() + g * granularity_;
    if (!v.mapped.empty() && v.mapped.back().first + v.mapped.back().second == addr) v.mapped.back().second += granularity_;
    else v.mapped.emplace_back(addr, granularity_);
  }
  std::unordered_set<uintptr_t> cached;  // freed into a thread's cache: free to the program
  for (const auto& c : caches_) {
    c->lock();
    c->for_each([&](uintptr_t addr, uint64_t, cudaStream_t, bool is_cached) {
      if (is_cached) cached.insert(addr);
    });
    c->unlock();
  }
  v.blocks.reserve(blocks_.size());
  for (const auto& [addr, b] : blocks_) {
    BlockView w;
    w.addr = addr;
    w.size = b.size;
    w.state = b.state == State::kLive && !cached.count(addr)            ? BlockView::State::kLive
              : b.state == State::kLive                                   ? BlockView::State::kFree
              : b.state == State::kPending || b.state == State::kRetiring ? BlockView::State::kPendingFree
                                                                           : BlockView::State::kFree;
    w.offloadable = b.state == State::kLive && b.offloadable;
    w.away = b.state == State::kLive && b.away;
    w.stream = stream_id(b.tag);
    w.requested = b.state == State::kLive ? traced_size(b) : b.size;
    v.blocks.push_back(w);
  }
  v.trace = history_.events();
  return v;
}

std::string DevicePool::Impl::check_invariants() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> broken;
  auto expect = [&](bool holds, const std::string& what) {
    if (!holds && broken.size() < 16) broken.push_back(what);
  };
  uintptr_t at = va_.base();
  uint64_t live = 0, quick = 0, free_blocks = 0, away = 0;
  std::vector<uintptr_t> needs_pages(granules_.size(), 0);  // a block that needs them
  std::vector<uint32_t> live_on[2];
  for (auto& counts : live_on) counts.assign(granules_.size(), 0);
  const Block* prev = nullptr;
  for (const auto& [addr, b] : blocks_) {
    expect(addr == at, "block " + pointer_name(reinterpret_cast<void*>(addr)) + " does not follow its neighbour");
    expect(b.size > 0 && addr % kAlignment == 0 && b.size % kAlignment == 0,
           "block " + pointer_name(reinterpret_cast<void*>(addr)) + " is not 512-byte aligned and sized");
    at = addr + b.size;
    if (b.state == State::kLive) {
      live += b.size;
      for (uint64_t g = granule_index(addr), last = granule_index(addr + b.size - 1); g <= last; ++g)
        ++live_on[b.offloadable][g];
    }
    if (b.state == State::kQuick) ++quick;
    if (b.away) ++away;
    if (b.state == State::kFree) {
      ++free_blocks;
      auto index = free_.find(b.tag);
      expect(index != free_.end() && index->second.count({b.size, addr}) == 1,
             "free block " + pointer_name(reinterpret_cast<void*>(addr)) + " is missing from the free index");
      expect(!(prev && prev->state == State::kFree && prev->tag == b.tag),
             "free blocks with the same tag next to each other at " + pointer_name(reinterpret_cast<void*>(addr)));
    }
    expect(!b.away || (b.offloadable && (b.state == State::kLive || b.state == State::kPending)),
           "block " + pointer_name(reinterpret_cast<void*>(addr)) + " is away but not a live offloadable one");
    // An evicted block may be freed, then pending; a free one may be retiring.
    if (b.state != State::kFree && b.state != State::kRetiring && !b.away)
      for (uint64_t g = granule_index(addr), last = granule_index(addr + b.size - 1); g <= last; ++g)
        needs_pages[g] = addr;
    prev = &b;
  }
  expect(at == va_.base() + va_.size(), "the blocks do not cover the reservation");
  expect(live == allocated_, "allocated_bytes " + std::to_string(allocated_) + " but live blocks hold " +
                                 std::to_string(live));
  expect(away == away_blocks_, "the pool counts " + std::to_string(away_blocks_) + " blocks away, " +
                                  std::to_string(away) + " are");
  expect(quick == quick_blocks_, "quick lists count " + std::to_string(quick_blocks_) + " blocks, " +
                                     std::to_string(quick) + " are quick-listed");
  // Note [Thread caches]: each cache's blocks are live ordinary blocks lent to it, of the
  // sizes it knows; and every block lent to a cache is one of its blocks.
  uint64_t lent = 0, in_caches = 0;
  for (const auto& [addr, b] : blocks_) lent += b.owner != nullptr;
  expect(caches_on_.load() || caches_.empty(), "thread caches are off but " + std::to_string(caches_.size()) +
                                                   " are registered");
  for (const auto& c : caches_) {
    c->lock();
    c->for_each([&](uintptr_t addr, uint64_t rounded, cudaStream_t, bool) {
      ++in_caches;
      auto b = blocks_.find(addr);
      expect(b != blocks_.end() && b->second.state == State::kLive && b->second.owner == c.get() &&
                 b->second.size == rounded && !b->second.offloadable,
             "thread cache block " + pointer_name(reinterpret_cast<void*>(addr)) +
                 " is not a live ordinary block of its size lent to that cache");
    });
    c->unlock();
  }
  expect(lent == in_caches, std::to_string(lent) + " blocks are lent to thread caches, which hold " +
                                std::to_string(in_caches));
  uint64_t indexed = 0;
  for (const auto& [key, set] : free_) indexed += set.size();
  expect(indexed == free_blocks, "the free index holds " + std::to_string(indexed) + " entries for " +
                                     std::to_string(free_blocks) + " free blocks");
  uint64_t mapped_bytes = 0;
  for (uint64_t g = 0; g < granules_.size(); ++g) {
    if (mapped(g)) {
      mapped_bytes += granularity_;
      const uint64_t head = granules_[g].head;
      const Granule& h = granules_[head];
      expect(head <= g && granules_[head].head == head && head + h.count > g && h.mapping &&
                 h.pages.size() == h.count * granularity_ && (g < mapped_top_),
             "granule " + std::to_string(g) + " lies in no well-formed run (head " + std::to_string(head) + ", " +
                 std::to_string(h.count) + " granules)");
    } else {
      expect(!granules_[g].mapping && granules_[g].count == 0,
             "granule " + std::to_string(g) + " is unmapped but holds a mapping");
    }
    expect(live_on[0][g] == live_on_[0][g] && live_on[1][g] == live_on_[1][g],
           "granule " + std::to_string(g) + " counts " + std::to_string(live_on_[0][g]) + " ordinary and " +
               std::to_string(live_on_[1][g]) + " offloadable live blocks, but " + std::to_string(live_on[0][g]) +
               " and " + std::to_string(live_on[1][g]) + " touch it");
    if (needs_pages[g] && !mapped(g)) {
      const Block& b = blocks_.at(needs_pages[g]);
      const char* state = b.state == State::kLive ? "live" : b.state == State::kPending ? "pending" : "quick-listed";
      expect(false, "granule " + std::to_string(g) + " under a block in use is not mapped (block " +
                        pointer_name(reinterpret_cast<void*>(needs_pages[g])) + ", " + format_size(b.size) + ", " +
                        state + (b.offloadable ? ", offloadable" : "") + ")");
    }
  }
  expect(mapped_bytes == mapped_, "mapped_bytes " + std::to_string(mapped_) + " but " + std::to_string(mapped_bytes) +
                                " bytes of granules are mapped");
  uint64_t spare = 0;
  for (const cuda::PhysicalPages& pages : spare_) spare += pages.size();
  expect(spare == spare_bytes_, "spare pages hold " + std::to_string(spare) + " bytes, the pool counts " +
                                    std::to_string(spare_bytes_));
  expect(reserved_ == mapped_ + spare_bytes_,
         "reserved_bytes " + std::to_string(reserved_) + " is not mapped plus spare");
  expect(reserved_ <= limit_, "reserved_bytes " + std::to_string(reserved_) + " passed the limit");
  std::string text;
  for (const std::string& b : broken) text += (text.empty() ? "" : "; ") + b;
  return text;
}

void DevicePool::Impl::reset_peaks() {
  std::lock_guard lock(mu_);
  peak_allocated_ = allocated_ - cached_in_threads();
  peak_reserved_ = reserved_;
  peak_mapped_ = mapped_;
}

std::string DevicePool::Impl::oom_report(size_t requested, uint64_t rounded, const std::string& why) const {
  uint64_t cached_free = 0;  // mapped bytes in no live block
  cached_free = reserved_ > allocated_ ? reserved_ - allocated_ : 0;
  size_t device_free = 0, device_total = 0;
  cuda::device_memory(device_, &device_free, &device_total);
  return "out of memory on device " + std::to_string(device_) + ": cannot allocate " + format_size(requested) + " (" +
         std::to_string(requested) + " bytes, " + std::to_string(rounded) + " rounded) within " + why +
         ". Limit " + format_size(limit_) + " of a " + format_size(card_bytes_) + " card; pool: " +
         format_size(allocated_) + " allocated, " + format_size(reserved_) + " reserved (mapped), " +
         format_size(cached_free) + " reserved but free; the device reports " + format_size(device_free) +
         " free. Free tensors or lower the batch size, or raise VRAMSWAP_LIMIT.";
}

DevicePool::DevicePool(const PoolOptions& options) : impl_(std::make_unique<Impl>(options)) {}
DevicePool::~DevicePool() = default;
void* DevicePool::allocate(size_t size, cudaStream_t stream, std::string* error) {
  return impl_->allocate(size, stream, error);
}
Result DevicePool::deallocate(void* ptr, cudaStream_t stream) { return impl_->deallocate(ptr, stream); }
uint64_t DevicePool::take_allocated_high() { return impl_->take_allocated_high(); }
Result DevicePool::record_stream(void* ptr, cudaStream_t stream) { return impl_->record_stream(ptr, stream); }
Result DevicePool::stream_destroyed(cudaStream_t stream) { return impl_->stream_destroyed(stream); }
Result DevicePool::grant_peer(int peer) { return impl_->grant_peer(peer); }
void DevicePool::empty_cache() { impl_->empty_cache(); }
PoolStats DevicePool::stats() const { return impl_->stats(); }
DevicePool::Census DevicePool::live_below(uint64_t bytes) const { return impl_->live_below(bytes); }
void DevicePool::record_history(size_t max_entries) { impl_->record_history(max_entries); }
DevicePool::MemoryView DevicePool::memory_view() const { return impl_->memory_view(); }
bool DevicePool::shares_granule_with_ordinary(const void* ptr) const { return impl_->shares_granule_with_ordinary(ptr); }
void* DevicePool::allocate_offloadable(size_t size, cudaStream_t stream, std::string* error, uint64_t* placed) {
  return impl_->allocate_offloadable(size, stream, error, placed);
}
Result DevicePool::unmap_block(void* ptr, bool* partly, uint64_t* freed) {
  return impl_->unmap_block(ptr, partly, freed);
}
void DevicePool::count_out_of_memory() { impl_->count_out_of_memory(); }
Result DevicePool::map_block(void* ptr, MapWait wait, cudaStream_t stream) {
  return impl_->map_block(ptr, wait, stream);
}
Result DevicePool::deallocate_to_any(void* ptr, cudaStream_t stream) { return impl_->deallocate_to_any(ptr, stream); }
void DevicePool::set_reclaimer(Reclaimer reclaimer) { impl_->set_reclaimer(std::move(reclaimer)); }
uint64_t DevicePool::granularity() const { return impl_->granularity(); }
uint64_t DevicePool::placed_size(uint64_t size) const { return impl_->placed_size(size); }
void DevicePool::reset_peaks() { impl_->reset_peaks(); }
std::string DevicePool::check_invariants() const { return impl_->check_invariants(); }
bool DevicePool::owns(const void* ptr) const { return impl_->owns(ptr); }
int DevicePool::device() const { return impl_->device(); }

}  // namespace vramswap::pool
