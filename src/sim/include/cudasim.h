/* cudasim.h: what only the emulator offers, for tests and benchmarks.
 *
 * cudasim stands in for libcudart.so.13 and libcuda.so.1 on machines with no GPU
 * (see DESIGN.md, "cudasim"). The CUDA API itself comes from the real CUDA headers;
 * this header adds the counters a test needs to prove what happened on the
 * "device": bytes copied per direction, physical memory, operations executed; and the
 * virtual-time clock, "kernels" and timeline a memory-pressure benchmark needs.
 * These symbols live in cudasim's libcuda.so.1 and exist nowhere else: code that
 * must also run on a real GPU looks them up with dlsym and copes with their absence.
 *
 * Thread safety: every function may be called from any thread. Counters are
 * atomics; a reading taken while operations run may not include them yet.
 */
#ifndef CUDASIM_H
#define CUDASIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cudasim_counters {
  uint64_t bytes_h2d;            /* bytes copied host -> device */
  uint64_t bytes_d2h;            /* bytes copied device -> host */
  uint64_t bytes_d2d;            /* bytes copied device -> device */
  uint64_t bytes_h2h;            /* bytes copied host -> host through a copy call */
  uint64_t bytes_memset;         /* bytes written by memset calls */
  uint64_t ops_executed;         /* stream operations completed (copies, memsets, kernels, host functions,
                                    event records, waits) */
  uint64_t physical_bytes;       /* device memory in use now: cuMemCreate handles located on the device plus
                                    cudaMalloc/cuMemAlloc blocks */
  uint64_t peak_physical_bytes;  /* the most physical_bytes has been since start or the last reset */
  uint64_t mapped_bytes;         /* bytes of VA currently mapped with cuMemMap to the device's memory */
  uint64_t capacity_bytes;       /* the device's size (CUDASIM_DEVICE_MEMORY) */
  /* Pinned host memory is the process's, not a device's: every device reads the same
   * values, and cudasim_reset_counters leaves them alone. */
  uint64_t pinned_bytes;         /* host memory from cudaHostAlloc/cudaMallocHost/cuMemHostAlloc/cuMemAllocHost
                                    not yet freed, in bytes asked for, plus cuMemCreate handles located on the
                                    host (CU_MEM_LOCATION_TYPE_HOST, _HOST_NUMA) not yet freed */
  uint64_t registered_bytes;     /* host memory page-locked by cudaHostRegister/cuMemHostRegister and not yet
                                    unregistered */
} cudasim_counters;

/* Reads the counters of `device`. Returns 0, or -1 when the device does not exist. */
int cudasim_get_counters(int device, cudasim_counters* out);

/* Zeroes the byte and operation counters of `device` and sets its peak to the current
 * physical use. Returns 0, or -1 when the device does not exist. */
int cudasim_reset_counters(int device);

/* 1: this process runs on cudasim. (The real driver has no such symbol.) */
int cudasim_is_emulated(void);

/* ---- Fault injection -------------------------------------------------------------------
 * Calls that fail on purpose (README, "Fault injection"). A rule list such as
 * "cuMemCreate:3,cudaMemcpyAsync:p0.01,cudaHostAlloc:*" names functions as a program writes
 * them and when each fails: N (the Nth call, counted from 1), N+ (the Nth and every later
 * call), pX (each call with probability X, from a generator seeded with CUDASIM_FAIL_SEED,
 * default 1) or * (every call); "=CODE" after a rule (a CUDA error name or number) replaces
 * the code the function returns by default. A failing call does nothing at all (nothing
 * allocated, mapped, queued, waited for or freed) and is never sticky. CUDASIM_FAIL sets the
 * rules at the first CUDA call; a bad value there stops the process with exit status 2. */

/* Replaces the rules with `spec` (NULL or "": no rule) and numbers calls from 1 again.
 * Returns 0; or -1, with a message naming the problem and the accepted form on stderr,
 * and the rules unchanged, for a bad spec. */
int cudasim_fail_configure(const char* spec);

/* How many calls have failed on purpose since the process started. */
uint64_t cudasim_failures_injected(void);

/* The functions a rule may name and the code each returns when it fails: fills up to
 * `capacity` entries of `names` and `codes` (either may be NULL) in the README's order and
 * returns how many there are. */
size_t cudasim_fail_functions(const char** names, int* codes, size_t capacity);

/* ---- Virtual time ----------------------------------------------------------------------
 * With CUDASIM_TIME=virtual, stream work runs on a simulated clock (DESIGN.md, "cudasim";
 * src/sim/core/virtual_time.h): one compute engine per device runs kernels, memsets and
 * device-to-device copies (CUDASIM_HBM_GBPS) in enqueue order; one copy engine per
 * direction runs host<->device copies at CUDASIM_PCIE_GBPS (or one shared engine with
 * CUDASIM_PCIE_DUPLEX=shared); one disk engine for the whole process runs stream-ordered
 * file reads and writes (cudasim's libcufile.so.0: cuFileReadAsync, cuFileWriteAsync) at
 * CUDASIM_DISK_GBPS, all devices' in turn. Each operation's virtual start and end are
 * fixed when it is queued; the host clock moves only when the host waits (a
 * synchronization moves it to the end of the work awaited), and event and stream queries
 * answer from it. With one host thread, the same call sequence gives the same times, run
 * after run. */

/* 1 when CUDASIM_TIME=virtual, else 0. Callable at any time. */
int cudasim_virtual_time(void);

/* The host's virtual clock in ns (0 at process start). In real-time mode: ns of a
 * monotonic clock since the library was loaded. */
uint64_t cudasim_now_ns(void);

/* Enqueues on `stream` (NULL: the legacy default stream; cudaStreamLegacy and
 * cudaStreamPerThread are honoured, and the legacy stream's implicit synchronization
 * applies as for any operation) an operation that stands for GPU compute taking `ns`
 * virtual nanoseconds on the device's compute engine. `label` (may be NULL; copied,
 * truncated to 47 characters) names it in the timeline ("kernel" when NULL or empty).
 * In real-time mode the operation sleeps min(ns, 10 ms) on the stream's worker.
 * While `stream` captures, the operation is captured into the graph and timed when the
 * graph is launched. The calling thread needs a current context for a NULL stream.
 * Returns 0 (cudaSuccess) or a CUDA error code: cudaErrorInvalidResourceHandle (400) for
 * an unknown stream, 201 without a current context, 3 before initialization, 800 (not
 * permitted) inside a host function, 906 (capture implicit) on the legacy stream while a
 * blocking stream captures. */
int cudasim_kernel(void* stream, uint64_t ns, const char* label);

typedef struct cudasim_timeline_entry {
  uint32_t kind;        /* 0 kernel, 1 h2d copy, 2 d2h copy, 3 d2d copy, 4 memset, 5 other (host fn, h2h copy),
                           6 disk read, 7 disk write (stream-ordered file I/O on the disk engine, the
                           bytes asked for; device: the stream's) */
  int32_t device;
  uint64_t stream;      /* the cudaStream_t value (0 for the legacy stream, 2 for a per-thread stream) */
  uint64_t bytes;       /* copies, memsets, disk reads and writes; 0 for kernels */
  uint64_t enqueue_ns;  /* host virtual time when it was enqueued */
  uint64_t start_ns;    /* virtual start on its engine */
  uint64_t end_ns;      /* virtual end */
  uint64_t stall_ns;    /* kernels: how much later it started than it could have if not for
                           cross-stream event waits (cudaStreamWaitEvent on events recorded on
                           other streams); else 0 */
  char label[48];       /* NUL-terminated: the kernel's label, or the operation ("memcpy HtoD") */
} cudasim_timeline_entry;

/* Copies up to `capacity` entries (in enqueue order, from the oldest kept) into `out` (may
 * be NULL to ask the count); returns how many are recorded. Recording is on in virtual
 * mode and, with CUDASIM_TIMELINE=1, in real-time mode (where times are real ns since
 * start, filled in when the operation has run: start_ns = end_ns = 0 before, stall_ns 0).
 * Event records, stream waits and stream-ordered frees are not recorded. The most recent
 * 1,048,576 entries are kept. */
size_t cudasim_timeline(cudasim_timeline_entry* out, size_t capacity);

/* Forgets every recorded entry. */
void cudasim_timeline_clear(void);

#ifdef __cplusplus
}
#endif

#endif /* CUDASIM_H */
