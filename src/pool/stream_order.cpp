// Stream-ordered reuse over time: freed blocks waiting for other streams' events
// (pending), promotions of a block freed for its stream to any stream once an event
// completes, retiring blocks cached for a stream by synchronizing that stream (or the
// device, where no capture forbids it), and a stream about to be destroyed, which nothing
// in the pool names once stream_destroyed() has returned (Note [A destroyed stream is
// forgotten]).
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
  // Until the lock is taken again, the streams this call names to CUDA, and those whose
  // blocks it holds out of the free index, are in syncing_: stream_destroyed() waits for
  // them to leave (Note [A destroyed stream is forgotten]).
  std::vector<cudaStream_t> held = tags;
  if (only != kAnyStream && std::find(held.begin(), held.end(), only) == held.end()) held.push_back(only);
  syncing_.insert(syncing_.end(), held.begin(), held.end());
  if (!retiring.empty()) ++holding_syncs_;
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
  for (auto& [addr, tag] : retiring)
    release_block(blocks_.find(addr), std::find(done.begin(), done.end(), tag) != done.end() ? kAnyStream : tag);
  for (cudaStream_t t : held) syncing_.erase(std::find(syncing_.begin(), syncing_.end(), t));
  if (!retiring.empty()) {
    --holding_syncs_;
    ++held_syncs_ended_;
  }
  if (!held.empty()) synced_.notify_all();
  if (!synchronized) return false;
  poll_pending();  // events recorded before the synchronization may have completed
  return true;
}

// Note [Blocks another synchronization holds]
// --------------------------------------------
// synchronize_and_retire takes the free blocks of the streams it waits for out of the free
// index and releases the lock while it waits: another thread's allocation then finds neither
// those blocks nor any stream to synchronize for them, and had nothing left but an
// out-of-memory with the memory "reserved but free". Before an out-of-memory, an allocation
// (or map_block) waits for the synchronizations under way that hold blocks, then tries its
// steps again; a few rounds at most, each after at least one of them ended.
bool DevicePool::Impl::await_held_blocks(std::unique_lock<std::mutex>& lock, int round) {
  constexpr int kRounds = 8;
  if (holding_syncs_ == 0 || round >= kRounds) return false;
  const uint64_t ended = held_syncs_ended_;
  synced_.wait(lock, [&] { return held_syncs_ended_ > ended; });
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

// Note [A destroyed stream is forgotten]
// ---------------------------------------
// Once stream_destroyed(S) has returned, nothing in the pool names S: no free block is
// tagged for it (free_, the quick lists, the threads' caches), no live or pending block has
// it as its allocation stream or in also_on, no pending free becomes free for it, no
// promotion waits on it, open_ keeps no granule for it. Whatever names a stream is handed to
// CUDA sooner or later (under the preload, empty_cache and the pressure steps synchronize
// every stream cached blocks are tagged for; a free records an event on every stream that
// used the block), where a destroyed handle is undefined behaviour, and on a GPU a stream
// created later may take S's address and inherit S's blocks with no ordering at all.
//
// Forgetting S is safe once S is synchronized: its queued work, which is what every such
// block waited for, is done, and the program queues no more on it. So stream_destroyed()
// synchronizes S (synchronize_and_retire), waits until no other thread's
// synchronize_and_retire names S or holds S's blocks out of the index (syncing_), and
// only then, with the lock held throughout, retags everything that still names S
// (forget_stream): free blocks for S become free for any stream, pending frees for S become
// free for any stream once their other events complete, live blocks stop waiting on S.
// Retagging must come after the last poll, and cover free blocks as well as pending ones: the
// poll at the end of the synchronization makes a pending free for S whose events completed
// free *for S* (a block allocated on O and freed on S, O's work done). Retagging only the
// entries still pending left such a block tagged for the destroyed stream, and the next
// empty_cache synchronized it (tests: StreamOrderStreamsReported.*, and under the preload
// plugin_preload_destroyed_free_stream_is_never_named_again).
void DevicePool::Impl::forget_stream(cudaStream_t stream) {
  flush_quick();  // quick lists and the threads' caches: any block cached for it is in free_ now
  if (auto it = free_.find(stream); it != free_.end()) {
    std::vector<uintptr_t> addrs;  // never adjacent (same tag): each is a block until released
    for (const auto& [size, addr] : it->second) addrs.push_back(addr);
    for (uintptr_t addr : addrs) {
      const BlockIt b = blocks_.find(addr);
      index_erase(b);
      release_block(b, kAnyStream);
    }
  }
  for (auto& [addr, b] : blocks_) {
    if (b.state == State::kFree) continue;
    if (b.tag == stream) b.tag = kAnyStream;  // live, or pending (what the memory view shows)
    std::erase(b.also_on, stream);
  }
  for (Pending& p : pending_)
    if (p.tag_after == stream) p.tag_after = kAnyStream;
  // Its events have completed, and its blocks are no longer tagged for it: stale.
  for (size_t i = 0; i < promotions_.size();) {
    if (promotions_[i].tag != stream) {
      ++i;
      continue;
    }
    events_.release(std::move(promotions_[i].event));
    promotions_[i] = std::move(promotions_.back());
    promotions_.pop_back();
  }
  open_.erase(stream);
}

Result DevicePool::Impl::stream_destroyed(cudaStream_t stream) {
  if (stream == kAnyStream || stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
    return {};  // the default streams are never destroyed
  std::unique_lock lock(mu_);
  auto unnamed = [&] { return std::find(syncing_.begin(), syncing_.end(), stream) == syncing_.end(); };
  // Another thread may be synchronizing it, or holding the blocks cached for it while it
  // synchronizes the device: the stream must outlive that call, and its blocks come back first.
  synced_.wait(lock, unnamed);
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
  // Its queued work done, nothing needs to wait on it: the blocks it freed go to any stream,
  // and the events already recorded on it have completed. A stream nothing waits on needs no
  // synchronization (a pending block allocated on it may still show it: forgotten below).
  if (known && !synchronize_and_retire(lock, stream))
    return {false, "the stream about to be destroyed could not be synchronized on device " + std::to_string(device_) +
                       "; the blocks it used keep waiting on it"};
  synced_.wait(lock, unnamed);  // another thread may have started on it while the lock was released
  forget_stream(stream);
  return {};
}

}  // namespace vramswap::pool
