// A plain CUDA program: it includes only the CUDA headers and links to the real
// toolkit's libcudart.so.13 and libcuda.so.1. Run with LD_LIBRARY_PATH pointing at
// cudasim's build directory it loads cudasim instead, which is how the unchanged
// vramswap libraries run on a machine without a GPU (DESIGN.md, "cudasim").
//
// It checks stream order, asynchronous copies, events and VMM map/write/read, prints
// each check, and exits 0 only if all of them held. With --require-emulated it also
// fails unless it runs on cudasim, and checks that touching an unmapped VMM range
// faults (in a forked child, so the program itself survives).
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace {

int g_failures = 0;

void check(bool ok, const char* what) {
  std::printf("[%s] %s\n", ok ? " ok " : "FAIL", what);
  if (!ok) ++g_failures;
}

bool rt_ok(cudaError_t e, const char* call) {
  if (e != cudaSuccess) std::printf("  %s -> %s\n", call, cudaGetErrorName(e));
  return e == cudaSuccess;
}

bool cu_ok(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) {
    const char* name = "?";
    cuGetErrorName(r, &name);
    std::printf("  %s -> %s\n", call, name);
  }
  return r == CUDA_SUCCESS;
}

#define RT(call) rt_ok((call), #call)
#define CU(call) cu_ok((call), #call)

void check_stream_order() {
  constexpr size_t n = 1 << 16;
  cudaStream_t s = nullptr;
  unsigned char* d = nullptr;
  unsigned char* h = nullptr;
  bool ok = RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) &&
            RT(cudaMalloc(reinterpret_cast<void**>(&d), n)) &&
            RT(cudaMallocHost(reinterpret_cast<void**>(&h), n));
  if (ok) {
    std::memset(h, 0, n);
    ok = RT(cudaMemsetAsync(d, 1, n, s)) && RT(cudaMemsetAsync(d, 2, n / 2, s)) &&
         RT(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s)) && RT(cudaMemsetAsync(d, 3, n, s)) &&
         RT(cudaStreamSynchronize(s));
    for (size_t i = 0; ok && i < n; ++i) ok = h[i] == (i < n / 2 ? 2 : 1);
  }
  check(ok, "work on one stream runs in the order it was queued");
  cudaFreeHost(h);
  cudaFree(d);
  if (s != nullptr) cudaStreamDestroy(s);
}

void check_async_copy_and_events() {
  constexpr size_t n = 1 << 16;
  cudaStream_t s = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  unsigned char* d = nullptr;
  unsigned char* h = nullptr;
  std::atomic<bool> release{false};
  bool ok = RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) && RT(cudaEventCreate(&start)) &&
            RT(cudaEventCreate(&stop)) && RT(cudaMalloc(reinterpret_cast<void**>(&d), n)) &&
            RT(cudaMallocHost(reinterpret_cast<void**>(&h), n)) && RT(cudaMemset(d, 0x4D, n)) &&
            RT(cudaDeviceSynchronize());
  bool held = false, waited = false, copied = false, timed = false;
  if (ok) {
    std::memset(h, 0, n);
    // A host function holds the stream, like a long kernel.
    ok = RT(cudaEventRecord(start, s)) &&
         RT(cudaLaunchHostFunc(
             s,
             [](void* p) {
               auto* flag = static_cast<std::atomic<bool>*>(p);
               while (!flag->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
             },
             &release)) &&
         RT(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s)) && RT(cudaEventRecord(stop, s));
    // Once `start` has completed, the stream is held for at least the 20 ms below, so the
    // elapsed time cannot be shorter whatever the scheduling.
    ok = ok && RT(cudaEventSynchronize(start));
    if (ok) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      held = cudaEventQuery(stop) == cudaErrorNotReady && cudaStreamQuery(s) == cudaErrorNotReady &&
             static_cast<volatile unsigned char*>(h)[0] == 0;
      release.store(true);
      waited = RT(cudaEventSynchronize(stop)) && cudaEventQuery(stop) == cudaSuccess;
      copied = h[0] == 0x4D && h[n - 1] == 0x4D;
      float ms = -1;
      timed = RT(cudaEventElapsedTime(&ms, start, stop)) && ms >= 19.0f;
    }
  }
  release.store(true);
  check(ok && held, "an async copy behind a busy stream has not happened, and its event is not ready");
  check(ok && waited, "cudaEventSynchronize waits for the event");
  check(ok && copied, "the async copy happened once the stream went on");
  check(ok && timed, "cudaEventElapsedTime covers the time the stream was held");
  if (s != nullptr) cudaStreamSynchronize(s);
  cudaFreeHost(h);
  cudaFree(d);
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  if (s != nullptr) cudaStreamDestroy(s);
}

void check_vmm(bool emulated) {
  CUdevice dev = 0;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gran = 0;
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle handle = 0;
  int supported = 0;
  bool ok = RT(cudaFree(nullptr)) && CU(cuDeviceGet(&dev, 0)) &&
            CU(cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)) &&
            supported == 1 &&
            CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  const size_t size = 2 * gran;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ok = ok && CU(cuMemAddressReserve(&va, size, 0, 0, 0)) && CU(cuMemCreate(&handle, size, &prop, 0)) &&
       CU(cuMemMap(va, size, 0, handle, 0)) && CU(cuMemSetAccess(va, size, &access, 1));
  bool round_trip = false;
  if (ok) {
    std::vector<unsigned char> in(size), out(size, 0);
    for (size_t i = 0; i < size; ++i) in[i] = static_cast<unsigned char>(i * 13 + 7);
    round_trip = RT(cudaMemcpy(reinterpret_cast<void*>(va), in.data(), size, cudaMemcpyHostToDevice)) &&
                 RT(cudaMemcpy(out.data(), reinterpret_cast<void*>(va), size, cudaMemcpyDeviceToHost)) &&
                 in == out;
  }
  check(ok && round_trip, "VMM: reserve, create, map, set access, write and read back");
  const bool unmapped = ok && CU(cuMemUnmap(va, size));
  check(unmapped, "VMM: unmap");
  if (emulated && unmapped) {
    std::fflush(stdout);
    const pid_t child = fork();
    if (child == 0) {
      struct rlimit none = {0, 0};
      setrlimit(RLIMIT_CORE, &none);
      static_cast<volatile unsigned char*>(reinterpret_cast<unsigned char*>(va))[0] = 1;
      _exit(0);  // not reached when the range faults as it must
    }
    int status = 0;
    const bool faulted = child > 0 && waitpid(child, &status, 0) == child && WIFSIGNALED(status) &&
                         WTERMSIG(status) == SIGSEGV;
    check(faulted, "VMM: touching an unmapped range faults with SIGSEGV (in a child process)");
  }
  check((handle == 0 || CU(cuMemRelease(handle))) && (va == 0 || CU(cuMemAddressFree(va, size))),
        "VMM: release and free the address range");
}

}  // namespace

int main(int argc, char** argv) {
  const bool require_emulated = argc > 1 && std::strcmp(argv[1], "--require-emulated") == 0;
  auto* is_emulated = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "cudasim_is_emulated"));
  const bool emulated = is_emulated != nullptr && is_emulated() == 1;
  std::printf("running on %s\n", emulated ? "cudasim" : "a real CUDA driver");
  if (require_emulated) check(emulated, "the program loaded cudasim's libraries");

  int runtime = 0, driver = 0, count = 0;
  check(RT(cudaRuntimeGetVersion(&runtime)) && RT(cudaDriverGetVersion(&driver)) &&
            RT(cudaGetDeviceCount(&count)) && count >= 1,
        "the runtime answers and sees a device");
  std::printf("runtime %d, driver %d, %d device(s)\n", runtime, driver, count);
  if (g_failures == 0) {
    check_stream_order();
    check_async_copy_and_events();
    check_vmm(emulated);
  }
  std::printf("%s: %d check(s) failed\n", g_failures == 0 ? "PASS" : "FAIL", g_failures);
  return g_failures == 0 ? 0 : 1;
}
