// Stream-ordered reuse over time: freed blocks waiting for other streams' events
// (pending), promotions of a block freed for its stream to any stream once an event
// completes, retiring blocks cached for a stream by synchronizing that stream (or the
// device, where no capture forbids it), and a stream about to be destroyed.
#include "pool/pool_impl.h"

namespace vramswap::pool {

DevicePool::Impl::BlockIt DevicePool::Impl::promoted_block(const Promotion& p) {
  auto b = blocks_.upper_bound(p.addr);
  if (b == blocks_.begin()) return blocks_.end();
  --b;  // the block that holds the freed address now
  const bool still = b->second.state == State::kFree && b->second.tag == p.tag && b->second.serial == p.serial &&
                     p.addr < b->first + b->second.size;
  return still ? b : blocks_.end();
}

void DevicePool::Impl::drop_stale_promotions() {
  for (size_t i = 0; i < promotions_.size();) {
    if (promoted_block(promotions_[i]) != blocks_.end()) {
      ++i;
      continue;
    }
    events_.release(std::move(promotions_[i].event));
    promotions_[i] = std::move(promotions_.back());
    promotions_.pop_back();
  }
}

void DevicePool::Impl::poll_pending(bool promote) {
  for (size_t i = 0; promote && i < promotions_.size();) {
    Promotion& p = promotions_[i];
    if (!p.event.query()) {
      ++i;
      continue;
    }
    if (BlockIt b = promoted_block(p); b != blocks_.end()) {
      index_erase(b);
      release_block(b, kAnyStream);
    }
    events_.release(std::move(p.event));
    promotions_[i] = std::move(promotions_.back());
    promotions_.pop_back();
  }
  for (size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    bool done = std::all_of(p.events.begin(), p.events.end(), [](const cuda::Event& e) { return e.query(); });
    if (!done) {
      ++i;
      continue;
    }
    for (auto& e : p.events) events_.release(std::move(e));
    for (uintptr_t addr : p.addrs) {
      const BlockIt b = blocks_.find(addr);
      history_.add(TraceEvent::Action::kFreeCompleted, addr, traced_size(b->second), stream_id(p.tag_after));
      b->second.requested = 0;
      release_block(b, p.tag_after);
    }
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
}

bool DevicePool::Impl::device_synchronization_allowed(cudaStream_t caller) const {
  if (captures_ && captures_->load(std::memory_order_acquire) > 0) return false;
  return caller == kAnyStream || cuda::outside_capture(caller);
}

bool DevicePool::Impl::synchronize_and_retire(std::unique_lock<std::mutex>& lock, cudaStream_t only,
                                              cudaStream_t caller) {
  flush_quick();
  std::vector<std::pair<uintptr_t, cudaStream_t>> retiring;  // (block, tag before)
  std::vector<cudaStream_t> tags;
  for (auto it = free_.begin(); it != free_.end();) {
    const cudaStream_t tag = it->first;
    if (tag == kAnyStream || (only != kAnyStream && tag != only)) {
      ++it;
      continue;
    }
    tags.push_back(tag);
    for (auto& [size, addr] : it->second) {
      blocks_.at(addr).state = State::kRetiring;
      retiring.emplace_back(addr, tag);
    }
    it = free_.erase(it);
  }
  const bool each = only == kAnyStream && streams_reported_;
  if (each) syncing_.insert(syncing_.end(), tags.begin(), tags.end());
  lock.unlock();
  std::vector<cudaStream_t> done;  // the tags whose queued work has completed
  bool synchronized = false;
  if (only != kAnyStream) {
    synchronized = cuda::synchronize_stream(only);  // false while it captures
    if (synchronized) done.push_back(only);
  } else if (streams_reported_) {
    for (cudaStream_t t : tags)
      if (cuda::synchronize_stream(t)) done.push_back(t);
    synchronized = !done.empty();
  } else if (device_synchronization_allowed(caller) && cuda::synchronize_device(device_)) {
    synchronized = true;
    done = tags;
  }
  lock.lock();
  if (each) {
    for (cudaStream_t t : tags) syncing_.erase(std::find(syncing_.begin(), syncing_.end(), t));
    synced_.notify_all();
  }
  for (auto& [addr, tag] : retiring)
    release_block(blocks_.find(addr), std::find(done.begin(), done.end(), tag) != done.end() ? kAnyStream : tag);
  if (!synchronized) return false;
  poll_pending();  // events recorded before the synchronization may have completed
  return true;
}

void DevicePool::Impl::drain_pending(std::unique_lock<std::mutex>& lock) {
  std::vector<cudaEvent_t> waits;
  uint64_t oldest = UINT64_MAX;
  for (auto& p : pending_) oldest = std::min(oldest, p.serial);
  for (auto& p : promotions_) oldest = std::min(oldest, p.serial);
  for (auto& p : pending_)
    if (p.serial == oldest)
      for (auto& e : p.events) waits.push_back(e.get());
  for (auto& p : promotions_)
    if (p.serial == oldest) waits.push_back(p.event.get());
  lock.unlock();
  cuda::synchronize_events(waits);  // an event recycled meanwhile only makes this wait longer
  lock.lock();
  poll_pending();
}

Result DevicePool::Impl::stream_destroyed(cudaStream_t stream) {
  if (stream == kAnyStream || stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
    return {};  // the default streams are never destroyed
  std::unique_lock lock(mu_);
  // Another thread may be synchronizing it (its cached blocks being retired): the stream must
  // outlive that call.
  synced_.wait(lock, [&] { return std::find(syncing_.begin(), syncing_.end(), stream) == syncing_.end(); });
  open_.erase(stream);
  for (auto& c : caches_) empty_thread_cache(*c);  // every block the pool's to retag
  flush_quick();
  auto names = [&](const Block& b) {
    return b.state == State::kLive &&
           (b.tag == stream || std::find(b.also_on.begin(), b.also_on.end(), stream) != b.also_on.end());
  };
  bool known = free_.count(stream) > 0;
  for (const Pending& p : pending_) known = known || p.tag_after == stream;
  for (const Promotion& p : promotions_) known = known || p.tag == stream;
  for (auto it = blocks_.begin(); !known && it != blocks_.end(); ++it) known = names(it->second);
  if (!known) return {};
  // Its queued work done, nothing needs to wait on it: the blocks it freed go to any stream
  // (synchronize_and_retire), and the events already recorded on it have completed.
  if (!synchronize_and_retire(lock, stream))
    return {false, "the stream about to be destroyed could not be synchronized on device " + std::to_string(device_) +
                       "; the blocks it used keep waiting on it"};
  for (auto& [addr, b] : blocks_) {
    if (b.state != State::kLive) continue;
    if (b.tag == stream) b.tag = kAnyStream;
    std::erase(b.also_on, stream);
  }
  // Blocks still waiting for other streams' events would become free for it: for any.
  for (Pending& p : pending_)
    if (p.tag_after == stream) p.tag_after = kAnyStream;
  return {};
}

}  // namespace vramswap::pool
