// cudasim's fault injection (README, "Fault injection"; src/sim/core/fault.h): rules that
// fail the Nth call, the Nth and later calls, calls at random with a seed, or every call;
// the code each function returns and its override; bad rule lists; a failed call has no
// side effect and breaks nothing; the counter of injected failures and the pinned-memory
// counters a leak check reads.
//
//   Fault.*             rules set at run time with cudasim_fail_configure (no environment)
//   FaultDeathTest.*    a bad CUDASIM_FAIL or CUDASIM_FAIL_SEED stops the process
//   FaultEnvironment.*  CUDASIM_FAIL from the environment, with CUDASIM_LOG=1; registered
//                       with that environment and skipped without it (see CMakeLists.txt)
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "runtime_test_util.h"

// The per-thread-stream form a program compiled with --default-stream per-thread calls.
extern "C" cudaError_t cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                            cudaStream_t stream);

namespace {

using cudasim_test::counters;
using cudasim_test::kMiB;
using cudasim_test::PinnedBuffer;
using cudasim_test::Stream;
using cudasim_test::StreamGate;

// Captures what the code under test writes to file descriptor 2.
class StderrCapture {
 public:
  StderrCapture() {
    std::fflush(stderr);
    char path[] = "/tmp/cudasim_fault_stderr_XXXXXX";
    fd_ = mkstemp(path);
    unlink(path);
    saved_ = dup(STDERR_FILENO);
    dup2(fd_, STDERR_FILENO);
  }
  ~StderrCapture() {
    restore();
    close(fd_);
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  std::string text() {
    restore();
    std::string out;
    char buf[4096];
    lseek(fd_, 0, SEEK_SET);
    for (ssize_t n; (n = read(fd_, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
    return out;
  }

 private:
  void restore() {
    if (saved_ >= 0) {
      std::fflush(stderr);
      dup2(saved_, STDERR_FILENO);
      close(saved_);
      saved_ = -1;
    }
  }
  int fd_ = -1;
  int saved_ = -1;
};

// Each case starts and ends with no rule, and with no error left for the next call.
class Fault : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(0, cudasim_fail_configure(nullptr));
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    cudaGetLastError();
  }
  void TearDown() override {
    EXPECT_EQ(0, cudasim_fail_configure(""));
    cudaDeviceSynchronize();
    cudaGetLastError();
  }
};

// Allocates and frees `n` bytes with cudaMalloc; the allocation's status.
cudaError_t malloc_and_free(size_t n) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, n);
  if (e == cudaSuccess) cudaFree(p);
  return e;
}

TEST_F(Fault, NthCallFailsThatCallOnly) {
  const uint64_t before = cudasim_failures_injected();
  ASSERT_EQ(0, cudasim_fail_configure("cudaMalloc:3"));
  EXPECT_CUDA_OK(malloc_and_free(kMiB));
  EXPECT_CUDA_OK(malloc_and_free(kMiB));
  void* p = reinterpret_cast<void*>(1);
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMalloc(&p, kMiB));
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaGetLastError());  // reported like any error...
  EXPECT_CUDA_OK(cudaGetLastError());                        // ...and not sticky
  for (int i = 0; i < 5; ++i) EXPECT_CUDA_OK(malloc_and_free(kMiB)) << "call " << 4 + i;
  EXPECT_EQ(before + 1, cudasim_failures_injected());
}

TEST_F(Fault, NthAndLaterCallsFail) {
  ASSERT_EQ(0, cudasim_fail_configure("cudaEventCreate:2+"));
  cudaEvent_t e = nullptr;
  ASSERT_CUDA_OK(cudaEventCreate(&e));
  for (int i = 2; i <= 6; ++i) {
    cudaEvent_t f = nullptr;
    EXPECT_EQ(cudaErrorMemoryAllocation, cudaEventCreate(&f)) << "call " << i;
  }
  EXPECT_CUDA_OK(cudaEventDestroy(e));
  ASSERT_EQ(0, cudasim_fail_configure(nullptr));  // cleared: it works again
  ASSERT_CUDA_OK(cudaEventCreate(&e));
  EXPECT_CUDA_OK(cudaEventDestroy(e));
}

TEST_F(Fault, StarFailsEveryCallAndOnlyOfThatFunction) {
  const uint64_t before = cudasim_failures_injected();
  ASSERT_EQ(0, cudasim_fail_configure("cudaHostAlloc:*"));
  for (int i = 0; i < 4; ++i) {
    void* p = nullptr;
    EXPECT_EQ(cudaErrorMemoryAllocation, cudaHostAlloc(&p, kMiB, cudaHostAllocDefault)) << "call " << i + 1;
  }
  PinnedBuffer other(kMiB);  // cudaMallocHost is another function
  EXPECT_CUDA_OK(other.status());
  EXPECT_EQ(before + 4, cudasim_failures_injected());
}

TEST_F(Fault, ConfigureNumbersCallsFromOneAgain) {
  ASSERT_EQ(0, cudasim_fail_configure("cudaMalloc:2"));
  EXPECT_CUDA_OK(malloc_and_free(kMiB));
  ASSERT_EQ(0, cudasim_fail_configure("cudaMalloc:2"));
  EXPECT_CUDA_OK(malloc_and_free(kMiB));  // the first call since the new rules
  EXPECT_EQ(cudaErrorMemoryAllocation, malloc_and_free(kMiB));
}

// Which of `n` cudaStreamQuery calls failed, as a string of 0 and 1.
std::string query_pattern(int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += cudaStreamQuery(nullptr) == cudaSuccess ? '0' : '1';
  cudaGetLastError();
  return out;
}

TEST_F(Fault, ProbabilityFailsAboutThatShareOfCallsTheSameWayEachTime) {
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamQuery:p0.25"));
  const std::string first = query_pattern(400);
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamQuery:p0.25"));
  const std::string again = query_pattern(400);
  EXPECT_EQ(first, again) << "the same seed and the same calls fail the same calls";
  const auto failed = std::count(first.begin(), first.end(), '1');
  // Binomial(400, 0.25): mean 100, standard deviation 8.7; the seed is fixed, so this is
  // a check of the generator's wiring, not a test that can fail by chance.
  EXPECT_GT(failed, 60) << first;
  EXPECT_LT(failed, 140) << first;
}

TEST_F(Fault, ProbabilityZeroNeverFailsAndOneAlwaysFails) {
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamQuery:p0"));
  EXPECT_EQ(std::string(100, '0'), query_pattern(100));
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamQuery:p1"));
  EXPECT_EQ(std::string(100, '1'), query_pattern(100));
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamQuery:p1.0=cudaErrorNotReady"));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(nullptr));
}

TEST_F(Fault, CodeOverrideByNameOrNumber) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemGenericAllocationHandle h = 0;
  ASSERT_EQ(0, cudasim_fail_configure("cuMemCreate:1=CUDA_ERROR_NOT_SUPPORTED,cuMemCreate:2=999"));
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, cuMemCreate(&h, 2 * kMiB, &prop, 0));
  EXPECT_EQ(CUresult(999), cuMemCreate(&h, 2 * kMiB, &prop, 0));
  ASSERT_CU_OK(cuMemCreate(&h, 2 * kMiB, &prop, 0));
  EXPECT_CU_OK(cuMemRelease(h));
  // A runtime name for a driver function is the same number.
  ASSERT_EQ(0, cudasim_fail_configure("cuMemCreate:1=cudaErrorMemoryAllocation"));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&h, 2 * kMiB, &prop, 0));
}

TEST_F(Fault, EachFunctionFailsWithItsDocumentedCode) {
  // A sample of the table; FunctionListMatchesTheReadme checks the whole list.
  std::map<std::string, int> code;
  const size_t n = cudasim_fail_functions(nullptr, nullptr, 0);
  std::vector<const char*> names(n);
  std::vector<int> codes(n);
  ASSERT_EQ(n, cudasim_fail_functions(names.data(), codes.data(), n));
  for (size_t i = 0; i < n; ++i) code[names[i]] = codes[i];
  EXPECT_EQ(int(CUDA_ERROR_OUT_OF_MEMORY), code["cuMemCreate"]);
  EXPECT_EQ(int(CUDA_ERROR_OUT_OF_MEMORY), code["cuMemMap"]);
  EXPECT_EQ(int(CUDA_ERROR_OUT_OF_MEMORY), code["cuMemAddressReserve"]);
  EXPECT_EQ(int(CUDA_ERROR_INVALID_VALUE), code["cuMemSetAccess"]);
  EXPECT_EQ(int(CUDA_ERROR_INVALID_VALUE), code["cuMemUnmap"]);
  EXPECT_EQ(int(cudaErrorMemoryAllocation), code["cudaHostAlloc"]);
  EXPECT_EQ(int(cudaErrorInvalidValue), code["cudaMemcpyAsync"]);
  EXPECT_EQ(int(cudaErrorInvalidResourceHandle), code["cudaStreamSynchronize"]);
  for (const char* required :
       {"cuInit", "cuDeviceGet", "cuDeviceTotalMem", "cuDeviceGetAttribute", "cuMemGetAllocationGranularity",
        "cuDeviceGetCount", "cuCtxSynchronize", "cuThreadExchangeStreamCaptureMode", "cuMemGetInfo",
        "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDevicePrimaryCtxRetain", "cuMemAddressReserve", "cuMemAddressFree",
        "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cudaGetDevice",
        "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaEventRecord", "cudaEventQuery", "cudaEventSynchronize",
        "cudaStreamCreateWithPriority", "cudaStreamDestroy", "cudaMemcpyAsync", "cudaStreamWaitEvent",
        "cudaStreamIsCapturing", "cudaThreadExchangeStreamCaptureMode", "cudaStreamSynchronize",
        "cudaDeviceGetStreamPriorityRange", "cudaDeviceSynchronize", "cudaHostAlloc", "cudaFreeHost",
        "cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaSetDevice", "cudaMemGetInfo",
        "cudaStreamGetDevice"})
    EXPECT_EQ(1u, code.count(required)) << required << ": vramswap calls it, so a rule must be able to fail it";
  // And a call really returns the listed code.
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamSynchronize:1,cudaDeviceSynchronize:1"));
  EXPECT_EQ(code["cudaStreamSynchronize"], int(cudaStreamSynchronize(nullptr)));
  EXPECT_EQ(code["cudaDeviceSynchronize"], int(cudaDeviceSynchronize()));
}

// The README's table (section "Fault injection") lists exactly the functions and codes
// cudasim_fail_functions reports, in its order.
TEST_F(Fault, FunctionListMatchesTheReadme) {
  std::ifstream readme(CUDASIM_README_PATH);
  ASSERT_TRUE(readme) << CUDASIM_README_PATH;
  std::vector<std::pair<std::string, std::string>> rows;  // (function, code name)
  bool in_section = false;
  for (std::string line; std::getline(readme, line);) {
    if (line.rfind("#", 0) == 0) in_section = line.find("Fault injection") != std::string::npos;
    if (!in_section || line.rfind("| `cu", 0) != 0) continue;
    // | `name` | `CODE` (value) | why |
    const size_t a = line.find('`'), b = line.find('`', a + 1), c = line.find('`', b + 1), d = line.find('`', c + 1);
    ASSERT_NE(d, std::string::npos) << line;
    rows.emplace_back(line.substr(a + 1, b - a - 1), line.substr(c + 1, d - c - 1));
  }
  const size_t n = cudasim_fail_functions(nullptr, nullptr, 0);
  std::vector<const char*> names(n);
  std::vector<int> codes(n);
  cudasim_fail_functions(names.data(), codes.data(), n);
  ASSERT_EQ(n, rows.size()) << "rows in README.md's fault table";
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(names[i], rows[i].first) << "row " << i + 1;
    const bool runtime = std::strncmp(names[i], "cuda", 4) == 0;
    const char* want = nullptr;
    if (runtime) want = cudaGetErrorName(static_cast<cudaError_t>(codes[i]));
    else cuGetErrorName(static_cast<CUresult>(codes[i]), &want);
    EXPECT_EQ(std::string(want ? want : "?"), rows[i].second) << names[i];
  }
}

TEST_F(Fault, PerThreadAndVersionedFormsCountAsTheirFunction) {
  PinnedBuffer host(4096);
  ASSERT_CUDA_OK(host.status());
  void* d = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&d, 4096));
  ASSERT_EQ(0, cudasim_fail_configure("cudaMemcpyAsync:2"));
  EXPECT_CUDA_OK(cudaMemcpyAsync(d, host.get(), 4096, cudaMemcpyHostToDevice, nullptr));
  EXPECT_EQ(cudaErrorInvalidValue, cudaMemcpyAsync_ptsz(d, host.get(), 4096, cudaMemcpyHostToDevice, nullptr));
  EXPECT_CUDA_OK(cudaMemcpyAsync_ptsz(d, host.get(), 4096, cudaMemcpyHostToDevice, nullptr));
  // cuda.h makes cuMemAlloc cuMemAlloc_v2; a rule may name either.
  ASSERT_EQ(0, cudasim_fail_configure("cuMemAlloc_v2:1,cuMemAlloc:2"));
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&p, 4096));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&p, 4096));
  ASSERT_CU_OK(cuMemAlloc(&p, 4096));
  EXPECT_CU_OK(cuMemFree(p));
  EXPECT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_CUDA_OK(cudaFree(d));
}

TEST_F(Fault, DriverCallsTheRuntimeMakesAreNotCounted) {
  // cudaHostAlloc is cuMemHostAlloc inside cudasim's runtime, and every runtime call asks
  // for the current context: rules on those driver functions leave runtime calls alone.
  ASSERT_EQ(0, cudasim_fail_configure("cuMemHostAlloc:*,cuCtxGetCurrent:*,cuInit:*"));
  PinnedBuffer pinned(kMiB);
  EXPECT_CUDA_OK(pinned.status());
  EXPECT_CUDA_OK(malloc_and_free(kMiB));
  void* p = nullptr;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemHostAlloc(&p, kMiB, 0));  // the program's own call fails
  CUcontext ctx = nullptr;
  EXPECT_EQ(CUDA_ERROR_DEINITIALIZED, cuCtxGetCurrent(&ctx));
  EXPECT_EQ(CUDA_ERROR_NO_DEVICE, cuInit(0));
}

// ---- A failed call has no side effect ------------------------------------------------

TEST_F(Fault, FailedCuMemCreateAndMapChangeNoCounter) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUdeviceptr va = 0;
  ASSERT_CU_OK(cuMemAddressReserve(&va, 4 * kMiB, 0, 0, 0));
  const cudasim_counters before = counters();
  ASSERT_EQ(0, cudasim_fail_configure("cuMemCreate:1,cuMemMap:1,cuMemSetAccess:1"));
  CUmemGenericAllocationHandle h = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&h, 4 * kMiB, &prop, 0));
  EXPECT_EQ(0u, h) << "no handle is written";
  EXPECT_EQ(before.physical_bytes, counters().physical_bytes);
  ASSERT_CU_OK(cuMemCreate(&h, 4 * kMiB, &prop, 0));
  EXPECT_EQ(before.physical_bytes + 4 * kMiB, counters().physical_bytes);
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemMap(va, 4 * kMiB, 0, h, 0));
  EXPECT_EQ(before.mapped_bytes, counters().mapped_bytes);
  ASSERT_CU_OK(cuMemMap(va, 4 * kMiB, 0, h, 0));  // the range was left unmapped
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemSetAccess(va, 4 * kMiB, &access, 1));
  unsigned long long flags = 99;
  EXPECT_CU_OK(cuMemGetAccess(&flags, &access.location, va));
  EXPECT_EQ(CU_MEM_ACCESS_FLAGS_PROT_NONE, flags) << "the failed call granted nothing";
  ASSERT_CU_OK(cuMemSetAccess(va, 4 * kMiB, &access, 1));
  // Failed unmaps and releases leave the mapping and the handle as they were.
  ASSERT_EQ(0, cudasim_fail_configure("cuMemUnmap:1,cuMemRelease:1,cuMemAddressFree:1"));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemUnmap(va, 4 * kMiB));
  EXPECT_EQ(before.mapped_bytes + 4 * kMiB, counters().mapped_bytes);
  static_cast<volatile unsigned char*>(reinterpret_cast<void*>(va))[0] = 7;  // still mapped and writable
  EXPECT_CU_OK(cuMemUnmap(va, 4 * kMiB));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemRelease(h));
  EXPECT_EQ(before.physical_bytes + 4 * kMiB, counters().physical_bytes);
  EXPECT_CU_OK(cuMemRelease(h));
  EXPECT_EQ(before.physical_bytes, counters().physical_bytes);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, 4 * kMiB));
  EXPECT_CU_OK(cuMemAddressFree(va, 4 * kMiB));
}

TEST_F(Fault, FailedHostAllocLeavesPinnedBytesAndFreesBalanceThem) {
  const uint64_t pinned = counters().pinned_bytes;
  ASSERT_EQ(0, cudasim_fail_configure("cudaHostAlloc:1,cudaMallocHost:1,cudaFreeHost:1"));
  void* p = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaHostAlloc(&p, 3 * kMiB, cudaHostAllocDefault));
  EXPECT_EQ(nullptr, p);
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMallocHost(&p, 3 * kMiB));
  EXPECT_EQ(pinned, counters().pinned_bytes);
  ASSERT_CUDA_OK(cudaHostAlloc(&p, 3 * kMiB + 5, cudaHostAllocDefault));
  EXPECT_EQ(pinned + 3 * kMiB + 5, counters().pinned_bytes) << "counted in bytes asked for";
  EXPECT_EQ(cudaErrorInvalidValue, cudaFreeHost(p));
  EXPECT_EQ(pinned + 3 * kMiB + 5, counters().pinned_bytes) << "a failed free frees nothing";
  static_cast<volatile unsigned char*>(p)[0] = 1;  // still there
  EXPECT_CUDA_OK(cudaFreeHost(p));
  EXPECT_EQ(pinned, counters().pinned_bytes);
}

TEST_F(Fault, RegisteredBytesAreCountedAndAFailedRegisterCountsNothing) {
  std::vector<unsigned char> host(2 * kMiB);
  const uint64_t registered = counters().registered_bytes;
  ASSERT_EQ(0, cudasim_fail_configure("cudaHostRegister:1,cudaHostUnregister:1"));
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaHostRegister(host.data(), host.size(), cudaHostRegisterDefault));
  EXPECT_EQ(registered, counters().registered_bytes);
  ASSERT_CUDA_OK(cudaHostRegister(host.data(), host.size(), cudaHostRegisterDefault));
  EXPECT_EQ(registered + host.size(), counters().registered_bytes);
  EXPECT_EQ(cudaErrorInvalidValue, cudaHostUnregister(host.data()));
  EXPECT_EQ(registered + host.size(), counters().registered_bytes);
  EXPECT_CUDA_OK(cudaHostUnregister(host.data()));
  EXPECT_EQ(registered, counters().registered_bytes);
}

TEST_F(Fault, FailedCudaMallocAndFreeChangeNothing) {
  const uint64_t physical = counters().physical_bytes;
  ASSERT_EQ(0, cudasim_fail_configure("cudaMalloc:1,cudaFree:1,cudaMallocAsync:1,cudaFreeAsync:1"));
  void* p = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMalloc(&p, 8 * kMiB));
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMallocAsync(&p, 8 * kMiB, nullptr));
  EXPECT_EQ(physical, counters().physical_bytes);
  ASSERT_CUDA_OK(cudaMalloc(&p, 8 * kMiB));
  EXPECT_EQ(cudaErrorInvalidValue, cudaFree(p));
  EXPECT_EQ(physical + 8 * kMiB, counters().physical_bytes);
  EXPECT_CUDA_OK(cudaFree(p));
  ASSERT_CUDA_OK(cudaMallocAsync(&p, 8 * kMiB, nullptr));
  EXPECT_EQ(cudaErrorInvalidValue, cudaFreeAsync(p, nullptr));
  EXPECT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(physical + 8 * kMiB, counters().physical_bytes);
  EXPECT_CUDA_OK(cudaFreeAsync(p, nullptr));
  EXPECT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(physical, counters().physical_bytes);
}

TEST_F(Fault, FailedCopyAndMemsetQueueNothing) {
  PinnedBuffer host(kMiB, 0xab);
  ASSERT_CUDA_OK(host.status());
  void* d = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&d, kMiB));
  ASSERT_CUDA_OK(cudaMemset(d, 0x11, kMiB));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const cudasim_counters before = counters();
  ASSERT_EQ(0, cudasim_fail_configure("cudaMemcpyAsync:1,cudaMemsetAsync:1"));
  EXPECT_EQ(cudaErrorInvalidValue, cudaMemcpyAsync(d, host.get(), kMiB, cudaMemcpyHostToDevice, nullptr));
  EXPECT_EQ(cudaErrorInvalidValue, cudaMemsetAsync(d, 0x22, kMiB, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const cudasim_counters after = counters();
  EXPECT_EQ(before.bytes_h2d, after.bytes_h2d);
  EXPECT_EQ(before.bytes_memset, after.bytes_memset);
  EXPECT_EQ(before.ops_executed, after.ops_executed);
  EXPECT_EQ(0x11, static_cast<volatile unsigned char*>(d)[kMiB - 1]);
  EXPECT_CUDA_OK(cudaFree(d));
}

TEST_F(Fault, FailedSynchronizationReturnsAtOnceAndLeavesTheStreamWorking) {
  Stream stream(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(stream.status());
  PinnedBuffer host(4096, 0);
  ASSERT_CUDA_OK(host.status());
  void* d = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&d, 4096));
  cudasim_test::Event event(cudaEventDisableTiming);
  ASSERT_CUDA_OK(event.status());
  StreamGate gate;
  ASSERT_CUDA_OK(gate.hold(stream));
  ASSERT_CUDA_OK(cudaMemsetAsync(d, 0x5a, 4096, stream));
  ASSERT_CUDA_OK(cudaMemcpyAsync(host.get(), d, 4096, cudaMemcpyDeviceToHost, stream));
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamSynchronize:1,cudaEventRecord:1,cudaEventSynchronize:1,"
                                      "cudaStreamWaitEvent:1,cudaDeviceSynchronize:1,cudaEventQuery:2"));
  // The stream is held: had any of these waited, the test would hang here.
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaStreamSynchronize(stream));
  EXPECT_EQ(cudaErrorDeviceUninitialized, cudaDeviceSynchronize());
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventRecord(event, stream));
  EXPECT_CUDA_OK(cudaEventQuery(event)) << "the failed record recorded nothing: an unrecorded event is complete";
  EXPECT_CUDA_OK(cudaEventRecord(event, stream));
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventQuery(event));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(event));
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaEventSynchronize(event));
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaStreamWaitEvent(nullptr, event, 0));
  EXPECT_EQ(0, host.at(0)) << "nothing ran yet";
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaGetLastError());  // the last failure, now cleared
  gate.open();
  EXPECT_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(0x5a, host.at(4095)) << "the queued work ran as queued";
  EXPECT_CUDA_OK(cudaEventSynchronize(event));
  EXPECT_CUDA_OK(cudaGetLastError()) << "no error is left behind";
  EXPECT_CUDA_OK(cudaFree(d));
}

TEST_F(Fault, FailedStreamAndEventCreationCreateNothing) {
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamCreateWithPriority:1,cudaEventCreateWithFlags:1"));
  cudaStream_t s = reinterpret_cast<cudaStream_t>(0x1);
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, 0));
  EXPECT_EQ(reinterpret_cast<cudaStream_t>(0x1), s) << "no handle is written";
  cudaEvent_t e = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  EXPECT_EQ(nullptr, e);
  ASSERT_CUDA_OK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, 0));
  ASSERT_EQ(0, cudasim_fail_configure("cudaStreamDestroy:1"));
  EXPECT_EQ(cudaErrorInvalidResourceHandle, cudaStreamDestroy(s));
  EXPECT_CUDA_OK(cudaStreamQuery(s)) << "the stream was not destroyed";
  EXPECT_CUDA_OK(cudaStreamDestroy(s));
}

// ---- Bad rule lists -------------------------------------------------------------------

struct BadSpec {
  const char* spec;
  const char* reason;  // what the message must say is wrong
};

class FaultBadSpec : public Fault, public ::testing::WithParamInterface<BadSpec> {};

TEST_P(FaultBadSpec, IsRefusedWithAMessageAndTheRulesStay) {
  ASSERT_EQ(0, cudasim_fail_configure("cudaMalloc:1"));
  StderrCapture capture;
  EXPECT_EQ(-1, cudasim_fail_configure(GetParam().spec));
  const std::string text = capture.text();
  EXPECT_NE(std::string::npos, text.find(std::string("cudasim_fail_configure(\"") + GetParam().spec + "\")"))
      << text;
  EXPECT_NE(std::string::npos, text.find(GetParam().reason)) << text;
  EXPECT_NE(std::string::npos, text.find("accepted: a comma-separated list of <function>:<when>[=<code>]")) << text;
  EXPECT_EQ(cudaErrorMemoryAllocation, malloc_and_free(kMiB)) << "the rules in force before are kept";
}

INSTANTIATE_TEST_SUITE_P(
    Specs, FaultBadSpec,
    ::testing::Values(BadSpec{"cuMemCreat:3",
                              "'cuMemCreat' is not a function cudasim can fail (did you mean cuMemCreate?)"},
                      BadSpec{"cuLaunchKernel:1", "'cuLaunchKernel' is not a function cudasim can fail"},
                      BadSpec{"cuMemCreate", "rule 'cuMemCreate' has no ':'"},
                      BadSpec{"cuMemCreate:0", "'0' is not N, N+, pX or *"},
                      BadSpec{"cuMemCreate:x", "'x' is not N, N+, pX or *"},
                      BadSpec{"cuMemCreate:+", "'+' is not N, N+, pX or *"},
                      BadSpec{"cuMemCreate:p2", "'p2' is not a probability"},
                      BadSpec{"cuMemCreate:p", "'p' is not a probability"},
                      BadSpec{"cuMemCreate:p-0.5", "'p-0.5' is not a probability"},
                      BadSpec{"cuMemCreate:pnan", "'pnan' is not a probability"},
                      BadSpec{"cuMemCreate:1=CUDA_ERROR_NOPE", "'CUDA_ERROR_NOPE' is not a CUDA error name"},
                      BadSpec{"cuMemCreate:1=0", "'0' is not an error code"},
                      BadSpec{"cuMemCreate:1=CUDA_SUCCESS", "'CUDA_SUCCESS' is success, not an error"},
                      BadSpec{"cuMemCreate:1,", "an empty rule after the last ','"},
                      BadSpec{"cuMemCreate:1,,cuMemMap:1", "an empty rule"},
                      BadSpec{" cuMemCreate:1", "' cuMemCreate' is not a function"}),
    [](const ::testing::TestParamInfo<BadSpec>& info) { return std::to_string(info.index); });

struct BadVariable {
  const char* name;
  const char* value;
  const char* message;
};

void PrintTo(const BadVariable& bad, std::ostream* os) { *os << bad.name << "='" << bad.value << "'"; }

class FaultDeathTest : public ::testing::TestWithParam<BadVariable> {};

TEST_P(FaultDeathTest, BadValueExitsWithStatus2NamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const BadVariable bad = GetParam();
  EXPECT_EXIT(
      {
        setenv(bad.name, bad.value, 1);
        void* p = nullptr;
        cudaMalloc(&p, 1);
      },
      ::testing::ExitedWithCode(2), bad.message);
}

INSTANTIATE_TEST_SUITE_P(
    Values, FaultDeathTest,
    ::testing::Values(
        BadVariable{"CUDASIM_FAIL", "cuMemCreat:3",
                    "cudasim: CUDASIM_FAIL='cuMemCreat:3' is not valid: 'cuMemCreat' is not a function cudasim can "
                    "fail \\(did you mean cuMemCreate\\?\\); accepted: a comma-separated list"},
        BadVariable{"CUDASIM_FAIL", "cudaMalloc:often",
                    "CUDASIM_FAIL='cudaMalloc:often' is not valid: 'often' is not N, N\\+, pX or \\*"},
        BadVariable{"CUDASIM_FAIL_SEED", "-1",
                    "CUDASIM_FAIL_SEED='-1' is not valid; accepted: an unsigned integer seed"}),
    [](const ::testing::TestParamInfo<BadVariable>& info) {
      return std::string(info.param.name + std::strlen("CUDASIM_")) + "_" + std::to_string(info.index);
    });

// ---- CUDASIM_FAIL from the environment ------------------------------------------------
// Registered with CUDASIM_FAIL=cudaMalloc:2,cudaStreamQuery:p0.5 and CUDASIM_LOG=1; each
// case runs in a process of its own, so the calls below are the process's first.

class FaultEnvironment : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* fail = std::getenv("CUDASIM_FAIL");
    const char* log = std::getenv("CUDASIM_LOG");
    if (!fail || std::strcmp(fail, kRules) != 0 || !log || std::strcmp(log, "1") != 0)
      GTEST_SKIP() << "needs CUDASIM_FAIL=" << kRules << " and CUDASIM_LOG=1 (tests/sim/CMakeLists.txt)";
  }
  static constexpr const char* kRules = "cudaMalloc:2,cudaStreamQuery:p0.5";
};

TEST_F(FaultEnvironment, RulesApplyFromTheFirstCallAndEachFailureIsLogged) {
  StderrCapture capture;
  EXPECT_CUDA_OK(malloc_and_free(kMiB));
  EXPECT_EQ(cudaErrorMemoryAllocation, malloc_and_free(kMiB));
  EXPECT_CUDA_OK(malloc_and_free(kMiB));
  const std::string text = capture.text();
  EXPECT_NE(std::string::npos, text.find("cudasim: injected failure: cudaMalloc call 2 -> cudaErrorMemoryAllocation\n"))
      << text;
  EXPECT_EQ(1u, cudasim_failures_injected());
}

TEST_F(FaultEnvironment, DriverFailuresAreLoggedWithTheDriversName) {
  ASSERT_EQ(0, cudasim_fail_configure("cuMemCreate:3"));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h[3] = {};
  ASSERT_CUDA_OK(cudaSetDevice(0));
  StderrCapture capture;
  EXPECT_CU_OK(cuMemCreate(&h[0], 2 * kMiB, &prop, 0));
  EXPECT_CU_OK(cuMemCreate(&h[1], 2 * kMiB, &prop, 0));
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&h[2], 2 * kMiB, &prop, 0));
  const std::string text = capture.text();
  EXPECT_NE(std::string::npos, text.find("cudasim: injected failure: cuMemCreate call 3 -> CUDA_ERROR_OUT_OF_MEMORY\n"))
      << text;
  EXPECT_CU_OK(cuMemRelease(h[0]));
  EXPECT_CU_OK(cuMemRelease(h[1]));
}

// Prints which of 64 cudaStreamQuery calls failed (the child of the next case).
TEST_F(FaultEnvironment, PrintQueryPattern) { std::printf("pattern %s\n", query_pattern(64).c_str()); }

// Runs PrintQueryPattern in a new process with CUDASIM_FAIL_SEED=`seed`; its pattern.
std::string child_pattern(const char* seed) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "readlink failed";
  self[n] = '\0';
  const std::string command = std::string("CUDASIM_LOG=1 CUDASIM_FAIL_SEED=") + seed + " '" + self +
                              "' --gtest_filter=FaultEnvironment.PrintQueryPattern 2>/dev/null";
  FILE* out = popen(command.c_str(), "r");
  if (!out) return "popen failed";
  std::string text;
  char buf[256];
  while (std::fgets(buf, sizeof buf, out)) text += buf;
  pclose(out);
  const size_t at = text.find("pattern ");
  return at == std::string::npos ? "no pattern in: " + text : text.substr(at + 8, 64);
}

TEST_F(FaultEnvironment, TheSeedDecidesWhichCallsFail) {
  const std::string one = child_pattern("1");
  ASSERT_EQ(64u, one.size()) << one;
  EXPECT_EQ(one, child_pattern("1")) << "the same seed fails the same calls in every run";
  EXPECT_NE(one, child_pattern("7")) << "another seed fails other calls";
}

}  // namespace
