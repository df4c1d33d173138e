// vramswap_demo: the CUDA mechanisms vramswap is built on, shown and checked step by step.
//
// A plain CUDA program: the real CUDA headers, linked against the real libcudart.so.13
// and libcuda.so.1, with no rpath. On a machine with a GPU the loader finds NVIDIA's
// libraries and the program runs on the GPU; with LD_LIBRARY_PATH=build/sim it finds
// cudasim's instead and the same binary runs with no GPU. It never asks which one it
// got except to say so (cudasim_is_emulated, looked up with dlsym) and to print
// cudasim's counters when they exist.
//
// The steps are the life of one evictable block (DESIGN.md, "The pool" and "Residency"):
// reserve VA, back it with physical pages, use it, evict it to pinned host memory and
// release the pages, restore it at the same address, and finally show that touching
// an unmapped range faults. Every CUDA call's result is checked; the exit status is 0
// only when every step held, 1 with a message naming the failed step otherwise.

#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "cudasim.h"  // only for the counters' type; the functions are looked up with dlsym

namespace {

// The message of a failed check: the call, the error's name and description, file:line.
class DemoFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

std::string located(const std::string& what, const char* file, int line) {
  return what + " (" + base_name(file) + ":" + std::to_string(line) + ")";
}

void check_result(cudaError_t rc, const char* call, const char* file, int line) {
  if (rc == cudaSuccess) return;
  throw DemoFailure(located(std::string(call) + " returned " + cudaGetErrorName(rc) + ": " +
                                cudaGetErrorString(rc),
                            file, line));
}

void check_result(CUresult rc, const char* call, const char* file, int line) {
  if (rc == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName(rc, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown CUresult";
  if (cuGetErrorString(rc, &text) != CUDA_SUCCESS || text == nullptr) text = "no description";
  throw DemoFailure(located(std::string(call) + " returned " + name + " (" + std::to_string(rc) +
                                "): " + text,
                            file, line));
}

// Checks a CUDA runtime or driver call and names it in the failure.
#define CHECK(call) check_result((call), #call, __FILE__, __LINE__)

// Checks a fact the demo relies on; `why` says what went wrong in words.
#define EXPECT(condition, why)                                                \
  do {                                                                        \
    if (!(condition)) throw DemoFailure(located((why), __FILE__, __LINE__)); \
  } while (0)

std::string bytes_text(std::uint64_t bytes) {
  char buf[64];
  if (bytes >= (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
  else if (bytes >= (1ull << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1ull << 20));
  else if (bytes >= (1ull << 10))
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(bytes) / (1ull << 10));
  else
    std::snprintf(buf, sizeof buf, "%" PRIu64 " B", bytes);
  return buf;
}

std::string address_text(CUdeviceptr address) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(address));
  return buf;
}

void* as_pointer(CUdeviceptr address) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(address));
}

// Fills `size` bytes with a pattern that differs per seed and per 4-byte word, so that a
// copy of the wrong bytes, a stale page or a zero-filled page cannot pass for it.
void fill_pattern(void* buffer, size_t size, std::uint32_t seed) {
  auto* words = static_cast<std::uint32_t*>(buffer);
  for (size_t i = 0; i < size / sizeof(std::uint32_t); ++i)
    words[i] = (static_cast<std::uint32_t>(i) * 2654435761u) ^ seed;
}

// Compares and, on a difference, says where the first one is.
void expect_same_bytes(const void* expected, const void* actual, size_t size, const char* what) {
  if (std::memcmp(expected, actual, size) == 0) return;
  const auto* e = static_cast<const unsigned char*>(expected);
  const auto* a = static_cast<const unsigned char*>(actual);
  size_t first = 0;
  while (e[first] == a[first]) ++first;
  char buf[160];
  std::snprintf(buf, sizeof buf, ": first difference at byte %zu (expected 0x%02x, read 0x%02x)",
                first, e[first], a[first]);
  throw DemoFailure(std::string(what) + buf);
}

// How free device memory moved between two readings of cudaMemGetInfo. On a shared GPU
// other processes move it too, so it is shown, never checked.
std::string free_change_text(size_t before, size_t after) {
  if (after < before) return "free device memory went down by " + bytes_text(before - after);
  if (after > before) return "free device memory went up by " + bytes_text(after - before);
  return "free device memory did not change";
}

size_t device_free_bytes() {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

// Prints a step's heading; the current step's title is kept for the failure message.
const char* g_step_title = "setup";
int g_step = 0;
constexpr int kSteps = 9;

void step(const char* title, const char* calls) {
  g_step_title = title;
  ++g_step;
  std::printf("\nStep %d/%d. %s\n          %s\n", g_step, kSteps, title, calls);
}

void say(const std::string& line) { std::printf("          %s\n", line.c_str()); }

// Forks a child that reads one byte at `address` and reports how the child ended:
// the signal that killed it, 0 when it read the byte and exited, -1 when it ended in
// any other way. The child restores the default action for the fault signals (so the
// outcome is the kernel's, not a handler's), writes no core file, and gives up after
// 10 seconds.
int signal_of_child_reading(CUdeviceptr address, int* exit_status) {
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t child = fork();
  if (child < 0) throw DemoFailure(std::string("fork failed: ") + std::strerror(errno));
  if (child == 0) {
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    signal(SIGSEGV, SIG_DFL);
    signal(SIGBUS, SIG_DFL);
    alarm(10);
    volatile const unsigned char* byte = static_cast<volatile const unsigned char*>(as_pointer(address));
    unsigned char value = *byte;
    _exit(value == 0 ? 0 : 1);
  }
  int status = 0;
  while (waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) throw DemoFailure(std::string("waitpid failed: ") + std::strerror(errno));
  }
  *exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (WIFSIGNALED(status)) return WTERMSIG(status);
  return WIFEXITED(status) ? 0 : -1;
}

int run_demo() {
  std::printf("vramswap demo: the CUDA mechanisms vramswap is built on, checked step by step.\n");

  auto is_emulated = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "cudasim_is_emulated"));
  const bool on_cudasim = is_emulated != nullptr && is_emulated() == 1;
  if (on_cudasim)
    std::printf("Running on cudasim, the CPU stand-in for libcudart.so.13 and libcuda.so.1: "
                "no GPU is used.\n");
  else
    std::printf("Running on the CUDA driver (no cudasim in this process).\n");

  // --- The device -------------------------------------------------------------------
  int device_count = 0;
  CHECK(cudaGetDeviceCount(&device_count));
  EXPECT(device_count > 0, "no CUDA device found");
  const int device = 0;
  CHECK(cudaSetDevice(device));
  CHECK(cudaFree(nullptr));  // creates the primary context, so driver calls below have one
  CHECK(cuInit(0));
  CUdevice cu_device = 0;
  CHECK(cuDeviceGet(&cu_device, device));

  char name[256] = {};
  CHECK(cuDeviceGetName(name, sizeof name, cu_device));
  int cc_major = 0;
  int cc_minor = 0;
  CHECK(cuDeviceGetAttribute(&cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cu_device));
  CHECK(cuDeviceGetAttribute(&cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, cu_device));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  int vmm_supported = 0;
  CHECK(cuDeviceGetAttribute(&vmm_supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                             cu_device));

  std::printf("\nDevice %d of %d: %s\n", device, device_count, name);
  std::printf("  compute capability     %d.%d\n", cc_major, cc_minor);
  std::printf("  memory                 %s total, %s free (cudaMemGetInfo)\n",
              bytes_text(total_bytes).c_str(), bytes_text(free_bytes).c_str());
  std::printf("  virtual memory mgmt    %s (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)\n",
              vmm_supported ? "supported" : "NOT supported");
  EXPECT(vmm_supported, "this device does not support CUDA virtual memory management, "
                        "which vramswap requires");

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = cu_device;
  size_t granularity = 0;
  size_t recommended = 0;
  CHECK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CHECK(cuMemGetAllocationGranularity(&recommended, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  std::printf("  VMM granularity        %s minimum, %s recommended (cuMemGetAllocationGranularity)\n",
              bytes_text(granularity).c_str(), bytes_text(recommended).c_str());
  EXPECT(granularity > 0, "cuMemGetAllocationGranularity reported a granularity of 0");

  // Two granules: enough to show a multi-page block, small enough for any device.
  const size_t size = 2 * granularity;
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  void* pattern = nullptr;   // what the block should hold
  void* host_copy = nullptr; // the block's evicted copy: the host tier
  void* readback = nullptr;  // what was read back from the device
  CHECK(cudaMallocHost(&pattern, size));
  CHECK(cudaMallocHost(&host_copy, size));
  CHECK(cudaMallocHost(&readback, size));

  // --- 1. Reserve ---------------------------------------------------------------------
  step("Reserve device virtual addresses", "cuMemAddressReserve");
  CUdeviceptr va = 0;
  CHECK(cuMemAddressReserve(&va, size, granularity, 0, 0));
  EXPECT(va != 0, "cuMemAddressReserve returned address 0");
  const CUdeviceptr block_address = va;
  say(bytes_text(size) + " of virtual addresses at " + address_text(va) + ", with nothing behind them");
  say("yet: this is the address a block keeps for its whole life.");

  // --- 2. Create ----------------------------------------------------------------------
  step("Create physical device memory", "cuMemCreate");
  const size_t free_before_create = device_free_bytes();
  CUmemGenericAllocationHandle pages = 0;
  CHECK(cuMemCreate(&pages, size, &prop, 0));
  say(bytes_text(size) + " of physical memory: " +
      free_change_text(free_before_create, device_free_bytes()) + ".");
  say("It has no address until it is mapped.");

  // --- 3. Map -------------------------------------------------------------------------
  step("Map the physical memory into the reservation", "cuMemMap");
  CHECK(cuMemMap(va, size, 0, pages, 0));
  say("The pages now sit behind " + address_text(va) + ", but nothing may access them yet.");

  // --- 4. Grant access ----------------------------------------------------------------
  step("Grant the device read/write access", "cuMemSetAccess");
  CHECK(cuMemSetAccess(va, size, &access, 1));
  say("Device " + std::to_string(device) + " may read and write " + address_text(va) + ".." +
      address_text(va + size) + ".");

  // --- 5. Use -------------------------------------------------------------------------
  step("Write a pattern, read it back, compare", "cudaMemcpy host->device, then device->host");
  fill_pattern(pattern, size, 0x5eed0001u);
  std::memset(readback, 0, size);
  CHECK(cudaMemcpy(as_pointer(va), pattern, size, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(readback, as_pointer(va), size, cudaMemcpyDeviceToHost));
  expect_same_bytes(pattern, readback, size, "the bytes read back differ from the bytes written");
  say(bytes_text(size) + " written and read back identical.");

  // --- 6. Evict -----------------------------------------------------------------------
  step("Evict: copy to pinned host memory, then unmap and release the pages",
       "cudaMemcpy device->host, cuMemUnmap, cuMemRelease");
  std::memset(host_copy, 0, size);
  CHECK(cudaMemcpy(host_copy, as_pointer(va), size, cudaMemcpyDeviceToHost));
  const size_t free_before_evict = device_free_bytes();
  CHECK(cuMemUnmap(va, size));
  CHECK(cuMemRelease(pages));
  pages = 0;
  say("The block's bytes are in pinned host memory and its device pages are released:");
  say(free_change_text(free_before_evict, device_free_bytes()) + ".");
  say("The addresses " + address_text(va) + ".." + address_text(va + size) +
      " stay reserved, with nothing behind them.");

  // --- 7. Restore ---------------------------------------------------------------------
  step("Restore: new physical pages at the same address, copy the bytes back",
       "cuMemCreate, cuMemMap, cuMemSetAccess, cudaMemcpy host->device, then device->host");
  CHECK(cuMemCreate(&pages, size, &prop, 0));
  CHECK(cuMemMap(va, size, 0, pages, 0));
  CHECK(cuMemSetAccess(va, size, &access, 1));
  CHECK(cudaMemcpy(as_pointer(va), host_copy, size, cudaMemcpyHostToDevice));
  std::memset(readback, 0, size);
  CHECK(cudaMemcpy(readback, as_pointer(va), size, cudaMemcpyDeviceToHost));
  expect_same_bytes(pattern, readback, size, "the restored block differs from the evicted one");
  EXPECT(va == block_address, "the block's address changed");
  say("Different physical pages, same address " + address_text(va) + ", same bytes.");
  say("The address did not change: this is what vramswap relies on, so a pointer the program");
  say("holds (a tensor's data pointer) stays valid while its block is away.");

  // --- 8. Asynchronous copies ---------------------------------------------------------
  step("Asynchronous copies on a stream, timed with events",
       "cudaStreamCreateWithFlags, cudaEventRecord, cudaMemcpyAsync, cudaEventSynchronize, "
       "cudaEventElapsedTime");
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  fill_pattern(pattern, size, 0x5eed0002u);
  std::memset(readback, 0, size);
  CHECK(cudaEventRecord(start, stream));
  CHECK(cudaMemcpyAsync(as_pointer(va), pattern, size, cudaMemcpyHostToDevice, stream));
  CHECK(cudaMemcpyAsync(readback, as_pointer(va), size, cudaMemcpyDeviceToHost, stream));
  CHECK(cudaEventRecord(stop, stream));
  // The host may look at `readback` only after the stream has passed `stop`.
  CHECK(cudaEventSynchronize(stop));
  CHECK(cudaEventQuery(stop));
  float elapsed_ms = 0.0f;
  CHECK(cudaEventElapsedTime(&elapsed_ms, start, stop));
  EXPECT(elapsed_ms >= 0.0f, "cudaEventElapsedTime reported a negative time");
  expect_same_bytes(pattern, readback, size, "the asynchronous round trip changed the bytes");
  char timing[160];
  std::snprintf(timing, sizeof timing,
                "%s host->device then %s device->host, in order on one stream: %.3f ms between "
                "the events.",
                bytes_text(size).c_str(), bytes_text(size).c_str(), elapsed_ms);
  say(timing);
  say("The host waited on the stop event before reading; the bytes came back identical.");
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaStreamDestroy(stream));

  // --- 9. Fault -----------------------------------------------------------------------
  step("Unmap again and touch the range from a forked child", "cuMemUnmap, cuMemRelease, fork");
  CHECK(cuMemUnmap(va, size));
  CHECK(cuMemRelease(pages));
  pages = 0;
  int exit_status = 0;
  const int child_signal = signal_of_child_reading(va, &exit_status);
  if (child_signal == 0)
    throw DemoFailure("the child read " + address_text(va) + " after cuMemUnmap and exited (status " +
                      std::to_string(exit_status) + ") instead of faulting");
  if (child_signal < 0) throw DemoFailure("the child ended without a signal or an exit status");
  // cudasim promises SIGSEGV; a host read of device addresses under the real driver faults
  // too, and SIGBUS is accepted there as the same verdict.
  const bool fault = child_signal == SIGSEGV || (!on_cudasim && child_signal == SIGBUS);
  EXPECT(fault, std::string("the child reading ") + address_text(va) +
                    " was killed by signal " + std::to_string(child_signal) + " (" +
                    strsignal(child_signal) + "), not by SIGSEGV");
  say(std::string("The child read ") + address_text(va) + " and was killed by " +
      (child_signal == SIGSEGV ? "SIGSEGV" : "SIGBUS") + ".");
  if (on_cudasim) {
    say("cudasim keeps unmapped device addresses inaccessible (PROT_NONE), so a stray access");
    say("faults right where a GPU would report an illegal address.");
  } else {
    say("Nothing is mapped there and the CPU cannot read device addresses, so the host read");
    say("faults; a GPU kernel touching the range would raise an illegal address error.");
  }
  say("This is how a test can prove that nothing touches an evicted block.");
  CHECK(cuMemAddressFree(va, size));

  CHECK(cudaFreeHost(pattern));
  CHECK(cudaFreeHost(host_copy));
  CHECK(cudaFreeHost(readback));

  auto get_counters =
      reinterpret_cast<int (*)(int, cudasim_counters*)>(dlsym(RTLD_DEFAULT, "cudasim_get_counters"));
  if (get_counters != nullptr) {
    cudasim_counters counters = {};
    EXPECT(get_counters(device, &counters) == 0, "cudasim_get_counters failed for device 0");
    std::printf("\ncudasim counters for device %d: %s host->device, %s device->host, peak physical "
                "memory %s, %" PRIu64 " stream operations.\n",
                device, bytes_text(counters.bytes_h2d).c_str(), bytes_text(counters.bytes_d2h).c_str(),
                bytes_text(counters.peak_physical_bytes).c_str(), counters.ops_executed);
  }

  std::printf("\nAll %d steps held.\n", kSteps);
  return 0;
}

}  // namespace

int main() {
  try {
    return run_demo();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    if (g_step == 0) {
      std::fprintf(stderr, "\nvramswap_demo: FAILED during %s: %s\n", g_step_title, e.what());
      if (dlsym(RTLD_DEFAULT, "cudasim_is_emulated") == nullptr)
        std::fprintf(stderr, "With no usable GPU, run it on cudasim: "
                             "LD_LIBRARY_PATH=build/sim build/bench/vramswap_demo\n");
    } else {
      std::fprintf(stderr, "\nvramswap_demo: FAILED at step %d/%d (%s): %s\n", g_step, kSteps,
                   g_step_title, e.what());
    }
    return 1;
  }
}
