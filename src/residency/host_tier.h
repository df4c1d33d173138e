// HostTier: the pinned host memory that evicted blocks are copied into (DESIGN.md, "The
// host tier").
//
// Note [The host tier]
// --------------------
// The copy engines reach full speed, and copy asynchronously at all, only from pinned
// (page-locked) host memory, and pinning is slow: the driver locks and maps every page,
// tens of milliseconds for a few hundred MiB. So the tier pins memory in chunks (256 MiB
// by default) and carves blocks out of them; a request larger than a chunk gets a chunk of
// its own size. Chunks are cudaHostAlloc'ed portable (pinned for every context) and not
// write-combined: the CPU reads host copies (VRAMSWAP_VERIFY's checksums), and most CPUs
// read write-combined memory very slowly.
//
// Placement inside the chunks is best fit (the Placer below): every chunk is tiled by
// extents in address order, free neighbours in the same chunk are merged at once, and the
// free ones are indexed by (size, address), so a request takes the smallest free extent
// that holds it, lowest address first, and splits off the rest. Blocks are 512-byte aligned
// and sized in 512-byte units, like the device pool's, so a block and its host copy are
// aligned alike for the copy engines. The other candidate, mimalloc's arena API over the
// same chunks (host_tier_mimalloc.cpp), was measured against it in bench/host_tier and
// lost on both counts: it pinned 1.45x (training-like trace) and 2.2x (random frees) the
// peak of live bytes where best fit pinned 1.13x (exactly the whole chunks the peak
// needs) and 1.33x, and an allocate+free pair of 1 to 64 MiB cost it 0.17 to 1.5 us
// against best fit's 0.12 to 0.17 us. Its arenas work in 32 MiB blocks, so a 16 MiB block
// takes a 32 MiB segment to itself and a 64 MiB block 96 MiB, and mimalloc 2.0 cannot
// give an arena back. It is built for the benchmark and the tests only, never shipped.
//
// The limit: the tier never holds more than limit_bytes of pinned memory. Pinned memory
// cannot be swapped or reclaimed by the kernel, so pinning most of the machine starves
// everything else (the data loader, the page cache, other processes) and invites the OOM
// killer; the default is half of the memory the process may use (MemTotal, or the cgroup's
// limit when lower). At the limit the last chunk shrinks to what is left; when even that
// cannot hold the request, chunks with no live block are released to make room for a
// larger one, and only then is the request refused (nullptr, with a report).
//
// Chunks stay pinned when their blocks are freed (pinning again would cost more than
// keeping them) until trim() releases those with no live block. cudaFreeHost synchronizes
// the device, so the tier never releases a chunk on its own except to make room at the
// limit. A block must not be freed while a copy into or out of it is still queued: the
// tier knows nothing of streams.
//
// Thread safety: one mutex guards all state. It is never held across a CUDA call
// (cudaHostAlloc is slow, cudaFreeHost synchronizes the device): one thread at a time pins
// a new chunk with the mutex released while the others wait for it and then try again.
// The counters are atomics, so the one-number getters take no lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vramswap::residency {

// Blocks are aligned to, and sized in, this unit: the device pool's block alignment.
inline constexpr uint64_t kHostBlockAlignment = 512;

// Pinned memory is acquired in chunks of this size by default: large enough that the
// cost of pinning (per call and per page) is paid rarely, small enough that the memory
// pinned beyond need (at most one chunk) stays a small share of a training run's host use.
inline constexpr uint64_t kDefaultHostChunkBytes = uint64_t{256} << 20;

// Chunk sizes are rounded up to this, the x86-64 huge-page size: a chunk is whole pages
// whichever page size the kernel backs it with, and chunk sizes stay few and round.
inline constexpr uint64_t kHostChunkGranularity = uint64_t{2} << 20;

struct HostTierOptions {
  // Pinned bytes the tier may hold (VRAMSWAP_HOST_LIMIT). 0: default_host_limit_bytes().
  uint64_t limit_bytes = 0;
  // Pinned memory is acquired in chunks of this many bytes, rounded up to
  // kHostChunkGranularity; a larger request gets a chunk of its own. 0: kDefaultHostChunkBytes.
  uint64_t chunk_bytes = 0;
  // The device whose primary context pins the memory (it is pinned portably, for all).
  int device = 0;
};

struct HostTierStats {
  uint64_t used_bytes = 0;          // bytes in live blocks (sizes rounded to 512)
  uint64_t peak_used_bytes = 0;
  uint64_t pinned_bytes = 0;        // bytes of pinned chunks held
  uint64_t peak_pinned_bytes = 0;
  uint64_t limit_bytes = 0;         // the effective limit
  uint64_t chunk_bytes = 0;         // the effective chunk size
  uint64_t free_bytes = 0;          // pinned bytes a block could still be placed in
  uint64_t largest_free_bytes = 0;  // the largest block that fits without pinning more;
                                    // 0 when the placement cannot tell (mimalloc)
  uint64_t unusable_bytes = 0;      // pinned bytes the placement can never use (mimalloc:
                                    // the alignment pad of each chunk)
  uint64_t num_chunks = 0;
  uint64_t num_allocs = 0;          // successful allocations
  uint64_t num_frees = 0;           // successful frees
  uint64_t num_refused = 0;         // allocations refused at the limit or for lack of memory
  uint64_t num_bad_frees = 0;       // frees refused: foreign pointer, double free, interior
  uint64_t num_chunks_pinned = 0;   // cudaHostAlloc calls that succeeded
  uint64_t num_chunks_released = 0; // chunks given back by trim() or to make room
};

class HostTier {
 public:
  class Placer;  // how blocks are laid out inside the chunks; see below

  // An empty tier (nothing is pinned until the first allocation) with best-fit placement.
  // Throws std::invalid_argument for a negative device. Thread-safe construction.
  explicit HostTier(const HostTierOptions& options);

  // The same over another placement: for the benchmark and the conformance tests, which
  // measure the candidate against best fit. Throws std::invalid_argument for a null placer.
  HostTier(const HostTierOptions& options, std::unique_ptr<Placer> placer);

  // Frees every block and releases every chunk. A live block is freed with the rest (its
  // owner must not use it afterwards). Never throws; tolerates a CUDA runtime that has
  // already shut down (the memory then goes back to the system with the process).
  ~HostTier();

  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // A pinned block of at least `bytes`, aligned to kHostBlockAlignment, or nullptr: for
  // 0 bytes (with *error cleared), or when the request cannot be held under the limit or
  // pinning fails (with *error set to a report: the request, the limit, what is pinned and
  // used, the largest free extent). May pin a new chunk. Throws nothing but std::bad_alloc
  // (the process's own heap exhausted). Thread-safe.
  void* allocate(size_t bytes, std::string* error = nullptr);

  // Frees a block allocate() returned. nullptr is a no-op (true). A pointer the tier did
  // not hand out, one inside a block, or a block freed already is refused: false with
  // *error saying which, and nothing changes. Never releases a chunk. Thread-safe.
  bool free(void* p, std::string* error = nullptr);

  // Releases (cudaFreeHost) every chunk that holds no live block; returns the bytes
  // released. cudaFreeHost synchronizes the device, so call this when a stall is
  // acceptable (empty_cache, the end of a step). Thread-safe.
  uint64_t trim();

  // Bytes in live blocks. Thread-safe (atomic; a reading taken during an allocation may
  // not include it).
  uint64_t used_bytes() const;
  // Bytes of pinned memory held. Thread-safe (atomic, as used_bytes()).
  uint64_t pinned_bytes() const;
  // The highest used_bytes() since construction or reset_peaks(). Thread-safe (atomic).
  uint64_t peak_used_bytes() const;

  // How broken up the free pinned memory is: 1 - largest free extent / free bytes, from 0
  // (all free memory in one extent, or none free) towards 1 (many small pieces). NaN when
  // the placement cannot tell its largest free extent (mimalloc). Thread-safe.
  double fragmentation() const;

  // A consistent reading of every counter. Thread-safe.
  HostTierStats stats() const;

  // Resets the peaks to the current values. Thread-safe.
  void reset_peaks();

  // True when `p` lies inside one of the tier's chunks. Thread-safe.
  bool owns(const void* p) const;

  // The effective limit and chunk size (the options with their defaults applied).
  // Thread-safe (immutable).
  uint64_t limit_bytes() const;
  uint64_t chunk_bytes() const;

  // "best_fit" or "mimalloc_arena". Thread-safe (immutable).
  const char* placement() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A placement policy: where blocks go inside the pinned chunks the tier gives it. The tier
// owns the chunks, the limit, the counters and the lock; every call below is made with the
// tier's mutex held, never concurrently. Sizes passed in are multiples of
// kHostBlockAlignment.
class HostTier::Placer {
 public:
  virtual ~Placer() = default;

  virtual const char* name() const = 0;

  // Bytes to pin for a new chunk that must hold a block of `bytes`, given the tier's
  // chunk size (0: the least that holds the block). A multiple of kHostChunkGranularity.
  virtual uint64_t chunk_bytes_for(uint64_t bytes, uint64_t chunk_bytes) const = 0;

  // Takes the fresh pinned chunk [base, base + size). False, with *error, when it cannot
  // use it (the tier then releases it).
  virtual bool add_chunk(void* base, uint64_t size, std::string* error) = 0;

  // A block of `bytes`, aligned to kHostBlockAlignment, in one of the chunks; nullptr when
  // none has room.
  virtual void* place(uint64_t bytes) = 0;

  // Frees the live block that starts at `p` and returns its size (as placed); nullopt,
  // with *error saying why, when `p` is not the start of a live block.
  virtual std::optional<uint64_t> release(void* p, std::string* error) = 0;

  // Bytes of the chunks that hold no live block and could be given back.
  virtual uint64_t free_chunk_bytes() const = 0;

  // Forgets those chunks and returns their bases; the tier releases them.
  virtual std::vector<void*> take_free_chunks() = 0;

  // The largest block place() could return now with no new chunk; nullopt when unknown.
  virtual std::optional<uint64_t> largest_free_bytes() const = 0;

  // Pinned bytes of the chunks that place() can never use.
  virtual uint64_t unusable_bytes() const { return 0; }
};

// Best fit over address-ordered extents (Note [The host tier]): what HostTier uses.
// Thread-safe; the placer is then used under one tier's lock.
std::unique_ptr<HostTier::Placer> make_best_fit_placer();

// The measured candidate: mimalloc's arena API (mi_manage_os_memory_ex, one exclusive arena
// per chunk, mi_heap_new_in_arena) over the same chunks, with libmimalloc loaded by
// dlopen(RTLD_LOCAL) so that it does not replace malloc in the process. Defined only in
// the library vramswap_host_tier_mimalloc, which the benchmark and tests link and the
// product does not. Throws std::runtime_error when libmimalloc cannot be loaded.
// Thread-safe; the placer is then used under one tier's lock.
std::unique_ptr<HostTier::Placer> make_mimalloc_arena_placer();

// The default limit of the tier for a machine with `memory_bytes` usable (host_memory.h):
// half of it, rounded down to kHostChunkGranularity. Thread-safe: pure.
uint64_t default_host_limit_bytes(uint64_t memory_bytes);

}  // namespace vramswap::residency
