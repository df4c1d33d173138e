// residency::Engine: moves cold tagged blocks of one device to pinned host memory when
// memory is short, and brings them back before backward needs them. DESIGN.md
// ("Residency") is the plan; this is its mechanism.
//
// Note [Block states]
// -------------------
//   resident --pack--> packed --mark_cold--> cold --evict--> evicting --copy landed--> clean
//   clean --drop (memory needed; its pages unmapped, no wait)--> evicted
//   evicted --prefetch / unpack--> fetching --unpack (the stream waits for the copy)--> in use
//   packed, cold, evicting (copy cancelled), clean (host copy freed) --unpack--> in use
//   in use --release--> resident (an ordinary block again)
//
// * A tagged block is offloadable (pool::DevicePool::allocate_offloadable): below half a
//   granule it is placed as any block and shares granules with its neighbours (no memory
//   cost); a larger one has whole granules of its own while the pool places for eviction
//   (Note [Placing for eviction] in device_pool.h). Giving a block's pages up
//   (unmap_block) unmaps the granules no block in use shares; a shared one goes with the
//   last of its blocks, and the engine counts only what was unmapped. The VA stays
//   reserved and the device pointer never changes.
// * pack() gives the block a handle (one per block: packing it again returns the same
//   handle and counts one more reference) and its place in the predicted order of use:
//   backward runs graphs oldest first and, within a graph, last-saved first.
// * mark_cold() records an event on the caller's stream: every kernel that could still
//   touch the block was queued before it. Only cold blocks are evicted.
// * Eviction: the D2H copy stream waits for the cold event, copies the block into a host
//   tier buffer and records the copy event. Once that event has completed (found by
//   polling at the next call) the block is *clean*: on the host and still on the device.
//   Its pages are given up (unmapped; they become the pool's spare pages, reused before
//   any new page is created) only when memory is needed: a clean block is dropped at once,
//   with no wait, and one that backward reaches while still clean costs no copy back.
//   Victims are chosen by Belady's rule, clean and evictable blocks together: from the
//   block needed furthest in the future, a clean block is dropped, a cold resident one
//   starts its copy; never one of the next `horizon` blocks (the prefetch window) but as
//   the last resort before an out-of-memory.
// * The soft limit bounds the resident bytes that have no host copy: past it, cold blocks
//   start their copies in the background (and become clean), so that the memory an
//   allocation needs is there to drop at once. The pool's limit bounds all resident bytes.
// * unpack() makes the contents valid for work queued on the caller's stream after the
//   call: an evicted block is fetched now (a fault); a fetching one makes the stream wait
//   for the fetch event (late if that event has not completed yet); an evicting one just
//   cancels the eviction (its pages are still mapped). The host blocks only when pages
//   must first be freed by evicting others. Then the next `horizon` blocks in predicted
//   order are prefetched on the H2D copy stream.
// * Kept blocks (Note [Kept blocks] below) are used again every step: their handle lives
//   until keep ends or the block is freed, and use/mark_cold bracket each use.
// * Handles are 64 bits: device (8) | slot (24) | generation (32). A stale handle (its
//   block released or freed), a foreign one, or 0 is refused with a message.
// * CUDA graph capture: the engine's copies run on its own streams, after events recorded
//   outside any capture, and its own CUDA calls run in the relaxed capture mode, so another
//   stream's capture neither stops eviction nor is broken by it. Only the caller's stream
//   matters where the engine queues work on it: mark_cold on a capturing stream is refused
//   (its record would be a graph node, not a point in time), and unpack on one fetches
//   nothing and waits for an event on the host instead of joining the capture.
// * Errors: a call either succeeds or changes nothing it reports (an event is recorded
//   before the state that depends on it changes; a failed eviction gives its host buffer
//   back, a failed fetch unmaps its pages again). Work a call sets off for later (landed
//   copies, soft eviction, the window's prefetches) is logged when it fails, never
//   returned: the call's own result stands.
//
// Note [Kept blocks]
// ------------------
// Frozen weights (a LoRA base) and optimizer state outlive every step and are used in each:
// a weight in its layer's forward (and in backward, through autograd's saved tensor), the
// optimizer's state inside step(). keep() gives such a block a handle that no release ends;
// use() makes it valid on a stream as unpack does (fetched if it left; then the window is
// prefetched) and mark_cold() ends the use. Between uses it is cold and a victim like any.
// * Where a use falls in the order: kForward, while a forward runs (in the forward about to
//   begin when a backward ran since the last graph_begin); kAfterBackward, after the newest
//   graph's backward (the optimizer's step). Uses are numbered in order within their graph
//   and lane (use_order.h); a kept block's next use is predicted at the same lane and
//   position one graph later, or at its earliest pack when autograd saved it meanwhile.
//   When a pack of a kept block is released after backward unpacked it, the block is cold
//   again from that point of the stream it was unpacked on (a block saved by two forwards
//   before their backward leaves between its two uses).
// * A frozen block's contents never change after keep (the caller promises it): its host
//   copy, once made, stays valid, so the block stays clean while used and is dropped (its
//   pages unmapped) with no copy every later time. Its first eviction is the only copy out.
//   Optimizer state is written by each use: after it, it is resident and cold, and its
//   next eviction copies it out again.
// * unkeep() makes it an ordinary block again (brought back first, as release does).
//
// Note [Kept blocks in the plan]
// ------------------------------
// A step's plan (policy/planner.h) covers its kept blocks too: each kept block cold as the
// step begins (not in use, not saved by autograd) is a block of the step, numbered then in
// slot order, cold from the step's first point and needed at its first use in the step (the
// optimizer's state: after backward; a frozen weight: in its layer's forward). The plan's
// victims among them start their copies as the step begins, the one needed furthest first:
// the order in which Belady's rule takes them and the planner queues their copies (queued
// in slot order, each victim taken later went ahead of those taken before it and pushed
// them late: on the AdamW-state step at 90% of its peak the walk took 2.5 GiB of state, and
// the plan kept 1.0 GiB of state and activations where 0.83 GiB must leave). A numbered
// block that autograd saves keeps its number; the others lose it as the step ends and are
// numbered again as the next one begins. A victim used in the step (the optimizer's state)
// starts its copy out for the next step at the mark_cold that ends that use, as any planned
// victim does, also while the fetch that brought it back is in flight as far as the host
// knows: the copy is queued behind the use (which waited for the fetch), into the host buffer
// the fetch read from, and takes the fetch's place in flight (evict_after_fetch). The next
// step then finds it clean, and drops its pages with no copy.
//
// Thread safety: one mutex per engine guards its state. It is held while copies are
// queued and, when memory is needed at once, while waiting for eviction copies to
// complete (so other threads' calls on this device wait too: that only happens when the
// alternative is an out-of-memory). The engine calls the pool (its own lock) under the
// engine's mutex; the pool calls the engine (the reclaimer) with no pool lock held, and
// the engine never allocates from the pool under its own lock, so the two never wait for
// each other.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "pool/device_pool.h"
#include "residency/disk_tier.h"
#include "residency/host_tier.h"

namespace vramswap::residency {

struct EngineOptions {
  uint64_t soft_limit_bytes = 0;   // resident bytes without a host copy above which cold
                                   // blocks are copied out in the background; 0: none
  uint64_t host_limit_bytes = 0;   // the host tier's cap; 0: its default
  std::string disk_dir;            // the disk tier's directory (disk_tier.h); "": none
  uint64_t disk_limit_bytes = 0;   // the disk tier's cap; 0: what the filesystem holds
  DiskIo disk_io = DiskIo::kThreads;  // how the disk tier's I/O runs (VRAMSWAP_DISK_IO)
  int horizon = 4;                 // blocks prefetched ahead, and protected from eviction
  bool verify = false;             // checksum at eviction, checked at restore
  bool plan = true;                // record steps and follow their plan (VRAMSWAP_PLAN)
  // The tracker's cold probe (vramswap_set_cold_probe): asked, with no lock of the engine's
  // held, to mark cold (mark_cold, on the stream it is given) the blocks that went cold since
  // the tracker last looked; returns how many it marked. Called when an allocation for that
  // stream finds memory short, before the engine looks for victims; never from within itself.
  std::function<uint64_t(cudaStream_t stream)> cold_probe;
};

struct EngineStats {
  uint64_t resident_bytes = 0;        // mapped device memory of the pool (all blocks)
  uint64_t peak_resident_bytes = 0;   // the pool's peak (reset with the pool's peaks)
  uint64_t tagged_bytes = 0;          // live tagged blocks, as placed (allocate_offloadable)
  uint64_t evictable_bytes = 0;       // cold, resident, outside the prefetch window
  uint64_t clean_bytes = 0;           // copied to the host and still mapped: given up at once
                                      // when memory is needed
  uint64_t evicted_bytes = 0;         // on the host only now (evicted or fetching)
  uint64_t in_flight_bytes = 0;       // being copied either way
  uint64_t host_bytes = 0;            // host tier in use
  uint64_t peak_host_bytes = 0;
  uint64_t bytes_evicted_total = 0;
  uint64_t bytes_prefetched_total = 0;
  uint64_t num_evictions = 0;
  uint64_t num_prefetches = 0;
  uint64_t num_clean_reuses = 0;      // unpack found a clean block: no fetch was needed
  uint64_t num_faults = 0;            // unpack found the block neither resident nor in flight
  uint64_t num_late_prefetches = 0;   // unpack found its fetch still in flight
  uint64_t num_verify_failures = 0;
  uint64_t tagged_waste_bytes = 0;    // placed minus requested, over live tagged blocks
  uint64_t peak_tagged_waste_bytes = 0;  // its highest value (reset with the pool's peaks)
  uint64_t num_tracked_blocks = 0;    // blocks with a live handle
  uint64_t num_planned_steps = 0;     // steps that followed a plan to their end
  uint64_t num_plan_divergences = 0;  // steps that stopped following it (a different step)
  uint64_t num_plan_backoffs = 0;     // planned steps slower than the reactive policy's
  uint64_t num_plan_fetch_moves = 0;  // planned fetches moved earlier for landing late
  uint64_t num_plan_fetch_moves_undone = 0;  // of those, moved back: the step was no faster
  uint64_t planned_bytes_d2h = 0;     // bytes the plan's evictions copied out (landed)
  uint64_t disk_bytes = 0;            // evicted blocks on the disk tier now
  uint64_t disk_bytes_written = 0;    // bytes moved from pinned memory to the disk tier, ever
  uint64_t disk_bytes_read = 0;       // bytes brought back from it, ever
  uint64_t disk_bytes_read_ahead = 0; // of those, read ahead of use (not waited for)
  uint64_t disk_bytes_written_ahead = 0;  // of disk_bytes_written, written ahead of need (not
                                          // waited for)
  uint64_t disk_bytes_bounced = 0;    // of disk_bytes_written and disk_bytes_read, moved between
                                      // the device and the disk through the bounce buffer
  uint64_t kept_bytes = 0;            // live kept blocks (Note [Kept blocks]), as placed
  uint64_t frozen_bytes_d2h = 0;      // bytes frozen kept blocks copied out, ever (each once)
  uint64_t frozen_bytes_dropped = 0;  // bytes of frozen kept blocks given up with no copy, ever
};

// The outcome of a tracker call: the pool's result type (ok, or refused with a message).
using Status = pool::Result;

class Engine {
 public:
  // The engine of `pool`'s device. Creates the copy streams and the host tier, and installs
  // itself as the pool's reclaimer. Throws cuda::CudaError.
  Engine(pool::DevicePool& pool, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // A tagged block (pool::DevicePool::allocate_offloadable) of `size` bytes for `stream`:
  // nullptr with *error set as pool::DevicePool::allocate. May evict asynchronously past the soft limit.
  // Thread-safe.
  void* allocate_tagged(size_t size, cudaStream_t stream, std::string* error);

  // True when `ptr` is the start of a live tagged block. Thread-safe.
  bool is_tagged(const void* ptr) const;

  // Frees a tagged block in any state (an eviction or a fetch in flight is left to
  // complete before the memory is reused; a host copy is dropped). The pool frees first: if
  // it refuses, nothing changed. `stream` may be pool::any_stream(). Thread-safe.
  pool::Result free_tagged(void* ptr, cudaStream_t stream);

  // The handle of the tagged block holding `ptr` (any address inside it), or 0 when no live
  // tagged block does. Records the save order within the current graph. Thread-safe.
  uint64_t pack(const void* ptr, cudaStream_t stream);

  // A new forward (graph) starts: later packs are needed after the earlier graphs'.
  // Thread-safe.
  void graph_begin();

  Status mark_cold(uint64_t handle, cudaStream_t stream);
  Status unpack(uint64_t handle, cudaStream_t stream);
  Status release(uint64_t handle);
  Status prefetch(uint64_t handle);

  // Note [Kept blocks]. keep: the handle of the tagged block holding `ptr`, kept until
  // unkeep or its free (keeping it again returns the same handle); 0 when no live tagged
  // block holds `ptr`. `frozen`: its contents never change from now on. Thread-safe.
  enum class UseLane { kForward, kAfterBackward };
  uint64_t keep(const void* ptr, bool frozen);
  Status use(uint64_t handle, cudaStream_t stream, UseLane lane);
  Status unkeep(uint64_t handle);

  // Frees at least `bytes` of device memory (the pool's reclaimer), as far as `mode` allows:
  // kNoWait drops clean blocks (and starts the copies of evictable ones further away);
  // kFull also waits for copies and starts more. `stream`: the allocation's (for the cold
  // probe, EngineOptions::cold_probe, which runs first). Returns the bytes freed. Thread-safe.
  uint64_t reclaim(uint64_t bytes, pool::DevicePool::ReclaimMode mode = pool::DevicePool::ReclaimMode::kFull,
                   cudaStream_t stream = nullptr);

  // The counters, after reaping the copies that have completed (so a block whose copy is
  // done counts as evicted or restored). Thread-safe.
  EngineStats stats() const;
  void reset_peaks();

  // Gives the host tier's unused pinned chunks back (cudaFreeHost synchronizes the device:
  // call it where that is acceptable, as empty_cache). Thread-safe.
  void trim_host();

  // Checks the invariants of engine_impl.h's opening comment and the counters against what the
  // blocks add up to: "" when all hold, else each broken one. Thread-safe.
  std::string check_invariants() const;

  // For an out-of-memory report: resident tagged, untagged, evictable and in-flight bytes,
  // and the host tier's use; and, where there are any, the mapped granules that cold or
  // evicted blocks cannot free because another block on them must stay (Note [Granules
  // that cannot go] in engine_reclaim.cpp). Walks every block of the pool. Thread-safe.
  std::string pressure_report() const;

  // The device of a handle (its top byte), for routing; -1 for 0.
  static int handle_device(uint64_t handle);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vramswap::residency
