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
//   set_device(int device) -> int        the calling thread's tensors come from cudasim's
//       device `device` from now on (vramswap.sim.device()); returns the previous one
//   storage_use_count(Tensor t) -> int   c10::StorageImpl's reference count: how many
//       TensorImpls (and Python storage objects) hold t's storage.
// and the tracker's pending blocks (packed, not yet cold; Note [Pending blocks]):
//   install_cold_probe(int mark_cold_fn, int last_error_fn) -> int
//       takes the addresses of vramswap_mark_cold and vramswap_last_error and returns the
//       address of the probe, for vramswap_set_cold_probe
//   watch(Tensor alias, int handle, int aliases) -> ()   handle is pending; its block is
//       cold once its storage is held by exactly `aliases` references (the tracker's own)
//   set_aliases(int handle, int aliases) -> ()   a pending handle's count changed (0: gone)
//   forget(int handle) -> ()                     no longer pending (unpacked)
//   poll_cold(int stream) -> int                 marks cold, on `stream`, every pending
//       block whose storage only the tracker holds; how many (raises if vramswap refused one)
//   is_pending(int handle) -> bool, num_cold_marks() -> int
//
// Invariants: the allocator object is never destroyed (tensors can be freed during
// interpreter shutdown, after static destructors ran), and a DataPtr allocated by it
// always frees through vramswap_free even after uninstall.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>
#include <torch/version.h>

// torch 2.3 changed c10::Allocator (allocate() no longer const, copy_data() pure virtual) and
// gave the pluggable allocator its graph-pool hooks; this file is written against that
// interface (vramswap/_ext.py refuses an older torch before compiling).
static_assert(TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3),
              "vramswap's LibTorch extensions need torch 2.3 or newer");

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

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

// The emulated device a thread's CPU tensors are allocated on (vramswap.sim.device(n), which
// also makes n cudasim's current device for the thread); 0 unless set.
thread_local int t_device = 0;

void vramswap_cpu_delete(void* ptr) {
  // The legacy stream: torch's CPU ops are synchronous, so nothing is queued on any stream
  // when a tensor dies. The device is a hint: vramswap finds the pool from the address.
  if (ptr != nullptr) g_free.load()(ptr, 0, t_device, nullptr);
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
// the thread (autograd's engine passes it on to backward's caller).
[[noreturn]] void throw_out_of_memory(size_t nbytes) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "vramswap: out of memory allocating ", nbytes,
                   " bytes (CPU-emulation mode): ", report());
  std::abort();  // not reached: the check above throws
}

// c10::Allocator over vramswap_malloc/vramswap_free on the thread's emulated device (0
// unless vramswap.sim.device() says otherwise), legacy stream.
struct VramswapCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {  // vramswap_malloc(0) is NULL; c10's alloc_cpu(0) is too
      return {nullptr, nullptr, &vramswap_cpu_delete, c10::Device(c10::DeviceType::CPU)};
    }
    void* ptr = g_malloc.load()(nbytes, t_device, nullptr);
    if (ptr == nullptr) throw_out_of_memory(nbytes);
    return {ptr, ptr, &vramswap_cpu_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &vramswap_cpu_delete; }
  // The memory is host memory in this mode (cudasim's device memory is the process's).
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count != 0) std::memcpy(dest, src, count);
  }
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

// Sets the calling thread's emulated device; returns the one it replaces.
int64_t set_device(int64_t device) {
  TORCH_CHECK(device >= 0 && device <= INT32_MAX, "set_device: device ", device, " is not a device ordinal");
  return std::exchange(t_device, static_cast<int>(device));
}

int64_t storage_use_count(const at::Tensor& t) {
  if (!t.has_storage()) return 0;
  return static_cast<int64_t>(t.storage().use_count());
}

// Note [Pending blocks]
// ~~~~~~~~~~~~~~~~~~~~~
// A saved block is cold when only the tracker's aliases hold its storage. The program's last
// reference goes away in between two of the tracker's calls, where no hook runs, so an
// allocation made then may find memory short only because such blocks are not marked yet.
// The pending set is therefore kept here, in C++, where vramswap's cold probe (called by
// vramswap_malloc, on the allocating thread, with no lock of vramswap's held) can look at it
// without Python: the probe and the tracker's own poll_cold() run the same sweep.
//
// Each pending handle holds a weak reference to its storage (the block's memory is not
// kept alive by it) and the number of the tracker's aliases of it (the Python side's count,
// which may lag behind by drops not yet counted: that only delays a cold mark). A handle
// leaves the set when it is marked cold, unpacked (forget) or has no alias left.
//
// The sweep marks cold while it holds the set's mutex: an unpack on another thread
// (forget, then vramswap_unpack) cannot slip in between the sweep's test and its mark, which
// would leave a block in use marked cold. The mutex is never held while waiting for
// anything else but vramswap's own locks, and vramswap never calls the probe under them.
using MarkColdFn = int (*)(uint64_t, void*);

struct Pending {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t aliases = 0;
};

std::atomic<MarkColdFn> g_mark_cold{nullptr};
std::atomic<int64_t> g_cold_marks{0};
std::mutex g_pending_mu;

std::unordered_map<uint64_t, Pending>& pending() {
  static auto* const map = new std::unordered_map<uint64_t, Pending>();  // leaked: see the invariants
  return *map;
}

void watch(const at::Tensor& alias, int64_t handle, int64_t aliases) {
  TORCH_CHECK(alias.has_storage(), "watch: the alias has no storage");
  std::lock_guard lock(g_pending_mu);
  auto [it, added] = pending().try_emplace(uint64_t(handle), Pending{alias.storage().getWeakStorageImpl(), 0});
  it->second.aliases = aliases;
}

void set_aliases(int64_t handle, int64_t aliases) {
  std::lock_guard lock(g_pending_mu);
  auto it = pending().find(uint64_t(handle));
  if (it == pending().end()) return;
  if (aliases <= 0) {
    pending().erase(it);
  } else {
    it->second.aliases = aliases;
  }
}

void forget(int64_t handle) {
  std::lock_guard lock(g_pending_mu);
  pending().erase(uint64_t(handle));
}

// Marks cold every pending block held only by the tracker's aliases; returns how many.
// A refused mark leaves the handle pending; *refusal gets vramswap's message for the first.
size_t sweep(void* stream, std::string* refusal) {
  const MarkColdFn mark_cold = g_mark_cold.load();
  if (mark_cold == nullptr) return 0;
  std::lock_guard lock(g_pending_mu);
  size_t marked = 0;
  for (auto it = pending().begin(); it != pending().end();) {
    const size_t uses = it->second.storage.use_count();
    if (uses == 0 || int64_t(uses) != it->second.aliases) {
      ++it;
      continue;
    }
    if (mark_cold(it->first, stream) != 0) {
      if (refusal != nullptr && refusal->empty()) refusal->assign(report());
      ++it;
      continue;
    }
    ++marked;
    it = pending().erase(it);
  }
  g_cold_marks.fetch_add(int64_t(marked));
  return marked;
}

// vramswap's cold probe (vramswap_set_cold_probe). A refused mark is left to the tracker's
// next poll, which reports it.
extern "C" size_t vramswap_torch_cold_probe(int /*device*/, void* stream) noexcept {
  try {
    return sweep(stream, nullptr);
  } catch (...) {
    return 0;
  }
}

int64_t install_cold_probe(int64_t mark_cold_fn, int64_t last_error_fn) {
  TORCH_CHECK(mark_cold_fn != 0, "install_cold_probe: null function address");
  g_mark_cold.store(reinterpret_cast<MarkColdFn>(mark_cold_fn));
  if (last_error_fn != 0) g_last_error.store(reinterpret_cast<LastErrorFn>(last_error_fn));
  return reinterpret_cast<int64_t>(&vramswap_torch_cold_probe);
}

int64_t poll_cold(int64_t stream) {
  std::string refusal;
  const size_t marked = sweep(reinterpret_cast<void*>(stream), &refusal);
  TORCH_CHECK(refusal.empty(), "vramswap_mark_cold failed: ", refusal);
  return int64_t(marked);
}

bool is_pending(int64_t handle) {
  std::lock_guard lock(g_pending_mu);
  return pending().count(uint64_t(handle)) == 1;
}

int64_t num_cold_marks() { return g_cold_marks.load(); }

}  // namespace

TORCH_LIBRARY(vramswap, m) {
  m.def("install_cpu_allocator(int malloc_fn, int free_fn, int last_error_fn) -> ()",
        &install_cpu_allocator);
  m.def("uninstall_cpu_allocator() -> ()", &uninstall_cpu_allocator);
  m.def("cpu_allocator_installed() -> bool", &cpu_allocator_installed);
  m.def("set_device(int device) -> int", &set_device);
  m.def("storage_use_count(Tensor t) -> int", &storage_use_count);
  m.def("install_cold_probe(int mark_cold_fn, int last_error_fn) -> int", &install_cold_probe);
  m.def("watch(Tensor alias, int handle, int aliases) -> ()", &watch);
  m.def("set_aliases(int handle, int aliases) -> ()", &set_aliases);
  m.def("forget(int handle) -> ()", &forget);
  m.def("poll_cold(int stream) -> int", &poll_cold);
  m.def("is_pending(int handle) -> bool", &is_pending);
  m.def("num_cold_marks() -> int", &num_cold_marks);
}
