// Helpers of the HostTier tests (tests/host_tier): the placements under test, stamps that
// show a block was not overwritten, and a registry of live ranges that catches overlaps.
//
// Every conformance case runs once per placement: best fit (what ships) and, when the build
// found mimalloc, the mimalloc arena candidate (make_mimalloc_arena_placer). A case that
// depends on what a placement can do (release a chunk, tell its largest free extent) asks
// the Placement it runs with.
//
// Thread safety: the free functions are thread-safe; LiveRanges is (one mutex).
#ifndef VRAMSWAP_TESTS_HOST_TIER_HOST_TIER_TEST_UTIL_H
#define VRAMSWAP_TESTS_HOST_TIER_HOST_TIER_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "residency/host_tier.h"
#include "common/cuda_test_util.h"


namespace vramswap::residency {
// Printed by GoogleTest in failure messages.
inline void PrintTo(const HostTierStats& s, std::ostream* os) {
  *os << "{used " << s.used_bytes << ", peak_used " << s.peak_used_bytes << ", pinned "
      << s.pinned_bytes << ", peak_pinned " << s.peak_pinned_bytes << ", limit " << s.limit_bytes
      << ", chunk " << s.chunk_bytes << ", free " << s.free_bytes << ", largest_free "
      << s.largest_free_bytes << ", unusable " << s.unusable_bytes << ", chunks " << s.num_chunks
      << ", allocs " << s.num_allocs << ", frees " << s.num_frees << ", refused "
      << s.num_refused << ", bad_frees " << s.num_bad_frees << ", pinned_calls "
      << s.num_chunks_pinned << ", released " << s.num_chunks_released << "}";
}
}  // namespace vramswap::residency

namespace host_tier_test {

using vramswap::residency::HostTier;
using vramswap::residency::HostTierOptions;
using vramswap::residency::HostTierStats;
using vramswap::residency::kHostBlockAlignment;
using vramswap::residency::kHostChunkGranularity;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

inline uint64_t round_up(uint64_t n, uint64_t unit) { return (n + unit - 1) / unit * unit; }
inline uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }
inline unsigned char* bytes_of(void* p) { return static_cast<unsigned char*>(p); }

// A placement under test and what it can do.
struct Placement {
  std::string name;                // the case-name suffix and HostTier::placement()
  bool releases_chunks = false;    // trim() and the limit can give chunks back
  bool knows_largest_free = false;  // largest_free_bytes and fragmentation() are meaningful
};

// Printed by GoogleTest as the placement's name. The cases keep GoogleTest's numbered
// names (.../0, .../1), which CTest's discovery turns into .../best_fit, .../mimalloc_arena.
inline void PrintTo(const Placement& placement, std::ostream* os) { *os << placement.name; }

inline std::vector<Placement> placements() {
  std::vector<Placement> all = {{"best_fit", true, true}};
#ifdef VRAMSWAP_HOST_TIER_TEST_MIMALLOC
  all.push_back({"mimalloc_arena", false, false});
#endif
  return all;
}

inline std::unique_ptr<HostTier> make_tier(const Placement& placement, const HostTierOptions& options) {
  if (placement.name == "best_fit") return std::make_unique<HostTier>(options);
#ifdef VRAMSWAP_HOST_TIER_TEST_MIMALLOC
  if (placement.name == "mimalloc_arena") {
    return std::make_unique<HostTier>(options, vramswap::residency::make_mimalloc_arena_placer());
  }
#endif
  ADD_FAILURE() << "no placement " << placement.name;
  return nullptr;
}

// Writes `stamp` into the first and last 8 bytes of the block [p, p + size) (size >= 16).
inline void stamp(void* p, size_t size, uint64_t stamp) {
  std::memcpy(p, &stamp, sizeof stamp);
  std::memcpy(bytes_of(p) + size - sizeof stamp, &stamp, sizeof stamp);
}

// True when both ends of the block still hold `stamp`.
inline bool has_stamp(void* p, size_t size, uint64_t stamp) {
  uint64_t head = 0;
  uint64_t tail = 0;
  std::memcpy(&head, p, sizeof head);
  std::memcpy(&tail, bytes_of(p) + size - sizeof tail, sizeof tail);
  return head == stamp && tail == stamp;
}

// The ranges of the live blocks: add() fails the test when a new block overlaps one.
class LiveRanges {
 public:
  ::testing::AssertionResult add(void* p, size_t size) {
    std::lock_guard lock(mu_);
    const uintptr_t a = address(p);
    auto after = ranges_.upper_bound(a);
    if (after != ranges_.end() && after->first < a + size) {
      return ::testing::AssertionFailure() << "block " << p << " (" << size
                                           << " bytes) overlaps the block at "
                                           << reinterpret_cast<void*>(after->first);
    }
    if (after != ranges_.begin()) {
      auto before = std::prev(after);
      if (before->first + before->second > a) {
        return ::testing::AssertionFailure()
               << "block " << p << " (" << size << " bytes) overlaps the block at "
               << reinterpret_cast<void*>(before->first) << " (" << before->second << " bytes)";
      }
    }
    ranges_.emplace(a, size);
    return ::testing::AssertionSuccess();
  }
  void remove(void* p) {
    std::lock_guard lock(mu_);
    ranges_.erase(address(p));
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, size_t> ranges_;
};

// The memory type CUDA reports for `p`.
inline cudaMemoryType memory_type(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) return cudaMemoryTypeUnregistered;
  return attr.type;
}

}  // namespace host_tier_test

#endif  // VRAMSWAP_TESTS_HOST_TIER_HOST_TIER_TEST_UTIL_H
