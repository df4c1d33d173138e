// vramswap's LibTorch extension for vramswap.install(): libvramswap.so as torch's CUDA
// allocator, through LibTorch's CUDAPluggableAllocator with all the hooks vramswap serves.
//
// torch's Python face of the pluggable allocator (torch.cuda.memory.CUDAPluggableAllocator)
// takes only malloc and free from a shared library, and torch hands a NULL that malloc
// returns to the caller as a tensor's data pointer. Built through the C++ API instead, the
// allocator's malloc throws c10::OutOfMemoryError with vramswap's report when vramswap_malloc
// fails, which Python sees as torch.cuda.OutOfMemoryError; torch.cuda.empty_cache() reaches
// vramswap_empty_cache and Tensor.record_stream reaches vramswap_record_stream.
//
// It is loaded with torch.ops.load_library and registers, in the `vramswap_cuda` namespace
// (not `vramswap`: csrc/cpu_sim.cpp owns that one, and both may be loaded):
//   install_cuda_allocator(int malloc_fn, int free_fn, int record_stream_fn,
//                          int empty_cache_fn, int last_error_fn, int capture_begin_fn,
//                          int capture_end_fn) -> ()
//       the addresses of vramswap_malloc, vramswap_free, vramswap_record_stream,
//       vramswap_empty_cache, vramswap_last_error, vramswap_capture_begin and
//       vramswap_capture_end, resolved by the Python side with
//       ctypes, so this library has no link-time dependency on libvramswap.so (and cannot
//       pick up a second copy of it). Creates the allocator, sets its hooks and makes it
//       torch's CUDA allocator; refused (c10::Error) when torch's allocator is initialized.
//   cuda_allocator_installed() -> bool
//   cuda_allocator_init_devices() -> int   the device count torch passed to the init hook
//       when it initialized CUDA, or -1 while it has not.
//
// What this relies on, read in PyTorch's source (pytorch/pytorch main, 2025: the stored
// torch/csrc/cuda/CUDAPluggableAllocator.h at 011c9ee1, .cpp at 5815a9e4, torch/cuda/memory.py
// at 00b65a04 and the registerCudaPluggableAllocator part of torch/csrc/cuda/Module.cpp; the
// CUDAHooks init in aten/src/ATen/cuda/detail/CUDAHooks.cpp. An older (2.0-era) .cpp at
// 00a1abb4 has the same setters and the same malloc; some versions declare alloc_fn's device
// as c10::DeviceIndex, which the int-taking function below converts from as well):
//   - namespace torch::cuda::CUDAPluggableAllocator; createCustomAllocator(
//     std::function<void*(size_t, int, cudaStream_t)> alloc_fn,
//     std::function<void(void*, size_t, int, cudaStream_t)> free_fn) returns a
//     std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> that holds a
//     CUDAPluggableAllocator (exported, TORCH_CUDA_CPP_API), on which it has already called
//     init(0) (so the new allocator reports initialized()).
//   - the setters: set_init_fn(std::function<void(int)>), set_reset_fn(std::function<void()>),
//     set_record_stream_fn(std::function<void(void* ptr, cudaStream_t stream)>),
//     set_memory_fraction_fn(std::function<void(double, int)>) (left unset here: torch's
//     set_per_process_memory_fraction is then a no-op; the limit is VRAMSWAP_LIMIT).
//   - malloc() calls alloc_fn outside its lock and does not check for NULL: it records the
//     pointer with its size, device and stream, and allocate() wraps it in a DataPtr. So an
//     exception thrown by alloc_fn leaves no record and reaches the caller.
//   - the DataPtr's deleter looks the pointer up and calls free_fn(ptr, size, device,
//     stream) with the values recorded at allocation.
//   - from torch 2.3: set_begin_allocate_to_pool(std::function<void(int device,
//     c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)> filter)>) and
//     set_end_allocate_to_pool_fn(std::function<void(int device, c10::cuda::MempoolId_t)>):
//     beginAllocateToPool / endAllocateToPool call them, which a CUDA graph's capture_begin
//     and capture_end call for the capture's device. vramswap counts them as captures
//     underway (vramswap_capture_begin/end): its pool then never synchronizes the device,
//     which would invalidate the capture. (The private pool itself is not served: blocks a
//     captured graph frees go back to vramswap's pool; README, Limits.)
//   - emptyCache() calls reset_fn if set; recordStream(DataPtr, CUDAStream) calls
//     record_stream_fn(ptr.get(), stream) if set; init(device_count) calls init_fn if set.
//     torch's lazy CUDA init (CUDAHooks init) calls c10::cuda::CUDACachingAllocator::init(
//     device count), i.e. the current allocator's init().
//   - changeCurrentAllocator(const std::shared_ptr<CUDAAllocator>&) TORCH_CHECKs that the
//     current allocator is not initialized ("Can't swap an already initialized allocator"),
//     stores the raw pointer as c10's current CUDA allocator and keeps the shared_ptr alive
//     in a static for the rest of the process.
//   - getDeviceStats, snapshot, resetPeakStats, ... throw "CUDAPluggableAllocator does not
//     yet support ...": torch.cuda.memory_stats() and friends fail; vramswap.memory_stats()
//     replaces them.
//   - torch/csrc/Exceptions.h turns c10::OutOfMemoryError into torch.cuda.OutOfMemoryError
//     (TORCH_CHECK_WITH(OutOfMemoryError, cond, ...) throws it).
//
// Invariants: the function table is written once, before the allocator is made current,
// and never changes afterwards (install is refused a second time), so the hooks read it
// without a lock; it has no destructor, so tensors freed during interpreter shutdown still
// reach vramswap_free. The allocator itself lives in torch's static shared_ptr.
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/library.h>
#include <torch/version.h>

// torch 2.3 changed c10::Allocator (allocate() no longer const, copy_data() pure virtual) and
// gave the pluggable allocator its graph-pool hooks; this file is written against that
// interface (vramswap/_ext.py refuses an older torch before compiling).
static_assert(TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3),
              "vramswap's LibTorch extensions need torch 2.3 or newer");

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

namespace {

using MallocFn = void* (*)(size_t, int, cudaStream_t);
using FreeFn = void (*)(void*, size_t, int, cudaStream_t);
using RecordStreamFn = void (*)(void*, cudaStream_t);
using EmptyCacheFn = void (*)();
using LastErrorFn = const char* (*)();
using CaptureFn = int (*)(int);

// libvramswap.so's functions. Written once by install_cuda_allocator before the allocator
// becomes current (the store to g_installed publishes them); read-only afterwards.
struct Functions {
  MallocFn malloc = nullptr;
  FreeFn free = nullptr;
  RecordStreamFn record_stream = nullptr;
  EmptyCacheFn empty_cache = nullptr;
  LastErrorFn last_error = nullptr;
  CaptureFn capture_begin = nullptr;
  CaptureFn capture_end = nullptr;
};
Functions g_fns;
std::atomic<bool> g_installed{false};
std::atomic<int> g_init_devices{-1};

// The allocator's alloc_fn: vramswap_malloc, with a failure turned into the exception torch
// raises for an out-of-memory, carrying vramswap's report (the limit, what was resident,
// evictable and pinned). Size 0 is NULL with no error, as from torch's own allocator.
void* vramswap_alloc(size_t size, int device, cudaStream_t stream) {
  void* ptr = g_fns.malloc(size, device, stream);
  if (ptr == nullptr && size != 0) {
    const char* last_error = g_fns.last_error != nullptr ? g_fns.last_error() : nullptr;
    // The message has one "vramswap: ": a report that starts with its own goes without it.
    std::string_view report = last_error != nullptr ? last_error : "";
    constexpr std::string_view kPrefix = "vramswap: ";
    while (report.substr(0, kPrefix.size()) == kPrefix) report.remove_prefix(kPrefix.size());
    TORCH_CHECK_WITH(OutOfMemoryError, false, "vramswap: CUDA out of memory allocating ", size,
                     " bytes on device ", device, ": ",
                     report.empty() ? std::string_view("(no message from vramswap)") : report);
  }
  return ptr;
}

void vramswap_dealloc(void* ptr, size_t size, int device, cudaStream_t stream) {
  g_fns.free(ptr, size, device, stream);
}

void install_cuda_allocator(int64_t malloc_fn, int64_t free_fn, int64_t record_stream_fn,
                            int64_t empty_cache_fn, int64_t last_error_fn, int64_t capture_begin_fn,
                            int64_t capture_end_fn) {
  namespace pluggable = torch::cuda::CUDAPluggableAllocator;
  TORCH_CHECK(malloc_fn != 0 && free_fn != 0 && record_stream_fn != 0 && empty_cache_fn != 0 &&
                  last_error_fn != 0 && capture_begin_fn != 0 && capture_end_fn != 0,
              "install_cuda_allocator: null function address");
  TORCH_CHECK(!g_installed.load(), "install_cuda_allocator: vramswap is already torch's CUDA allocator");
  g_fns.malloc = reinterpret_cast<MallocFn>(malloc_fn);
  g_fns.free = reinterpret_cast<FreeFn>(free_fn);
  g_fns.record_stream = reinterpret_cast<RecordStreamFn>(record_stream_fn);
  g_fns.empty_cache = reinterpret_cast<EmptyCacheFn>(empty_cache_fn);
  g_fns.last_error = reinterpret_cast<LastErrorFn>(last_error_fn);
  g_fns.capture_begin = reinterpret_cast<CaptureFn>(capture_begin_fn);
  g_fns.capture_end = reinterpret_cast<CaptureFn>(capture_end_fn);

  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator =
      pluggable::createCustomAllocator(&vramswap_alloc, &vramswap_dealloc);
  auto hooks = std::dynamic_pointer_cast<pluggable::CUDAPluggableAllocator>(allocator);
  TORCH_CHECK(hooks != nullptr,
              "install_cuda_allocator: torch's createCustomAllocator did not return a "
              "CUDAPluggableAllocator; this torch is not supported by vramswap's extension");
  hooks->set_init_fn([](int device_count) { g_init_devices.store(device_count); });
  hooks->set_reset_fn([] { g_fns.empty_cache(); });
  hooks->set_record_stream_fn([](void* ptr, cudaStream_t stream) { g_fns.record_stream(ptr, stream); });
  // A capture begins or ends on `device` (a refusal can only be an end vramswap never saw
  // begin: nothing to undo).
  hooks->set_begin_allocate_to_pool(
      [](int device, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>) { g_fns.capture_begin(device); });
  hooks->set_end_allocate_to_pool_fn([](int device, c10::cuda::MempoolId_t) { g_fns.capture_end(device); });
  pluggable::changeCurrentAllocator(allocator);  // throws when torch's allocator is initialized
  g_installed.store(true);
}

bool cuda_allocator_installed() { return g_installed.load(); }

int64_t cuda_allocator_init_devices() { return g_init_devices.load(); }

}  // namespace

TORCH_LIBRARY(vramswap_cuda, m) {
  m.def("install_cuda_allocator(int malloc_fn, int free_fn, int record_stream_fn, int empty_cache_fn, "
        "int last_error_fn, int capture_begin_fn, int capture_end_fn) -> ()",
        &install_cuda_allocator);
  m.def("cuda_allocator_installed() -> bool", &cuda_allocator_installed);
  m.def("cuda_allocator_init_devices() -> int", &cuda_allocator_init_devices);
}
