// LentTable: which thread's cache a block is lent to, found from its address with no lock.
// A flat table over the pool's reservation: one entry per 512-byte unit, in pages of one
// granule's units allocated the first time a lent block starts in that granule and kept
// until the pool goes. A free from a thread other than the block's owner looks its owner up
// here instead of under the pool's mutex (Note [Thread caches] in thread_caches.cpp).
//
// An entry is only a hint: it is written under the pool's mutex when a block is lent and
// cleared when the block leaves its cache, and a reader that finds a cache must still ask
// that cache, under its lock, whether the block is its own (ThreadCache::give). Caches are
// never destroyed while the pool lives, so a stale entry names a cache that says no.
//
// Thread safety: set(), clear() and for_each() under the pool's mutex; owner() from any
// thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace vramswap::pool {

class ThreadCache;

class LentTable {
 public:
  static constexpr uint64_t kUnit = 512;  // the pool's alignment: blocks start on units

  LentTable(uintptr_t base, uint64_t size, uint64_t granularity)
      : base_(base),
        size_(size),
        granularity_(granularity),
        per_page_(granularity / kUnit),
        pages_(new std::atomic<Entry*>[size / granularity]) {
    for (uint64_t g = 0; g < size / granularity; ++g) pages_[g].store(nullptr, std::memory_order_relaxed);
  }
  ~LentTable() {
    for (uint64_t g = 0; g < size_ / granularity_; ++g) delete[] pages_[g].load(std::memory_order_relaxed);
  }
  LentTable(const LentTable&) = delete;
  LentTable& operator=(const LentTable&) = delete;

  // The cache the block at `addr` was lent to when last set, or nullptr.
  ThreadCache* owner(uintptr_t addr) const {
    if (addr < base_ || addr - base_ >= size_ || (addr - base_) % kUnit != 0) return nullptr;
    const Entry* page = pages_[(addr - base_) / granularity_].load(std::memory_order_acquire);
    return page ? page[(addr - base_) % granularity_ / kUnit].load(std::memory_order_acquire) : nullptr;
  }
  // The block at `addr` (in the reservation, on a unit) is lent to `cache`.
  void set(uintptr_t addr, ThreadCache* cache) {
    std::atomic<Entry*>& slot = pages_[(addr - base_) / granularity_];
    Entry* page = slot.load(std::memory_order_relaxed);
    if (page == nullptr) {
      page = new Entry[per_page_];
      for (uint64_t i = 0; i < per_page_; ++i) page[i].store(nullptr, std::memory_order_relaxed);
      slot.store(page, std::memory_order_release);
    }
    page[(addr - base_) % granularity_ / kUnit].store(cache, std::memory_order_release);
  }
  // Calls f(addr) for every address whose entry names a cache.
  template <class F>
  void for_each(F&& f) const {
    for (uint64_t g = 0; g < size_ / granularity_; ++g) {
      const Entry* page = pages_[g].load(std::memory_order_acquire);
      if (page == nullptr) continue;
      for (uint64_t i = 0; i < per_page_; ++i)
        if (page[i].load(std::memory_order_acquire)) f(base_ + g * granularity_ + i * kUnit);
    }
  }
  // The block at `addr` is lent to no cache any more.
  void clear(uintptr_t addr) {
    Entry* page = pages_[(addr - base_) / granularity_].load(std::memory_order_relaxed);
    if (page) page[(addr - base_) % granularity_ / kUnit].store(nullptr, std::memory_order_release);
  }

 private:
  using Entry = std::atomic<ThreadCache*>;
  const uintptr_t base_;
  const uint64_t size_, granularity_, per_page_;
  std::unique_ptr<std::atomic<Entry*>[]> pages_;  // per granule: its units' entries, or null
};

}  // namespace vramswap::pool
