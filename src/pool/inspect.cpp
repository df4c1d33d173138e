// Reading the pool: statistics (with what the threads' caches hold), the census of small
// live blocks for out-of-memory reports, the memory view for snapshots, peaks, and
// check_invariants, which walks every block against the invariants of pool_impl.h.
#include "pool/pool_impl.h"

namespace vramswap::pool {

PoolStats DevicePool::Impl::stats() const {
  std::lock_guard lock(mu_);
  PoolStats s;
  // What the threads' caches did and hold (Note [Thread caches]): their allocations are all
  // cache hits, and what they hold is lent, counted in allocated_ but free to the program.
  uint64_t cached = 0;
  for (const auto& c : caches_) {
    c->lock();
    cached += c->cached_bytes;
    s.num_allocs += c->allocs;
    s.num_cache_hits += c->allocs;
    s.num_frees += c->frees;
    s.num_free_blocks += c->cached_blocks;
    c->unlock();
  }
  s.allocated_bytes = allocated_ - cached;
  s.reserved_bytes = reserved_;
  s.mapped_bytes = mapped_;
  s.peak_mapped_bytes = peak_mapped_;
  s.spare_bytes = spare_bytes_;
  s.peak_allocated_bytes = peak_allocated_;
  s.peak_reserved_bytes = peak_reserved_;
  s.limit_bytes = limit_;
  s.num_allocs += num_allocs_;
  s.num_frees += num_frees_;
  s.num_cache_hits += num_cache_hits_;
  s.num_ooms = num_ooms_;
  for (auto& [key, set] : free_) s.num_free_blocks += set.size();
  s.num_free_blocks += quick_blocks_;
  s.va_reserved_bytes = va_.size();
  return s;
}

DevicePool::Census DevicePool::Impl::live_below(uint64_t bytes) const {
  std::lock_guard lock(mu_);
  Census c;
  for (const auto& [addr, b] : blocks_) {
    if (b.state != State::kLive) continue;
    if (b.offloadable) c.offloadable_bytes += b.size;
    if (b.size < bytes) {
      ++c.blocks;
      c.bytes += b.size;
    }
  }
  return c;
}

DevicePool::MemoryView DevicePool::Impl::memory_view() const {
  std::lock_guard lock(mu_);
  MemoryView v;
  for (uint64_t g = 0; g < mapped_top_; ++g) {
    if (!mapped(g)) continue;
    const uintptr_t addr = va_.base() + g * granularity_;
    if (!v.mapped.empty() && v.mapped.back().first + v.mapped.back().second == addr) v.mapped.back().second += granularity_;
    else v.mapped.emplace_back(addr, granularity_);
  }
  std::unordered_set<uintptr_t> cached;  // freed into a thread's cache: free to the program
  for (const auto& c : caches_) {
    c->lock();
    c->for_each([&](uintptr_t addr, uint64_t, cudaStream_t, bool is_cached) {
      if (is_cached) cached.insert(addr);
    });
    c->unlock();
  }
  v.blocks.reserve(blocks_.size());
  for (const auto& [addr, b] : blocks_) {
    BlockView w;
    w.addr = addr;
    w.size = b.size;
    w.state = b.state == State::kLive && !cached.count(addr)            ? BlockView::State::kLive
              : b.state == State::kLive                                   ? BlockView::State::kFree
              : b.state == State::kPending || b.state == State::kRetiring ? BlockView::State::kPendingFree
                                                                           : BlockView::State::kFree;
    w.offloadable = b.state == State::kLive && b.offloadable;
    w.away = b.state == State::kLive && b.away;
    w.stream = stream_id(b.tag);
    w.requested = b.state == State::kLive ? traced_size(b) : b.size;
    v.blocks.push_back(w);
  }
  v.trace = history_.events();
  return v;
}

std::string DevicePool::Impl::check_invariants() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> broken;
  auto expect = [&](bool holds, const std::string& what) {
    if (!holds && broken.size() < 16) broken.push_back(what);
  };
  uintptr_t at = va_.base();
  uint64_t live = 0, quick = 0, free_blocks = 0, away = 0;
  std::vector<uintptr_t> needs_pages(granules_.size(), 0);  // a block that needs them
  std::vector<uint32_t> live_on[2];
  for (auto& counts : live_on) counts.assign(granules_.size(), 0);
  const Block* prev = nullptr;
  for (const auto& [addr, b] : blocks_) {
    expect(addr == at, "block " + format_pointer(reinterpret_cast<void*>(addr)) + " does not follow its neighbour");
    expect(b.size > 0 && addr % kAlignment == 0 && b.size % kAlignment == 0,
           "block " + format_pointer(reinterpret_cast<void*>(addr)) + " is not 512-byte aligned and sized");
    at = addr + b.size;
    if (b.state == State::kLive) {
      live += b.size;
      for (uint64_t g = granule_index(addr), last = granule_index(addr + b.size - 1); g <= last; ++g)
        ++live_on[b.offloadable][g];
    }
    if (b.state == State::kQuick) ++quick;
    if (b.away) ++away;
    if (b.state == State::kFree) {
      ++free_blocks;
      auto index = free_.find(b.tag);
      expect(index != free_.end() && index->second.count({b.size, addr}) == 1,
             "free block " + format_pointer(reinterpret_cast<void*>(addr)) + " is missing from the free index");
      expect(!(prev && prev->state == State::kFree && prev->tag == b.tag),
             "free blocks with the same tag next to each other at " + format_pointer(reinterpret_cast<void*>(addr)));
    }
    expect(!b.away || (b.offloadable && (b.state == State::kLive || b.state == State::kPending)),
           "block " + format_pointer(reinterpret_cast<void*>(addr)) + " is away but not a live offloadable one");
    // An evicted block may be freed, then pending; a free one may be retiring.
    if (b.state != State::kFree && b.state != State::kRetiring && !b.away)
      for (uint64_t g = granule_index(addr), last = granule_index(addr + b.size - 1); g <= last; ++g)
        needs_pages[g] = addr;
    prev = &b;
  }
  expect(at == va_.base() + va_.size(), "the blocks do not cover the reservation");
  expect(live == allocated_, "allocated_bytes " + std::to_string(allocated_) + " but live blocks hold " +
                                 std::to_string(live));
  expect(away == away_blocks_, "the pool counts " + std::to_string(away_blocks_) + " blocks away, " +
                                  std::to_string(away) + " are");
  expect(quick == quick_blocks_, "quick lists count " + std::to_string(quick_blocks_) + " blocks, " +
                                     std::to_string(quick) + " are quick-listed");
  // Note [Thread caches]: each cache's blocks are live ordinary blocks lent to it, of the
  // sizes it knows; and every block lent to a cache is one of its blocks.
  // lent_ counts the lent blocks starting in each granule and names their cache when they
  // have one.
  uint64_t lent = 0, in_caches = 0;
  std::vector<uint32_t> lent_in(granules_.size(), 0);
  for (const auto& [addr, b] : blocks_) {
    if (b.owner == nullptr) continue;
    ++lent;
    const uint64_t g = granule_index(addr);
    ++lent_in[g];
    bool is_mixed = false;
    const ThreadCache* named = lent_->entry(g, &is_mixed);
    expect(is_mixed || named == b.owner, "block " + format_pointer(reinterpret_cast<void*>(addr)) +
                                             " is lent to a cache its granule's entry does not name");
  }
  for (uint64_t g = 0; g < granules_.size(); ++g) {
    bool is_mixed = false;
    const ThreadCache* named = lent_->entry(g, &is_mixed);
    expect(lent_->count(g) == lent_in[g] && (lent_in[g] > 0 || (!named && !is_mixed)),
           "granule " + std::to_string(g) + ": lent_ counts " + std::to_string(lent_->count(g)) +
               " lent blocks, " + std::to_string(lent_in[g]) + " start there");
  }
  expect(caches_on_.load() || caches_.empty(), "thread caches are off but " + std::to_string(caches_.size()) +
                                                   " are registered");
  for (const auto& c : caches_) {
    c->lock();
    c->for_each([&](uintptr_t addr, uint64_t rounded, cudaStream_t, bool) {
      ++in_caches;
      auto b = blocks_.find(addr);
      expect(b != blocks_.end() && b->second.state == State::kLive && b->second.owner == c.get() &&
                 b->second.size == rounded && !b->second.offloadable,
             "thread cache block " + format_pointer(reinterpret_cast<void*>(addr)) +
                 " is not a live ordinary block of its size lent to that cache");
    });
    c->unlock();
  }
  expect(lent == in_caches, std::to_string(lent) + " blocks are lent to thread caches, which hold " +
                                std::to_string(in_caches));
  uint64_t indexed = 0;
  for (const auto& [key, set] : free_) indexed += set.size();
  expect(indexed == free_blocks, "the free index holds " + std::to_string(indexed) + " entries for " +
                                     std::to_string(free_blocks) + " free blocks");
  uint64_t mapped_bytes = 0;
  for (uint64_t g = 0; g < granules_.size(); ++g) {
    if (mapped(g)) {
      mapped_bytes += granularity_;
      const uint64_t head = granules_[g].head;
      const Granule& h = granules_[head];
      expect(head <= g && granules_[head].head == head && head + h.count > g && h.mapping &&
                 h.pages.size() == h.count * granularity_ && (g < mapped_top_),
             "granule " + std::to_string(g) + " lies in no well-formed run (head " + std::to_string(head) + ", " +
                 std::to_string(h.count) + " granules)");
    } else {
      expect(!granules_[g].mapping && granules_[g].count == 0,
             "granule " + std::to_string(g) + " is unmapped but holds a mapping");
    }
    expect(live_on[0][g] == live_on_[0][g] && live_on[1][g] == live_on_[1][g],
           "granule " + std::to_string(g) + " counts " + std::to_string(live_on_[0][g]) + " ordinary and " +
               std::to_string(live_on_[1][g]) + " offloadable live blocks, but " + std::to_string(live_on[0][g]) +
               " and " + std::to_string(live_on[1][g]) + " touch it");
    if (needs_pages[g] && !mapped(g)) {
      const Block& b = blocks_.at(needs_pages[g]);
      const char* state = b.state == State::kLive ? "live" : b.state == State::kPending ? "pending" : "quick-listed";
      expect(false, "granule " + std::to_string(g) + " under a block in use is not mapped (block " +
                        format_pointer(reinterpret_cast<void*>(needs_pages[g])) + ", " + format_size(b.size) + ", " +
                        state + (b.offloadable ? ", offloadable" : "") + ")");
    }
  }
  expect(mapped_bytes == mapped_, "mapped_bytes " + std::to_string(mapped_) + " but " + std::to_string(mapped_bytes) +
                                " bytes of granules are mapped");
  uint64_t spare = 0;
  for (const cuda::PhysicalPages& pages : spare_) spare += pages.size();
  expect(spare == spare_bytes_, "spare pages hold " + std::to_string(spare) + " bytes, the pool counts " +
                                    std::to_string(spare_bytes_));
  expect(reserved_ == mapped_ + spare_bytes_,
         "reserved_bytes " + std::to_string(reserved_) + " is not mapped plus spare");
  expect(reserved_ <= limit_, "reserved_bytes " + std::to_string(reserved_) + " passed the limit");
  std::string text;
  for (const std::string& b : broken) text += (text.empty() ? "" : "; ") + b;
  return text;
}

void DevicePool::Impl::reset_peaks() {
  std::lock_guard lock(mu_);
  peak_allocated_ = allocated_ - cached_in_threads();
  peak_reserved_ = reserved_;
  peak_mapped_ = mapped_;
}

}  // namespace vramswap::pool
