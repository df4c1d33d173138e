// cudasim conformance: the driver's virtual memory management API (cuMemAddressReserve,
// cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree).
// This executable links only libcuda.so.1.
//
// cudasim emulates device memory with host mappings (DESIGN.md, "cudasim"), so a mapped
// range with access granted is readable and writable from the host, and touching a range
// without access faults like an illegal address on a GPU; the death tests check that.
#include <cuda.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdint>
#include <cstring>
#include <vector>

#include "driver_test_util.h"

namespace {

using cudasim_test::counters;
using cudasim_test::kMiB;

class Vmm : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CU_OK(cuInit(0));
    ASSERT_CU_OK(cuDeviceGet(&dev_, 0));
    ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&ctx_, dev_));
    ASSERT_CU_OK(cuCtxSetCurrent(ctx_));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = dev_;
    ASSERT_CU_OK(cuMemGetAllocationGranularity(&gran_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    ASSERT_GT(gran_, 0u);
  }
  void TearDown() override {
    if (ctx_ != nullptr) {
      cuCtxSetCurrent(nullptr);
      cuDevicePrimaryCtxRelease(dev_);
    }
  }

  CUdeviceptr reserve(size_t size) {
    CUdeviceptr va = 0;
    EXPECT_CU_OK(cuMemAddressReserve(&va, size, 0, 0, 0));
    return va;
  }
  CUmemGenericAllocationHandle create(size_t size) {
    CUmemGenericAllocationHandle handle = 0;
    EXPECT_CU_OK(cuMemCreate(&handle, size, &prop_, 0));
    return handle;
  }
  static CUmemLocation on_device(int device) {
    CUmemLocation location{};
    location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    location.id = device;
    return location;
  }
  // Grants `device` (the fixture's by default) `flags` on the range.
  CUresult set_access(CUdeviceptr va, size_t size, CUmemAccess_flags flags, int device = -1) {
    CUmemAccessDesc desc{};
    desc.location = on_device(device < 0 ? dev_ : device);
    desc.flags = flags;
    return cuMemSetAccess(va, size, &desc, 1);
  }
  // cuMemGetAccess's answer for `device` at `va` (a failure is recorded, and 99 returned).
  unsigned long long access_of(CUdeviceptr va, int device) {
    const CUmemLocation location = on_device(device);
    unsigned long long flags = 99;
    EXPECT_CU_OK(cuMemGetAccess(&flags, &location, va));
    return flags;
  }
  static bool two_devices() {
    int count = 0;
    return cuDeviceGetCount(&count) == CUDA_SUCCESS && count >= 2;
  }
  // Reserves, creates, maps and grants read-write access to `size` bytes.
  CUdeviceptr map_rw(size_t size, CUmemGenericAllocationHandle* handle) {
    const CUdeviceptr va = reserve(size);
    *handle = create(size);
    EXPECT_CU_OK(cuMemMap(va, size, 0, *handle, 0));
    EXPECT_CU_OK(set_access(va, size, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    return va;
  }
  void unmap_all(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle handle) {
    EXPECT_CU_OK(cuMemUnmap(va, size));
    EXPECT_CU_OK(cuMemRelease(handle));
    EXPECT_CU_OK(cuMemAddressFree(va, size));
  }

  CUdevice dev_ = -1;
  CUcontext ctx_ = nullptr;
  CUmemAllocationProp prop_{};
  size_t gran_ = 0;
};

unsigned char* host_ptr(CUdeviceptr va) { return reinterpret_cast<unsigned char*>(va); }

// A death-test child should not spend time writing a core file.
void no_core_dumps() {
  struct rlimit none = {0, 0};
  setrlimit(RLIMIT_CORE, &none);
}

TEST_F(Vmm, GranularityIsTwoMiB) {
  EXPECT_EQ(2 * kMiB, gran_);
  size_t recommended = 0;
  ASSERT_CU_OK(
      cuMemGetAllocationGranularity(&recommended, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  EXPECT_GE(recommended, gran_);
  EXPECT_EQ(0u, recommended % gran_);
}

TEST_F(Vmm, ReserveCreateMapAccessWriteReadUnmapReleaseFree) {
  const size_t size = 2 * gran_;
  const auto c0 = counters();
  const CUdeviceptr va = reserve(size);
  ASSERT_NE(0u, va);
  EXPECT_EQ(0u, va % gran_) << "a default-aligned reservation is granularity-aligned";
  const CUmemGenericAllocationHandle handle = create(size);
  ASSERT_CU_OK(cuMemMap(va, size, 0, handle, 0));
  ASSERT_CU_OK(set_access(va, size, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  EXPECT_EQ(c0.mapped_bytes + size, counters().mapped_bytes);

  // Written from the host (cudasim's device memory is host memory) ...
  for (size_t i = 0; i < size; i += 4096) host_ptr(va)[i] = static_cast<unsigned char>(i >> 12);
  // ... read through the driver's copy, and written through it and read from the host.
  std::vector<unsigned char> out(size);
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), va, size));
  for (size_t i = 0; i < size; i += 4096) {
    ASSERT_EQ(static_cast<unsigned char>(i >> 12), out[i]) << "offset " << i;
  }
  std::vector<unsigned char> in(size, 0x6B);
  ASSERT_CU_OK(cuMemcpyHtoD(va, in.data(), size));
  EXPECT_EQ(0x6B, host_ptr(va)[size - 1]);
  EXPECT_EQ(0x6B, host_ptr(va)[0]);

  ASSERT_CU_OK(cuMemUnmap(va, size));
  EXPECT_EQ(c0.mapped_bytes, counters().mapped_bytes);
  ASSERT_CU_OK(cuMemRelease(handle));
  ASSERT_CU_OK(cuMemAddressFree(va, size));
  EXPECT_EQ(c0.physical_bytes, counters().physical_bytes);
}

// The memory behind a handle survives unmapping: mapping it again shows the same bytes.
TEST_F(Vmm, RemappedHandleKeepsItsContents) {
  const size_t size = gran_;
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(size, &handle);
  std::memset(host_ptr(va), 0xA5, size);
  ASSERT_CU_OK(cuMemUnmap(va, size));
  const CUdeviceptr other = reserve(size);
  ASSERT_CU_OK(cuMemMap(other, size, 0, handle, 0));
  ASSERT_CU_OK(set_access(other, size, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  std::vector<unsigned char> out(size);
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), other, size));
  EXPECT_EQ(std::vector<unsigned char>(size, 0xA5), out);
  unmap_all(other, size, handle);
  EXPECT_CU_OK(cuMemAddressFree(va, size));
}

// cuMemSetAccess: "The range must be a fully mapped address range containing all
// allocations created by cuMemMap / cuMemCreate." Two handles side by side form one
// range.
TEST_F(Vmm, TwoHandlesMappedSideBySideFormOneRange) {
  const CUdeviceptr va = reserve(2 * gran_);
  const CUmemGenericAllocationHandle a = create(gran_), b = create(gran_);
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, a, 0));
  ASSERT_CU_OK(cuMemMap(va + gran_, gran_, 0, b, 0));
  ASSERT_CU_OK(set_access(va, 2 * gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  std::vector<unsigned char> in(8192, 0x3E), out(8192, 0);
  ASSERT_CU_OK(cuMemcpyHtoD(va + gran_ - 4096, in.data(), in.size()));  // across the seam
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), va + gran_ - 4096, out.size()));
  EXPECT_EQ(in, out);
  EXPECT_EQ(0x3E, host_ptr(va + gran_)[0]);
  ASSERT_CU_OK(cuMemUnmap(va, gran_));
  ASSERT_CU_OK(cuMemUnmap(va + gran_, gran_));
  EXPECT_CU_OK(cuMemRelease(a));
  EXPECT_CU_OK(cuMemRelease(b));
  EXPECT_CU_OK(cuMemAddressFree(va, 2 * gran_));
}

// cuMemCreate: "The size of this allocation must be a multiple of the the value given
// via cuMemGetAllocationGranularity with the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag."
TEST_F(Vmm, CreateSizeNotMultipleOfGranularityIsInvalidValue) {
  CUmemGenericAllocationHandle handle = 0;
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&handle, gran_ + 4096, &prop_, 0));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&handle, gran_ / 2, &prop_, 0));
}

// cuMemMap: offset "Note: currently must be zero."
TEST_F(Vmm, MapWithNonzeroOffsetIsInvalidValue) {
  const CUdeviceptr va = reserve(gran_);
  const CUmemGenericAllocationHandle handle = create(2 * gran_);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, gran_, gran_, handle, 0));
  EXPECT_CU_OK(cuMemRelease(handle));
  EXPECT_CU_OK(cuMemAddressFree(va, gran_));
}

// cuMemMap: "Both ptr, size, and offset must be a multiple of the value given via
// cuMemGetAllocationGranularity", and offset + size must fit in the allocation.
TEST_F(Vmm, MapMisalignedOrLargerThanHandleIsInvalidValue) {
  const CUdeviceptr va = reserve(4 * gran_);
  const CUmemGenericAllocationHandle handle = create(gran_);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemMap(va + 4096, gran_, 0, handle, 0));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, 2 * gran_, 0, handle, 0));
  EXPECT_CU_OK(cuMemRelease(handle));
  EXPECT_CU_OK(cuMemAddressFree(va, 4 * gran_));
}

// cuMemMap: "cuMemMap can only create mappings on VA range reservations that are not
// currently mapped."
TEST_F(Vmm, MapOverAnAlreadyMappedRangeIsInvalidValue) {
  const CUdeviceptr va = reserve(4 * gran_);
  const CUmemGenericAllocationHandle a = create(gran_), b = create(2 * gran_);
  ASSERT_CU_OK(cuMemMap(va + gran_, gran_, 0, a, 0));
  ASSERT_CU_OK(set_access(va + gran_, gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  host_ptr(va + gran_)[0] = 0x77;
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemMap(va + gran_, gran_, 0, b, 0)) << "same range";
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, 2 * gran_, 0, b, 0)) << "overlapping range";
  EXPECT_EQ(0x77, host_ptr(va + gran_)[0]) << "the failed map disturbed the existing one";
  ASSERT_CU_OK(cuMemUnmap(va + gran_, gran_));
  EXPECT_CU_OK(cuMemRelease(a));
  EXPECT_CU_OK(cuMemRelease(b));
  EXPECT_CU_OK(cuMemAddressFree(va, 4 * gran_));
}

// cuMemUnmap: "cuMemUnmap cannot unmap a sub-range of an address range mapped by
// cuMemCreate / cuMemMap."
TEST_F(Vmm, UnmapOfSubRangeIsInvalidValue) {
  const size_t size = 2 * gran_;
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(size, &handle);
  host_ptr(va)[0] = 0x19;
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemUnmap(va, gran_));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemUnmap(va + gran_, gran_));
  EXPECT_EQ(0x19, host_ptr(va)[0]) << "the failed unmap removed the mapping";
  unmap_all(va, size, handle);
}

// cuMemMap: "This range must be an address reservation previously reserved with
// cuMemAddressReserve".
TEST_F(Vmm, MapOutsideAnyReservationIsInvalidValue) {
  const CUmemGenericAllocationHandle handle = create(gran_);
  // A granularity-aligned host address that cudasim never reserved. It is ours, so a
  // wrong MAP_FIXED over it clobbers nothing but this region.
  const size_t region = 3 * gran_;
  void* host = mmap(nullptr, region, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(MAP_FAILED, host);
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(host) + gran_ - 1) & ~(gran_ - 1);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemMap(aligned, gran_, 0, handle, 0));
  // A range that runs past the end of a reservation.
  const CUdeviceptr va = reserve(gran_);
  const CUmemGenericAllocationHandle big = create(2 * gran_);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, 2 * gran_, 0, big, 0));
  EXPECT_CU_OK(cuMemRelease(big));
  EXPECT_CU_OK(cuMemRelease(handle));
  EXPECT_CU_OK(cuMemAddressFree(va, gran_));
  munmap(host, region);
}

// cuMemAddressFree: "The size must match what was given to memAddressReserve and the ptr
// given must match what was returned from memAddressReserve."
TEST_F(Vmm, AddressFreeWithWrongSizeOrPointerIsInvalidValue) {
  const CUdeviceptr va = reserve(2 * gran_);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, gran_));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, 4 * gran_));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va + gran_, gran_));
  EXPECT_CU_OK(cuMemAddressFree(va, 2 * gran_));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, 2 * gran_)) << "freed twice";
}

// cuMemSetAccess: "The range must be a fully mapped address range".
TEST_F(Vmm, SetAccessOnPartlyUnmappedRangeIsInvalidValue) {
  const CUdeviceptr va = reserve(2 * gran_);
  const CUmemGenericAllocationHandle handle = create(gran_);
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, handle, 0));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, set_access(va, 2 * gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, set_access(va + gran_, gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  ASSERT_CU_OK(cuMemUnmap(va, gran_));
  EXPECT_CU_OK(cuMemRelease(handle));
  EXPECT_CU_OK(cuMemAddressFree(va, 2 * gran_));
}

TEST_F(Vmm, CreateBeyondCapacityIsOutOfMemory) {
  const size_t capacity = counters().capacity_bytes;
  ASSERT_GT(capacity, 2 * gran_);
  size_t total = 0;
  ASSERT_CU_OK(cuDeviceTotalMem(&total, dev_));
  EXPECT_EQ(total, capacity);
  const size_t beyond = (capacity + gran_) / gran_ * gran_;
  CUmemGenericAllocationHandle handle = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&handle, beyond, &prop_, 0));

  // Live handles count against the same capacity.
  const size_t half = capacity / 2 / gran_ * gran_;
  const CUmemGenericAllocationHandle first = create(half);
  const auto c = counters();
  EXPECT_GE(c.physical_bytes, half);
  EXPECT_GE(c.peak_physical_bytes, c.physical_bytes);
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&handle, half + 2 * gran_, &prop_, 0));
  size_t free_bytes = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_bytes, &total));
  EXPECT_LE(free_bytes, capacity - half);
  ASSERT_CU_OK(cuMemRelease(first));
  ASSERT_CU_OK(cuMemCreate(&handle, half + 2 * gran_, &prop_, 0)) << "released memory is reusable";
  EXPECT_CU_OK(cuMemRelease(handle));
}

TEST_F(Vmm, PhysicalAndMappedBytesCounters) {
  const auto c0 = counters();
  const CUmemGenericAllocationHandle handle = create(3 * gran_);
  EXPECT_EQ(c0.physical_bytes + 3 * gran_, counters().physical_bytes);
  EXPECT_EQ(c0.mapped_bytes, counters().mapped_bytes) << "created, not mapped yet";
  const CUdeviceptr va = reserve(3 * gran_);
  ASSERT_CU_OK(cuMemMap(va, 3 * gran_, 0, handle, 0));
  EXPECT_EQ(c0.mapped_bytes + 3 * gran_, counters().mapped_bytes);
  EXPECT_EQ(c0.physical_bytes + 3 * gran_, counters().physical_bytes) << "mapping adds no memory";
  ASSERT_CU_OK(cuMemUnmap(va, 3 * gran_));
  EXPECT_EQ(c0.mapped_bytes, counters().mapped_bytes);
  ASSERT_CU_OK(cuMemRelease(handle));
  EXPECT_EQ(c0.physical_bytes, counters().physical_bytes);
  EXPECT_GE(counters().peak_physical_bytes, c0.physical_bytes + 3 * gran_);
  EXPECT_CU_OK(cuMemAddressFree(va, 3 * gran_));
}

// cuMemRelease: "The memory allocation will be freed when all outstanding mappings to
// the memory are unmapped ... The generic memory handle can be freed when there are
// still outstanding mappings made with this handle."
TEST_F(Vmm, ReleaseWhileMappedKeepsMemoryUntilUnmap) {
  const size_t size = gran_;
  const auto c0 = counters();
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(size, &handle);
  std::memset(host_ptr(va), 0xC3, size);
  ASSERT_CU_OK(cuMemRelease(handle));
  EXPECT_EQ(c0.physical_bytes + size, counters().physical_bytes) << "still mapped";
  std::vector<unsigned char> out(size);
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), va, size));
  EXPECT_EQ(std::vector<unsigned char>(size, 0xC3), out);
  host_ptr(va)[7] = 0x01;  // still writable
  ASSERT_CU_OK(cuMemUnmap(va, size));
  EXPECT_EQ(c0.physical_bytes, counters().physical_bytes) << "freed with its last mapping";
  EXPECT_CU_OK(cuMemAddressFree(va, size));
}

TEST_F(Vmm, GetAccessReportsWhatSetAccessGranted) {
  const size_t size = gran_;
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(size, &handle);
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READWRITE), access_of(va, dev_));
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READWRITE), access_of(va + size - 1, dev_));
  ASSERT_CU_OK(set_access(va, size, CU_MEM_ACCESS_FLAGS_PROT_READ));
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READ), access_of(va, dev_));
  unmap_all(va, size, handle);
}

TEST_F(Vmm, ReadOnlyRangeCanBeRead) {
  const size_t size = gran_;
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(size, &handle);
  std::memset(host_ptr(va), 0x2F, size);
  ASSERT_CU_OK(set_access(va, size, CU_MEM_ACCESS_FLAGS_PROT_READ));
  EXPECT_EQ(0x2F, static_cast<volatile unsigned char*>(host_ptr(va))[size / 2]);
  std::vector<unsigned char> out(4096);
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), va, out.size()));
  EXPECT_EQ(std::vector<unsigned char>(4096, 0x2F), out);
  unmap_all(va, size, handle);
}

// cuMemSetAccess grants access per device: "Sets the access flags for each location
// specified in desc for the given virtual address range." A grant to the owning device says
// nothing of another device's access.
TEST_F(Vmm, AccessIsGrantedPerDevice) {
  if (!two_devices()) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
  const size_t size = gran_;
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(size, &handle);
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_NONE), access_of(va, 1));
  ASSERT_CU_OK(set_access(va, size, CU_MEM_ACCESS_FLAGS_PROT_READ, 1));
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READ), access_of(va, 1));
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READWRITE), access_of(va, dev_))
      << "the owner's grant stays";
  unmap_all(va, size, handle);
}

// Device 1's stream copies from device 0's mapping once device 1 has been granted access.
TEST_F(Vmm, AnotherDeviceWithAGrantCopiesFromTheMapping) {
  if (!two_devices()) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
  const size_t size = gran_;
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(size, &handle);
  std::memset(host_ptr(va), 0x6d, size);
  ASSERT_CU_OK(set_access(va, size, CU_MEM_ACCESS_FLAGS_PROT_READ, 1));
  CUcontext ctx1 = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&ctx1, 1));
  ASSERT_CU_OK(cuCtxSetCurrent(ctx1));
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUdeviceptr dst = 0;
  ASSERT_CU_OK(cuMemAlloc(&dst, size));
  ASSERT_CU_OK(cuMemcpyDtoDAsync(dst, va, size, stream));
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  std::vector<unsigned char> out(size);
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), dst, size));
  EXPECT_EQ(std::vector<unsigned char>(size, 0x6d), out);
  EXPECT_CU_OK(cuMemFree(dst));
  EXPECT_CU_OK(cuStreamDestroy(stream));
  ASSERT_CU_OK(cuCtxSetCurrent(ctx_));
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(1));
  unmap_all(va, size, handle);
}

using VmmDeathTest = Vmm;

TEST_F(VmmDeathTest, TouchingReservedButUnmappedAddressFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const CUdeviceptr va = reserve(gran_);
  EXPECT_EXIT(
      {
        no_core_dumps();
        static_cast<volatile unsigned char*>(host_ptr(va))[100] = 1;
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  EXPECT_CU_OK(cuMemAddressFree(va, gran_));
}

// cuMemMap: "Please note calling cuMemMap does not make the address accessible, the
// caller needs to update accessibility of a contiguous mapped VA range by calling
// cuMemSetAccess."
TEST_F(VmmDeathTest, TouchingMappedRangeBeforeSetAccessFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const CUdeviceptr va = reserve(gran_);
  const CUmemGenericAllocationHandle handle = create(gran_);
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, handle, 0));
  EXPECT_EXIT(
      {
        no_core_dumps();
        (void)static_cast<volatile unsigned char*>(host_ptr(va))[0];
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  unmap_all(va, gran_, handle);
}

TEST_F(VmmDeathTest, TouchingRangeAfterUnmapFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(gran_, &handle);
  host_ptr(va)[0] = 1;
  ASSERT_CU_OK(cuMemUnmap(va, gran_));
  EXPECT_EXIT(
      {
        no_core_dumps();
        (void)static_cast<volatile unsigned char*>(host_ptr(va))[0];
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  EXPECT_CU_OK(cuMemRelease(handle));
  EXPECT_CU_OK(cuMemAddressFree(va, gran_));
}

// cuMemUnmap: "Any new mapping to this virtual address will need to have access granted
// through cuMemSetAccess, as all mappings start with no accessibility setup."
TEST_F(VmmDeathTest, RemappedRangeStartsWithoutAccess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(gran_, &handle);
  ASSERT_CU_OK(cuMemUnmap(va, gran_));
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, handle, 0));
  EXPECT_EXIT(
      {
        no_core_dumps();
        static_cast<volatile unsigned char*>(host_ptr(va))[0] = 2;
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  unmap_all(va, gran_, handle);
}

// Without a grant, a copy on another device's stream touching the mapping faults (an illegal
// address on a GPU): the process stops and says which device lacked access.
TEST_F(VmmDeathTest, AnotherDeviceWithoutAGrantFaults) {
  if (!two_devices()) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(gran_, &handle);
  EXPECT_DEATH(
      {
        no_core_dumps();
        CUcontext ctx1 = nullptr;
        cuDevicePrimaryCtxRetain(&ctx1, 1);
        cuCtxSetCurrent(ctx1);
        CUstream stream = nullptr;
        cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
        CUdeviceptr dst = 0;
        cuMemAlloc(&dst, gran_);
        cuMemcpyDtoDAsync(dst, va, gran_, stream);
        cuStreamSynchronize(stream);
      },
      "device 1 has no access");
  unmap_all(va, gran_, handle);
}

TEST_F(VmmDeathTest, WritingReadOnlyRangeFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_rw(gran_, &handle);
  ASSERT_CU_OK(set_access(va, gran_, CU_MEM_ACCESS_FLAGS_PROT_READ));
  EXPECT_EXIT(
      {
        no_core_dumps();
        static_cast<volatile unsigned char*>(host_ptr(va))[64] = 3;
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  unmap_all(va, gran_, handle);
}

}  // namespace
