// src/cuda/vmm.h's host pages (PhysicalPages::on_host, host_vmm_supported): VMM physical
// memory on the host, for a device. The cases run on cudasim and, through the GPU suite's
// runner (tests/gpu/cpp_tests.py), on a GPU: what needs cudasim (its counters, fault
// injection, CUDASIM_HOST_VMM) is found with dlsym, and a case skips itself without it.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/cuda_test_util.h"
#include "cuda/error.h"
#include "cuda/vmm.h"
#include "cudasim.h"

namespace {

using vramswap::cuda::CudaError;
using vramswap::cuda::host_vmm_supported;
using vramswap::cuda::Mapping;
using vramswap::cuda::PhysicalPages;
using vramswap::cuda::VaReservation;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// cudasim's counters of device 0, read through dlsym; nullopt when not on cudasim.
std::optional<cudasim_counters> sim_counters() {
  using Fn = int (*)(int, cudasim_counters*);
  static const Fn fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "cudasim_get_counters"));
  cudasim_counters c{};
  if (fn == nullptr || fn(0, &c) != 0) return std::nullopt;
  return c;
}

// cudasim_fail_configure through dlsym: -2 when not on cudasim.
int fail_configure(const char* spec) {
  using Fn = int (*)(const char*);
  static const Fn fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "cudasim_fail_configure"));
  return fn == nullptr ? -2 : fn(spec);
}

// The minimum granularity of host memory on device 0's host node.
uint64_t host_granularity() {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  int node = 0;
  cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, 0);
  prop.location.id = node < 0 ? 0 : node;
  size_t g = 0;
  EXPECT_EQ(CUDA_SUCCESS, cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  return g;
}

std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) % 251);
  return v;
}

class HostPages : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(cudaFree(nullptr));
    // A GPU whose driver lacks host-located VMM is not this case's subject; on cudasim it is
    // supported unless CUDASIM_HOST_VMM=0 (HostPagesUnsupported).
    if (!sim_counters() && !host_vmm_supported(0)) GTEST_SKIP() << "the driver has no host-located VMM";
    ASSERT_TRUE(host_vmm_supported(0));
    granularity_ = host_granularity();
    ASSERT_GT(granularity_, 0u);
  }
  void TearDown() override {
    cudaDeviceSynchronize();
    fail_configure(nullptr);
  }
  uint64_t granularity_ = 0;
};

TEST_F(HostPages, SizeIsRoundedUpToTheGranularity) {
  PhysicalPages one = PhysicalPages::on_host(0, 1);
  EXPECT_TRUE(one);
  EXPECT_TRUE(one.on_host());
  EXPECT_EQ(0, one.device());
  EXPECT_EQ(granularity_, one.size());
  PhysicalPages more = PhysicalPages::on_host(0, granularity_ + 1);
  EXPECT_EQ(2 * granularity_, more.size());
  PhysicalPages exact = PhysicalPages::on_host(0, 2 * granularity_);
  EXPECT_EQ(2 * granularity_, exact.size());

  CUmemAllocationProp prop{};
  ASSERT_EQ(CUDA_SUCCESS, cuMemGetAllocationPropertiesFromHandle(&prop, one.handle()));
  EXPECT_EQ(CU_MEM_LOCATION_TYPE_HOST_NUMA, prop.location.type);
  EXPECT_FALSE(PhysicalPages(0, granularity_).on_host()) << "device pages are not host pages";
}

// Host pages map beside device pages in one reservation; copies through the addresses reach
// both. The engine's use: an evicted block's range backed by host memory stays addressable.
TEST_F(HostPages, MappedBesideDevicePagesCopiesReachBoth) {
  const uint64_t g = granularity_;
  VaReservation va(2 * g, g);
  PhysicalPages device_pages(0, g);
  PhysicalPages host_pages = PhysicalPages::on_host(0, g);
  Mapping on_device(va.base(), device_pages);
  Mapping on_host(va.base() + g, host_pages);
  auto* dev = reinterpret_cast<unsigned char*>(va.base());
  auto* host = reinterpret_cast<unsigned char*>(va.base() + g);

  const std::vector<unsigned char> data = pattern(g, 5);
  ASSERT_CUDA_OK(cudaMemcpy(host, data.data(), g, cudaMemcpyHostToDevice));
  ASSERT_CUDA_OK(cudaMemcpy(dev, host, g, cudaMemcpyDeviceToDevice));
  ASSERT_CUDA_OK(cudaMemset(host, 0, g));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned char> out(g);
  ASSERT_CUDA_OK(cudaMemcpy(out.data(), dev, g, cudaMemcpyDeviceToHost));
  EXPECT_EQ(data, out) << "device pages, copied from host pages";
  ASSERT_CUDA_OK(cudaMemcpy(host, dev, g, cudaMemcpyDeviceToDevice));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_CUDA_OK(cudaMemcpy(out.data(), host, g, cudaMemcpyDeviceToHost));
  EXPECT_EQ(data, out) << "host pages, copied from device pages";
}

TEST_F(HostPages, CountAsPinnedHostMemoryNotDeviceMemory) {
  const auto c0 = sim_counters();
  if (!c0) GTEST_SKIP() << "needs cudasim's counters (cudasim.h)";
  PhysicalPages pages = PhysicalPages::on_host(0, 3 * kMiB);
  const uint64_t size = pages.size();
  EXPECT_EQ(c0->pinned_bytes + size, sim_counters()->pinned_bytes);
  EXPECT_EQ(c0->physical_bytes, sim_counters()->physical_bytes);
  pages.release();
  EXPECT_FALSE(pages);
  EXPECT_EQ(c0->pinned_bytes, sim_counters()->pinned_bytes);
}

TEST_F(HostPages, AFailedCreateThrowsAndHoldsNothing) {
  const auto c0 = sim_counters();
  if (!c0) GTEST_SKIP() << "needs cudasim's fault injection (cudasim.h)";
  ASSERT_EQ(0, fail_configure("cuMemCreate:1"));
  try {
    PhysicalPages::on_host(0, kMiB);
    ADD_FAILURE() << "no CudaError";
  } catch (const CudaError& e) {
    EXPECT_TRUE(e.out_of_memory()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("cuMemCreate")) << e.what();
  }
  EXPECT_EQ(c0->pinned_bytes, sim_counters()->pinned_bytes);
  PhysicalPages pages = PhysicalPages::on_host(0, kMiB);  // the next one is made
  EXPECT_TRUE(pages);
}

TEST_F(HostPages, NoBytesIsAnError) {
  EXPECT_THROW(PhysicalPages::on_host(0, 0), CudaError);
}

// CUDASIM_HOST_VMM=0: a driver without host-located VMM. The wrapper says so, naming the
// attribute, with CUDA_ERROR_NOT_SUPPORTED, and makes no cuMemCreate.
class HostPagesUnsupported : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* v = std::getenv("CUDASIM_HOST_VMM");
    if (v == nullptr || std::strcmp(v, "0") != 0) GTEST_SKIP() << "needs CUDASIM_HOST_VMM=0 (ctest sets it)";
    ASSERT_CUDA_OK(cudaSetDevice(0));
  }
  void TearDown() override { fail_configure(nullptr); }
};

TEST_F(HostPagesUnsupported, CreatingThemFailsWithNotSupportedAndSaysWhy) {
  EXPECT_FALSE(host_vmm_supported(0));
  const auto c0 = sim_counters();
  ASSERT_TRUE(c0);
  // A cuMemCreate would fail here with another code: only one made would show it.
  ASSERT_EQ(0, fail_configure("cuMemCreate:*=CUDA_ERROR_UNKNOWN"));
  try {
    PhysicalPages::on_host(0, kMiB);
    ADD_FAILURE() << "no CudaError";
  } catch (const CudaError& e) {
    EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, e.code()) << e.what();
    EXPECT_NE(std::string::npos, std::string(e.what()).find("HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))
        << e.what();
  }
  EXPECT_EQ(c0->pinned_bytes, sim_counters()->pinned_bytes);
  ASSERT_EQ(0, fail_configure(nullptr));
  EXPECT_TRUE(PhysicalPages(0, 2 * kMiB)) << "device pages are unaffected";
}

}  // namespace
