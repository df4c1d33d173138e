// When memory is short: the relief steps an allocation (or map_block) takes in order before
// it reports out of memory (unused granules and quick lists, the reclaimer without waiting,
// pending frees, the allocating stream, the device, the reclaimer waiting), empty_cache,
// and the out-of-memory report.
#include "pool/pool_impl.h"

namespace vramswap::pool {

bool DevicePool::Impl::call_reclaimer(uint64_t bytes, ReclaimMode mode, cudaStream_t stream,
                                      std::unique_lock<std::mutex>& lock) {
  if (!reclaimer_) return false;
  Reclaimer reclaim = reclaimer_;
  ++reclaimer_calls_;
  lock.unlock();
  uint64_t freed = 0;
  try {
    freed = reclaim(bytes, mode, stream);
  } catch (...) {
    lock.lock();
    if (--reclaimer_calls_ == 0) reclaimer_idle_.notify_all();
    throw;
  }
  lock.lock();
  if (--reclaimer_calls_ == 0) reclaimer_idle_.notify_all();
  if (freed == 0) return false;
  poll_if_waiting();
  flush_quick();
  return true;
}

bool DevicePool::Impl::relieve(Relief relief, uint64_t bytes, cudaStream_t stream,
                               std::unique_lock<std::mutex>& lock) {
  caches_off();  // under pressure every block is the pool's (Note [Thread caches])
  switch (relief) {
    case Relief::kUnusedGranules:
      poll_if_waiting();
      flush_quick();
      break;
    case Relief::kReclaimNoWait:
      if (!call_reclaimer(bytes, ReclaimMode::kNoWait, stream, lock)) return false;
      break;
    case Relief::kDrainPending:
      if (pending_.empty() && promotions_.empty()) return false;
      drain_pending(lock);
      break;
    case Relief::kSynchronizeStream:
      // The allocating stream is alive (the caller is queueing work on it), so it can be
      // synchronized; other streams cannot (see Note [The pool]).
      flush_quick();
      if (stream == kAnyStream || !free_.count(stream) || !synchronize_and_retire(lock, stream)) return false;
      break;
    case Relief::kSynchronize: {
      flush_quick();
      bool tagged = false;
      for (auto& [tag, set] : free_) tagged |= tag != kAnyStream;
      if (!tagged || !synchronize_and_retire(lock, kAnyStream, stream)) return false;
      break;
    }
    case Relief::kReclaim:
      if (!call_reclaimer(bytes, ReclaimMode::kFull, stream, lock)) return false;
      break;
  }
  return true;
}

void DevicePool::Impl::empty_cache() {
  std::unique_lock lock(mu_);
  poll_pending();
  flush_quick();
  synchronize_and_retire(lock, kAnyStream);
  unmap_unused(UINT64_MAX);
  release_spare();
}

// Note [Why nothing fits]
// -----------------------
// An out-of-memory with megabytes "reserved but free" reads as a bug unless the report says
// why that memory could not serve. The pool knows two reasons and names the one that holds:
//   * by bytes: the blocks in use and the request together pass the limit. No placement can
//     serve it; only blocks given up to offload could (the engine's figures follow: what is
//     evictable, in flight, in use).
//   * by granules: the bytes fit, but pages are mapped in whole granules. The place needing
//     the fewest granules not mapped (find_mapped_fit, any hole) needs more than the limit
//     leaves (spare pages, headroom, granules no block needs); the reserved-but-free memory lies
//     in pieces on granules that blocks in use share, each smaller than the request
//     (GranuleFit.AnOutOfMemoryReportSaysWhyTheFreeMemoryCannotServe).
std::string DevicePool::Impl::why_nothing_fits(uint64_t size, cudaStream_t stream, bool offloadable, uintptr_t at) {
  uint64_t away = 0;
  if (away_blocks_ > 0)
    for (const auto& [addr, b] : blocks_)
      if (b.state == State::kLive && b.away) away += b.size;
  const uint64_t in_use = allocated_ - std::min(away, allocated_);
  if (in_use + size > limit_)
    return " Why nothing fits: the blocks in use hold " + format_size(in_use) + ", with this request " +
           format_size(in_use + size) + ", more than the limit: no placement can serve it, only blocks given up to "
           "offload could.";
  // Pages the limit still allows: spare ones, headroom, and mapped granules no block needs.
  uint64_t pages = spare_bytes_ + (limit_ > reserved_ ? limit_ - reserved_ : 0);
  for (uint64_t g = 0; g < mapped_top_; ++g)
    if (mapped(g) && granule_idle(g)) pages += granularity_;
  // The free blocks' pieces on mapped granules that blocks in use share (a granule wholly in a
  // free block is idle): the granules holding them, and the largest piece (one may span two).
  std::vector<bool> shared(mapped_top_, false);
  uint64_t largest = 0;
  for (const auto& [addr, b] : blocks_) {
    if (b.state != State::kFree || mapped_top_ == 0 || granule_index(addr) >= mapped_top_) continue;
    const uint64_t last = std::min(granule_index(addr + b.size - 1), mapped_top_ - 1);
    uint64_t piece = 0;
    for (uint64_t g = granule_index(addr); g <= last; ++g) {
      if (!mapped(g) || granule_idle(g)) {
        piece = 0;
        continue;
      }
      const uintptr_t lo = std::max<uintptr_t>(addr, va_.base() + g * granularity_);
      const uintptr_t hi = std::min<uintptr_t>(addr + b.size, va_.base() + (g + 1) * granularity_);
      piece += hi - lo;
      largest = std::max(largest, piece);
      shared[g] = true;
    }
  }
  const uint64_t granules = uint64_t(std::count(shared.begin(), shared.end(), true));
  const bool fixed = at != 0;  // an away block coming back: its own place, no other
  uint64_t missing = 0;
  if (fixed) missing = unmapped_in(at, size);
  else if (find_mapped_fit(size, stream, offloadable, false, &at, false, &missing) == blocks_.end())
    return "";
  if (missing * granularity_ <= pages) return "";  // pages enough: refused for another reason (the report's)
  return " Why nothing fits: by bytes it would (" + format_size(in_use) + " in use, " + format_size(in_use + size) +
         " with it), but pages are mapped in whole granules of " + format_size(granularity_) + ": " +
         (fixed ? "its place needs " : "the place for it needing the fewest new ones needs ") +
         std::to_string(missing) + " (" + format_size(missing * granularity_) + ") and the limit leaves " +
         format_size(pages) +
         " for them (headroom, spare pages, granules no block needs); what is reserved but free lies in pieces "
         "beside blocks in use on " + std::to_string(granules) + (granules == 1 ? " granule" : " granules") +
         ", the largest " + format_size(largest) + ".";
}

std::string DevicePool::Impl::oom_report(size_t requested, uint64_t rounded, const std::string& why) const {
  // Blocks given up (unmap_block) are allocated and hold no page (but for granules they
  // share with blocks in use): what is reserved and free is counted from the others.
  uint64_t away = 0;
  if (away_blocks_ > 0)
    for (const auto& [addr, b] : blocks_)
      if (b.state == State::kLive && b.away) away += b.size;
  const uint64_t in_use = allocated_ - std::min(away, allocated_);
  const uint64_t cached_free = reserved_ > in_use ? reserved_ - in_use : 0;  // mapped bytes in no block in use
  size_t device_free = 0, device_total = 0;
  cuda::device_memory(device_, &device_free, &device_total);
  return "out of memory on device " + std::to_string(device_) + ": cannot allocate " + format_size(requested) + " (" +
         std::to_string(requested) + " bytes, " + std::to_string(rounded) + " rounded) within " + why +
         ". Limit " + format_size(limit_) + " of a " + format_size(card_bytes_) + " card; pool: " +
         format_size(allocated_) + " allocated" +
         (away > 0 ? " (" + format_size(away) + " of it in blocks given up to offload, their pages unmapped)" : "") +
         ", " + format_size(reserved_) + " reserved (mapped), " +
         format_size(cached_free) + " reserved but free; the device reports " + format_size(device_free) +
         " free. Free tensors or lower the batch size, or raise VRAMSWAP_LIMIT.";
}

}  // namespace vramswap::pool
