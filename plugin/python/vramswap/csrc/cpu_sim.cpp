// vramswap's LibTorch extension for the CPU-emulation mode (and the tracker's storage
// use count).
//
// On a machine with no GPU, libvramswap.so runs on cudasim, whose "device" memory is
// ordinary host memory (mmap'd memfd pages). This extension makes torch's CPU allocator
// hand out that memory: every CPU tensor allocated after install_cpu_allocator() lives in
// a vramswap block, so autograd's saved activations can be evicted (their pages really
// unmapped: a stray touch faults) and restored at the same address, and any torch
// script can be run under offload with no GPU.
//
// It is loaded with torch.ops.load_library and registers, in the `vramswap` namespace:
//   install_cpu_allocator(int malloc_fn, int free_fn, int last_error_fn) -> ()
//       the addresses of vramswap_malloc, vramswap_free and vramswap_last_error (the Python
//       side resolves them with ctypes, so this library has no link-time dependency on
//       libvramswap.so and cannot pick up a second copy of it). An allocation vramswap
//       cannot serve throws c10::OutOfMemoryError (torch.cuda.OutOfMemoryError in Python)
//       whose message is "vramswap: out of memory allocating N bytes (CPU-emulation mode): "
//       and vramswap's report.
//   uninstall_cpu_allocator() -> ()      back to c10's default CPU allocator
//   storage_use_count(Tensor t) -> int   c10::StorageImpl's reference count: how many
//       TensorImpls (and Python storage objects) hold t's storage. The tracker uses it to
//       see that only its own saved references still reach a block (cold).
//
// Invariants: the allocator object is never destroyed (tensors can be freed during
// interpreter shutdown, after static destructors ran), and a DataPtr allocated by it
// always frees through vramswap_free even after uninstall.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

namespace {

using MallocFn = void* (*)(size_t, int, void*);
using FreeFn = void (*)(void*, size_t, int, void*);
using LastErrorFn = const char* (*)();

std::atomic<MallocFn> g_malloc{nullptr};
std::atomic<FreeFn> g_free{nullptr};
std::atomic<LastErrorFn> g_last_error{nullptr};

// Highest priority: c10's default CPU allocator registers at 0, and SetCPUAllocator only
// replaces an allocator of lower or equal priority. Uninstalling re-registers the default
// allocator at the same priority.
constexpr uint8_t kPriority = 255;

void vramswap_cpu_delete(void* ptr) {
  // Device 0 and the legacy stream: the mode runs on cudasim's device 0, and torch's CPU
  // ops are synchronous, so nothing is queued on any stream when a tensor dies.
  if (ptr != nullptr) g_free.load()(ptr, 0, 0, nullptr);
}

// vramswap's report of the failed allocation (the last error), without a "vramswap: " of
// its own: the message adds one.
std::string report() {
  LastErrorFn last_error = g_last_error.load();
  std::string text = last_error != nullptr && last_error() != nullptr ? last_error() : "";
  constexpr std::string_view kPrefix = "vramswap: ";
  while (std::string_view(text).substr(0, kPrefix.size()) == kPrefix) text.erase(0, kPrefix.size());
  return text.empty() ? "(no message from vramswap)" : text;
}

// The failure of an allocation, as torch raises an out-of-memory: c10::OutOfMemoryError,
// which Python sees as torch.cuda.OutOfMemoryError (vramswap.OutOfMemoryError), whatever
// the thread (autograd's engine passes it on to backward's caller). torch before 1.13 has
// no such class: a plain c10::Error (RuntimeError) there.
[[noreturn]] void throw_out_of_memory(size_t nbytes) {
#if TORCH_VERSION_MAJOR > 1 || (TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR >= 13)
  TORCH_CHECK_WITH(OutOfMemoryError, false, "vramswap: out of memory allocating ", nbytes,
                   " bytes (CPU-emulation mode): ", report());
#else
  TORCH_CHECK(false, "vramswap: out of memory allocating ", nbytes, " bytes (CPU-emulation mode): ", report());
#endif
  std::abort();  // not reached: the checks above throw
}

// c10::Allocator over vramswap_malloc/vramswap_free on device 0, legacy stream.
struct VramswapCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) const override {
    if (nbytes == 0) {  // vramswap_malloc(0) is NULL; c10's alloc_cpu(0) is too
      return {nullptr, nullptr, &vramswap_cpu_delete, c10::Device(c10::DeviceType::CPU)};
    }
    void* ptr = g_malloc.load()(nbytes, 0, nullptr);
    if (ptr == nullptr) throw_out_of_memory(nbytes);
    return {ptr, ptr, &vramswap_cpu_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &vramswap_cpu_delete; }
};

VramswapCpuAllocator* allocator() {
  static auto* const instance = new VramswapCpuAllocator();  // leaked: see the invariants
  return instance;
}

void install_cpu_allocator(int64_t malloc_fn, int64_t free_fn, int64_t last_error_fn) {
  TORCH_CHECK(malloc_fn != 0 && free_fn != 0, "install_cpu_allocator: null function address");
  g_malloc.store(reinterpret_cast<MallocFn>(malloc_fn));
  g_free.store(reinterpret_cast<FreeFn>(free_fn));
  g_last_error.store(reinterpret_cast<LastErrorFn>(last_error_fn));
  c10::SetCPUAllocator(allocator(), kPriority);
}

void uninstall_cpu_allocator() { c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), kPriority); }

bool cpu_allocator_installed() { return c10::GetCPUAllocator() == allocator(); }

int64_t storage_use_count(const at::Tensor& t) {
  if (!t.has_storage()) return 0;
  return static_cast<int64_t>(t.storage().use_count());
}

}  // namespace

TORCH_LIBRARY(vramswap, m) {
  m.def("install_cpu_allocator(int malloc_fn, int free_fn, int last_error_fn) -> ()",
        &install_cpu_allocator);
  m.def("uninstall_cpu_allocator() -> ()", &uninstall_cpu_allocator);
  m.def("cpu_allocator_installed() -> bool", &cpu_allocator_installed);
  m.def("storage_use_count(Tensor t) -> int", &storage_use_count);
}
