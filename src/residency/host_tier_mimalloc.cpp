// The mimalloc-arena placement: the candidate that was measured against best fit (Note [The
// host tier] in host_tier.h) and lost. Built into vramswap_host_tier_mimalloc for the
// benchmark and the conformance tests; the product does not link it.
//
// How it uses mimalloc 2.0 (Debian 12's libmimalloc 2.0.9), and what that costs:
//   * libmimalloc is loaded with dlopen(RTLD_LOCAL), never linked: Debian's library exports
//     malloc and free too, and linking it would replace glibc's malloc in the whole process.
//     The header only gives the functions' types. Debian ships no static library, so the
//     alternative (linking a private copy with hidden symbols) would mean vendoring mimalloc.
//   * Each chunk becomes one exclusive arena (mi_manage_os_memory_ex, committed and not
//     "large", which mimalloc treats as pinned: it never decommits or resets the memory, as
//     it must not, and it never falls back to the OS for a heap bound to an arena) with its
//     own heap (mi_heap_new_in_arena: a heap allocates from one arena only). Placement tries
//     the heap that placed last, then the others.
//   * Arenas are managed in 32 MiB blocks (MI_SEGMENT_SIZE) and must start 32 MiB-aligned
//     (mimalloc finds a block's segment by masking its address), while cudaHostAlloc
//     promises page alignment only: each chunk is pinned 32 MiB larger and the arena starts
//     at the first aligned address. The pad is reported as unusable_bytes.
//   * A heap belongs to the thread that made it, and is deleted when that thread exits. The
//     tier is used from any thread, so the heaps are made by a thread of this placer's own
//     (HeapOwner) that does nothing else and lives as long as the placer; the tier's mutex
//     serializes every call, so the owner's thread-local data is never used concurrently.
//     Frees from other threads take mimalloc's cross-thread path: the block waits on its
//     page's thread-free list until its heap collects, so when no heap can place a block,
//     every heap is collected (mi_heap_collect) and placement tried again before the tier
//     pins another chunk.
//   * Blocks above 128 KiB (MI_MEDIUM_OBJ_SIZE_MAX) come from mi_heap_malloc, which starts
//     them on a 64 KiB page boundary: mi_heap_malloc_aligned would over-allocate by the
//     alignment and push, say, a 16 MiB block into a 64 MiB huge segment. Smaller blocks use
//     mi_heap_malloc_aligned_at(512, offset 0): 2.0.9's mi_heap_malloc_aligned returns
//     misaligned blocks when size == alignment is 256, 512 or 1024 (microsoft/mimalloc#700,
//     fixed after 2.0.9; the conformance test BlocksAreAlignedTo512Bytes caught it here).
//   * mimalloc cannot tell a foreign or double free (it would corrupt itself), so the live
//     blocks are kept in a hash map, as the tier's contract needs.
//   * mimalloc 2.0 has no way to give an arena back: trim() releases nothing. At destruction
//     the heaps are destroyed (mi_heap_destroy) and the tier unpins the chunks, which nothing
//     can reach any more (exclusive arenas, no heap left), but their arena slots stay taken:
//     a process has 64 (MI_MAX_ARENAS), shared with anything else that uses the library.
#include <dlfcn.h>
#include <mimalloc.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "residency/host_tier.h"

#include "config/units.h"

#ifndef VRAMSWAP_MIMALLOC_LIBRARY
#define VRAMSWAP_MIMALLOC_LIBRARY "libmimalloc.so.2"
#endif

namespace vramswap::residency {
namespace {

// mimalloc 2.0's constants (mimalloc-types.h, 64-bit), which its public header does not
// export: the arena block and segment size and alignment, the largest block of a page
// shared with other blocks, and the largest block kept in a regular segment.
constexpr uint64_t kMiSegment = uint64_t{32} << 20;
constexpr uint64_t kMiMediumObjMax = uint64_t{128} << 10;
constexpr uint64_t kMiLargeObjMax = kMiSegment / 2;

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// mimalloc's rounding of a large request (_mi_os_good_alloc_size).
uint64_t mi_good_size(uint64_t bytes) {
  const uint64_t kMiB = uint64_t{1} << 20;
  const uint64_t align = bytes < 2 * kMiB    ? 64 << 10
                         : bytes < 8 * kMiB  ? 256 << 10
                         : bytes < 32 * kMiB ? kMiB
                                             : 4 * kMiB;
  return round_up(bytes, align);
}

// The functions used, from the dlopen'ed library.
struct MimallocApi {
  decltype(&mi_manage_os_memory_ex) manage_os_memory_ex = nullptr;
  decltype(&mi_heap_new_in_arena) heap_new_in_arena = nullptr;
  decltype(&mi_heap_malloc) heap_malloc = nullptr;
  decltype(&mi_heap_malloc_aligned_at) heap_malloc_aligned_at = nullptr;
  decltype(&mi_heap_collect) heap_collect = nullptr;
  decltype(&mi_heap_destroy) heap_destroy = nullptr;
  decltype(&mi_free) free = nullptr;
  std::string error;  // why the library cannot be used, if it cannot
};

template <typename Fn>
void find(void* lib, const char* name, Fn* fn, std::string* error) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) *error = std::string("libmimalloc has no ") + name;
}

const MimallocApi& mimalloc_api() {
  static const MimallocApi api = [] {
    MimallocApi a;
    void* lib = dlopen(VRAMSWAP_MIMALLOC_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libmimalloc.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      a.error = std::string("cannot load libmimalloc: ") + dlerror();
      return a;
    }
    find(lib, "mi_manage_os_memory_ex", &a.manage_os_memory_ex, &a.error);
    find(lib, "mi_heap_new_in_arena", &a.heap_new_in_arena, &a.error);
    find(lib, "mi_heap_malloc", &a.heap_malloc, &a.error);
    find(lib, "mi_heap_malloc_aligned_at", &a.heap_malloc_aligned_at, &a.error);
    find(lib, "mi_heap_collect", &a.heap_collect, &a.error);
    find(lib, "mi_heap_destroy", &a.heap_destroy, &a.error);
    find(lib, "mi_free", &a.free, &a.error);
    return a;  // the library stays loaded for the life of the process
  }();
  return api;
}

// A thread that runs the calls a mimalloc heap must receive from its owner (creating and
// destroying it), and otherwise waits. Thread safety: run() may be called from any thread,
// one call at a time runs.
class HeapOwner {
 public:
  HeapOwner() : thread_([this] { loop(); }) {}
  ~HeapOwner() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  HeapOwner(const HeapOwner&) = delete;
  HeapOwner& operator=(const HeapOwner&) = delete;

  // Runs `task` on the owner thread and returns when it has run. `task` must not throw.
  void run(const std::function<void()>& task) {
    std::unique_lock lock(mu_);
    done_.wait(lock, [&] { return task_ == nullptr; });
    task_ = &task;
    wake_.notify_all();
    done_.wait(lock, [&] { return task_ != &task; });
  }

 private:
  void loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || task_ != nullptr; });
      if (task_ != nullptr) {
        (*task_)();
        task_ = nullptr;
        done_.notify_all();
      } else {
        return;
      }
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void()>* task_ = nullptr;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

class MimallocArenaPlacer final : public HostTier::Placer {
 public:
  explicit MimallocArenaPlacer(const MimallocApi& mi) : mi_(mi) {}

  ~MimallocArenaPlacer() override {
    owner_.run([&] {
      for (const Arena& a : arenas_) mi_.heap_destroy(a.heap);
    });
  }

  const char* name() const override { return "mimalloc_arena"; }

  uint64_t chunk_bytes_for(uint64_t bytes, uint64_t chunk_bytes) const override {
    // A block up to kMiLargeObjMax fits in one regular segment. A larger one gets a huge
    // segment of its own: the rounded block plus the segment's header (one slice entry
    // per 64 KiB; 512 bytes per 64 KiB is a generous bound), in whole arena blocks.
    const uint64_t need = bytes <= kMiLargeObjMax
                              ? kMiSegment
                              : round_up(mi_good_size(bytes) + bytes / 128 + (64 << 10), kMiSegment);
    return round_up(std::max(need, chunk_bytes), kHostChunkGranularity) + kMiSegment;  // + the pad
  }

  bool add_chunk(void* base, uint64_t size, std::string* error) override {
    const uintptr_t start = round_up(address(base), kMiSegment);
    const uintptr_t end = address(base) + size;
    if (end < start + kMiSegment) {
      *error = "the chunk has no 32 MiB-aligned 32 MiB inside";
      return false;
    }
    const uint64_t arena_bytes = (end - start) / kMiSegment * kMiSegment;
    mi_arena_id_t id{};
    if (!mi_.manage_os_memory_ex(reinterpret_cast<void*>(start), arena_bytes, /*is_committed=*/true,
                                 /*is_large=*/false, /*is_zero=*/false, /*numa_node=*/-1,
                                 /*exclusive=*/true, &id)) {
      *error = "mi_manage_os_memory_ex refused it (a process has at most 64 mimalloc arenas, "
               "and mimalloc 2.0 never gives one back)";
      return false;
    }
    mi_heap_t* heap = nullptr;
    owner_.run([&] { heap = mi_.heap_new_in_arena(id); });
    if (heap == nullptr) {
      *error = "mi_heap_new_in_arena failed";
      return false;
    }
    arenas_.push_back(Arena{address(base), size, heap});
    unusable_ += size - arena_bytes;
    return true;
  }

  void* place(uint64_t bytes) override {
    for (int attempt = 0; attempt < 2 && !arenas_.empty(); ++attempt) {
      for (size_t i = 0; i < arenas_.size(); ++i) {
        const size_t k = (last_ + i) % arenas_.size();
        if (void* p = place_in(arenas_[k].heap, bytes)) {
          last_ = k;
          live_.emplace(address(p), bytes);
          return p;
        }
      }
      // Blocks freed by other threads are not reusable until their heap collects them.
      for (const Arena& a : arenas_) mi_.heap_collect(a.heap, true);
    }
    return nullptr;
  }

  std::optional<uint64_t> release(void* p, std::string* error) override {
    auto it = live_.find(address(p));
    if (it == live_.end()) {
      *error = in_a_chunk(address(p)) ? "it is not the start of a live block (freed already, or "
                                        "inside a block)"
                                      : "the host tier did not allocate it";
      return std::nullopt;
    }
    const uint64_t size = it->second;
    live_.erase(it);
    mi_.free(p);
    return size;
  }

  uint64_t free_chunk_bytes() const override { return 0; }
  std::vector<void*> take_free_chunks() override { return {}; }
  std::optional<uint64_t> largest_free_bytes() const override { return std::nullopt; }
  uint64_t unusable_bytes() const override { return unusable_; }

 private:
  struct Arena {
    uintptr_t base;  // the chunk
    uint64_t size;
    mi_heap_t* heap;
  };

  void* place_in(mi_heap_t* heap, uint64_t bytes) {
    if (bytes > kMiMediumObjMax) {
      void* p = mi_.heap_malloc(heap, bytes);
      if (p == nullptr || address(p) % kHostBlockAlignment == 0) return p;
      mi_.free(p);  // not expected: large blocks start on a page boundary
    }
    return mi_.heap_malloc_aligned_at(heap, bytes, kHostBlockAlignment, 0);
  }

  bool in_a_chunk(uintptr_t a) const {
    for (const Arena& c : arenas_) {
      if (a >= c.base && a < c.base + c.size) return true;
    }
    return false;
  }

  const MimallocApi& mi_;
  std::vector<Arena> arenas_;
  std::unordered_map<uintptr_t, uint64_t> live_;  // block -> size as requested (rounded)
  size_t last_ = 0;                               // the arena that placed last
  uint64_t unusable_ = 0;
  HeapOwner owner_;  // last: its thread outlives every use of the heaps
};

}  // namespace

std::unique_ptr<HostTier::Placer> make_mimalloc_arena_placer() {
  const MimallocApi& mi = mimalloc_api();
  if (!mi.error.empty()) throw std::runtime_error("mimalloc arena placement: " + mi.error);
  return std::make_unique<MimallocArenaPlacer>(mi);
}

}  // namespace vramswap::residency
