// cudasim conformance: the driver API before and after cuInit. This executable links
// only libcuda.so.1: the runtime would call cuInit itself.
//
// Under CTest every test runs in its own process. Run by hand, the tests run in the
// order written, so NotInitializedBeforeCuInit comes first on purpose.
#include <cuda.h>
#include <gtest/gtest.h>

#include <vector>

#include "driver_test_util.h"

namespace {

// cuInit: "If cuInit() has not been called, any function from the driver API will return
// CUDA_ERROR_NOT_INITIALIZED."
TEST(DriverInit, CallsBeforeCuInitAreNotInitialized) {
  int count = -1;
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGetCount(&count));
  CUdevice dev = -1;
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGet(&dev, 0));
  CUcontext ctx = nullptr;
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, cuCtxGetCurrent(&ctx));
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, cuDevicePrimaryCtxRetain(&ctx, 0));
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, cuMemAlloc(&p, 4096));
  CUmemGenericAllocationHandle handle = 0;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, cuMemCreate(&handle, 2 << 20, &prop, 0));
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, cuMemAddressReserve(&p, 2 << 20, 0, 0, 0));

  // And cuInit makes them work.
  ASSERT_CU_OK(cuInit(0));
  ASSERT_CU_OK(cuDeviceGetCount(&count));
  EXPECT_GE(count, 1);
  ASSERT_CU_OK(cuDeviceGet(&dev, 0));
  EXPECT_EQ(0, dev);
}

// cuInit: "Currently, the Flags parameter must be 0."
TEST(DriverInit, CuInitRejectsNonzeroFlags) {
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuInit(1));
  EXPECT_CU_OK(cuInit(0));
  EXPECT_CU_OK(cuInit(0)) << "cuInit may be called again";
}

// A driver-only program has no current context until it makes one current.
TEST(DriverInit, NoContextIsCurrentAfterCuInit) {
  ASSERT_CU_OK(cuInit(0));
  CUcontext ctx = reinterpret_cast<CUcontext>(0x1);
  ASSERT_CU_OK(cuCtxGetCurrent(&ctx));
  EXPECT_EQ(nullptr, ctx);
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_INVALID_CONTEXT, cuMemAlloc(&p, 4096));
}

TEST(DriverInit, MemoryThroughThePrimaryContext) {
  ASSERT_CU_OK(cuInit(0));
  CUdevice dev = -1;
  ASSERT_CU_OK(cuDeviceGet(&dev, 0));
  CUcontext ctx = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&ctx, dev));
  ASSERT_CU_OK(cuCtxSetCurrent(ctx));

  size_t free_before = 0, total = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_before, &total));
  EXPECT_LE(free_before, total);

  constexpr size_t kSize = 1 << 20;
  CUdeviceptr p = 0;
  ASSERT_CU_OK(cuMemAlloc(&p, kSize));
  size_t free_during = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_during, &total));
  EXPECT_LE(free_during + kSize, free_before);

  std::vector<unsigned char> in(kSize), out(kSize, 0);
  for (size_t i = 0; i < kSize; ++i) in[i] = static_cast<unsigned char>(i * 7 + 1);
  ASSERT_CU_OK(cuMemcpyHtoD(p, in.data(), kSize));
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), p, kSize));
  EXPECT_EQ(in, out);
  ASSERT_CU_OK(cuMemsetD8(p, 0xEE, kSize));
  ASSERT_CU_OK(cuCtxSynchronize());
  ASSERT_CU_OK(cuMemcpyDtoH(out.data(), p, kSize));
  EXPECT_EQ(std::vector<unsigned char>(kSize, 0xEE), out);

  ASSERT_CU_OK(cuMemFree(p));
  size_t free_after = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_after, &total));
  EXPECT_EQ(free_before, free_after);
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(dev));
}

}  // namespace
