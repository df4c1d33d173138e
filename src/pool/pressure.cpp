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
