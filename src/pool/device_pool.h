// DevicePool: vramswap's caching allocator for one device, built on CUDA VMM.
//
// Note [The pool]
// ---------------
// The pool owns one large reservation of device virtual addresses (a few times the card)
// and carves blocks out of it. Physical memory is mapped per granule (2 MiB on current
// GPUs) under the granules that allocated or cached blocks cover, and only there: a
// granule is mapped when a block that touches it is handed out and stays mapped (cached)
// after the block is freed, until empty_cache() or pressure unmaps granules no live block
// touches. Once the pool is under pressure, the granules a block covers whole are mapped
// as one run (one physical allocation and one map call: on a GPU each call costs tens of
// microseconds however large), unmapped only whole, and no block is placed so that it
// would take part of a run another block still needs (Note [Runs] in granules.cpp).
// The pool's "reserved" memory is its mapped granules and spare pages; the limit caps it.
//
// Blocks are 512-byte aligned and sized in 512-byte units. All blocks, free or not, are
// kept in address order; a free block is merged with free neighbours of the same stream
// tag, and the free ones are indexed by (size, address) per tag for best fit. A larger
// free block is split when the rest is worth keeping.
//
// Stream-ordered reuse (the rules of PyTorch's caching allocator): a block freed on
// stream S is reusable at once by an allocation on S (its tag is S). Any other stream
// that used the block (record_stream's, or the allocation stream when the free names
// another) gets an event recorded at free time, and the block is held back until those
// events complete. A block tagged S becomes reusable by any stream only after S, or the
// device, has been synchronized, which the pool does only under pressure or in
// empty_cache(): no event is ever recorded on S after the free, because S may have been
// destroyed by then. S itself is synchronized when it is known to be alive (the allocating
// stream; every stream when the program reports the streams it destroys, as the preload
// does: PoolOptions::streams_reported), the device otherwise. A capture forbids both: a
// capturing stream is never synchronized, and the device is not while the allocating
// stream captures (a device synchronization while any stream of the device captures
// invalidates that capture in every mode); events are queried in the relaxed mode.
// Pending events are polled at the start of an allocation when there are any.
//
// The hot path: a block freed on S with nothing to wait for goes, whole and unmerged, to
// a quick list for (S, rounded size) (at most kQuickPerSize each); an allocation of that
// size on S takes it back in O(1). Any other allocation first merges the quick lists into
// the free index, so best fit always sees every cached block. Neither path makes a CUDA call.
// While the pool has memory to spare, the quick lists of ordinary blocks are per thread
// (Note [Thread caches] in thread_caches.cpp): a thread's same-stream free and reallocation
// take no pool lock, and two threads share no cache line. Growing
// maps granules (cuMemCreate + cuMemMap + cuMemSetAccess); at the limit, or when the
// device is full, the pool unmaps cached granules no block uses, asks the reclaimer for
// what it can free without waiting, waits for the events of pending frees, synchronizes
// the allocating stream (which is alive: its blocks become usable by any stream, so their
// granules can be unmapped), synchronizes the other streams with cached blocks, or the
// device (only when their blocks could become usable; the device waits for every stream,
// copy streams too), lets the
// reclaimer start copies and wait for them, and only then reports out of memory (a
// refused request leaves nothing newly mapped).
//
// Note [Placing for eviction]
// ---------------------------
// Giving up a small offloadable block frees a page only when every other block on its
// granule is free or given up too. Best fit, which packs blocks as densely as it can, puts
// a tensor saved in the first layer next to untagged ones, or a new block into a hole among
// blocks that went cold long ago: the granule stays mapped after all but one of them left.
// So while the pool is under pressure, or may come to be, it places for eviction
// (grouping(): a limit below the card, a mapping refused once, or half the limit reserved;
// Note [A step without pressure] says when it stops):
//   * an ordinary block never touches a granule a live offloadable block touches;
//   * a small offloadable block (below half a granule) goes on the granule its stream's
//     last one ended on, or on a granule no live block touches, never into a hole among
//     older blocks: blocks saved one after another in the forward share granules, go cold
//     together and are needed back together; and it lies within one granule (one that
//     would cross a granule's end starts the next one), so that fetching it back needs one
//     page, not two;
//   * a small block of either kind goes where it needs no granule that holds no live
//     block, when the free blocks offer such a place (at the start or at the end of a free
//     block), else where it needs no new mapping, and only then where best fit puts it: a
//     small block on a cached idle granule, or on a new one, pins that page for as long as
//     it lives;
//   * a quick-listed block is taken back only by a block of its own kind, and only where
//     these rules allow.
// These are preferences, never a reason to fail: once every measure against pressure has
// failed, an allocation takes any hole on the mapped granules, closed ones included,
// before it reports out of memory.
// With no limit and no pressure the pool places densely, as it always did: tagging costs no
// memory (nothing is evicted, so grouping would only cost). A tagged block is then placed,
// cached and reused as an untagged one would be: one quick list for both kinds (the block
// freed last of a size is taken first, whichever kind frees or asks), offloadable blocks of
// half a granule and more quick-listed too, a free to any stream (deallocate_to_any) a plain
// free, and the threads' cached blocks of a size moved to its quick list before a tagged
// block freed joins it. Each of these once made the same program place differently
// tagged: the residual CNN of test_vramswap_run with oneDNN's AVX2 kernels peaked at 134 MiB
// against 130 untagged (the next allocation of a tagged block's size took an older ordinary
// block, and a larger one found no room later: OwnSpan.WithNoPressure* in
// tests/pool/own_span_test.cpp). Measured in the CPU-emulation
// mode (tests/python/test_vramswap_run.py), with VRAMSWAP_MIN_OFFLOAD_BYTES=64KiB at 60% of
// the peak: train_transformer.py --batch 24 --heads 2 ran out of memory with dense placement
// and completes when placing for eviction; --batch 16 --heads 2 --vocab 128 (saved tensors
// 64-768 KiB; 5 granules at that limit) completed only once the last three rules were
// added, each of them needed (without any one it runs out of memory). With no limit both
// peak as untagged; the simulated benchmark rows are unchanged.
//
// Note [A step without pressure]
// ------------------------------
// Placing for eviction is a bet that pressure will come, and it costs memory: whole granules
// for large tagged blocks, ordinary blocks kept off their granules. Once a whole step (the
// engine's step boundaries, begin_step()) has run without a block given up and without a
// mapping refused, the bet has lost: the steps fit. From then on the pool places densely, as
// with no limit, until a block is given up or a mapping is refused, which puts it back to
// placing for eviction (for good, once refused). The first step still places for eviction,
// since nothing is known before it (tests/pool/limit_test.cpp, StepWithoutPressure). The
// steps before and after the change are the same step to the recorder, which names an
// allocation by the size asked for, not the size placed. Measured with `vramswap bench all
// --json`, two warm-ups: gpt-small-v10k at 112% and 125% of its peak reserved 318 MiB more
// than with no offload and now 4 MiB more; no row below its peak changed. Not everywhere:
// with the H100's host costs (CUDASIM_HOST_COSTS=h100) its third step's best fit finds no
// mapped place for the 313 MiB logits and maps them afresh, and it stays 318 MiB above (the
// step before's addresses, tried there too, cost gpt-small-lora 1.6 GiB). What is placed
// before the change stays where it is: tagged blocks that live across steps (frozen
// weights, optimizer state) keep their whole granules (gpt-small-lora 70 MiB above no
// offload, gpt-medium-adamw 156 MiB), and so do the granules the first step mapped.
// (The engine fetches a shared granule's evicted blocks together: Note [A shared granule
// comes back whole] in engine_copies.cpp.) Not done: ordinary blocks that live long (gradients,
// optimizer state allocated in the first backward) still pin granules they share with
// saved ones once placed there by the last-resort rule.
//
// Thread safety: one mutex per pool guards all state but the threads' caches, each guarded
// by its own lock (taken by its thread on the hot path, by the pool under its mutex). The
// mutex is never held across a synchronization (event waits happen with the lock
// released); mapping calls are made under it. Counters read by stats() are taken under the
// locks.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pool/history.h"

namespace vramswap::pool {

// The stream argument that names no stream (not a valid stream handle: 0 is the legacy
// default stream, so null cannot serve). allocate() with it gives a block every stream may
// use at once (cudaMalloc's promise): only memory no stream's queued work can still touch.
// deallocate() with it frees a block after the caller synchronized every stream that used
// it (cudaFree's promise): reusable by every stream at once (streams record_stream named
// are still waited for).
inline cudaStream_t any_stream() { return reinterpret_cast<cudaStream_t>(~uintptr_t(0)); }

struct PoolOptions {
  int device = 0;
  // Device memory the pool may map, in bytes; 0 means the whole card.
  uint64_t limit_bytes = 0;
  // The program reports every stream before destroying it (stream_destroyed: the preload,
  // which interposes cudaStreamDestroy), so every stream the pool names is alive: blocks
  // cached for other streams are retired by synchronizing those streams rather than the
  // device (which a capture on any stream of the device forbids). Without it, the pool
  // synchronizes the device, except while the allocating stream captures.
  bool streams_reported = false;
  // Other devices granted read-write access to every mapping (bit d: device d): peers that
  // may read and write this pool's blocks (grant_peer).
  uint64_t peers = 0;
  // Captures the program reports underway on the device (torch's begin/end-allocate-to-pool
  // hooks, vramswap_capture_begin/end); null: none reported. While it is above 0 the pool
  // never synchronizes the device, which would invalidate them (it still synchronizes
  // streams it knows to be alive and not capturing). Read, never written, by the pool.
  const std::atomic<int>* captures = nullptr;
};

struct PoolStats {
  uint64_t allocated_bytes = 0;       // bytes in live blocks (as rounded)
  uint64_t reserved_bytes = 0;        // bytes of physical memory the pool owns: mapped + spare
  uint64_t mapped_bytes = 0;          // bytes of mapped granules (resident)
  uint64_t peak_mapped_bytes = 0;
  uint64_t spare_bytes = 0;           // owned pages mapped nowhere, reused before new ones
  uint64_t peak_allocated_bytes = 0;
  uint64_t peak_reserved_bytes = 0;
  uint64_t limit_bytes = 0;           // the effective limit
  uint64_t num_allocs = 0;            // successful allocations of more than 0 bytes
  uint64_t num_frees = 0;
  uint64_t num_cache_hits = 0;        // allocations served with no new mapping
  uint64_t num_ooms = 0;
  uint64_t num_free_blocks = 0;       // free blocks of all tags, quick-listed ones and the
                                      // unused rest of the address range included
  uint64_t va_reserved_bytes = 0;     // the size of the VA reservation
};

// The outcome of a call that can be refused; `message` says why (empty on success).
struct Result {
  bool ok = true;
  std::string message;
  bool out_of_memory = false;  // refused for want of device memory (the limit or the card)
};

class DevicePool {
 public:
  // Reserves the pool's VA on `options.device`. Throws cuda::CudaError when the device
  // cannot be used (no VMM support, no device). Thread-safe construction.
  explicit DevicePool(const PoolOptions& options);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // A block of at least `size` bytes, 512-byte aligned, usable by work on `stream`.
  // size 0 returns nullptr with *error empty. Out of memory returns nullptr with *error set
  // to a report: the request, the limit and the pool's numbers. Thread-safe.
  void* allocate(size_t size, cudaStream_t stream, std::string* error);

  // Frees a block allocate() returned, for reuse in `stream`'s order (the stream it was
  // allocated on, normally). nullptr is a no-op. A pointer the pool did not hand out,
  // one freed already, or one inside a block is refused with a message and changes
  // nothing. Thread-safe.
  Result deallocate(void* ptr, cudaStream_t stream);

  // Marks the live block at `ptr` as used by `stream` too: its memory is not reused until
  // the work queued on `stream` before the free has completed. Thread-safe.
  Result record_stream(void* ptr, cudaStream_t stream);

  // The program is about to destroy `stream` (still alive): after this call the pool never
  // names it to CUDA again, where a destroyed handle is undefined behaviour (the driver may
  // crash, or find a later stream at that address). When a live block was allocated on it
  // or record_stream named it, or blocks it freed are cached for it, the stream is
  // synchronized once (its queued work is what reuse had to wait for) and those blocks no
  // longer wait on it: cached ones become free for any stream, live ones free as if that
  // stream had never used them, pending frees for it free for any stream once their other
  // events complete. Once it returns, no block, free list, cache or pending free names the
  // stream (Note [A destroyed stream is forgotten] in stream_order.cpp). A stream the pool
  // does not know costs nothing, once no other thread is synchronizing it or the device
  // with its cached blocks held (to retire them): the call waits for that. A refusal (the
  // synchronization failed) leaves everything as it was. Thread-safe.
  Result stream_destroyed(cudaStream_t stream);

  // Device `peer` may access this pool's blocks from now on: every mapping now and later
  // grants it read-write access (cuMemSetAccess gives each device its own; enabling peer
  // access between devices does not cover VMM mappings). Granting twice costs nothing. A
  // refusal says which mapping could not be granted; those before it keep their grant.
  // Thread-safe.
  Result grant_peer(int peer);

  // Unmaps and releases every mapped run no live or pending block uses, and every spare
  // page. Thread-safe.
  void empty_cache();

  // ---- For the residency engine (eviction) ----

  // Like allocate(), but the block's pages can be taken away and given back later at the
  // same address (unmap_block, map_block): an *offloadable* block (the residency engine's
  // tagged ones). Below half a granule it is placed as allocate() would place it (quick
  // lists included), sharing granules with its neighbours, so that tagging costs no memory,
  // except that while the pool places for eviction (Note [Placing for eviction]) it shares
  // them only with offloadable blocks allocated just before it. A larger one is placed
  // densely too with no pressure (nothing is evicted then), from the quick lists as any
  // block; while placing for eviction it starts on a granule boundary and covers whole
  // granules no other block touches (placed_size), never quick-listed: its eviction frees
  // all of it, and its rounding wastes less than it would for a small block. *placed (may be
  // null): the bytes placed (0 on failure). Thread-safe.
  void* allocate_offloadable(size_t size, cudaStream_t stream, std::string* error, uint64_t* placed = nullptr);

  // Gives up a live offloadable block's contents (the caller copied them elsewhere and
  // ordered this after all work using it): the block becomes *away*, and each run of
  // granules under it that no other block needs (every block touching the run is free for
  // any stream, or live and away) is unmapped whole; a granule shared with a block still in
  // use stays mapped until that one goes too (its unmap_block, its free, or unused-granule
  // unmapping). Unmapped pages become spare, mapped again before any new page is created
  // (a run's pages for a run of their size; others are released first). The block stays live
  // and keeps its address. *freed (may be null): the bytes this call unmapped (0 when every
  // granule is shared). When CUDA refuses to unmap a granule, that granule stays mapped and
  // the result is a refusal; *partly (may be null) then says whether other granules went
  // already (the block then counts as away: map_block maps what is missing) or nothing
  // changed. Thread-safe.
  Result unmap_block(void* ptr, bool* partly = nullptr, uint64_t* freed = nullptr);

  // How long map_block() may wait for memory: not at all (pages free now, or cached
  // granules no block uses), for the events of pending frees, for those and a
  // synchronization of the caller's `stream` (kStream), or also for a device
  // synchronization.
  // kStream: also synchronize `stream` (a live stream of the caller's) so that the blocks it
  // freed become usable (their granules unmapped), without waiting for other streams.
  enum class MapWait { kNone, kPendingFrees, kStream, kSynchronize };

  // Maps pages (spare first) under the granules of an away block (unmap_block) that are not
  // mapped, and makes it an ordinary live block again: its bytes are garbage until the
  // caller restores them (a granule that stayed mapped kept them; one mapped again for a
  // neighbour did not).
  // Refused, with nothing mapped, when the limit or the device does not allow it even
  // after the pool's own measures that `wait` allows (out_of_memory set, the message the
  // pool's out-of-memory report). Thread-safe.
  Result map_block(void* ptr, MapWait wait, cudaStream_t stream = any_stream());
  // Counts an out-of-memory the caller reports for the pool's memory (num_ooms): a block
  // that map_block could not bring back when it was needed. Thread-safe.
  void count_out_of_memory();

  // True when a granule under the live block at `ptr` is touched by a live ordinary
  // (allocate()'s) block too: giving the block up cannot free that page while the ordinary
  // block lives. False for a pointer that is not a live block's start. Thread-safe.
  bool shares_granule_with_ordinary(const void* ptr) const;

  // Frees a block for the freeing stream at once (as deallocate() does) and for any stream
  // once an event recorded now on `stream` completes: for large blocks whose memory is
  // wanted elsewhere soon (eviction's prefetches on a copy stream), where waiting for an
  // event beats a device synchronization, while the program's own stream reuses the block
  // without waiting (its host may run far ahead of the GPU). A block other streams used
  // (record_stream) waits for all their events, then goes to any stream. Allocations look
  // at completed events only while the pool places for eviction (Note [Placing for
  // eviction]); with no pressure it is deallocate(): the block goes to its stream's quick
  // list or free blocks as any block would (tagging costs no memory), and for other streams
  // waits for the pool's next synchronization, so that placement does not depend on how far
  // the GPU got. Thread-safe.
  Result deallocate_to_any(void* ptr, cudaStream_t stream);

  // How far a reclaimer may go: each mode is asked for in turn, with the pool's own
  // measures in between (see Note [The pool]).
  enum class ReclaimMode {
    kNoWait,  // what it can free at once (blocks whose copies to the host have landed);
              // it may start work for later
    kFull,    // it may start work and wait for it
  };
  // Called, with no pool lock held, when an allocation for `stream` (any_stream() for
  // cudaMalloc's) found no memory within the limit; it should free at least `bytes` of
  // device memory (for instance by unmap_block()ing evicted blocks) and return how much it
  // freed (0: nothing). Set before allocations
  // start; setting another (nullptr included) waits for calls of the old one in progress,
  // so its owner may be destroyed once set_reclaimer() returns (never call it from inside
  // the reclaimer).
  using Reclaimer = std::function<uint64_t(uint64_t bytes, ReclaimMode mode, cudaStream_t stream)>;
  void set_reclaimer(Reclaimer reclaimer);

  // The VMM allocation granularity of the device. Thread-safe (immutable).
  uint64_t granularity() const;

  // The bytes allocate_offloadable(size) places while placing for eviction: `size` in
  // 512-byte units below half a granule, else whole granules (with no pressure, always
  // 512-byte units). Thread-safe (immutable).
  uint64_t placed_size(uint64_t size) const;

  // A consistent reading of the counters. Thread-safe.
  PoolStats stats() const;

  // The highest allocated_bytes since the previous call (or since the pool was made), and
  // from now on the mark starts again at the current allocated_bytes: the demand between
  // two points of a recorded step (policy/planner.h). Thread-safe.
  uint64_t take_allocated_high();

  // A training step begins (the engine's step boundaries; after a step without pressure the
  // pool places densely: Note [A step without pressure]): from now on, at the limit, each
  // allocation of half a granule or more goes where the step before placed the allocation
  // of the same order and size, when that place is free for it and has no more granules
  // unmapped than best fit's (Note [A step's addresses]). Thread-safe.
  void begin_step();

  // Checks the invariants of pool_impl.h and the counters against
  // what the blocks add up to: "" when all hold, else each broken one ("; "-separated).
  // Walks every block under the lock. Thread-safe.
  std::string check_invariants() const;

  // The live blocks smaller than `bytes`: how many, and what they hold (as rounded); and
  // the bytes of live offloadable blocks (the engine's tagged ones). For out-of-memory reports
  // (what offload cannot take), without asking the engine. Walks every block under the
  // lock. Thread-safe.
  struct Census {
    uint64_t blocks = 0;
    uint64_t bytes = 0;
    uint64_t offloadable_bytes = 0;
  };
  Census live_below(uint64_t bytes) const;

  // Resets the peaks to the current values. Thread-safe.
  void reset_peaks();

  // ---- Memory history and snapshots (Note [Memory history] in history.h) ----

  // From now on records the pool's actions, keeping the last `max_entries` (0: records
  // none and drops the events kept). Thread-safe.
  void record_history(size_t max_entries);

  // What the pool holds, as a memory snapshot shows it: the mapped address ranges (runs of
  // mapped granules, adjacent ones joined), every block in address order (the unused rest
  // of the range included, as one free block; a block a thread's cache holds shows as free,
  // as the program freed it), and the history kept. Walks every block under the lock.
  // Thread-safe.
  struct BlockView {
    enum class State : uint8_t { kLive, kPendingFree, kFree };
    uintptr_t addr = 0;
    uint64_t size = 0;
    State state = State::kFree;
    bool offloadable = false;  // live: an engine's tagged block
    bool away = false;         // live: given up (unmap_block): its contents are elsewhere
    uintptr_t stream = 0;      // live: the allocation stream; free: the stream that may reuse it
                               // (0: any stream)
    uint64_t requested = 0;    // live: the size asked for when the history recorded its
                               // allocation, else `size`
  };
  struct MemoryView {
    std::vector<std::pair<uintptr_t, uint64_t>> mapped;  // (address, bytes), address order
    std::vector<BlockView> blocks;
    std::vector<TraceEvent> trace;  // oldest first
  };
  MemoryView memory_view() const;

  // True when `ptr` lies in this pool's VA reservation. Thread-safe (immutable range).
  bool owns(const void* ptr) const;

  int device() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vramswap::pool
