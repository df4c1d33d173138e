// cudasim conformance: devices, contexts, error reporting and unsupported calls, as the
// CUDA 13 runtime and driver documentation describe them.
//
// The suite is registered twice: with the default device count, and with
// CUDASIM_DEVICE_COUNT=3 (tests that need several devices skip on one).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "runtime_test_util.h"

namespace {

using cudasim_test::counters;
using cudasim_test::kMiB;

// The device count this process should see: CUDASIM_DEVICE_COUNT, or 1 by default.
int expected_device_count() {
  const char* value = std::getenv("CUDASIM_DEVICE_COUNT");
  return value == nullptr ? 1 : std::atoi(value);
}

int device_count() {
  int count = -1;
  EXPECT_CUDA_OK(cudaGetDeviceCount(&count));
  return count;
}

TEST(Device, CountIsOneByDefaultAndFollowsEnvironment) {
  int count = -1;
  ASSERT_CUDA_OK(cudaGetDeviceCount(&count));
  EXPECT_EQ(expected_device_count(), count);
}

TEST(Device, SetDeviceThenGetDeviceReturnsIt) {
  const int count = device_count();
  ASSERT_GE(count, 1);
  for (int d = count - 1; d >= 0; --d) {
    ASSERT_CUDA_OK(cudaSetDevice(d));
    int current = -1;
    ASSERT_CUDA_OK(cudaGetDevice(&current));
    EXPECT_EQ(d, current);
  }
}

// cudaSetDevice: "Sets device as the current device for the calling host thread."
TEST(Device, CurrentDeviceIsPerThread) {
  const int count = device_count();
  if (count < 2) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
  ASSERT_CUDA_OK(cudaSetDevice(0));
  std::thread other([] {
    EXPECT_CUDA_OK(cudaSetDevice(1));
    int current = -1;
    EXPECT_CUDA_OK(cudaGetDevice(&current));
    EXPECT_EQ(1, current);
  });
  other.join();
  int current = -1;
  ASSERT_CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(0, current);
}

// cudaSetDevice: "Valid device id's are 0 to (cudaGetDeviceCount() - 1)."
TEST(Device, InvalidOrdinalIsInvalidDevice) {
  const int count = device_count();
  ASSERT_CUDA_OK(cudaSetDevice(0));
  EXPECT_EQ(cudaErrorInvalidDevice, cudaSetDevice(count));
  EXPECT_EQ(cudaErrorInvalidDevice, cudaSetDevice(-1));
  cudaDeviceProp prop{};
  EXPECT_EQ(cudaErrorInvalidDevice, cudaGetDeviceProperties(&prop, count));
  int value = 0;
  EXPECT_EQ(cudaErrorInvalidDevice,
            cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, count));
  // A failed cudaSetDevice leaves the current device as it was.
  int current = -1;
  ASSERT_CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(0, current);
  cudaGetLastError();
}

TEST(Device, PropertiesTotalGlobalMemEqualsMemGetInfoTotal) {
  const int count = device_count();
  for (int d = 0; d < count; ++d) {
    ASSERT_CUDA_OK(cudaSetDevice(d));
    cudaDeviceProp prop{};
    ASSERT_CUDA_OK(cudaGetDeviceProperties(&prop, d));
    size_t free_bytes = 0, total_bytes = 0;
    ASSERT_CUDA_OK(cudaMemGetInfo(&free_bytes, &total_bytes));
    EXPECT_EQ(total_bytes, prop.totalGlobalMem) << "device " << d;
    EXPECT_LE(free_bytes, total_bytes);
    EXPECT_GT(free_bytes, 0u);
    EXPECT_GT(std::strlen(prop.name), 0u) << "cudaDeviceProp::name is empty";
    EXPECT_GE(prop.major, 1);
  }
  ASSERT_CUDA_OK(cudaSetDevice(0));
}

// CUDASIM_DEVICE_MEMORY sets the card's size and cudaMemGetInfo reports it (DESIGN.md).
TEST(Device, CapacityFollowsCudasimDeviceMemory) {
  const char* value = std::getenv("CUDASIM_DEVICE_MEMORY");
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_CUDA_OK(cudaMemGetInfo(&free_bytes, &total_bytes));
  EXPECT_EQ(total_bytes, counters().capacity_bytes);
  if (value == nullptr || std::string(value) != "512MiB") {
    GTEST_SKIP() << "CUDASIM_DEVICE_MEMORY is not 512MiB here";
  }
  EXPECT_EQ(512 * kMiB, total_bytes);
}

TEST(Device, AttributesAgreeWithProperties) {
  cudaDeviceProp prop{};
  ASSERT_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const struct {
    cudaDeviceAttr attr;
    int expected;
    const char* name;
  } rows[] = {
      {cudaDevAttrComputeCapabilityMajor, prop.major, "major"},
      {cudaDevAttrComputeCapabilityMinor, prop.minor, "minor"},
      {cudaDevAttrMultiProcessorCount, prop.multiProcessorCount, "multiProcessorCount"},
      {cudaDevAttrWarpSize, prop.warpSize, "warpSize"},
      {cudaDevAttrUnifiedAddressing, prop.unifiedAddressing, "unifiedAddressing"},
  };
  for (const auto& row : rows) {
    int value = -1;
    ASSERT_CUDA_OK(cudaDeviceGetAttribute(&value, row.attr, 0)) << row.name;
    EXPECT_EQ(row.expected, value) << row.name;
  }
  // cudaMemcpyDefault "is only allowed on systems that support unified virtual addressing".
  EXPECT_EQ(1, prop.unifiedAddressing);
  EXPECT_EQ(32, prop.warpSize);
}

TEST(Device, EachDeviceHasItsOwnMemory) {
  if (device_count() < 2) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
  ASSERT_CUDA_OK(cudaSetDevice(0));
  size_t free0_before = 0, total0 = 0;
  ASSERT_CUDA_OK(cudaMemGetInfo(&free0_before, &total0));
  ASSERT_CUDA_OK(cudaSetDevice(1));
  void* p = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&p, 16 * kMiB));
  cudaPointerAttributes attr{};
  ASSERT_CUDA_OK(cudaPointerGetAttributes(&attr, p));
  EXPECT_EQ(cudaMemoryTypeDevice, attr.type);
  EXPECT_EQ(1, attr.device);
  EXPECT_GE(counters(1).physical_bytes, 16 * kMiB);
  ASSERT_CUDA_OK(cudaSetDevice(0));
  size_t free0_after = 0;
  ASSERT_CUDA_OK(cudaMemGetInfo(&free0_after, &total0));
  EXPECT_EQ(free0_before, free0_after) << "an allocation on device 1 used device 0's memory";
  EXPECT_CUDA_OK(cudaFree(p));
}

// "cudaEventRecord() will fail if the input event and input stream are associated to
// different devices", while "cudaStreamWaitEvent() will succeed even if the input stream and
// input event are associated to different devices" (CUDA C++ Programming Guide, multi-device
// system, stream and event behavior). An event belongs to the device current at its creation.
TEST(Device, AnEventIsRecordedOnlyOnItsOwnDevicesStreams) {
  if (device_count() < 2) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
  ASSERT_CUDA_OK(cudaSetDevice(0));
  cudaEvent_t event = nullptr;
  ASSERT_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  cudaStream_t s0 = nullptr, s1 = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  ASSERT_CUDA_OK(cudaSetDevice(1));
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventRecord(event, s1));
  cudaGetLastError();
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventRecord(event, nullptr)) << "device 1's legacy stream";
  cudaGetLastError();
  EXPECT_CUDA_OK(cudaEventRecord(event, s0)) << "its own device's stream, whichever device is current";
  EXPECT_CUDA_OK(cudaStreamWaitEvent(s1, event, 0)) << "another device's stream may wait for it";
  EXPECT_CUDA_OK(cudaStreamSynchronize(s1));
  EXPECT_CUDA_OK(cudaEventDestroy(event));
  EXPECT_CUDA_OK(cudaStreamDestroy(s1));
  ASSERT_CUDA_OK(cudaSetDevice(0));
  EXPECT_CUDA_OK(cudaStreamDestroy(s0));
}

// Peer access between two devices: asked, enabled once (a second time is
// cudaErrorPeerAccessAlreadyEnabled), disabled once (again: cudaErrorPeerAccessNotEnabled);
// a device is never its own peer.
TEST(Device, PeerAccessIsEnabledAndDisabledOnce) {
  if (device_count() < 2) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT >= 2";
  int can = -1;
  ASSERT_CUDA_OK(cudaDeviceCanAccessPeer(&can, 1, 0));
  EXPECT_EQ(1, can);
  ASSERT_CUDA_OK(cudaDeviceCanAccessPeer(&can, 0, 0));
  EXPECT_EQ(0, can);
  EXPECT_EQ(cudaErrorInvalidDevice, cudaDeviceCanAccessPeer(&can, 0, 99));
  cudaGetLastError();
  ASSERT_CUDA_OK(cudaSetDevice(1));
  EXPECT_CUDA_OK(cudaDeviceEnablePeerAccess(0, 0));
  EXPECT_EQ(cudaErrorPeerAccessAlreadyEnabled, cudaDeviceEnablePeerAccess(0, 0));
  cudaGetLastError();
  EXPECT_EQ(cudaErrorInvalidDevice, cudaDeviceEnablePeerAccess(1, 0)) << "itself";
  cudaGetLastError();
  EXPECT_EQ(cudaErrorInvalidValue, cudaDeviceEnablePeerAccess(0, 1)) << "flags must be 0";
  cudaGetLastError();
  EXPECT_CUDA_OK(cudaDeviceDisablePeerAccess(0));
  EXPECT_EQ(cudaErrorPeerAccessNotEnabled, cudaDeviceDisablePeerAccess(0));
  cudaGetLastError();
  ASSERT_CUDA_OK(cudaSetDevice(0));
}

TEST(Errors, GetLastErrorResetsPeekAtLastErrorDoesNot) {
  ASSERT_CUDA_OK(cudaFree(nullptr));  // initializes the runtime
  cudaGetLastError();                 // starts from cudaSuccess
  ASSERT_EQ(cudaSuccess, cudaPeekAtLastError());
  ASSERT_EQ(cudaErrorInvalidDevice, cudaSetDevice(-1));
  // cudaPeekAtLastError: "This call does not reset the error to cudaSuccess like
  // cudaGetLastError()."
  EXPECT_EQ(cudaErrorInvalidDevice, cudaPeekAtLastError());
  EXPECT_EQ(cudaErrorInvalidDevice, cudaPeekAtLastError());
  EXPECT_EQ(cudaErrorInvalidDevice, cudaGetLastError());
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  EXPECT_EQ(cudaSuccess, cudaPeekAtLastError());
}

TEST(Errors, LastErrorIsPerHostThread) {
  cudaGetLastError();
  std::thread other([] {
    EXPECT_EQ(cudaErrorInvalidDevice, cudaSetDevice(-1));
    EXPECT_EQ(cudaErrorInvalidDevice, cudaPeekAtLastError());
  });
  other.join();
  // "Returns the last error that has been produced by any of the runtime calls in the
  // same instance of the CUDA Runtime library in the host thread."
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}

TEST(Errors, SuccessfulCallsDoNotClearTheLastError) {
  cudaGetLastError();
  ASSERT_EQ(cudaErrorInvalidDevice, cudaSetDevice(-1));
  int count = 0;
  ASSERT_CUDA_OK(cudaGetDeviceCount(&count));
  EXPECT_EQ(cudaErrorInvalidDevice, cudaGetLastError());
}

TEST(Errors, RuntimeErrorNamesAndStrings) {
  EXPECT_STREQ("cudaSuccess", cudaGetErrorName(cudaSuccess));
  EXPECT_STREQ("cudaErrorMemoryAllocation", cudaGetErrorName(cudaErrorMemoryAllocation));
  EXPECT_STREQ("cudaErrorInvalidValue", cudaGetErrorName(cudaErrorInvalidValue));
  EXPECT_STREQ("cudaErrorNotReady", cudaGetErrorName(cudaErrorNotReady));
  EXPECT_STREQ("cudaErrorStreamCaptureUnsupported",
               cudaGetErrorName(cudaErrorStreamCaptureUnsupported));
  const char* description = cudaGetErrorString(cudaErrorMemoryAllocation);
  ASSERT_NE(nullptr, description);
  EXPECT_GT(std::strlen(description), 0u);
  EXPECT_STRNE("unrecognized error code", description);
  EXPECT_STRNE("cudaErrorMemoryAllocation", description) << "a description, not the name";
  // "If the error code is not recognized, "unrecognized error code" is returned."
  EXPECT_STREQ("unrecognized error code", cudaGetErrorName(static_cast<cudaError_t>(12345)));
  EXPECT_STREQ("unrecognized error code", cudaGetErrorString(static_cast<cudaError_t>(12345)));
}

TEST(Errors, DriverErrorNamesAndStrings) {
  const char* str = nullptr;
  ASSERT_CU_OK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &str));
  EXPECT_STREQ("CUDA_ERROR_OUT_OF_MEMORY", str);
  ASSERT_CU_OK(cuGetErrorName(CUDA_SUCCESS, &str));
  EXPECT_STREQ("CUDA_SUCCESS", str);
  ASSERT_CU_OK(cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &str));
  EXPECT_STREQ("CUDA_ERROR_NOT_INITIALIZED", str);
  str = nullptr;
  ASSERT_CU_OK(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &str));
  ASSERT_NE(nullptr, str);
  EXPECT_GT(std::strlen(str), 0u);
  // "If the error code is not recognized, CUDA_ERROR_INVALID_VALUE will be returned
  // and *pStr will be set to the NULL address."
  str = "not cleared";
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuGetErrorName(static_cast<CUresult>(12345), &str));
  EXPECT_EQ(nullptr, str);
  str = "not cleared";
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuGetErrorString(static_cast<CUresult>(12345), &str));
  EXPECT_EQ(nullptr, str);
}

TEST(Unsupported, RuntimeCallReturnsNotSupported) {
  ASSERT_CUDA_OK(cudaFree(nullptr));
  cudaGetLastError();
  cudaChannelFormatDesc desc{};
  desc.x = 32;
  desc.f = cudaChannelFormatKindFloat;
  cudaArray_t array = nullptr;
  EXPECT_EQ(cudaErrorNotSupported, cudaMallocArray(&array, &desc, 16, 16));
  EXPECT_EQ(cudaErrorNotSupported, cudaGetLastError());
  // The runtime keeps working afterwards.
  void* p = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&p, 4096));
  EXPECT_CUDA_OK(cudaFree(p));
}

TEST(Unsupported, DriverCallReturnsNotSupported) {
  ASSERT_CUDA_OK(cudaFree(nullptr));  // the runtime initializes the driver
  CUmodule module = nullptr;
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, cuModuleLoad(&module, "/nonexistent/kernels.cubin"));
  CUdeviceptr p = 0;
  ASSERT_CU_OK(cuMemAlloc(&p, 4096));
  EXPECT_CU_OK(cuMemFree(p));
}

TEST(Driver, DeviceQueriesAgreeWithRuntime) {
  ASSERT_CU_OK(cuInit(0));
  int count = -1;
  ASSERT_CU_OK(cuDeviceGetCount(&count));
  EXPECT_EQ(device_count(), count);
  CUdevice dev = -1;
  ASSERT_CU_OK(cuDeviceGet(&dev, 0));
  int vmm = 0;
  ASSERT_CU_OK(
      cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  EXPECT_EQ(1, vmm);
  size_t total = 0;
  ASSERT_CU_OK(cuDeviceTotalMem(&total, dev));
  cudaDeviceProp prop{};
  ASSERT_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  EXPECT_EQ(prop.totalGlobalMem, total);
  int major = -1;
  ASSERT_CU_OK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  EXPECT_EQ(prop.major, major);
  char name[256] = {};
  ASSERT_CU_OK(cuDeviceGetName(name, sizeof name, dev));
  EXPECT_STREQ(prop.name, name);
  CUdevice bad = -1;
  EXPECT_EQ(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet(&bad, count));
}

TEST(Driver, PrimaryContextRetainReleaseAndCurrent) {
  ASSERT_CU_OK(cuInit(0));
  CUdevice dev = -1;
  ASSERT_CU_OK(cuDeviceGet(&dev, 0));
  CUcontext first = nullptr, second = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&first, dev));
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&second, dev));
  ASSERT_NE(nullptr, first);
  EXPECT_EQ(first, second) << "a device has one primary context";
  unsigned int flags = 0;
  int active = 0;
  ASSERT_CU_OK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
  EXPECT_EQ(1, active);

  ASSERT_CU_OK(cuCtxSetCurrent(first));
  CUcontext current = nullptr;
  ASSERT_CU_OK(cuCtxGetCurrent(&current));
  EXPECT_EQ(first, current);
  CUdevice ctx_dev = -1;
  ASSERT_CU_OK(cuCtxGetDevice(&ctx_dev));
  EXPECT_EQ(dev, ctx_dev);

  // cuCtxGetCurrent: "If no context is bound to the calling CPU thread then *pctx is set
  // to NULL and CUDA_SUCCESS is returned."
  ASSERT_CU_OK(cuCtxSetCurrent(nullptr));
  current = first;
  ASSERT_CU_OK(cuCtxGetCurrent(&current));
  EXPECT_EQ(nullptr, current);

  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(dev));
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(dev));
}

// cudaSetDevice: "This call will bind the primary context of the specified device to
// the calling thread".
TEST(Driver, RuntimeBindsThePrimaryContext) {
  ASSERT_CUDA_OK(cudaSetDevice(0));
  CUcontext current = nullptr;
  ASSERT_CU_OK(cuCtxGetCurrent(&current));
  CUdevice dev = -1;
  ASSERT_CU_OK(cuDeviceGet(&dev, 0));
  CUcontext primary = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&primary, dev));
  EXPECT_EQ(primary, current);
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(dev));

  // Memory from the driver and from the runtime is the same memory.
  CUdeviceptr p = 0;
  ASSERT_CU_OK(cuMemAlloc(&p, 4096));
  ASSERT_CU_OK(cuMemsetD8(p, 0x3C, 4096));
  std::vector<unsigned char> host(4096, 0);
  ASSERT_CUDA_OK(cudaMemcpy(host.data(), reinterpret_cast<void*>(p), 4096, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::vector<unsigned char>(4096, 0x3C), host);
  cudaPointerAttributes attr{};
  ASSERT_CUDA_OK(cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(p)));
  EXPECT_EQ(cudaMemoryTypeDevice, attr.type);
  EXPECT_CU_OK(cuMemFree(p));
}

TEST(Driver, DriverAndRuntimeVersionsAreCuda13) {
  int driver = 0, runtime = 0;
  ASSERT_CUDA_OK(cudaDriverGetVersion(&driver));
  ASSERT_CUDA_OK(cudaRuntimeGetVersion(&runtime));
  EXPECT_GE(driver, 13000);
  EXPECT_GE(runtime, 13000);
  EXPECT_LT(runtime, 14000);
  EXPECT_GE(driver, runtime) << "the driver must support the runtime's version";
  int cu_driver = 0;
  ASSERT_CU_OK(cuDriverGetVersion(&cu_driver));
  EXPECT_EQ(driver, cu_driver);
}

TEST(Driver, EmulatorAnnouncesItself) { EXPECT_EQ(1, cudasim_is_emulated()); }

}  // namespace
