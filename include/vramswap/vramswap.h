/* vramswap: the C ABI of libvramswap.so (and of libvramswap_preload.so, which exports the
 * same functions).
 *
 * This header is the only contract between vramswap and the outside world: PyTorch's
 * CUDAPluggableAllocator (vramswap_malloc and vramswap_free have exactly the signatures
 * it calls), ctypes, and C or C++ programs. Every symbol is versioned VRAMSWAP_0.1; a test
 * compares the exported list with the functions below, so the ABI cannot grow by accident.
 *
 * Errors. No function throws or aborts: each one catches everything and reports failure
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
 */
#ifndef VRAMSWAP_VRAMSWAP_H_
#define VRAMSWAP_VRAMSWAP_H_

#include <stddef.h>

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

/* Returns a block that vramswap_malloc() handed out. `stream` is the stream the block was
 * allocated on (torch passes it): the block is reusable at once by allocations on that
 * stream and by others only after the work queued on it so far has completed. `size` and
 * `device` are hints (the pool that owns `ptr` is found from the address). NULL is a no-op.
 * A pointer vramswap did not hand out, or one already freed, sets the last error, logs a
 * warning and is otherwise ignored. Thread-safe. */
void vramswap_free(void* ptr, size_t size, int device, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* Marks the live block at `ptr` as used by work on `stream` too (torch's record_stream):
 * when the block is freed, its memory is not reused until the work queued on `stream` up
 * to the free has completed. An unknown pointer sets the last error. Thread-safe. */
void vramswap_record_stream(void* ptr, struct CUstream_st* stream) VRAMSWAP_NOEXCEPT;

/* Releases all cached device memory (physical pages under no live block) of every device
 * back to the driver; live blocks are untouched. Thread-safe; it may wait for pending
 * stream-ordered frees to complete. */
void vramswap_empty_cache(void) VRAMSWAP_NOEXCEPT;

/* Sets one VRAMSWAP_* setting, by the same key and with the same validation as the
 * environment (e.g. vramswap_configure("VRAMSWAP_LIMIT", "16GiB")). Returns 0 on success;
 * -1 with the last error set (naming the key, the value and the accepted form, or the
 * closest known key for an unknown one) and nothing changed otherwise.
 * When it takes effect: VRAMSWAP_LOG and VRAMSWAP_STATS_FILE at once. VRAMSWAP_LIMIT
 * applies to the pool of each device, which is created by the first allocation on that
 * device: once any pool exists it can no longer change (setting the value it already has
 * succeeds; any other value is refused with -1), so set it before the first allocation.
 * Setting a key to a valid value also clears an invalid environment value of that key.
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
 * num_ooms (totals over devices; the peaks are sums of each device's peak), then
 * num_invalid_frees (frees vramswap refused), then "devices": an array with one object per
 * device that has a pool ({"device": ordinal, the same nine keys, num_free_blocks,
 * va_reserved_bytes}). Thread-safe; a reading taken during allocations on other threads
 * is consistent per device, not across devices. */
size_t vramswap_stats_json(char* buf, size_t cap) VRAMSWAP_NOEXCEPT;

/* Resets every device's peak_allocated_bytes and peak_reserved_bytes to their current
 * values (torch.cuda.reset_peak_memory_stats). Thread-safe. */
void vramswap_reset_peak_stats(void) VRAMSWAP_NOEXCEPT;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* VRAMSWAP_VRAMSWAP_H_ */
