// HostTier: the chunks, the limit, the counters and the lock (Note [The host tier] in
// host_tier.h). The best-fit placement that ships is host_tier_best_fit.cpp.
//
// Invariants (checked by tests/host_tier through the public API):
//   * chunks holds every pinned chunk (base -> size); pinned is their sum and never more
//     than limit; used is the sum of the live blocks' sizes as placed;
//   * growing is true exactly while one thread pins a chunk with mu released; no other
//     thread pins meanwhile (they wait on `grown`), so the limit check needs no reservation;
#include "residency/host_tier.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "config/units.h"
#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/host_time.h"
#include "residency/host_memory.h"

namespace vramswap::residency {
namespace {

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }
void* pointer(uintptr_t a) { return reinterpret_cast<void*>(a); }

// Pins a chunk on `device`'s primary context (the calling thread's current context is
// restored afterwards). nullptr, with *error, when the driver refuses.
void* pin_chunk(int device, uint64_t bytes, std::string* error) {
  try {
    cuda::ContextScope scope(device);
    void* p = nullptr;
    cuda::TimedCall timed(cuda::HostTime::kPin);
    VRAMSWAP_CUDART(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    return p;
  } catch (const cuda::CudaError& e) {
    *error = e.what();
    return nullptr;
  }
}

// Unpins a chunk; false when the driver refused twice (the caller keeps the chunk, to try
// again at the next trim: forgetting it would leak its pinned memory). At exit a refusal
// is ignored: the runtime may have shut down already (cudaErrorCudartUnloading), and the
// memory goes back with the process.
bool release_chunk(void* base) noexcept {
  cuda::TimedCall timed(cuda::HostTime::kPin);
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (cudaFreeHost(base) == cudaSuccess) return true;
    cudaGetLastError();  // not the program's error
  }
  return false;
}

// Raises `peak` to at least `value`. Called with the tier's mutex held (the only writer).
void raise_peak(std::atomic<uint64_t>& peak, uint64_t value) {
  if (value > peak.load(std::memory_order_relaxed)) peak.store(value, std::memory_order_relaxed);
}

}  // namespace

// ---- The tier ----

struct HostTier::State {
  State(const HostTierOptions& options, std::unique_ptr<Placer> p)
      : device(options.device),
        limit(options.limit_bytes != 0 ? options.limit_bytes
                                        : default_host_limit_bytes(host_memory_bytes())),
        chunk(options.chunk_bytes == 0
                  ? kDefaultHostChunkBytes
                  : round_up(std::min(options.chunk_bytes,
                                      std::numeric_limits<uint64_t>::max() / 2),
                             kHostChunkGranularity)),
        placer(std::move(p)) {
    if (device < 0) {
      throw std::invalid_argument("HostTier: device " + std::to_string(device) + " is negative");
    }
    if (!placer) throw std::invalid_argument("HostTier: no placer");
  }

  // The report of a refused allocation. Called with mu held.
  std::string refusal(uint64_t bytes, const std::string& why) const {
    std::ostringstream out;
    out << "host tier: cannot hold a block of " << format_size(bytes) << ": " << why << " ("
        << format_size(pinned.load()) << " pinned of the " << format_size(limit)
        << " limit, " << format_size(used.load()) << " in live blocks";
    if (auto largest = placer->largest_free_bytes()) {
      out << ", largest free extent " << format_size(*largest);
    }
    // (A chunk pinned at the limit may be smaller than the chunk size.)
    out << ", " << chunks.size() << (chunks.size() == 1 ? " chunk" : " chunks") << " pinned, chunk size "
        << format_size(chunk) << ")";
    return out.str();
  }

  // Pinned bytes not in live blocks that a block could be placed in. Called with mu held.
  uint64_t free_bytes() const {
    const uint64_t idle = pinned.load() - used.load();
    return idle - std::min(idle, placer->unusable_bytes());
  }

  const int device;
  const uint64_t limit;
  const uint64_t chunk;

  mutable std::mutex mu;
  std::condition_variable grown;  // a thread finished pinning (growing went false)
  bool growing = false;
  std::unique_ptr<Placer> placer;
  std::map<uintptr_t, uint64_t> chunks;  // base -> size
  // Chunks the driver refused to unpin: counted in `pinned` (they are), unpinned again at
  // the next trim or growth.
  std::vector<std::pair<void*, uint64_t>> refused;

  // Takes `chunks` (base, size) off the books for release_outside(). Called with mu held.
  std::vector<std::pair<void*, uint64_t>> take_refused() {
    std::vector<std::pair<void*, uint64_t>> out;
    out.swap(refused);
    for (const auto& [base, size] : out) pinned.store(pinned.load() - size);
    return out;
  }
  // Unpins chunks already off the books, with mu NOT held (cudaFreeHost synchronizes); a
  // chunk the driver refuses goes back on them, in `refused`.
  void release_outside(const std::vector<std::pair<void*, uint64_t>>& off) {
    for (const auto& [base, size] : off) {
      if (release_chunk(base)) continue;
      std::lock_guard lock(mu);
      refused.emplace_back(base, size);
      pinned.store(pinned.load() + size);
    }
  }

  // Written under mu, read anywhere.
  std::atomic<uint64_t> used{0};
  std::atomic<uint64_t> pinned{0};
  std::atomic<uint64_t> peak_used{0};
  std::atomic<uint64_t> peak_pinned{0};

  // Under mu.
  uint64_t num_allocs = 0;
  uint64_t num_frees = 0;
  uint64_t num_refused = 0;
  uint64_t num_bad_frees = 0;
  uint64_t num_chunks_pinned = 0;
  uint64_t num_chunks_released = 0;
};

HostTier::HostTier(const HostTierOptions& options) : HostTier(options, make_best_fit_placer()) {}

HostTier::HostTier(const HostTierOptions& options, std::unique_ptr<Placer> placer)
    : state_(std::make_unique<State>(options, std::move(placer))) {}

HostTier::~HostTier() {
  State& s = *state_;
  s.placer.reset();  // first: a placement may keep state inside the chunks (mimalloc)
  for (const auto& [base, size] : s.chunks) release_chunk(pointer(base));
  for (const auto& [base, size] : s.refused) release_chunk(base);
}

void* HostTier::allocate(size_t bytes, std::string* error) {
  State& s = *state_;
  std::string ignored;
  std::string& message = error != nullptr ? *error : ignored;
  message.clear();
  if (bytes == 0) return nullptr;

  std::unique_lock lock(s.mu);
  if (bytes > s.limit) {
    ++s.num_refused;
    message = s.refusal(bytes, "the request is larger than the limit (VRAMSWAP_HOST_LIMIT)");
    return nullptr;
  }
  const uint64_t size = round_up(bytes, kHostBlockAlignment);  // no overflow: bytes <= limit

  auto placed = [&](void* p) {
    s.used.store(s.used.load() + size);
    raise_peak(s.peak_used, s.used.load());
    ++s.num_allocs;
    return p;
  };

  for (;;) {
    if (void* p = s.placer->place(size)) return placed(p);
    if (s.growing) {  // another thread is pinning: wait for it, then look again
      s.grown.wait(lock);
      continue;
    }

    // Pin a chunk: of the configured size, or less where the limit is near; when even the
    // least that holds the block does not fit, release chunks with no live block first.
    const uint64_t least = s.placer->chunk_bytes_for(size, 0);
    uint64_t headroom = s.limit - s.pinned.load();
    std::vector<std::pair<void*, uint64_t>> released;
    if (least > headroom) {
      if (least > headroom + s.placer->free_chunk_bytes()) {
        ++s.num_refused;
        message = s.refusal(bytes, "the limit is reached (VRAMSWAP_HOST_LIMIT)");
        return nullptr;
      }
      released = s.take_refused();
      for (void* base : s.placer->take_free_chunks()) {
        auto c = s.chunks.find(address(base));
        s.pinned.store(s.pinned.load() - c->second);
        released.emplace_back(base, c->second);
        s.chunks.erase(c);
        ++s.num_chunks_released;
      }
      headroom = s.limit - s.pinned.load();
    }
    uint64_t want = std::max(
        least, std::min(s.placer->chunk_bytes_for(size, s.chunk),
                        headroom / kHostChunkGranularity * kHostChunkGranularity));

    s.growing = true;
    lock.unlock();
    std::string pin_error;
    void* base = nullptr;
    try {
      s.release_outside(released);
      base = pin_chunk(s.device, want, &pin_error);
      if (base == nullptr && want > least) {
        // The host will not pin a whole chunk (its RAM, or RLIMIT_MEMLOCK in a container):
        // the least chunk that holds the block may still be pinned.
        std::string least_error;
        base = pin_chunk(s.device, least, &least_error);
        if (base != nullptr) want = least;
        else pin_error += "; pinning " + format_size(least) + ", the least that holds the block, failed too: " + least_error;
      }
    } catch (...) {  // std::bad_alloc from a message: the waiting threads must not hang
      lock.lock();
      s.growing = false;
      s.grown.notify_all();
      throw;
    }
    lock.lock();
    s.growing = false;
    s.grown.notify_all();

    if (base == nullptr) {
      ++s.num_refused;
      message = s.refusal(bytes, "pinning a chunk of " + format_size(want) + " failed: " + pin_error);
      return nullptr;
    }
    std::string why;
    if (!s.placer->add_chunk(base, want, &why)) {
      ++s.num_refused;
      message = s.refusal(bytes, "the " + std::string(s.placer->name()) +
                                     " placement cannot use a new chunk: " + why);
      lock.unlock();
      release_chunk(base);
      return nullptr;
    }
    s.chunks.emplace(address(base), want);
    s.pinned.store(s.pinned.load() + want);
    raise_peak(s.peak_pinned, s.pinned.load());
    ++s.num_chunks_pinned;

    // The chunk was sized for this block and the lock was held since: it fits, unless the
    // placement misjudged its needs; then refuse rather than pin on.
    if (void* p = s.placer->place(size)) return placed(p);
    ++s.num_refused;
    message = s.refusal(bytes, "the " + std::string(s.placer->name()) +
                                   " placement could not place it in a fresh chunk of " +
                                   format_size(want));
    return nullptr;
  }
}

bool HostTier::free(void* p, std::string* error) {
  if (error != nullptr) error->clear();
  if (p == nullptr) return true;
  State& s = *state_;
  std::lock_guard lock(s.mu);
  std::string why;
  const std::optional<uint64_t> size = s.placer->release(p, &why);
  if (!size) {
    ++s.num_bad_frees;
    if (error != nullptr) *error = "host tier: free of " + format_pointer(p) + " refused: " + why;
    return false;
  }
  s.used.store(s.used.load() - *size);
  ++s.num_frees;
  return true;
}

uint64_t HostTier::trim() {
  State& s = *state_;
  std::vector<std::pair<void*, uint64_t>> released;
  uint64_t bytes = 0;
  {
    std::lock_guard lock(s.mu);
    released = s.take_refused();
    for (void* base : s.placer->take_free_chunks()) {
      auto c = s.chunks.find(address(base));
      bytes += c->second;
      released.emplace_back(base, c->second);
      s.chunks.erase(c);
      ++s.num_chunks_released;
    }
    s.pinned.store(s.pinned.load() - bytes);
  }
  s.release_outside(released);  // outside the lock: it synchronizes
  return bytes;
}

uint64_t HostTier::used_bytes() const { return state_->used.load(std::memory_order_relaxed); }
uint64_t HostTier::pinned_bytes() const { return state_->pinned.load(std::memory_order_relaxed); }
uint64_t HostTier::peak_used_bytes() const {
  return state_->peak_used.load(std::memory_order_relaxed);
}

double HostTier::fragmentation() const {
  const State& s = *state_;
  std::lock_guard lock(s.mu);
  const uint64_t free_bytes = s.free_bytes();
  if (free_bytes == 0) return 0.0;
  const std::optional<uint64_t> largest = s.placer->largest_free_bytes();
  if (!largest) return std::numeric_limits<double>::quiet_NaN();
  return 1.0 - static_cast<double>(*largest) / static_cast<double>(free_bytes);
}

HostTierStats HostTier::stats() const {
  const State& s = *state_;
  std::lock_guard lock(s.mu);
  HostTierStats st;
  st.used_bytes = s.used.load();
  st.peak_used_bytes = s.peak_used.load();
  st.pinned_bytes = s.pinned.load();
  st.peak_pinned_bytes = s.peak_pinned.load();
  st.limit_bytes = s.limit;
  st.chunk_bytes = s.chunk;
  st.unusable_bytes = s.placer->unusable_bytes();
  st.free_bytes = s.free_bytes();
  st.largest_free_bytes = s.placer->largest_free_bytes().value_or(0);
  st.num_chunks = s.chunks.size();
  st.num_allocs = s.num_allocs;
  st.num_frees = s.num_frees;
  st.num_refused = s.num_refused;
  st.num_bad_frees = s.num_bad_frees;
  st.num_chunks_pinned = s.num_chunks_pinned;
  st.num_chunks_released = s.num_chunks_released;
  return st;
}

void HostTier::reset_peaks() {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  s.peak_used.store(s.used.load());
  s.peak_pinned.store(s.pinned.load());
}

bool HostTier::owns(const void* p) const {
  const State& s = *state_;
  const uintptr_t a = address(p);
  std::lock_guard lock(s.mu);
  auto after = s.chunks.upper_bound(a);
  if (after == s.chunks.begin()) return false;
  const auto& [base, size] = *std::prev(after);
  return a < base + size;
}

uint64_t HostTier::limit_bytes() const { return state_->limit; }
uint64_t HostTier::chunk_bytes() const { return state_->chunk; }
const char* HostTier::placement() const { return state_->placer->name(); }

// ---- The default limit ----

uint64_t default_host_limit_bytes(uint64_t memory_bytes) {
  const uint64_t half = memory_bytes / 2;
  const uint64_t rounded = half / kHostChunkGranularity * kHostChunkGranularity;
  return rounded != 0 ? rounded : half;
}

}  // namespace vramswap::residency
