/* cudasim.h: what only the emulator offers, for tests and benchmarks.
 *
 * cudasim stands in for libcudart.so.13 and libcuda.so.1 on machines with no GPU
 * (see DESIGN.md, "cudasim"). The CUDA API itself comes from the real CUDA headers;
 * this header adds the counters a test needs to prove what happened on the
 * "device": bytes copied per direction, physical memory, operations executed.
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
  uint64_t ops_executed;         /* stream operations completed (copies, memsets, host functions, event records, waits) */
  uint64_t physical_bytes;       /* device memory in use now: cuMemCreate handles plus cudaMalloc/cuMemAlloc blocks */
  uint64_t peak_physical_bytes;  /* the most physical_bytes has been since start or the last reset */
  uint64_t mapped_bytes;         /* bytes of VA currently mapped to physical memory with cuMemMap */
  uint64_t capacity_bytes;       /* the device's size (CUDASIM_DEVICE_MEMORY) */
} cudasim_counters;

/* Reads the counters of `device`. Returns 0, or -1 when the device does not exist. */
int cudasim_get_counters(int device, cudasim_counters* out);

/* Zeroes the byte and operation counters of `device` and sets its peak to the current
 * physical use. Returns 0, or -1 when the device does not exist. */
int cudasim_reset_counters(int device);

/* 1: this process runs on cudasim. (The real driver has no such symbol.) */
int cudasim_is_emulated(void);

#ifdef __cplusplus
}
#endif

#endif /* CUDASIM_H */
