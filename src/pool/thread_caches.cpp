// The hot path's per-thread caches: the policy (Note [Thread caches]) and the pool's side of
// it (registration, lending, emptying, turning the caches off). The cache itself is
// thread_cache.h.
#include "pool/pool_impl.h"

namespace vramswap::pool {
namespace detail {

thread_local ThreadCaches* tls_caches = nullptr;
thread_local bool tls_caches_gone = false;
std::atomic<uint64_t> next_pool_id{1};

}  // namespace detail

namespace {

// Runs at the thread's exit once own_cache_or_make() touched it: marks its caches orphaned.
struct ThreadCachesReaper {
  bool armed = false;
  ~ThreadCachesReaper() {
    tls_caches_gone = true;
    if (tls_caches == nullptr) return;
    for (auto& [id, cache] : tls_caches->entries) cache->orphaned.store(true, std::memory_order_release);
    delete std::exchange(tls_caches, nullptr);
  }
};
thread_local ThreadCachesReaper tls_reaper;

}  // namespace

// Note [Thread caches]
// --------------------
// The hot path (an allocation of a size the thread freed before, on the same stream) takes
// no pool lock. Each thread has a cache per pool (thread_cache.h) to which the pool *lends*
// the ordinary blocks the thread allocates: the pool still counts them allocated (live, with
// their granules), and the cache knows each one's size and stream. The thread's free of a
// lent block on its own stream moves it to the cache's list for (stream, size), the thread's
// next allocation of that size on that stream takes it back: each with the cache's own lock,
// which no other thread takes unless the pool asks, so threads share no cache line. These
// are exactly the quick lists' rules (Note [The pool] in device_pool.h), per thread: at most
// kQuickPerSize blocks per (stream, size), the last freed first; the thread's first
// allocation that its cache cannot serve empties the cache into the free index (with the
// pool's quick lists), so that best fit sees its cached blocks. What the caches hold,
// counted in statistics, is subtracted from the pool's allocated bytes when read.
//
// A block another thread allocated, freed on the stream it was allocated on, goes to its
// owner's cache the same way: the freeing thread finds the owner in lent_ (lent_table.h, a
// flat table over the reservation, one entry per granule, read with no lock; a granule
// whose lent blocks belong to several threads sends the free the pool's way) and gives
// the block to that cache
// under that cache's lock, so frees handed from one thread to another (autograd's backward
// thread freeing what the forward's thread allocated) take no pool lock either; the owner's
// next allocation of that size on that stream takes it. Everything else goes through the
// pool under its mutex as before: a free on another stream (the pool takes the block back
// from its cache: disown), record_stream (the block goes back to the pool), offloadable
// blocks, the free of a block the cache has no room for (released, as a full quick list
// releases it). A free of a block cached by some thread is a double free and is refused,
// as ever. Caches emptied for good are kept (retired) until the pool goes, so that an entry
// of lent_ read just before it was cleared names a cache that refuses the block.
//
// Caches are an optimization for a pool with memory to spare: once the pool places for
// eviction (grouping()), remaps pages, records its history, or would reach half its limit,
// caches_off() empties every cache and the pool never lends again; its placement rules,
// pressure measures and records then see every block as they always did. A single thread
// gets the same blocks in the same places as from the pool's quick lists; with several
// threads, any thread's miss first moves every cache's blocks to the quick lists
// (caches_to_quick), takes one of its size from there (the last freed first) and only then
// merges the quick lists for best fit (flush_quick): what another thread freed is reused
// exactly as with no caches. Emptying only the missing thread's own cache cost memory on a
// GPU: autograd's device thread frees the forward's activations into the forward thread's
// cache, and its own allocations, placed by best fit beside them, mapped new pages (H200,
// torch 2.11, no limit: the GPU suite's step peaked at 36.08 GiB reserved with the caches,
// 34.08 without, torch's allocator 34.09). Merging every cache into the free index on a
// miss was half the cure: best fit over the merged blocks is not the quick lists' exact
// reuse (bench/autograd_threads.py, the backward on a thread of its own: reserved with the
// caches 1.185x the peak without them, 1.092x after merging, 1.000x now;
// tests/pool/thread_cache_test.cpp has both patterns). The peak of allocated bytes may count
// other threads' cached blocks as allocated (it never misses a peak).
ThreadCache* DevicePool::Impl::own_cache_or_make() {
  if (ThreadCache* c = own_cache()) return c;
  if (tls_caches_gone) return nullptr;  // the thread is exiting
  tls_reaper.armed = true;              // constructs it: its destructor runs at the thread's exit
  if (tls_caches == nullptr) tls_caches = new ThreadCaches;
  auto cache = std::make_shared<ThreadCache>();
  auto& entries = tls_caches->entries;
  std::erase_if(entries, [](const auto& e) { return e.second->dead.load(std::memory_order_acquire); });
  entries.emplace_back(id_, cache);
  caches_.push_back(cache);
  return cache.get();
}

uint64_t DevicePool::Impl::cached_in_threads() const {
  uint64_t bytes = 0;
  for (const auto& c : caches_) {
    c->lock();
    bytes += c->cached_bytes;
    c->unlock();
  }
  return bytes;
}

void DevicePool::Impl::uncache(uintptr_t addr, uint64_t rounded, cudaStream_t stream, bool to_quick) {
  BlockIt b = blocks_.find(addr);
  allocated_ -= rounded;
  count_on_granules(addr, rounded, 0, -1);
  unlend(b);
  if (!to_quick || !push_quick(b, stream)) release_block(b, stream);
}

void DevicePool::Impl::take_cached(ThreadCache& c, bool to_quick) {
  c.drain_cached([&](uintptr_t addr, uint64_t rounded, cudaStream_t stream) { uncache(addr, rounded, stream, to_quick); });
}

void DevicePool::Impl::key_to_quick(cudaStream_t stream, uint64_t rounded) {
  for (auto& c : caches_) {
    if (c->cached_blocks_now() == 0) continue;
    c->lock();
    c->drain_cached(stream, rounded, [&](uintptr_t addr) { uncache(addr, rounded, stream, true); });
    c->unlock();
  }
}

void DevicePool::Impl::empty_thread_cache(ThreadCache& c) {
  c.lock();
  take_cached(c, false);
  c.drain_live([&](uintptr_t addr) { unlend(blocks_.find(addr)); });
  num_allocs_ += c.allocs;
  num_cache_hits_ += std::exchange(c.allocs, 0);
  num_frees_ += std::exchange(c.frees, 0);
  c.unlock();
}

void DevicePool::Impl::caches_to_quick() {
  for (auto& c : caches_) {
    if (c->cached_blocks_now() == 0) continue;
    c->lock();
    take_cached(*c, true);
    c->unlock();
  }
}

void DevicePool::Impl::lend(void* p, uint64_t rounded, cudaStream_t stream) {
  ThreadCache* c = own_cache_or_make();
  if (c == nullptr) return;  // the thread is exiting: the block stays the pool's
  c->lock();
  c->add_live(reinterpret_cast<uintptr_t>(p), rounded, stream);
  c->unlock();
  blocks_.find(reinterpret_cast<uintptr_t>(p))->second.owner = c;
  lent_->set(reinterpret_cast<uintptr_t>(p), c);
}

void DevicePool::Impl::caches_off() {
  caches_on_.store(false, std::memory_order_release);
  for (auto& c : caches_) {
    empty_thread_cache(*c);
    c->dead.store(true, std::memory_order_release);  // its thread drops it at its next registration
    retire(std::move(c));
  }
  caches_.clear();
}

void DevicePool::Impl::retire(std::shared_ptr<ThreadCache> c) {
  c->lock();
  c->release_memory();
  c->unlock();
  retired_.push_back(std::move(c));
}

void DevicePool::Impl::reap_orphans() {
  for (size_t i = 0; i < caches_.size();) {
    if (!caches_[i]->orphaned.load(std::memory_order_acquire)) {
      ++i;
      continue;
    }
    empty_thread_cache(*caches_[i]);
    retire(std::move(caches_[i]));
    caches_[i] = std::move(caches_.back());
    caches_.pop_back();
  }
}

}  // namespace vramswap::pool
