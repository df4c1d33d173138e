// cudasim conformance: VMM physical memory located on the host (cuMemCreate with
// CU_MEM_LOCATION_TYPE_HOST_NUMA or CU_MEM_LOCATION_TYPE_HOST), mapped into a reservation
// beside device memory and reached through it by copies, memsets and CPU code standing in
// for kernels (DESIGN.md, "cudasim"). The rules quoted are cuda.h's (CUDA 13.0).
//
// Suites and the environment each needs (tests/sim/CMakeLists.txt registers them so):
//   HostVmm, HostVmmDeathTest  the defaults (one device, host-located VMM supported)
//   HostVmmTwoDevices*         CUDASIM_DEVICE_COUNT=2 (skipped with one device)
//   HostVmmOff                 CUDASIM_HOST_VMM=0: a driver without host-located VMM
//   HostVmmPinnedLimit         CUDASIM_HOST_PINNED_LIMIT=8MiB
//   HostVmmVirtualTime         CUDASIM_TIME=virtual CUDASIM_PCIE_GBPS=50 CUDASIM_HBM_GBPS=1000
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime_test_util.h"
#include "timeline_test_util.h"

namespace {

using cudasim_test::counters;
using cudasim_test::DeviceBuffer;
using cudasim_test::kMiB;
using cudasim_test::pattern;
using cudasim_test::Stream;

unsigned char* host_ptr(CUdeviceptr va) { return reinterpret_cast<unsigned char*>(va); }

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// A death-test child should not spend time writing a core file.
void no_core_dumps() {
  struct rlimit none = {0, 0};
  setrlimit(RLIMIT_CORE, &none);
}

int attribute(CUdevice_attribute attr, int device = 0) {
  int value = -99;
  EXPECT_CU_OK(cuDeviceGetAttribute(&value, attr, device));
  return value;
}

CUmemAllocationProp located(CUmemLocationType type, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  return prop;
}

class HostVmm : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(cudaFree(nullptr));  // the runtime's context, current from here on
    ASSERT_CU_OK(cuMemGetAllocationGranularity(&gran_, &device_prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    ASSERT_EQ(2 * kMiB, gran_);
  }
  void TearDown() override {
    cudaDeviceSynchronize();
    cudasim_fail_configure(nullptr);
  }

  CUdeviceptr reserve(size_t size) {
    CUdeviceptr va = 0;
    EXPECT_CU_OK(cuMemAddressReserve(&va, size, 0, 0, 0));
    return va;
  }
  CUmemGenericAllocationHandle create(const CUmemAllocationProp& prop, size_t size) {
    CUmemGenericAllocationHandle handle = 0;
    EXPECT_CU_OK(cuMemCreate(&handle, size, &prop, 0));
    return handle;
  }
  CUmemGenericAllocationHandle create_on_host(size_t size) { return create(host_prop_, size); }
  // Grants `device` `flags` on the range.
  static CUresult grant(CUdeviceptr va, size_t size, CUmemAccess_flags flags, int device = 0) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = flags;
    return cuMemSetAccess(va, size, &desc, 1);
  }
  // Grants the host itself `flags` on the range (a CU_MEM_LOCATION_TYPE_HOST_NUMA descriptor).
  static CUresult grant_host(CUdeviceptr va, size_t size, CUmemAccess_flags flags) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    desc.location.id = 0;
    desc.flags = flags;
    return cuMemSetAccess(va, size, &desc, 1);
  }
  // Reserves `size` bytes and maps host memory there, read-write for device 0.
  CUdeviceptr map_host_rw(size_t size, CUmemGenericAllocationHandle* handle) {
    const CUdeviceptr va = reserve(size);
    *handle = create_on_host(size);
    EXPECT_CU_OK(cuMemMap(va, size, 0, *handle, 0));
    EXPECT_CU_OK(grant(va, size, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    return va;
  }
  void unmap_all(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle handle) {
    EXPECT_CU_OK(cuMemUnmap(va, size));
    EXPECT_CU_OK(cuMemRelease(handle));
    EXPECT_CU_OK(cuMemAddressFree(va, size));
  }

  CUmemAllocationProp device_prop_ = located(CU_MEM_LOCATION_TYPE_DEVICE, 0);
  CUmemAllocationProp host_prop_ = located(CU_MEM_LOCATION_TYPE_HOST_NUMA, 0);
  size_t gran_ = 0;
};

// CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (141) and
// CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (145): "Device supports
// HOST_NUMA [HOST] location with the virtual memory management APIs". cudasim's host is one
// NUMA node, 0 (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID).
TEST_F(HostVmm, DeviceAttributesSayHostLocatedVmmIsSupported) {
  EXPECT_EQ(1, attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED));
  EXPECT_EQ(1, attribute(CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED));
  EXPECT_EQ(0, attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID));
}

TEST_F(HostVmm, GranularityOfHostMemoryIsTwoMiB) {
  for (const auto& prop : {host_prop_, located(CU_MEM_LOCATION_TYPE_HOST, 0)}) {
    size_t minimum = 0, recommended = 0;
    ASSERT_CU_OK(cuMemGetAllocationGranularity(&minimum, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    ASSERT_CU_OK(cuMemGetAllocationGranularity(&recommended, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    EXPECT_EQ(2 * kMiB, minimum) << "location type " << prop.location.type;
    EXPECT_EQ(0u, recommended % minimum);
  }
}

// cuMemCreate: "Specifying CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT as the CUmemLocation::type
// will result in CUDA_ERROR_INVALID_VALUE"; "On systems where NUMA is not available
// CUmemLocation::id must be set to 0"; HOST allocations: "requestedHandleTypes must be 0, any
// other value will result in CUDA_ERROR_INVALID_VALUE", and their id "is ignored".
TEST_F(HostVmm, HostLocationsTheHeaderRejectsAreInvalidValue) {
  const auto c0 = counters();
  CUmemGenericAllocationHandle handle = 0;
  const CUmemAllocationProp current = located(CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, 0);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&handle, gran_, &current, 0));
  size_t granularity = 0;
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE,
            cuMemGetAllocationGranularity(&granularity, &current, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  const CUmemAllocationProp node1 = located(CU_MEM_LOCATION_TYPE_HOST_NUMA, 1);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&handle, gran_, &node1, 0)) << "the host has one node, 0";
  CUmemAllocationProp shareable = located(CU_MEM_LOCATION_TYPE_HOST, 0);
  shareable.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&handle, gran_, &shareable, 0));
  EXPECT_EQ(c0.pinned_bytes, counters().pinned_bytes) << "a refused create holds nothing";

  const CUmemAllocationProp any_id = located(CU_MEM_LOCATION_TYPE_HOST, 7);
  ASSERT_CU_OK(cuMemCreate(&handle, gran_, &any_id, 0)) << "the id of a HOST location is ignored";
  EXPECT_CU_OK(cuMemRelease(handle));
}

// Host-located memory is host memory the driver pinned, not device memory.
TEST_F(HostVmm, CreatedMemoryIsPinnedHostMemoryNotDeviceMemory) {
  const auto c0 = counters();
  size_t free0 = 0, total = 0;
  ASSERT_CUDA_OK(cudaMemGetInfo(&free0, &total));
  const CUmemGenericAllocationHandle handle = create_on_host(3 * gran_);
  auto c = counters();
  EXPECT_EQ(c0.pinned_bytes + 3 * gran_, c.pinned_bytes);
  EXPECT_EQ(c0.physical_bytes, c.physical_bytes);
  size_t free1 = 0;
  ASSERT_CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(free0, free1) << "the device's free memory is unchanged";

  const CUdeviceptr va = reserve(3 * gran_);
  ASSERT_CU_OK(cuMemMap(va, 3 * gran_, 0, handle, 0));
  c = counters();
  EXPECT_EQ(c0.mapped_bytes, c.mapped_bytes) << "mapped_bytes counts the device's memory only";
  EXPECT_EQ(c0.pinned_bytes + 3 * gran_, c.pinned_bytes) << "mapping adds no memory";
  ASSERT_CU_OK(cuMemUnmap(va, 3 * gran_));
  ASSERT_CU_OK(cuMemRelease(handle));
  c = counters();
  EXPECT_EQ(c0.pinned_bytes, c.pinned_bytes);
  EXPECT_EQ(c0.physical_bytes, c.physical_bytes);
  EXPECT_CU_OK(cuMemAddressFree(va, 3 * gran_));
}

TEST_F(HostVmm, PropertiesReportTheHostLocation) {
  const CUmemGenericAllocationHandle numa = create_on_host(gran_);
  const CUmemGenericAllocationHandle host = create(located(CU_MEM_LOCATION_TYPE_HOST, 0), gran_);
  CUmemAllocationProp prop{};
  ASSERT_CU_OK(cuMemGetAllocationPropertiesFromHandle(&prop, numa));
  EXPECT_EQ(CU_MEM_ALLOCATION_TYPE_PINNED, prop.type);
  EXPECT_EQ(CU_MEM_LOCATION_TYPE_HOST_NUMA, prop.location.type);
  EXPECT_EQ(0, prop.location.id);
  ASSERT_CU_OK(cuMemGetAllocationPropertiesFromHandle(&prop, host));
  EXPECT_EQ(CU_MEM_LOCATION_TYPE_HOST, prop.location.type);
  const CUmemGenericAllocationHandle dev = create(device_prop_, gran_);
  ASSERT_CU_OK(cuMemGetAllocationPropertiesFromHandle(&prop, dev));
  EXPECT_EQ(CU_MEM_LOCATION_TYPE_DEVICE, prop.location.type);
  EXPECT_EQ(0, prop.location.id);
  EXPECT_CU_OK(cuMemRelease(numa));
  EXPECT_CU_OK(cuMemRelease(host));
  EXPECT_CU_OK(cuMemRelease(dev));
}

// The engine's use (issue 47, N6): one reservation, device memory at one offset and host
// memory at the next, one access grant over both; CPU code (a kernel's stand-in) and copies
// reach both, and across the seam.
TEST_F(HostVmm, MappedBesideDeviceMemoryCopiesAndTheCpuReachBoth) {
  const auto c0 = counters();
  const CUdeviceptr va = reserve(2 * gran_);
  const CUdeviceptr on_dev = va, on_host = va + gran_;
  const CUmemGenericAllocationHandle d = create(device_prop_, gran_), h = create_on_host(gran_);
  ASSERT_CU_OK(cuMemMap(on_dev, gran_, 0, d, 0));
  ASSERT_CU_OK(cuMemMap(on_host, gran_, 0, h, 0));
  ASSERT_CU_OK(grant(va, 2 * gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) << "one grant over both";

  const std::vector<unsigned char> data = pattern(gran_, 3);
  std::memcpy(host_ptr(on_host), data.data(), gran_);  // written by the CPU
  // Host memory to device memory through the two addresses, and back out.
  ASSERT_CUDA_OK(cudaMemcpy(host_ptr(on_dev), host_ptr(on_host), gran_, cudaMemcpyDeviceToDevice));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned char> out(gran_);
  ASSERT_CUDA_OK(cudaMemcpy(out.data(), host_ptr(on_dev), gran_, cudaMemcpyDeviceToHost));
  EXPECT_EQ(data, out);

  {  // Out to a cudaMalloc buffer and back in, on a stream.
    Stream s(cudaStreamNonBlocking);
    DeviceBuffer buffer(gran_);
    ASSERT_CUDA_OK(buffer.status());
    ASSERT_CUDA_OK(cudaMemcpyAsync(buffer.get(), host_ptr(on_host), gran_, cudaMemcpyDefault, s));
    ASSERT_CUDA_OK(cudaStreamSynchronize(s));
    std::memset(host_ptr(on_host), 0, gran_);
    ASSERT_CUDA_OK(cudaMemcpyAsync(host_ptr(on_host), buffer.get(), gran_, cudaMemcpyDefault, s));
    ASSERT_CUDA_OK(cudaStreamSynchronize(s));
    EXPECT_EQ(0, std::memcmp(data.data(), host_ptr(on_host), gran_)) << "read by the CPU";
  }

  // Across the seam: the last 4 KiB of device memory and the first 4 KiB of host memory.
  const std::vector<unsigned char> seam = pattern(8192, 9);
  ASSERT_CUDA_OK(cudaMemcpy(host_ptr(on_host - 4096), seam.data(), seam.size(), cudaMemcpyHostToDevice));
  std::vector<unsigned char> seam_out(seam.size());
  ASSERT_CUDA_OK(cudaMemcpy(seam_out.data(), host_ptr(on_host - 4096), seam.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(seam, seam_out);
  EXPECT_EQ(seam[4096], host_ptr(on_host)[0]);

  ASSERT_CU_OK(cuMemUnmap(va, 2 * gran_)) << "one unmap over both mappings";
  ASSERT_CU_OK(cuMemRelease(d));
  ASSERT_CU_OK(cuMemRelease(h));
  ASSERT_CU_OK(cuMemAddressFree(va, 2 * gran_));
  const auto c = counters();
  EXPECT_EQ(c0.pinned_bytes, c.pinned_bytes);
  EXPECT_EQ(c0.physical_bytes, c.physical_bytes);
  EXPECT_EQ(c0.mapped_bytes, c.mapped_bytes);
}

// The bytes of host-located memory cross the link: a copy out of it into device memory is
// host-to-device, one into it device-to-host, whatever the addresses' kind says.
TEST_F(HostVmm, CopiesOfHostMemoryAreCountedAsCrossingTheLink) {
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
  DeviceBuffer buffer(gran_);
  ASSERT_CUDA_OK(buffer.status());
  Stream s(cudaStreamNonBlocking);
  auto c0 = counters();
  ASSERT_CUDA_OK(cudaMemcpyAsync(buffer.get(), host_ptr(va), gran_, cudaMemcpyDeviceToDevice, s));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  auto c = counters();
  EXPECT_EQ(c0.bytes_h2d + gran_, c.bytes_h2d);
  EXPECT_EQ(c0.bytes_d2d, c.bytes_d2d);
  c0 = c;
  ASSERT_CUDA_OK(cudaMemcpyAsync(host_ptr(va), buffer.get(), gran_, cudaMemcpyDeviceToDevice, s));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  c = counters();
  EXPECT_EQ(c0.bytes_d2h + gran_, c.bytes_d2h);
  EXPECT_EQ(c0.bytes_d2d, c.bytes_d2d);
  unmap_all(va, gran_, handle);
}

TEST_F(HostVmm, MemsetThroughTheAddressWritesHostMemory) {
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
  ASSERT_CUDA_OK(cudaMemset(host_ptr(va), 0x5c, gran_));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(0x5c, host_ptr(va)[0]);
  EXPECT_EQ(0x5c, host_ptr(va)[gran_ - 1]);
  unmap_all(va, gran_, handle);
}

// The memory behind a handle survives unmapping; two mappings of one handle share it.
TEST_F(HostVmm, AHandleMappedTwiceAndRemappedKeepsItsContents) {
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
  const CUdeviceptr other = reserve(gran_);
  ASSERT_CU_OK(cuMemMap(other, gran_, 0, handle, 0));
  ASSERT_CU_OK(grant(other, gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  host_ptr(va)[100] = 0x42;
  EXPECT_EQ(0x42, host_ptr(other)[100]) << "one memory behind both addresses";
  ASSERT_CU_OK(cuMemUnmap(va, gran_));
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, handle, 0));
  ASSERT_CU_OK(grant(va, gran_, CU_MEM_ACCESS_FLAGS_PROT_READ));
  EXPECT_EQ(0x42, host_ptr(va)[100]);
  ASSERT_CU_OK(cuMemUnmap(other, gran_));
  EXPECT_CU_OK(cuMemAddressFree(other, gran_));
  unmap_all(va, gran_, handle);
}

// cuMemRelease: "The memory allocation will be freed when all outstanding mappings to the
// memory are unmapped".
TEST_F(HostVmm, ReleaseWhileMappedKeepsHostMemoryUntilUnmap) {
  const auto c0 = counters();
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
  std::memset(host_ptr(va), 0x3d, gran_);
  ASSERT_CU_OK(cuMemRelease(handle));
  EXPECT_EQ(c0.pinned_bytes + gran_, counters().pinned_bytes) << "still mapped";
  std::vector<unsigned char> out(gran_);
  ASSERT_CUDA_OK(cudaMemcpy(out.data(), host_ptr(va), gran_, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::vector<unsigned char>(gran_, 0x3d), out);
  ASSERT_CU_OK(cuMemUnmap(va, gran_));
  EXPECT_EQ(c0.pinned_bytes, counters().pinned_bytes) << "freed with its last mapping";
  EXPECT_CU_OK(cuMemAddressFree(va, gran_));
}

// cuMemSetAccess: "Users cannot specify CU_MEM_LOCATION_TYPE_HOST_NUMA accessibility for
// allocations created on with other location types."
TEST_F(HostVmm, HostAccessIsGrantedOnHostMemoryOnly) {
  const CUdeviceptr va = reserve(2 * gran_);
  const CUmemGenericAllocationHandle d = create(device_prop_, gran_), h = create_on_host(gran_);
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, d, 0));
  ASSERT_CU_OK(cuMemMap(va + gran_, gran_, 0, h, 0));
  ASSERT_CU_OK(grant_host(va + gran_, gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, grant_host(va, 2 * gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
      << "a range with device memory in it";
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, grant_host(va, gran_, CU_MEM_ACCESS_FLAGS_PROT_READ));

  CUmemLocation host{};
  host.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  CUmemLocation dev0{};
  dev0.type = CU_MEM_LOCATION_TYPE_DEVICE;
  dev0.id = 0;
  unsigned long long flags = 99;
  ASSERT_CU_OK(cuMemGetAccess(&flags, &host, va + gran_));
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READWRITE), flags);
  ASSERT_CU_OK(cuMemGetAccess(&flags, &dev0, va + gran_));
  EXPECT_EQ(static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_NONE), flags)
      << "the host's grant is not the device's";
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemGetAccess(&flags, &host, va)) << "device memory has no host grant";

  ASSERT_CU_OK(cuMemUnmap(va, 2 * gran_));
  EXPECT_CU_OK(cuMemRelease(d));
  EXPECT_CU_OK(cuMemRelease(h));
  EXPECT_CU_OK(cuMemAddressFree(va, 2 * gran_));
}

// CUDASIM_FAIL rules fail a host-located cuMemCreate as they fail a device one: calls are
// numbered per function, whatever their location, and a failed call holds nothing.
TEST_F(HostVmm, AFaultRuleFailsAHostLocatedCreate) {
  const auto c0 = counters();
  const uint64_t injected = cudasim_failures_injected();
  ASSERT_EQ(0, cudasim_fail_configure("cuMemCreate:2"));
  const CUmemGenericAllocationHandle first = create(device_prop_, gran_);
  CUmemGenericAllocationHandle handle = 12345;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&handle, gran_, &host_prop_, 0)) << "the second cuMemCreate";
  EXPECT_EQ(12345u, handle) << "a failing call writes no output";
  EXPECT_EQ(injected + 1, cudasim_failures_injected());
  EXPECT_EQ(c0.pinned_bytes, counters().pinned_bytes);
  const CUmemGenericAllocationHandle third = create_on_host(gran_);
  EXPECT_EQ(c0.pinned_bytes + gran_, counters().pinned_bytes) << "not sticky";

  ASSERT_EQ(0, cudasim_fail_configure("cuMemCreate:1=CUDA_ERROR_NOT_SUPPORTED"));
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, cuMemCreate(&handle, gran_, &host_prop_, 0));
  ASSERT_EQ(0, cudasim_fail_configure(nullptr));
  EXPECT_CU_OK(cuMemRelease(first));
  EXPECT_CU_OK(cuMemRelease(third));
  EXPECT_EQ(c0.pinned_bytes, counters().pinned_bytes);
}

// cuPointerGetAttribute's answers for host-located VMM memory are not documented: cudasim
// says so rather than invent them.
TEST_F(HostVmm, PointerAttributesOfHostMemoryAreNotSupported) {
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
  unsigned type = 0;
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va));
  unmap_all(va, gran_, handle);
}

using HostVmmDeathTest = HostVmm;

// cuMemMap: "calling cuMemMap does not make the address accessible".
TEST_F(HostVmmDeathTest, TouchingHostMemoryBeforeAGrantFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const CUdeviceptr va = reserve(gran_);
  const CUmemGenericAllocationHandle handle = create_on_host(gran_);
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, handle, 0));
  EXPECT_EXIT(
      {
        no_core_dumps();
        static_cast<volatile unsigned char*>(host_ptr(va))[0] = 1;
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  unmap_all(va, gran_, handle);
}

// CPU code on cudasim stands in for kernels, so the devices' grants open host-located memory
// to it; the host's own grant is kept (cuMemGetAccess) but opens nothing.
TEST_F(HostVmmDeathTest, AGrantToTheHostAloneOpensNothingToCpuCode) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const CUdeviceptr va = reserve(gran_);
  const CUmemGenericAllocationHandle handle = create_on_host(gran_);
  ASSERT_CU_OK(cuMemMap(va, gran_, 0, handle, 0));
  ASSERT_CU_OK(grant_host(va, gran_, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  EXPECT_EXIT(
      {
        no_core_dumps();
        static_cast<volatile unsigned char*>(host_ptr(va))[0] = 1;
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  unmap_all(va, gran_, handle);
}

TEST_F(HostVmmDeathTest, TouchingHostMemoryAfterUnmapFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
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

// cuMemSetAccess grants each device its own access to host-located memory too: device 1's
// copies reach it once device 1 was granted, and fault (an illegal address) before.
class HostVmmTwoDevices : public HostVmm {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
    HostVmm::SetUp();
  }
  // Copies `size` bytes from `src` on a stream of device 1 into device 1's memory and back out.
  static std::vector<unsigned char> copy_on_device1(CUdeviceptr src, size_t size) {
    std::vector<unsigned char> out(size);
    cudaSetDevice(1);
    void* dst = nullptr;
    cudaStream_t s = nullptr;
    cudaMalloc(&dst, size);
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMemcpyAsync(dst, host_ptr(src), size, cudaMemcpyDeviceToDevice, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(out.data(), dst, size, cudaMemcpyDeviceToHost);
    cudaStreamDestroy(s);
    cudaFree(dst);
    cudaSetDevice(0);
    return out;
  }
};
using HostVmmTwoDevicesDeathTest = HostVmmTwoDevices;

TEST_F(HostVmmTwoDevices, AGrantedDeviceCopiesFromHostMemory) {
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
  std::memset(host_ptr(va), 0x6e, gran_);
  ASSERT_CU_OK(grant(va, gran_, CU_MEM_ACCESS_FLAGS_PROT_READ, 1));
  EXPECT_EQ(std::vector<unsigned char>(gran_, 0x6e), copy_on_device1(va, gran_));
  unmap_all(va, gran_, handle);
}

TEST_F(HostVmmTwoDevicesDeathTest, ADeviceWithoutAGrantFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);  // granted to device 0 only
  EXPECT_DEATH(
      {
        no_core_dumps();
        copy_on_device1(va, gran_);
      },
      "device 1 has no access");
  unmap_all(va, gran_, handle);
}

// CUDASIM_HOST_VMM=0: a driver that cannot place VMM memory on the host. The attributes say
// so, and cuMemCreate answers CUDA_ERROR_NOT_SUPPORTED; device memory is unaffected.
class HostVmmOff : public HostVmm {
 protected:
  void SetUp() override {
    if (!env_is("CUDASIM_HOST_VMM", "0")) GTEST_SKIP() << "needs CUDASIM_HOST_VMM=0 (ctest sets it)";
    HostVmm::SetUp();
  }
};

TEST_F(HostVmmOff, AttributesSayNoAndCreateIsNotSupported) {
  EXPECT_EQ(0, attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED));
  EXPECT_EQ(0, attribute(CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED));
  const auto c0 = counters();
  CUmemGenericAllocationHandle handle = 0;
  for (const auto& prop : {host_prop_, located(CU_MEM_LOCATION_TYPE_HOST, 0)}) {
    EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, cuMemCreate(&handle, gran_, &prop, 0)) << "type " << prop.location.type;
    size_t granularity = 0;
    EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED,
              cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  }
  EXPECT_EQ(c0.pinned_bytes, counters().pinned_bytes);
  const CUmemGenericAllocationHandle dev = create(device_prop_, gran_);
  EXPECT_CU_OK(cuMemRelease(dev));
}

// CUDASIM_HOST_PINNED_LIMIT=8MiB: host-located memory is page-locked, and counts against the
// same limit as cudaHostAlloc's.
class HostVmmPinnedLimit : public HostVmm {
 protected:
  void SetUp() override {
    if (!env_is("CUDASIM_HOST_PINNED_LIMIT", "8MiB")) GTEST_SKIP() << "needs CUDASIM_HOST_PINNED_LIMIT=8MiB";
    HostVmm::SetUp();
  }
};

TEST_F(HostVmmPinnedLimit, HostMemoryCountsAgainstThePinnedLimit) {
  const CUmemGenericAllocationHandle first = create_on_host(2 * gran_);  // 4 MiB
  CUmemGenericAllocationHandle handle = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&handle, 3 * gran_, &host_prop_, 0)) << "4 + 6 MiB > 8 MiB";
  void* pinned = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMallocHost(&pinned, 6 * kMiB)) << "one limit for both";
  ASSERT_CU_OK(cuMemRelease(first));
  const CUmemGenericAllocationHandle second = create_on_host(3 * gran_);
  EXPECT_CU_OK(cuMemRelease(second));
}

// Virtual time: a copy between host-located memory and device memory runs on a copy engine
// at the link's rate (CUDASIM_PCIE_GBPS), not on the compute engine at HBM's.
class HostVmmVirtualTime : public HostVmm {
 protected:
  void SetUp() override {
    if (!cudasim_virtual_time() || !env_is("CUDASIM_PCIE_GBPS", "50") || !env_is("CUDASIM_HBM_GBPS", "1000"))
      GTEST_SKIP() << "needs CUDASIM_TIME=virtual CUDASIM_PCIE_GBPS=50 CUDASIM_HBM_GBPS=1000 (ctest sets them)";
    HostVmm::SetUp();
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    cudasim_timeline_clear();
  }
};

TEST_F(HostVmmVirtualTime, CopiesOfHostMemoryRunOverTheLink) {
  CUmemGenericAllocationHandle handle = 0;
  const CUdeviceptr va = map_host_rw(gran_, &handle);
  DeviceBuffer buffer(gran_);
  ASSERT_CUDA_OK(buffer.status());
  Stream s(cudaStreamNonBlocking);
  cudasim_timeline_clear();
  ASSERT_CUDA_OK(cudaMemcpyAsync(buffer.get(), host_ptr(va), gran_, cudaMemcpyDeviceToDevice, s));
  ASSERT_CUDA_OK(cudaMemcpyAsync(host_ptr(va), buffer.get(), gran_, cudaMemcpyDeviceToDevice, s));
  ASSERT_CUDA_OK(cudaStreamSynchronize(s));
  const uint64_t link_ns = (gran_ + 49) / 50;  // 2 MiB at 50 GB/s, rounded up
  const auto up = cudasim_test::only(1), down = cudasim_test::only(2);
  EXPECT_EQ(link_ns, up.end_ns - up.start_ns);
  EXPECT_STREQ("memcpy HtoD", up.label);
  EXPECT_EQ(link_ns, down.end_ns - down.start_ns);
  EXPECT_STREQ("memcpy DtoH", down.label);
  for (const auto& e : cudasim_test::timeline()) EXPECT_NE(3u, e.kind) << "no device-to-device copy";
  unmap_all(va, gran_, handle);
}

}  // namespace
