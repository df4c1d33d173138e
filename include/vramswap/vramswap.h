/* vramswap: the C ABI of libvramswap.so (and of libvramswap_preload.so, which exports the
 * same functions).
 *
 * This header is the only contract between vramswap and the outside world: PyTorch's
 * CUDAPluggableAllocator (vramswap_malloc and vramswap_free have exactly the signatures
 * it calls), ctypes, and C or C++ programs. Every symbol is versioned VRAMSWAP_0.1; a test
 * compares the exported list with the functions below, so the ABI cannot grow by accident.
 *
 * Errors. No function throws or aborts (the one exception, vramswap_torch_malloc, exists
 * only for torch and is marked as such): each one catches everything and reports failure
 * through its return value where it has one (nullptr, -1, 0) and through a thread-local
 * last error. Every function except vramswap_last_error() clears the calling thread's last
 * error when it starts, so after a call vramswap_last_error() is "" exactly when that call
 * succeeded; this is how a failed vramswap_free() or vramswap_record_stream() is seen.
 * A free of a pointer vramswap did not hand out, or of one freed already, is refused and
 * reported (last error and a warning on stderr); it never changes the pool and never
 * crashes.
 *
 * Configuration. The process-wide allocator is created by the first call of any function
 * here and reads the VRAMSWAP_* environment then (see the README's table); a bad value
 * there makes every vramswap_malloc() fail, with that error as the last error, until
 * vramswap_configure() sets the same key to a valid value. vramswap_configure() accepts the
 * same keys; when it takes effect is documented on it.
 *
 * Streams are cudaStream_t; the declarations use `struct CUstream_st*`, which is what
 * cudaStream_t and CUstream are, so this header needs no CUDA header and mixes with them.
 *
 * Offloading (DESIGN.md, "Residency"). Allocations made while the calling thread has an
 * offload scope open (vramswap_scope_push) and of at least VRAMSWAP_MIN_OFFLOAD_BYTES are
 * *tagged*: placed on device pages of their own, so that they can be moved to pinned host
 * memory and back without their address ever changing. A tracker (the torch package's
 * saved-tensor hooks, or a program of its own) tells vramswap how tagged blocks are used,
 * through opaque 64-bit handles:
 *
 *   forward:  h = vramswap_pack(ptr, s)     a tensor in the block was saved for backward
 *             vramswap_mark_cold(h, s)      nothing but that saved slot can reach it now
 *             ... when memory is short, cold blocks are evicted (copied to the host, their
 *             pages unmapped) in the order backward will need them last ...
 *   backward: vramswap_unpack(h, s)         backward needs it: valid for work on s from now
 *             vramswap_release(h)           backward is done with it
 *             vramswap_free(ptr, ...)       (when the program frees the block, as usual)
 *
 * Backward is assumed to need blocks in reverse order of packing within a forward, and
 * forwards oldest first (vramswap_graph_begin marks where each forward starts); that order
 * chooses what is evicted (the block needed furthest in the future) and what is prefetched
 * (the next VRAMSWAP_HORIZON blocks after each unpack). A handle carries a generation: once
 * its block is released or freed, the handle is stale and every call with it is refused
 * with a message; it never names another block. Handles and blocks of different devices
 * never mix (each device has its own engine; a handle names its device).
 */
#ifndef VRAMSWAP_VRAMSWAP_H_
#define VRAMSWAP_VRAMSWAP_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#define VRAMSWAP_NOEXCEPT noexcept
extern "C" {
#else
#define VRAMSWAP_NOEXCEPT
#endif

struct CUstream_st;

/* A block of at least `size` bytes of device memory on `device` (an ordinal), aligned to
 * at least 512 bytes, for work on `stream`: it may be used by work on `stream` at once,
 * and by work on other streams once they are ordered after `stream`. size 0 returns NULL
 * and is not an error (the last error stays ""). Out of memory, an invalid device, or a
 * configuration error returns NULL and sets the last error; out of memory also writes one
 * warning with the request, the limit and the pool's numbers. Steady state makes no CUDA
 * call (a cached block of the stream is reused). Thread-safe. */
void* vramswap_malloc(size_t size, int device, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* vramswap_malloc for torch's CUDAPluggableAllocator, the alloc function
 * torch.cuda.memory.CUDAPluggableAllocator(path, "vramswap_torch_malloc", "vramswap_free")
 * takes. torch does not check the pointer an alloc function returns (a NULL becomes a tensor
 * at address 0 that faults on the GPU later), but it does pass on a C++ exception, and its
 * Python bindings raise it as RuntimeError with the message. So this is vramswap_malloc
 * (same allocation, same last error) except that a failure for a nonzero size throws a
 * std::runtime_error whose what() is "vramswap: CUDA out of memory allocating <size> bytes
 * on device <device>: " followed by vramswap's report (the last error), or "vramswap:
 * allocating ... failed: " and the last error for a failure that is not out of memory (an
 * invalid device, a configuration error). Size 0 returns NULL and never throws.
 * NOT noexcept, unlike every other function here: call it only from C++ that handles
 * exceptions (torch); from C, ctypes or any caller an exception cannot unwind through, use
 * vramswap_malloc. Thread-safe. Blocks are freed with vramswap_free. */
void* vramswap_torch_malloc(size_t size, int device, struct CUstream_st* stream);

/* Returns a block that vramswap_malloc() handed out. `stream` is the stream the block was
 * allocated on (torch passes it): the block is reusable at once by allocations on that
 * stream and by others only after the work queued on it so far has completed. A free on
 * cudaStreamPerThread first waits for the calling thread's own stream (that handle names a
 * different stream on every thread). A free is all or nothing: if its reuse cannot be
 * ordered (CUDA refused an event on a stream that used the block; a stream destroyed since
 * must have been announced with vramswap_stream_destroyed), the device is synchronized instead;
 * if even that fails the block stays allocated and the last error says why. `size` and
 * `device` are hints (the pool that owns `ptr` is found from the address). NULL is a no-op.
 * A pointer vramswap did not hand out, or one already freed, sets the last error, logs a
 * warning and is otherwise ignored. Thread-safe. */
void vramswap_free(void* ptr, size_t size, int device, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* Marks the live block at `ptr` as used by work on `stream` too (torch's record_stream):
 * when the block is freed, its memory is not reused until the work queued on `stream` up
 * to the free has completed. An unknown pointer sets the last error. Thread-safe. */
void vramswap_record_stream(void* ptr, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* Call before destroying a stream that blocks were allocated on (or that
 * vramswap_record_stream named) while any of them may still be live or cached: vramswap
 * never names the stream to CUDA again, where a destroyed handle is undefined behaviour.
 * It synchronizes the stream once if it knows it, and costs nothing otherwise. Under
 * libvramswap_preload.so, cudaStreamDestroy does this itself. A failed synchronization sets
 * the last error (the blocks then keep waiting on the stream). Thread-safe. */
void vramswap_stream_destroyed(struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* A CUDA graph capture on a stream of `device` begins, or ends (torch's begin- and
 * end-allocate-to-pool hooks call these under vramswap.install() with torch 2.3 or newer).
 * Under memory pressure vramswap may otherwise synchronize the device to reuse memory other
 * streams freed, which CUDA forbids while any stream of the device captures (the capture is
 * invalidated, in every capture mode); between a begin and its end it does not, and an
 * allocation that would have needed it fails as out of memory instead. The capturing
 * stream's own allocations are always recognized; the calls tell vramswap of captures on
 * other streams. They nest. Returns 0, or -1 with the last error set (a device out of range,
 * an end with no begin). Thread-safe. Under libvramswap_preload.so they are not needed. */
int vramswap_capture_begin(int device) VRAMSWAP_NOEXCEPT;
int vramswap_capture_end(int device) VRAMSWAP_NOEXCEPT;

/* Device `device` may read and write the blocks vramswap allocated on device `peer` (the
 * program enabled peer access: cudaDeviceEnablePeerAccess(peer, 0) with `device` current).
 * vramswap's blocks are CUDA VMM mappings, which peer access does not cover: each mapping
 * of `peer`'s pool, now and later, grants `device` access itself. Under
 * libvramswap_preload.so, cudaDeviceEnablePeerAccess does this itself. Returns 0, or -1 with
 * the last error set (a device out of range, a grant the driver refused). Thread-safe. */
int vramswap_enable_peer_access(int device, int peer) VRAMSWAP_NOEXCEPT;

/* Releases all cached device memory (physical pages under no live block) of every device
 * back to the driver; live blocks are untouched. Thread-safe; it may wait for pending
 * stream-ordered frees to complete. */
void vramswap_empty_cache(void) VRAMSWAP_NOEXCEPT;

/* Sets one VRAMSWAP_* setting, by the same key and with the same validation as the
 * environment (e.g. vramswap_configure("VRAMSWAP_LIMIT", "16GiB")). Returns 0 on success;
 * -1 with the last error set (naming the key, the value and the accepted form, or the
 * closest known key for an unknown one) and nothing changed otherwise.
 * When it takes effect: VRAMSWAP_LOG, VRAMSWAP_STATS_FILE and VRAMSWAP_MIN_OFFLOAD_BYTES
 * at once. VRAMSWAP_LIMIT, VRAMSWAP_SOFT_LIMIT, VRAMSWAP_HOST_LIMIT, VRAMSWAP_HORIZON and
 * VRAMSWAP_VERIFY apply to the pool and eviction engine of each device, which are created
 * by the first allocation on that device: once any pool exists they can no longer change
 * (setting the value in force succeeds; any other value is refused with -1), so set them
 * before the first allocation.
 * Setting a key to a valid value also clears an invalid environment value of that key
 * (for VRAMSWAP_CONF: of each key its items set).
 * Thread-safe. */
int vramswap_configure(const char* key, const char* value) VRAMSWAP_NOEXCEPT;

/* The calling thread's last error: "" if the last vramswap call on this thread succeeded
 * (or none was made), otherwise a message saying what failed and why. The text stays
 * valid until the thread's next vramswap call. Never NULL. Thread-safe (thread-local). */
const char* vramswap_last_error(void) VRAMSWAP_NOEXCEPT;

/* Statistics as one JSON object. Returns its length in bytes (not counting the NUL); when
 * `cap` is larger than that, writes the object and a NUL to `buf`, otherwise writes only
 * "" (if cap > 0) so a truncated object is never seen. Call with (NULL, 0) to learn the
 * size; allow some slack, as the numbers can grow in between. On an internal error it
 * returns 0 and sets the last error.
 * Keys, in this order: allocated_bytes, reserved_bytes, peak_allocated_bytes,
 * peak_reserved_bytes, device_limit_bytes, num_allocs, num_frees, num_cache_hits,
 * num_ooms; then the eviction engine's: resident_bytes (mapped device memory),
 * peak_resident_bytes, tagged_bytes (live tagged blocks, whole pages), evictable_bytes
 * (cold and resident), clean_bytes (copied to the host and still mapped: given up at once
 * when memory is needed), evicted_bytes (on the host only), in_flight_bytes (being copied
 * either way), host_bytes (pinned host memory in use), peak_host_bytes,
 * bytes_evicted_total, bytes_prefetched_total, num_evictions (copies to the host that
 * completed; a block's pages go only when memory is needed), num_prefetches, num_faults
 * (unpack found the block on the host with no copy under way), num_late_prefetches (unpack
 * found its copy still in flight), num_clean_reuses (unpack found a clean block: no copy
 * back was needed), num_verify_failures (VRAMSWAP_VERIFY), tagged_waste_bytes
 * (page rounding of tagged blocks), peak_tagged_waste_bytes, num_tracked_blocks (blocks with a live handle),
 * num_planned_steps (steps that followed the plan of the step before to their end,
 * VRAMSWAP_PLAN), num_plan_divergences (steps that stopped following it: a different
 * step), num_plan_backoffs (planned steps slower than the reactive policy's, each sending
 * the next steps back to it for a while), num_plan_fetch_moves (planned fetches moved
 * earlier because they landed late while the copy stream idled before them),
 * num_plan_fetch_moves_undone (of those, moved back because the step was no faster),
 * planned_bytes_d2h (bytes the plan's evictions copied out), disk_bytes (evicted blocks on the disk tier now, VRAMSWAP_DISK_DIR),
 * disk_bytes_written (moved from pinned memory to it), disk_bytes_read (brought back),
 * disk_bytes_read_ahead (of those, read back ahead of use, while compute ran),
 * disk_bytes_written_ahead (of disk_bytes_written, written ahead of need, while compute ran),
 * disk_bytes_bounced (of disk_bytes_written and disk_bytes_read, moved between the device
 * and the disk in chunks through a small pinned bounce buffer: blocks the pinned tier could
 * not hold),
 * kept_bytes (live kept blocks, vramswap_keep), frozen_bytes_d2h (bytes frozen kept blocks
 * copied out: each at most once), frozen_bytes_dropped (bytes of frozen kept blocks given up
 * with no copy, their host copy made earlier). These
 * are totals over devices (the peaks are sums of each device's peak). Then
 * num_invalid_frees (frees vramswap refused), host_wait_ns (host time the process's threads
 * spent in vramswap waiting for the device: event, stream and device synchronizations),
 * host_vmm_ns (host time in CUDA's virtual memory calls: creating, mapping with access,
 * unmapping and releasing pages; on a GPU each 2 MiB granule given pages or taken them
 * costs tens of microseconds), host_pin_ns (host time pinning and unpinning host memory),
 * host_vmm_mapped_bytes, host_vmm_unmapped_bytes, host_vmm_created_bytes,
 * host_vmm_released_bytes (what the VMM calls did: bytes given pages by cuMemMap, taken
 * them by cuMemUnmap, bytes of pages created by cuMemCreate and released by cuMemRelease),
 * host_vmm_map_calls, host_vmm_unmap_calls, host_vmm_create_calls, host_vmm_release_calls
 * (the calls that did it, a map being a cuMemMap with its cuMemSetAccess: on a GPU each
 * costs the same whether it covers one 2 MiB granule or hundreds), all process-wide,
 * then "devices": an array with one object per device that has a pool ({"device": ordinal,
 * the same 44 keys, num_free_blocks, va_reserved_bytes}). Thread-safe; a reading taken
 * during allocations on other threads is consistent per device, not across devices. */
size_t vramswap_stats_json(char* buf, size_t cap) VRAMSWAP_NOEXCEPT;

/* Memory history, as torch.cuda.memory._record_memory_history(max_entries=...): from now on
 * every device's pool records its actions (allocations, frees asked for and completed, pages
 * mapped and unmapped, evictions' and fetches' included, refused allocations), keeping the
 * last `max_entries` per device; 0 stops recording and drops the events kept. Devices used
 * later record too. Thread-safe. */
void vramswap_record_history(size_t max_entries) VRAMSWAP_NOEXCEPT;

/* A memory snapshot as one JSON object in torch's snapshot layout (torch 2.1's
 * torch.cuda.memory._snapshot(): "segments", the mapped memory with its blocks, and
 * "device_traces", one list of the recorded events per device), plus "vramswap": the
 * evicted blocks no mapped page holds. The layout is described in
 * src/runtime/snapshot_document.h. Returns and writes as vramswap_stats_json does. Costs a
 * walk over every block under each device's lock. Thread-safe. */
size_t vramswap_snapshot_json(char* buf, size_t cap) VRAMSWAP_NOEXCEPT;

/* Resets every device's peaks (peak_allocated_bytes, peak_reserved_bytes,
 * peak_resident_bytes, peak_host_bytes, peak_tagged_waste_bytes) to their current values
 * (torch.cuda.reset_peak_memory_stats). Thread-safe. */
void vramswap_reset_peak_stats(void) VRAMSWAP_NOEXCEPT;

/* A self-check for tests and for bug reports: checks the internal invariants of every
 * device's pool and eviction engine (blocks tile the address range; the counters equal what
 * the blocks add up to; every live or pending block has its pages; each evicted block has
 * its host copy; no copy in flight is lost track of). Returns 0 when all hold; otherwise -1
 * with the last error listing each broken invariant ("device N: ...", "; "-separated). Costs a walk over every block under
 * each device's locks: not for a hot path. Thread-safe. */
int vramswap_check_invariants(void) VRAMSWAP_NOEXCEPT;

/* ---- Offloading: the scope and the tracker protocol (see "Offloading" above) ---- */

/* Opens an offload scope on the calling thread: until the matching vramswap_scope_pop(),
 * every allocation this thread makes through vramswap (vramswap_malloc, or cudaMalloc and
 * cudaMallocAsync under libvramswap_preload.so) of at least VRAMSWAP_MIN_OFFLOAD_BYTES is
 * tagged. Scopes nest: allocations are tagged while at least one is open. Smaller
 * allocations, and those of other threads, are untouched. Never fails. Thread-safe: the
 * scope belongs to the calling thread (and to this library: libvramswap.so and
 * libvramswap_preload.so loaded in one process keep separate scopes). */
void vramswap_scope_push(void) VRAMSWAP_NOEXCEPT;

/* Closes the calling thread's innermost offload scope. Blocks tagged inside it stay tagged
 * until they are freed. A pop with no scope open changes nothing and sets the last error
 * (a push/pop mismatch in the caller). Thread-safe (per thread, as vramswap_scope_push). */
void vramswap_scope_pop(void) VRAMSWAP_NOEXCEPT;

/* The handle of the tagged block that holds `ptr` (any address inside it), recording that
 * it was saved now: within the current forward, blocks packed later are assumed needed
 * earlier by backward. Packing a block again returns the same handle and counts one more
 * reference (each needs its own vramswap_release). Returns 0, with the last error "", when
 * the memory cannot be offloaded: an untagged block (allocated outside a scope, or smaller
 * than VRAMSWAP_MIN_OFFLOAD_BYTES), memory vramswap did not hand out, or NULL. `stream` is
 * the stream the saving work runs on. The tracker calls it from autograd's pack hook, for
 * every tensor saved for backward. Thread-safe. */
uint64_t vramswap_pack(const void* ptr, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* A new forward starts, on every device: blocks packed from now on are needed by backward
 * after those of the earlier forwards (gradient accumulation and pipeline microbatches run
 * several forwards before their backwards, oldest backward first). The torch tracker calls
 * it when a forward starts, which it recognises as the first pack after a backward
 * finished or after the offload scope was opened. Calling it with nothing packed since the
 * last call is harmless. Never fails. Thread-safe. */
void vramswap_graph_begin(void) VRAMSWAP_NOEXCEPT;

/* Nothing but the saved slot of handle `h` can reach its block any more (the tracker sees
 * that torch's storage is held only by its own saved references): the block may be evicted
 * when memory is short. The point of no use is recorded on `stream` now, so every piece of
 * work queued on `stream` before this call (the last kernels that read the block) completes
 * before the block is copied out; work on other streams must be ordered before this point
 * by the caller. Returns 0; or -1 with the last error for a handle that is 0, stale
 * (released or freed), or not vramswap's, each named in the message, for a `stream` that is
 * capturing a CUDA graph (the point of no use cannot be recorded there), or when CUDA
 * refuses the record: after -1 the block is not cold and is never evicted for this call.
 * Eviction this call sets off in the background never makes it fail (a failure there is
 * logged and undone). Thread-safe. */
int vramswap_mark_cold(uint64_t h, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* Backward needs the block of handle `h` (a packed one: a kept block that is not packed
 * now is refused, use vramswap_use): its contents are valid for all work queued on
 * `stream` after this call, at its original address (also when it never left the device
 * and was marked cold on another stream: `stream` then waits for that point). If the block
 * was evicted it is
 * fetched now (counted in num_faults); if its prefetch is still in flight `stream` waits
 * for it on the device (num_late_prefetches); the host thread blocks only when other
 * blocks must be evicted first to make room. Then the next VRAMSWAP_HORIZON blocks in
 * predicted order are prefetched on a copy stream. The block is not evicted again until it
 * is marked cold again. The tracker calls it from autograd's unpack hook. Returns 0; -2
 * when the block cannot be brought back for want of device memory, even after evicting
 * every other cold block (an out-of-memory: counted in num_ooms, the last error the
 * report of what holds the memory; the block stays on the host and a later unpack can
 * try again); or -1 with the last error for a bad handle (as vramswap_mark_cold), when
 * a stream is capturing a CUDA graph (nothing is copied during capture), or when a copy or
 * the disk tier's read fails (the block stays where it was; a later unpack tries again).
 * Pinned memory is never the reason: a block the pinned tier cannot hold comes back from
 * the disk through a bounce buffer. Thread-safe. */
int vramswap_unpack(uint64_t h, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* Drops one reference the handle holds (one vramswap_pack). When the last is dropped the
 * block becomes an ordinary (still tagged) block again and every call with `h` is refused
 * from then on; a block released without being unpacked is first brought back to the device
 * (the host thread waits for the copy), so nothing is lost. The tracker calls it when
 * autograd frees the saved tensor (after backward used it, or with a graph that is never
 * run backward). Returns 0; or -1 with the last error for a bad handle, or when an evicted
 * block cannot be brought back. Thread-safe. */
int vramswap_release(uint64_t h) VRAMSWAP_NOEXCEPT;

/* A hint: the block of handle `h` will be needed soon, so start copying it back to the
 * device now if it was evicted (without waiting for the copy; a resident block is left as
 * it is). It is not an unpack: the block still needs vramswap_unpack() before use. Returns
 * 0; or -1 with the last error for a bad handle, or when there is no device memory to map
 * it into now (free memory, or memory freed behind the events of pending frees): a prefetch
 * never evicts, drops or copies out another block to make room. Thread-safe. */
int vramswap_prefetch(uint64_t h) VRAMSWAP_NOEXCEPT;

/* Kept blocks: frozen weights and optimizer state, used again in every step, outside
 * backward (DESIGN.md, "Kept blocks"). Their handle lives until vramswap_unkeep or the
 * block's free, and each use is bracketed by vramswap_use and vramswap_mark_cold; between
 * uses the block is cold and may be evicted. A kept block autograd saves is also packed as
 * any (vramswap_pack returns the same handle): after backward unpacked it and its last pack
 * is released, it is cold again from that point of the stream it was unpacked on.
 *
 *   h = vramswap_keep(ptr, frozen)      each step: vramswap_use(h, s, lane) ... use it ...
 *                                                  vramswap_mark_cold(h, s)
 *
 * vramswap_keep returns the handle of the tagged block holding `ptr` (keeping it again
 * returns the same one), or 0, with the last error "", when no tagged block holds it (as
 * vramswap_pack). The block is not cold until vramswap_mark_cold. `frozen` non-zero: its
 * contents never change from now on (the caller's promise: a frozen weight), so its host
 * copy, once made, stays valid: every eviction after the first drops its pages with no
 * copy. Never fails otherwise. Thread-safe.
 * Outside its uses a kept block may be away. Where the driver has host VMM
 * (CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) its address still
 * reaches its bytes then (a host copy of its own, mapped there while it is away; a kept block
 * below half a granule never leaves), once the device is synchronized: a fetch ahead of its
 * use that is still in flight is not ordered before the read. Elsewhere an away kept block's
 * address faults: use it first. */
uint64_t vramswap_keep(const void* ptr, int frozen) VRAMSWAP_NOEXCEPT;

/* Where a use falls in the predicted order: VRAMSWAP_USE_FORWARD while a forward runs (a
 * frozen layer's weights; after a backward, in the forward about to begin), and
 * VRAMSWAP_USE_AFTER_BACKWARD after the newest forward's backward (the optimizer's step).
 * Uses are numbered in order; a kept block's next use is predicted at the same place one
 * forward later. */
#define VRAMSWAP_USE_FORWARD 0
#define VRAMSWAP_USE_AFTER_BACKWARD 1

/* The kept block of `h` is used now: valid for work queued on `stream` after this call,
 * as vramswap_unpack (fetched if it left, the stream waits for a fetch in flight; the next
 * VRAMSWAP_HORIZON blocks in predicted order are prefetched). It stays in use (never
 * evicted) until vramswap_mark_cold(h, s). Returns 0, -2 for an out-of-memory as
 * vramswap_unpack, or -1 with the last error for a bad handle, a handle that is not kept,
 * a `lane` that is neither value above, or a stream capturing a CUDA graph with the block
 * evicted. Thread-safe. */
int vramswap_use(uint64_t h, struct CUstream_st* stream, int lane) VRAMSWAP_NOEXCEPT;

/* The block of `h` is kept no more: an ordinary (still tagged) block again once no pack of
 * it is left, brought back to the device first (the host thread waits) if it was evicted.
 * Returns 0; or -1 with the last error for a bad handle, one that is not kept, or when an
 * evicted block cannot be brought back (it stays kept). Thread-safe. */
int vramswap_unkeep(uint64_t h) VRAMSWAP_NOEXCEPT;

/* The tracker's cold probe. A block becomes cold when the program drops its last reference
 * to it, which no hook sees: the tracker notices only at its next call (a pack, an unpack),
 * and an allocation in between may find memory short only because cold blocks are not
 * marked yet. So vramswap calls the probe, on the allocating thread and with no lock of its
 * own held, when an allocation on `device` for `stream` finds device memory short: before
 * it evicts to make room, and again before it reports out of memory. The probe marks cold
 * (vramswap_mark_cold, on `stream`) every block that has become cold since the tracker last
 * looked, and returns how many it marked. It may call any function here; an allocation it
 * makes does not call it again. NULL (the default) removes it; the torch package's tracker
 * registers one. Never fails. Thread-safe: the probe may run on several threads at once. */
typedef size_t (*vramswap_cold_probe_fn)(int device, struct CUstream_st* stream);
void vramswap_set_cold_probe(vramswap_cold_probe_fn probe) VRAMSWAP_NOEXCEPT;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* VRAMSWAP_VRAMSWAP_H_ */
