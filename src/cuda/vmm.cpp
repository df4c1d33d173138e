// VA reservations, physical pages and mappings. See vmm.h.
#include "cuda/vmm.h"

#include <string>
#include <utility>

#include "config/units.h"
#include "cuda/error.h"
#include "cuda/host_time.h"

namespace vramswap::cuda {

VaReservation::VaReservation(uint64_t size, uint64_t alignment) {
  CUdeviceptr p = 0;
  VRAMSWAP_CU(cuMemAddressReserve(&p, size, alignment, 0, 0));
  base_ = p;
  size_ = size;
}
VaReservation::~VaReservation() { reset(); }
VaReservation::VaReservation(VaReservation&& o) noexcept
    : base_(std::exchange(o.base_, 0)), size_(std::exchange(o.size_, 0)) {}
VaReservation& VaReservation::operator=(VaReservation&& o) noexcept {
  if (this != &o) {
    reset();
    base_ = std::exchange(o.base_, 0);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}
void VaReservation::reset() noexcept {
  if (size_) cuMemAddressFree(base_, size_);
  base_ = 0;
  size_ = 0;
}

PhysicalPages::PhysicalPages(int device, uint64_t size) : size_(size), device_(device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  TimedCall timed(HostTime::kVmm);
  VRAMSWAP_CU(cuMemCreate(&handle_, size, &prop, 0));
  count_vmm_call(VmmCall::kCreate, size);
}

bool host_vmm_supported(int device) {
  VRAMSWAP_CU(cuInit(0));
  int supported = 0;
  VRAMSWAP_CU(
      cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device));
  return supported != 0;
}

PhysicalPages PhysicalPages::on_host(int device, uint64_t size) {
  if (!host_vmm_supported(device))
    throw CudaError("host memory for VMM: the driver of device " + std::to_string(device) +
                        " cannot create it (CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)",
                    CUDA_ERROR_NOT_SUPPORTED);
  // The node nearest the device; -1 means the host has no NUMA, where cuMemCreate wants 0.
  int node = 0;
  VRAMSWAP_CU(cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop.location.id = node < 0 ? 0 : node;
  size_t granularity = 0;
  VRAMSWAP_CU(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  PhysicalPages pages;
  pages.size_ = round_up(size, granularity);
  pages.device_ = device;
  pages.on_host_ = true;
  TimedCall timed(HostTime::kVmm);
  CUresult r = cuMemCreate(&pages.handle_, pages.size_, &prop, 0);
  if (r != CUDA_SUCCESS) {
    pages.handle_ = 0;  // nothing to release
    throw_driver_error(r, "cuMemCreate(&handle, size, &prop /* host NUMA node */, 0)", __FILE__, __LINE__);
  }
  count_vmm_call(VmmCall::kCreate, pages.size_);
  return pages;
}

PhysicalPages::~PhysicalPages() { reset(); }
PhysicalPages::PhysicalPages(PhysicalPages&& o) noexcept
    : handle_(std::exchange(o.handle_, 0)),
      size_(std::exchange(o.size_, 0)),
      device_(o.device_),
      on_host_(std::exchange(o.on_host_, false)) {}
PhysicalPages& PhysicalPages::operator=(PhysicalPages&& o) noexcept {
  if (this != &o) {
    reset();
    handle_ = std::exchange(o.handle_, 0);
    size_ = std::exchange(o.size_, 0);
    device_ = o.device_;
    on_host_ = std::exchange(o.on_host_, false);
  }
  return *this;
}
void PhysicalPages::release() {
  if (!handle_) return;
  TimedCall timed(HostTime::kVmm);
  VRAMSWAP_CU(cuMemRelease(handle_));
  count_vmm_call(VmmCall::kRelease, size_);
  handle_ = 0;
  size_ = 0;
}
void PhysicalPages::reset() noexcept {
  if (handle_) {
    TimedCall timed(HostTime::kVmm);
    if (cuMemRelease(handle_) == CUDA_SUCCESS) count_vmm_call(VmmCall::kRelease, size_);
  }
  handle_ = 0;
  size_ = 0;
}

namespace {

CUmemAccessDesc read_write(int device) {
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

}  // namespace

Mapping::Mapping(uintptr_t address, const PhysicalPages& pages, uint64_t peers) {
  TimedCall timed(HostTime::kVmm);
  VRAMSWAP_CU(cuMemMap(address, pages.size(), 0, pages.handle(), 0));
  CUmemAccessDesc access[65];
  size_t count = 0;
  access[count++] = read_write(pages.device());
  for (int d = 0; d < 64; ++d)
    if ((peers >> d) & 1 && d != pages.device()) access[count++] = read_write(d);
  CUresult r = cuMemSetAccess(address, pages.size(), access, count);
  if (r != CUDA_SUCCESS) {
    // Undo the map so that "throws" means "nothing mapped": a range left mapped would hold
    // the pages (never freed) and refuse every later map there. A refused unmap is tried
    // once more (a transient refusal); should both fail, the error says the range is lost.
    const bool unmapped = cuMemUnmap(address, pages.size()) == CUDA_SUCCESS ||
                          cuMemUnmap(address, pages.size()) == CUDA_SUCCESS;
    throw_driver_error(r,
                       unmapped ? "cuMemSetAccess(address, pages.size(), access, count)"
                                : "cuMemSetAccess(address, pages.size(), access, count) (and the range could not be "
                                  "unmapped again: it stays mapped)",
                       __FILE__, __LINE__);
  }
  count_vmm_call(VmmCall::kMap, pages.size());
  address_ = address;
  size_ = pages.size();
}
Mapping::~Mapping() { reset(); }
Mapping::Mapping(Mapping&& o) noexcept : address_(std::exchange(o.address_, 0)), size_(std::exchange(o.size_, 0)) {}
Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    reset();
    address_ = std::exchange(o.address_, 0);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}
void Mapping::unmap() {
  if (!size_) return;
  TimedCall timed(HostTime::kVmm);
  VRAMSWAP_CU(cuMemUnmap(address_, size_));
  count_vmm_call(VmmCall::kUnmap, size_);
  address_ = 0;
  size_ = 0;
}
void Mapping::grant(int device) {
  if (!size_) return;
  TimedCall timed(HostTime::kVmm);
  const CUmemAccessDesc access = read_write(device);
  VRAMSWAP_CU(cuMemSetAccess(address_, size_, &access, 1));
}
void Mapping::reset() noexcept {
  if (size_) {
    TimedCall timed(HostTime::kVmm);
    if (cuMemUnmap(address_, size_) == CUDA_SUCCESS) count_vmm_call(VmmCall::kUnmap, size_);
  }
  address_ = 0;
  size_ = 0;
}

}  // namespace vramswap::cuda
