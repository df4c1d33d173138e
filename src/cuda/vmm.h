// CUDA virtual memory management as three owning types:
//
//   VaReservation  a range of device virtual addresses (cuMemAddressReserve / Free)
//   PhysicalPages  device memory with no address (cuMemCreate / cuMemRelease), or host
//                  memory for a device (PhysicalPages::on_host)
//   Mapping        pages mapped read-write at an address (cuMemMap + cuMemSetAccess /
//                  cuMemUnmap)
//
// Host pages are page-locked host RAM that maps into a reservation as device pages do,
// beside them: a device granted access reaches them over the link, slowly, so a range
// backed by them stays addressable while its data lives on the host. Where the driver
// cannot make them (host_vmm_supported), creating them fails with CUDA_ERROR_NOT_SUPPORTED.
//
// Destroying a Mapping unmaps the range: the caller orders that after all work using it
// (the driver does not promise to). Destructors never throw and tolerate a driver that is
// shutting down. Each type is movable, not copyable; none is shared across threads
// without the owner's lock.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace vramswap::cuda {

class VaReservation {
 public:
  VaReservation() = default;
  // Reserves `size` bytes aligned to `alignment`. Throws CudaError.
  VaReservation(uint64_t size, uint64_t alignment);
  ~VaReservation();
  VaReservation(VaReservation&& o) noexcept;
  VaReservation& operator=(VaReservation&& o) noexcept;

  uintptr_t base() const { return base_; }
  uint64_t size() const { return size_; }
  bool contains(uintptr_t p) const { return p - base_ < size_; }

 private:
  void reset() noexcept;
  uintptr_t base_ = 0;
  uint64_t size_ = 0;
};

// Whether `device`'s driver can create VMM physical memory on the host's NUMA nodes
// (CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED), as
// PhysicalPages::on_host does. Throws CudaError when the driver cannot be asked.
bool host_vmm_supported(int device);

class PhysicalPages {
 public:
  PhysicalPages() = default;
  // Creates `size` bytes (a multiple of the granularity) on `device`. Throws CudaError;
  // error.out_of_memory() when the device is full.
  PhysicalPages(int device, uint64_t size);
  // Creates at least `size` bytes (above 0) of host memory for `device`: `size` rounded up to
  // the granularity of host memory, on the host NUMA node nearest `device` (node 0 on a host
  // without NUMA). device() is `device`, the device a Mapping of them grants access. Throws
  // CudaError: code CUDA_ERROR_NOT_SUPPORTED, saying so, when the driver cannot
  // (host_vmm_supported), without a cuMemCreate; error.out_of_memory() when the host cannot
  // pin more.
  static PhysicalPages on_host(int device, uint64_t size);
  ~PhysicalPages();
  PhysicalPages(PhysicalPages&& o) noexcept;
  PhysicalPages& operator=(PhysicalPages&& o) noexcept;

  CUmemGenericAllocationHandle handle() const { return handle_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }
  // True for host memory (on_host).
  bool on_host() const { return on_host_; }
  explicit operator bool() const { return handle_ != 0; }

  // Gives the memory back to the driver now. Throws CudaError, and then still owns it: the
  // caller keeps it and may try again (the destructor cannot report a refusal).
  void release();

 private:
  void reset() noexcept;
  CUmemGenericAllocationHandle handle_ = 0;
  uint64_t size_ = 0;
  int device_ = 0;
  bool on_host_ = false;
};

class Mapping {
 public:
  Mapping() = default;
  // Maps all of `pages` at `address` and grants `pages.device()` read-write access, and
  // every device whose bit is set in `peers` (bit d: device d) too. Device and host pages
  // map alike, side by side in one reservation. Throws CudaError (and leaves nothing
  // mapped).
  Mapping(uintptr_t address, const PhysicalPages& pages, uint64_t peers = 0);
  ~Mapping();
  Mapping(Mapping&& o) noexcept;
  Mapping& operator=(Mapping&& o) noexcept;

  uintptr_t address() const { return address_; }
  uint64_t size() const { return size_; }
  explicit operator bool() const { return size_ != 0; }

  // Unmaps the range now. Throws CudaError, and then still owns the mapping (the range is
  // still mapped): the caller can keep using it or try again.
  void unmap();
  // Grants `device` read-write access to the range too (a peer: cuMemSetAccess gives each
  // device its own access, and peer access enabled between devices does not cover VMM
  // mappings). Throws CudaError.
  void grant(int device);

 private:
  void reset() noexcept;
  uintptr_t address_ = 0;
  uint64_t size_ = 0;
};

}  // namespace vramswap::cuda
