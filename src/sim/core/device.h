// cudasim devices: capacity accounting, physical memory, contexts, counters.
//
// A device is a capacity (CUDASIM_DEVICE_MEMORY), a memfd that stands for its physical
// memory, and counters. Physical memory for cuMemCreate is carved out of the memfd
// (MemoryFile: best fit over free extents; freed extents are hole-punched so the host gets
// the RAM back); blocks from cuMemAlloc are anonymous mappings. Both are charged against the
// capacity: charge() fails, as the device would, when the total would pass it. Physical
// memory that cuMemCreate places on the host (a host location) is carved out of another
// MemoryFile, the host's (host_memory()), and counted as pinned host memory instead.
//
// Invariants: used_bytes <= capacity at all times; peak_bytes >= used_bytes; every
// extent of a MemoryFile is either free or owned by exactly one PhysicalAlloc.
//
// Thread safety: counters are atomics; a MemoryFile's extent map has its own mutex;
// contexts are created once at initialization and never destroyed.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cudasim.h"

namespace cudasim {

class Stream;

// Physical memory of the VMM API: an extent of a device's memfd, or of the host's
// (host_memory()) for an allocation located on the host.
struct PhysicalAlloc {
  uint64_t id = 0;          // the CUmemGenericAllocationHandle value
  int device = 0;           // the owning device; -1 for host-located memory
  // The location cuMemCreate was given (cuMemGetAllocationPropertiesFromHandle's answer):
  // CU_MEM_LOCATION_TYPE_DEVICE and the device, or a host location and its id.
  CUmemLocationType location = CU_MEM_LOCATION_TYPE_DEVICE;
  int location_id = 0;
  uint64_t size = 0;
  uint64_t file_offset = 0;
  int mappings = 0;         // live cuMemMap mappings of this allocation
  int handle_refs = 1;      // cuMemCreate / cuMemRetainAllocationHandle minus cuMemRelease
  // The memory is freed when both counts reach 0.

  bool on_host() const { return device < 0; }
};

// A memfd that stands for physical memory, carved into extents: best fit over the free
// ones; a freed extent is hole-punched, so the host gets its pages back and a later extent
// there reads zeros. The file is sparse: only pages written (or made resident) take RAM.
class MemoryFile {
 public:
  // Creates the file with room for `size` bytes; stops the process (status 2) when it cannot.
  MemoryFile(const char* name, uint64_t size);
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;

  // An extent of `size` bytes; false when no free extent holds it.
  bool allocate(uint64_t size, uint64_t* offset);
  // Gives the extent back (its pages go back to the host).
  void free(uint64_t offset, uint64_t size);
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // file offset -> length
};

// The host's physical memory for host-located VMM allocations, created at its first use.
// Thread-safe.
MemoryFile& host_memory();

struct Counters {
  std::atomic<uint64_t> bytes_h2d{0}, bytes_d2h{0}, bytes_d2d{0}, bytes_h2h{0}, bytes_memset{0};
  std::atomic<uint64_t> ops_executed{0};
  std::atomic<uint64_t> mapped_bytes{0};
};

class Device;

}  // namespace cudasim

// The primary context of a device: the only kind cudasim creates.
struct CUctx_st {
  cudasim::Device* device;
  std::atomic<int> refcount{0};
  std::atomic<unsigned> flags{0};
  std::atomic<uint32_t> peers{0};  // cuCtxEnablePeerAccess: device_bit(d) for device d's context
};

namespace cudasim {

class Device {
 public:
  Device(int ordinal, uint64_t capacity);
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int ordinal() const { return ordinal_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_.load(std::memory_order_relaxed); }
  CUctx_st* primary_context() { return &primary_; }
  Counters& counters() { return counters_; }

  // Charges `bytes` against the capacity; false (and nothing charged) when it would pass it.
  bool charge(uint64_t bytes);
  void uncharge(uint64_t bytes);

  // Physical memory for cuMemCreate: charges and carves an extent, or returns false.
  bool allocate_physical(uint64_t size, uint64_t* file_offset);
  // Returns the extent (its pages go back to the host) and uncharges it.
  void free_physical(uint64_t file_offset, uint64_t size);
  int memfd() const { return memory_.fd(); }

  void fill_counters(cudasim_counters* out) const;
  void reset_counters();

  // The legacy default stream (created at initialization, never destroyed).
  Stream& legacy_stream() { return *legacy_; }
  const std::shared_ptr<Stream>& legacy_stream_ptr() const { return legacy_; }

  // Blocking streams (not cudaStreamNonBlocking, not the legacy stream): the legacy
  // stream synchronizes with every one of them.
  void add_blocking_stream(const std::shared_ptr<Stream>& s);
  std::vector<std::shared_ptr<Stream>> blocking_streams();
  // Every live stream of the device, for device-wide synchronization.
  void add_stream(const std::shared_ptr<Stream>& s);
  std::vector<std::shared_ptr<Stream>> all_streams();
  // Blocks the calling (host) thread until all work queued on the device so far has
  // completed; in virtual time the host clock then moves to the device's virtual end
  // (which covers streams destroyed since).
  void synchronize();

 private:
  const int ordinal_;
  const uint64_t capacity_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> peak_{0};
  Counters counters_;
  CUctx_st primary_;

  MemoryFile memory_;

  std::shared_ptr<Stream> legacy_;
  std::mutex streams_mu_;
  std::vector<std::weak_ptr<Stream>> blocking_;
  std::vector<std::weak_ptr<Stream>> streams_;
};

// The driver's global state, created by cuInit and never destroyed (so that detached
// stream workers and late calls during process exit never see it torn down).
struct Driver {
  std::vector<std::unique_ptr<Device>> devices;
  std::mutex physical_mu;
  std::map<uint64_t, PhysicalAlloc> physical;  // live cuMemCreate handles by id
  uint64_t next_physical_id = 0x5100000001ull;
};

// The driver after cuInit, or nullptr before it.
Driver* driver();
// Initializes (idempotent, thread-safe). Returns CUDA_SUCCESS.
CUresult initialize();
// The device with this ordinal, or nullptr.
Device* device(int ordinal);
int device_count();

// The thread's current context (cuCtxSetCurrent / the runtime's cudaSetDevice).
CUctx_st*& current_context();
// The current context's device, or nullptr when the thread has none.
Device* current_device();

// True on a stream worker thread while it runs a host function: CUDA calls are not
// permitted there.
bool& in_host_function();

// Pinned and registered host memory of the process, in bytes (cudasim_counters).
std::atomic<uint64_t>& pinned_host_bytes();
std::atomic<uint64_t>& registered_host_bytes();
// Counts `bytes` more of page-locked host memory in `counter` (pinned_host_bytes() or
// registered_host_bytes()) unless the two together would pass CUDASIM_HOST_PINNED_LIMIT;
// false (nothing counted) when they would. Thread-safe.
bool lock_host_pages(std::atomic<uint64_t>& counter, uint64_t bytes);

// The memory allocation granularity of the VMM API on cudasim (and on current GPUs).
constexpr uint64_t kGranularity = 2ull << 20;

}  // namespace cudasim
