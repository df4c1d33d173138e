// ThreadCache: one thread's cache of one pool's blocks, the pool's hot path. See
// thread_caches.cpp, Note [Thread caches], for the policy; this file is its data structure.
//
// A cache holds two kinds of blocks, both live in the pool's eyes (the pool counts them as
// allocated and lends them to the cache):
//   * live: blocks this thread allocated (ordinary ones, on one stream, used by no other),
//     each with its rounded size and stream, so that the thread's free of one is known at
//     once to be valid and to need no event;
//   * cached: blocks the thread freed, per (stream, rounded size), at most kPerKey each,
//     the last freed taken first, for the thread's next allocation of that size on that
//     stream.
// The owner thread calls take() and give() with the cache locked; another thread freeing
// a block lent to this cache on its stream calls give() with it locked; the pool, holding
// its own mutex, locks a cache to add a block the owner allocated on the slow path, to take
// a block back (disown: freed on another stream, or named by record_stream), to empty it,
// or to read its counters. The lock is a spin lock: the owner's lock and unlock are one
// exchange and one store on a line no other thread touches unless the pool asks or it frees
// one of the owner's blocks, so two threads allocating at once share nothing.
//
// Neither take() nor give() allocates memory once the tables have grown to the thread's
// working set: both tables are open-addressed arrays that grow by doubling (at half load)
// and never shrink until emptied.
//
// Thread safety: lock() / unlock() around every other member; the flags are atomics.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace vramswap::pool {

class ThreadCache {
 public:
  static constexpr uint32_t kPerKey = 32;  // blocks cached per (stream, size), as the pool's quick lists

  ThreadCache() { clear(); }
  ThreadCache(const ThreadCache&) = delete;
  ThreadCache& operator=(const ThreadCache&) = delete;

  void lock() {
    while (locked_.exchange(true, std::memory_order_acquire))
      while (locked_.load(std::memory_order_relaxed)) {
      }
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

  // ---- Locked ----

  // A cached block of `rounded` bytes for `stream`, now live again (0: none).
  uintptr_t take(cudaStream_t stream, uint64_t rounded) {
    List* list = find_list(stream, rounded);
    if (list == nullptr || list->count == 0) return 0;
    const uintptr_t addr = list->addrs[--list->count];
    insert_live(addr, rounded, stream);
    cached_bytes -= rounded;
    --cached_blocks;
    ++allocs;
    return addr;
  }

  // Caches `addr` freed on `stream`: true when it is a live block of this cache allocated on
  // `stream` and its list has room; false (nothing changed) otherwise.
  bool give(uintptr_t addr, cudaStream_t stream) {
    const size_t i = find_live(addr);
    if (i == kNone || live_[i].stream != stream) return false;
    const uint64_t rounded = live_[i].rounded;
    List& list = list_for(stream, rounded);
    if (list.count == kPerKey) return false;
    erase_live(i);
    list.addrs[list.count++] = addr;
    cached_bytes += rounded;
    ++cached_blocks;
    ++frees;
    return true;
  }

  // give() under the cache's lock (the owner's free, or another thread's free of a block
  // lent to this cache).
  bool give_locked(uintptr_t addr, cudaStream_t stream) {
    lock();
    const bool given = give(addr, stream);
    unlock();
    return given;
  }

  // A block the owner allocated on the pool's slow path, now this cache's (counted by the
  // pool, not here).
  void add_live(uintptr_t addr, uint64_t rounded, cudaStream_t stream) { insert_live(addr, rounded, stream); }

  // Takes back a live block (the pool frees it, or record_stream names another stream):
  // false when it is not live here (cached here: a double free).
  bool disown(uintptr_t addr) {
    const size_t i = find_live(addr);
    if (i == kNone) return false;
    erase_live(i);
    return true;
  }

  // Calls f(addr, rounded, stream) for each cached block and forgets them.
  template <class F>
  void drain_cached(F&& f) {
    for (List& list : lists_) {
      for (uint32_t k = 0; k < list.count; ++k) f(list.addrs[k], list.rounded, list.stream);
      list.count = 0;
    }
    cached_bytes = 0;
    cached_blocks = 0;
  }
  // Calls f(addr) for each cached block of (stream, rounded), the first freed first, and
  // forgets them.
  template <class F>
  void drain_cached(cudaStream_t stream, uint64_t rounded, F&& f) {
    List* list = find_list(stream, rounded);
    if (list == nullptr) return;
    for (uint32_t k = 0; k < list->count; ++k) f(list->addrs[k]);
    cached_bytes -= uint64_t(list->count) * rounded;
    cached_blocks -= list->count;
    list->count = 0;
  }
  // Calls f(addr) for each live block and forgets them (the pool takes them back).
  template <class F>
  void drain_live(F&& f) {
    for (Live& e : live_)
      if (e.addr != 0) f(e.addr);
    clear_live();
  }
  // An emptied cache for good: its tables shrink to their initial size.
  void release_memory() {
    clear();
    lists_.shrink_to_fit();
  }

  // Calls f(addr, rounded, stream, cached) for every block, live and cached.
  template <class F>
  void for_each(F&& f) const {
    for (const Live& e : live_)
      if (e.addr != 0) f(e.addr, e.rounded, e.stream, false);
    for (const List& list : lists_)
      for (uint32_t k = 0; k < list.count; ++k) f(list.addrs[k], list.rounded, list.stream, true);
  }

  // cached_blocks / cached_bytes read under the lock: another thread's free may add to them
  // at any time.
  uint64_t cached_blocks_now() {
    lock();
    const uint64_t n = cached_blocks;
    unlock();
    return n;
  }
  uint64_t cached_bytes_now() {
    lock();
    const uint64_t n = cached_bytes;
    unlock();
    return n;
  }

  // Counters of the fast path, summed by the pool when read (under the lock).
  uint64_t allocs = 0;         // allocations take() served (each a cache hit)
  uint64_t frees = 0;          // frees give() took
  uint64_t cached_bytes = 0;   // bytes of the blocks cached now
  uint64_t cached_blocks = 0;  // and how many

  // Set when the thread has exited (its cache is the pool's to empty) or the pool is gone.
  std::atomic<bool> orphaned{false};
  std::atomic<bool> dead{false};

 private:
  static constexpr size_t kNone = SIZE_MAX;
  struct Live {
    uintptr_t addr = 0;  // 0: an empty slot
    uint64_t rounded = 0;
    cudaStream_t stream = nullptr;
  };
  struct List {
    cudaStream_t stream = nullptr;
    uint64_t rounded = 0;  // 0: an empty slot of index_
    uint32_t count = 0;
    uintptr_t addrs[kPerKey];
  };

  static size_t hash(uint64_t x) {
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    return size_t(x ^ (x >> 32));
  }
  size_t live_slot(uintptr_t addr) const { return hash(addr >> 9) & (live_.size() - 1); }
  size_t find_live(uintptr_t addr) const {
    for (size_t i = live_slot(addr);; i = (i + 1) & (live_.size() - 1)) {
      if (live_[i].addr == addr) return i;
      if (live_[i].addr == 0) return kNone;
    }
  }
  void insert_live(uintptr_t addr, uint64_t rounded, cudaStream_t stream) {
    if (2 * (live_count_ + 1) > live_.size()) {
      std::vector<Live> old(live_.size() * 2);
      old.swap(live_);
      for (const Live& e : old)
        if (e.addr != 0) place_live(e);
    }
    place_live({addr, rounded, stream});
    ++live_count_;
  }
  void place_live(const Live& e) {
    size_t i = live_slot(e.addr);
    while (live_[i].addr != 0) i = (i + 1) & (live_.size() - 1);
    live_[i] = e;
  }
  // Backward-shift deletion: the entries after the hole that hash at or before it move up.
  void erase_live(size_t i) {
    const size_t mask = live_.size() - 1;
    for (size_t j = (i + 1) & mask; live_[j].addr != 0; j = (j + 1) & mask) {
      const size_t home = live_slot(live_[j].addr);
      if (((j - home) & mask) >= ((j - i) & mask)) {
        live_[i] = live_[j];
        i = j;
      }
    }
    live_[i] = Live{};
    --live_count_;
  }
  void clear_live() {
    live_.assign(16, Live{});
    live_count_ = 0;
  }

  size_t list_slot(cudaStream_t stream, uint64_t rounded) const {
    return hash(rounded * 31 + reinterpret_cast<uintptr_t>(stream)) & (index_.size() - 1);
  }
  List* find_list(cudaStream_t stream, uint64_t rounded) {
    for (size_t i = list_slot(stream, rounded);; i = (i + 1) & (index_.size() - 1)) {
      const uint32_t k = index_[i];
      if (k == 0) return nullptr;
      List& list = lists_[k - 1];
      if (list.rounded == rounded && list.stream == stream) return &list;
    }
  }
  List& list_for(cudaStream_t stream, uint64_t rounded) {
    if (List* list = find_list(stream, rounded)) return *list;
    if (2 * (lists_.size() + 1) > index_.size()) {
      index_.assign(index_.size() * 2, 0);
      for (uint32_t k = 0; k < lists_.size(); ++k) place_list(lists_[k].stream, lists_[k].rounded, k + 1);
    }
    lists_.push_back(List{stream, rounded, 0, {}});
    place_list(stream, rounded, uint32_t(lists_.size()));
    return lists_.back();
  }
  void place_list(cudaStream_t stream, uint64_t rounded, uint32_t k) {
    size_t i = list_slot(stream, rounded);
    while (index_[i] != 0) i = (i + 1) & (index_.size() - 1);
    index_[i] = k;
  }
  void clear() {
    clear_live();
    lists_.clear();
    index_.assign(16, 0);
  }

  std::atomic<bool> locked_{false};
  std::vector<Live> live_;  // open-addressed by address; size a power of two
  size_t live_count_ = 0;
  std::vector<List> lists_;      // one per (stream, size) seen; kept (emptied) until cleared
  std::vector<uint32_t> index_;  // open-addressed by (stream, size): 1 + index into lists_
};

}  // namespace vramswap::pool
