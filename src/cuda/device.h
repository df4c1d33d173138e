// Devices as the pool sees them, and the context the driver calls run in.
//
// vramswap uses the runtime's primary context of each device (the one torch and any
// runtime program use): ContextScope makes it current for driver calls and restores
// whatever the thread had before.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace vramswap::cuda {

struct DeviceInfo {
  int ordinal = 0;
  uint64_t total_bytes = 0;   // the card's memory
  uint64_t granularity = 0;   // VMM allocation granularity (minimum)
  bool vmm_supported = false;
};

// Initializes the driver (idempotent) and describes `ordinal`. Throws CudaError.
// Thread-safe.
DeviceInfo device_info(int ordinal);

// Number of devices (0 when the driver cannot initialize). Thread-safe.
int device_count();

// The device of the calling thread's current runtime context. Throws CudaError.
int current_device();

// Waits for all work queued on `ordinal` so far. Does it in the relaxed capture mode (the
// global mode's rule on unsafe calls does not apply then), but a device synchronization
// while any stream of the device captures fails and invalidates that capture in every mode:
// callers make one only when no stream they serve can be capturing (DevicePool). False
// when the driver refused. Never throws.
bool synchronize_device(int ordinal);

// The device's free and total memory as the driver reports them (not the runtime's
// cudaMemGetInfo, which an LD_PRELOAD face may interpose). Zeros on failure. Never throws.
void device_memory(int ordinal, size_t* free_bytes, size_t* total_bytes);

// Makes `ordinal`'s primary context current for the scope; restores the previous current
// context on exit. Throws CudaError on entry; never throws on exit. Not shared across threads.
class ContextScope {
 public:
  explicit ContextScope(int ordinal);
  ~ContextScope();
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

}  // namespace vramswap::cuda
