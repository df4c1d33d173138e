// LentTable: which thread's cache the blocks starting in a granule are lent to, found from
// a block's address with no lock. A flat table over the pool's reservation, one entry per
// granule: the cache every lent block starting there belongs to, kMixed when they belong to
// several caches, nullptr when none is lent. A free from a thread other than the block's
// owner looks its owner up here instead of under the pool's mutex (Note [Thread caches] in
// thread_caches.cpp); a granule of several owners sends it the pool's way. A training
// step's thread allocates most blocks, so its granules have one owner.
//
// An entry is only a hint: it is written under the pool's mutex when a block is lent or
// leaves its cache, and a reader that finds a cache must still ask that cache, under its
// lock, whether the block is its own (ThreadCache::give). Caches are never destroyed while
// the pool lives, so a stale entry names a cache that says no.
//
// Costs 12 bytes of host memory a granule of the reservation (an 80 GiB card: 960 KiB).
//
// Thread safety: set() and clear() under the pool's mutex; owner() from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace vramswap::pool {

class ThreadCache;

class LentTable {
 public:
  LentTable(uintptr_t base, uint64_t size, uint64_t granularity)
      : base_(base),
        granules_(size / granularity),
        granularity_(granularity),
        owner_(new std::atomic<ThreadCache*>[granules_]),
        count_(new uint32_t[granules_]()) {
    for (uint64_t g = 0; g < granules_; ++g) owner_[g].store(nullptr, std::memory_order_relaxed);
  }
  LentTable(const LentTable&) = delete;
  LentTable& operator=(const LentTable&) = delete;

  // The cache the block at `addr` may be lent to: the one its granule's lent blocks all
  // belong to; nullptr when none or several (or `addr` is outside the reservation).
  ThreadCache* owner(uintptr_t addr) const {
    if (addr < base_ || addr - base_ >= granules_ * granularity_) return nullptr;
    ThreadCache* c = owner_[(addr - base_) / granularity_].load(std::memory_order_acquire);
    return c == mixed() ? nullptr : c;
  }
  // The block at `addr` (in the reservation) is lent to `cache`.
  void set(uintptr_t addr, ThreadCache* cache) {
    const uint64_t g = (addr - base_) / granularity_;
    ThreadCache* now = owner_[g].load(std::memory_order_relaxed);
    owner_[g].store(count_[g] == 0 || now == cache ? cache : mixed(), std::memory_order_release);
    ++count_[g];
  }
  // The block at `addr`, set() before, is lent to no cache any more.
  void clear(uintptr_t addr) {
    const uint64_t g = (addr - base_) / granularity_;
    if (--count_[g] == 0) owner_[g].store(nullptr, std::memory_order_release);
  }
  // For check_invariants: the lent blocks starting in granule `g`, and its entry (kMixed:
  // `mixed` is set).
  uint32_t count(uint64_t g) const { return count_[g]; }
  ThreadCache* entry(uint64_t g, bool* is_mixed) const {
    ThreadCache* c = owner_[g].load(std::memory_order_relaxed);
    *is_mixed = c == mixed();
    return *is_mixed ? nullptr : c;
  }

 private:
  // Not a cache: a granule whose lent blocks belong to several.
  static ThreadCache* mixed() { return reinterpret_cast<ThreadCache*>(uintptr_t{1}); }

  const uintptr_t base_;
  const uint64_t granules_, granularity_;
  std::unique_ptr<std::atomic<ThreadCache*>[]> owner_;
  std::unique_ptr<uint32_t[]> count_;  // lent blocks starting in each granule
};

}  // namespace vramswap::pool
