// DevicePool's entry points: allocating (the pool's quick lists, then the slow path under
// the relief steps of pressure.cpp), freeing in stream order (an event on every other
// stream that used the block; a block with nothing to wait for is quick-listed or
// released), record_stream, and the public class forwarding to Impl. The policy is Note
// [The pool] in device_pool.h; the state and invariants are in pool_impl.h.
#include "pool/pool_impl.h"

namespace vramswap::pool {

DevicePool::Impl::Impl(const PoolOptions& options)
    : device_(options.device),
      streams_reported_(options.streams_reported),
      captures_(options.captures),
      peers_(options.peers & ~(uint64_t(1) << (options.device & 63))),
      events_(options.device) {
  cuda::DeviceInfo info = cuda::device_info(device_);
  if (!info.vmm_supported)
    throw cuda::CudaError("device " + std::to_string(device_) + " does not support CUDA virtual memory management",
                          CUDA_ERROR_NOT_SUPPORTED);
  granularity_ = info.granularity;
  card_bytes_ = info.total_bytes;
  limit_ = options.limit_bytes == 0 ? card_bytes_ : std::min(options.limit_bytes, card_bytes_);
  // Twice the card: room for fragmentation of addresses, which cost nothing until mapped.
  const uint64_t va_size = round_up(2 * card_bytes_, granularity_);
  {
    cuda::ContextScope scope(device_);
    va_ = cuda::VaReservation(va_size, granularity_);
  }
  granules_.resize(va_size / granularity_);
  for (auto& counts : live_on_) counts.assign(granules_.size(), 0);
  lent_ = std::make_unique<LentTable>(va_.base(), va_size, granularity_);
  index_insert(blocks_.emplace(va_.base(), Block{va_size, State::kFree, kAnyStream, {}}).first);
}

void DevicePool::Impl::flush_quick() {
  caches_to_quick();
  if (quick_blocks_ == 0) return;
  for (auto& [key, list] : quick_)
    for (BlockIt b : list) release_block(b, key.stream);
  quick_.clear();
  quick_blocks_ = 0;
}

void* DevicePool::Impl::take(BlockIt b, uintptr_t start, uint64_t size, cudaStream_t stream, bool offloadable,
                             bool mapped_new) {
  index_erase(b);
  {  // split off the part before `start`
    const uint64_t head = start - b->first;
    if (head) {
      Block rest{b->second.size - head, State::kFree, b->second.tag, {}};
      rest.serial = b->second.serial;
      b->second.size = head;
      index_insert(b);
      b = blocks_.emplace(b->first + head, rest).first;
    }
  }
  if (b->second.size > size) {  // split: the rest stays free under the same tag
    Block rest{b->second.size - size, State::kFree, b->second.tag, {}};
    rest.serial = b->second.serial;  // untouched since that release: its promotion still holds
    b->second.size = size;
    index_insert(blocks_.emplace(b->first + size, rest).first);
  }
  b->second.state = State::kLive;
  b->second.tag = stream;
  b->second.offloadable = offloadable;
  b->second.away = false;
  count_on_granules(b->first, size, offloadable, +1);
  if (offloadable && size < granularity_ / 2) open_[stream] = granule_index(b->first + size - 1);
  allocated_ += size;
  const uint64_t in_use = allocated_ - own_cached();  // Note [Thread caches]
  peak_allocated_ = std::max(peak_allocated_, in_use);
  allocated_high_ = std::max(allocated_high_, in_use);
  ++num_allocs_;
  if (!mapped_new) ++num_cache_hits_;
  return reinterpret_cast<void*>(b->first);
}

bool DevicePool::Impl::push_quick(BlockIt b, cudaStream_t stream) {
  auto& list = quick_[{stream, b->second.size, quick_kind(b->second.offloadable)}];
  if (list.size() >= kQuickPerSize) return false;
  b->second.state = State::kQuick;
  b->second.tag = stream;
  b->second.also_on.clear();
  list.push_back(b);
  ++quick_blocks_;
  return true;
}

void* DevicePool::Impl::take_quick(uint64_t rounded, cudaStream_t stream, bool offloadable) {
  auto q = quick_.find({stream, rounded, quick_kind(offloadable)});
  if (q == quick_.end() || q->second.empty()) return nullptr;
  BlockIt b = q->second.back();
  // The other kind may have come to its granules since it was freed.
  if (closed_to(granule_index(b->first), offloadable, stream) ||
      closed_to(granule_index(b->first + rounded - 1), offloadable, stream))
    return nullptr;
  if (cuts_busy_run(b->first, rounded)) return nullptr;
  q->second.pop_back();
  --quick_blocks_;
  b->second.state = State::kLive;
  b->second.offloadable = offloadable;
  b->second.away = false;
  count_on_granules(b->first, rounded, offloadable, +1);
  if (offloadable && rounded < granularity_ / 2) open_[stream] = granule_index(b->first + rounded - 1);
  allocated_ += rounded;
  const uint64_t in_use = allocated_ - own_cached();  // Note [Thread caches]
  peak_allocated_ = std::max(peak_allocated_, in_use);
  allocated_high_ = std::max(allocated_high_, in_use);
  ++num_allocs_;
  ++num_cache_hits_;
  return reinterpret_cast<void*>(b->first);
}

void* DevicePool::Impl::allocate(size_t size, cudaStream_t stream, std::string* error) {
  error->clear();
  if (size == 0) return nullptr;
  // The hot path: the thread's own cache (Note [Thread caches]).
  if (caches_on_.load(std::memory_order_acquire) && size <= va_.size()) {
    if (ThreadCache* c = own_cache()) {
      c->lock();
      const uintptr_t p = c->take(stream, round_up(size, kAlignment));
      c->unlock();
      if (p) return reinterpret_cast<void*>(p);
    }
  }
  std::unique_lock lock(mu_);
  if (size > va_.size()) {
    ++num_ooms_;
    trace_oom(size, stream);
    *error = oom_report(size, size, "the pool's address range");
    return nullptr;
  }
  const uint64_t rounded = round_up(size, kAlignment);
  check_caches(rounded);
  poll_before_allocating();
  void* p = nullptr;
  // Other threads' cached blocks join the quick lists first, so that an allocation of a size
  // another thread freed takes that block as it would with no caches; a miss then merges
  // the quick lists so that best fit sees every cached block (Note [Thread caches]).
  caches_to_quick();
  if (quick_blocks_) p = take_quick(rounded, stream, false);
  if (!p) flush_quick();
  if (!p) p = allocate_slow(size, rounded, stream, false, false, lock, error);
  if (p && caches_on_.load(std::memory_order_relaxed)) lend(p, rounded, stream);
  return traced_alloc(p, size, stream);
}

void* DevicePool::Impl::allocate_offloadable(size_t size, cudaStream_t stream, std::string* error,
                                             uint64_t* placed) {
  error->clear();
  if (placed) *placed = 0;
  if (size == 0) return nullptr;
  std::unique_lock lock(mu_);
  if (size > va_.size() - granularity_) {
    ++num_ooms_;
    trace_oom(size, stream);
    *error = oom_report(size, size, "the pool's address range");
    return nullptr;
  }
  check_caches(round_up(size, kAlignment));
  poll_before_allocating();
  uint64_t rounded = round_up(size, kAlignment);  // the block's size, whichever path takes it
  void* p = nullptr;
  // From half a granule on, while placing for eviction: whole granules of its own (its
  // eviction frees all of it), never from a quick list. Else placed as allocate() places any
  // block (the threads' caches, then its quick lists, then best fit), so that tagging costs
  // no memory (under the rules of closed_to() for a small block while placing for eviction).
  const bool own = rounded >= granularity_ / 2 && grouping();
  if (own) rounded = placed_size(size);
  caches_to_quick();
  if (!own && quick_blocks_) p = take_quick(rounded, stream, true);
  if (!p) {
    flush_quick();
    p = allocate_slow(size, rounded, stream, true, own, lock, error);
  }
  if (p && placed) *placed = rounded;
  return traced_alloc(p, size, stream);
}

void* DevicePool::Impl::allocate_slow(size_t size, uint64_t rounded, cudaStream_t stream, bool offloadable,
                                      bool aligned, std::unique_lock<std::mutex>& lock, std::string* error) {
  std::string why;
  // What the reclaimer is asked for: what the last refused mapping lacked, so that it gives
  // up no more than needed (every block it gives up must come back later).
  uint64_t lacking = rounded;
  constexpr Relief kSteps[] = {Relief::kUnusedGranules,     Relief::kReclaimNoWait,   Relief::kDrainPending,
                               Relief::kSynchronizeStream, Relief::kSynchronize, Relief::kReclaim};
  // A place for the block (find_fit's, `strict` as there) mapped and taken, or nullptr.
  auto place = [&](bool strict) -> void* {
    uintptr_t start = 0;
    BlockIt b = find_fit(rounded, stream, offloadable, aligned, &start, strict);
    const uint64_t granules = (rounded + granularity_ - 1) / granularity_;
    // Note [A step's addresses]: at the limit, the step before's place, unless best fit's has
    // more of its pages mapped.
    if (pages_scarce(granules + !aligned)) {
      uintptr_t at = 0;
      BlockIt s = find_step_place(round_up(size, kAlignment), rounded, stream, offloadable, aligned, &at, strict);
      if (s != blocks_.end() && (b == blocks_.end() || unmapped_in(at, rounded) <= unmapped_in(start, rounded))) {
        b = s;
        start = at;
      }
    }
    // Note [Placing on mapped pages]
    if (b != blocks_.end() && rounded >= granularity_ / 2 && grouping() && pages_scarce(granules + !aligned) &&
        away_blocks_ == 0) {
      const uint64_t missing = unmapped_in(start, rounded);
      uintptr_t other = 0;
      uint64_t other_missing = 0;
      BlockIt c = find_mapped_fit(rounded, stream, offloadable, aligned, &other, strict, &other_missing);
      if (c != blocks_.end() && other_missing < missing && 2 * (missing - other_missing) >= granules) {
        b = c;
        start = other;
      }
    }
    if (b == blocks_.end()) {
      why = "the pool's address range";
      return nullptr;
    }
    const uint64_t reserved_before = reserved_;
    if (!unmap_cut_runs(start, rounded)) {
      why = "CUDA's refusal to unmap";
      return nullptr;
    }
    if (!map_range(start, rounded, &why, &lacking)) return nullptr;
    return take(b, start, rounded, stream, offloadable, reserved_ != reserved_before);
  };
  for (int round = 0;; ++round) {
    for (size_t step = 0; step <= std::size(kSteps); ++step) {
      if (step > 0 && !relieve(kSteps[step - 1], lacking, stream, lock)) continue;
      if (void* p = place(true)) return p;
      if (step > 0 && kSteps[step - 1] == Relief::kDrainPending && waiting()) --step;  // the next oldest
    }
    // Placing for eviction is a preference, never a reason to fail: any hole on the mapped
    // granules, closed ones included, before an out-of-memory.
    if (grouping())
      if (void* p = place(false)) return p;
    if (!await_held_blocks(lock, round)) break;  // Note [Blocks another synchronization holds]
  }
  ++num_ooms_;
  trace_oom(size, stream);
  *error = oom_report(size, rounded, why);
  // Note [Why nothing fits]: at its own size, anywhere on the mapped granules.
  if (why == "the limit") *error += why_nothing_fits(round_up(size, kAlignment), stream, offloadable);
  return nullptr;
}

DevicePool::Impl::BlockIt DevicePool::Impl::find_live(void* ptr, Result* refusal) {
  auto b = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (b != blocks_.end() && b->second.state == State::kLive) return b;
  if (!owns(ptr)) *refusal = {false, "free of " + format_pointer(ptr) + ": not a pointer vramswap allocated"};
  else if (b != blocks_.end()) *refusal = {false, "free of " + format_pointer(ptr) + ": already freed (double free)"};
  else
    *refusal = {false, "free of " + format_pointer(ptr) +
                           ": not the start of a block vramswap handed out (an interior or stale pointer)"};
  return blocks_.end();
}

std::vector<cudaStream_t> DevicePool::Impl::users_besides(const Block& block, cudaStream_t except) {
  // A free that names no stream (kAnyStream) comes after a synchronization of everything
  // the program queued; only streams named by record_stream (the engine's copy streams
  // among them) are still waited for. kAnyStream itself is never a stream to wait on.
  std::vector<cudaStream_t> users = block.also_on;
  if (except != kAnyStream) users.push_back(block.tag);
  std::erase(users, except);
  std::erase(users, kAnyStream);
  std::sort(users.begin(), users.end());
  users.erase(std::unique(users.begin(), users.end()), users.end());
  return users;
}

bool DevicePool::Impl::record_events(const std::vector<cudaStream_t>& streams, std::vector<cuda::Event>* events,
                                     std::string* why) {
  try {
    for (cudaStream_t s : streams) {
      cuda::Event e = events_.acquire();
      try {
        e.record(s);
      } catch (...) {
        events_.release(std::move(e));
        throw;
      }
      events->push_back(std::move(e));
    }
    return true;
  } catch (const cuda::CudaError& e) {
    for (auto& event : *events) events_.release(std::move(event));
    events->clear();
    *why = e.what();
    return false;
  }
}

void DevicePool::Impl::count_free(BlockIt b) {
  allocated_ -= b->second.size;
  count_on_granules(b->first, b->second.size, b->second.offloadable, -1);
  ++num_frees_;
}

void DevicePool::Impl::hold_back(BlockIt b, std::vector<cuda::Event> events, cudaStream_t tag_after) {
  b->second.state = State::kPending;
  b->second.also_on.clear();
  pending_.push_back(Pending{{b->first}, std::move(events), tag_after, ++next_serial_});
}

bool DevicePool::Impl::free_after_device_synchronization(void* ptr, cudaStream_t stream,
                                                         std::unique_lock<std::mutex>& lock, Result* result) {
  if (!device_synchronization_allowed(stream)) return false;
  lock.unlock();
  const bool synchronized = cuda::synchronize_device(device_);
  lock.lock();
  BlockIt b = find_live(ptr, result);  // another thread may have freed it meanwhile
  if (b == blocks_.end() || !synchronized) return false;
  count_free(b);
  history_.add(TraceEvent::Action::kFreeRequested, b->first, traced_size(b->second), stream_id(stream));
  history_.add(TraceEvent::Action::kFreeCompleted, b->first, traced_size(b->second), stream_id(stream));
  b->second.requested = 0;
  release_block(b, kAnyStream);
  return true;
}

Result DevicePool::Impl::free_behind(void* ptr, cudaStream_t stream, bool to_any) {
  if (!ptr) return {};
  std::unique_lock lock(mu_);
  // With no pressure a free to any stream is a free (deallocate_to_any): its block goes to
  // its stream's quick list as any block would, so that tagging costs no memory.
  if (to_any && !grouping()) to_any = false;
  Result result;
  BlockIt b = find_live(ptr, &result);
  if (b == blocks_.end()) return result;
  // A block lent to a thread's cache comes back to the pool; one cached there was freed
  // already (Note [Thread caches]).
  bool own_cache_full = false;
  if (ThreadCache* owner = b->second.owner) {
    owner->lock();
    const bool live = owner->disown(b->first);
    owner->unlock();
    if (!live) return {false, "free of " + format_pointer(ptr) + ": already freed (double free)"};
    unlend(b);
    own_cache_full = owner == own_cache();  // its own thread's free that its cache had no room for
  }
  // Work queued before the free on every stream that used the block must finish before
  // another stream reuses it. The freeing stream orders reuse on itself; any other stream
  // that used the block (the allocation stream, record_stream's) gets an event now. Events
  // are recorded before anything changes, so a refusal leaves the block live and counted.
  std::vector<cudaStream_t> others = users_besides(b->second, stream);
  const bool promote = to_any && stream != kAnyStream;
  if (promote) others.push_back(stream);  // alone: a promotion; else behind all, then any stream
  std::vector<cuda::Event> events;
  std::string why;
  if (!record_events(others, &events, &why)) {
    // A stream that used the block takes no event (the program destroyed it, or CUDA
    // refused): order reuse after everything on the device instead.
    if (free_after_device_synchronization(ptr, stream, lock, &result)) return {};
    if (!result.ok) return result;
    return {false, "free of " + format_pointer(ptr) + ": its reuse cannot be ordered after the streams that used it (" +
                       why + "), and synchronizing device " + std::to_string(device_) +
                       " failed too; the block stays allocated"};
  }
  count_free(b);
  Block& block = b->second;
  history_.add(TraceEvent::Action::kFreeRequested, b->first, traced_size(block), stream_id(stream));
  const bool promotion = promote && others.size() == 1 && others.front() == stream;
  if (events.empty() || promotion) {  // reusable now by the freeing stream; else once the events complete
    history_.add(TraceEvent::Action::kFreeCompleted, b->first, traced_size(block), stream_id(stream));
    block.requested = 0;
  }
  if (promotion) {
    // Reusable at once by the freeing stream (its later work is ordered after the free, as
    // for deallocate()), and by any stream once the event recorded now completes.
    const uintptr_t addr = b->first;
    const uint64_t serial = ++next_serial_;
    release_block(b, stream, serial);
    promotions_.push_back({addr, serial, stream, std::move(events.front())});
  } else if (!events.empty()) {
    hold_back(b, std::move(events), to_any ? kAnyStream : stream);
  } else {
    // A block of half a granule or more placed for eviction (its own span: its granules go
    // with it) is never quick-listed; with no pressure an offloadable block is cached as any.
    const bool own_span = block.offloadable && block.size >= granularity_ / 2 && grouping();
    const bool quick = !to_any && !block.away && !own_span && !own_cache_full;
    // The threads' cached blocks of its size were freed before it (Note [Thread caches]).
    if (quick && caches_on_.load(std::memory_order_relaxed)) key_to_quick(stream, block.size);
    if (!quick || !push_quick(b, stream)) release_block(b, stream);
  }
  return {};
}

Result DevicePool::Impl::deallocate(void* ptr, cudaStream_t stream) {
  // The hot path: a block lent to this thread's cache, or to another thread's (found in
  // lent_ without the pool's lock), freed on the stream it was allocated on, goes to that
  // cache under that cache's lock (Note [Thread caches]).
  if (ptr && caches_on_.load(std::memory_order_acquire)) {
    const auto addr = reinterpret_cast<uintptr_t>(ptr);
    ThreadCache* own = own_cache();
    if (own && own->give_locked(addr, stream)) return {};
    ThreadCache* owner = lent_->owner(addr);
    if (owner && owner != own && owner->give_locked(addr, stream)) return {};
  }
  return free_behind(ptr, stream, false);
}

Result DevicePool::Impl::deallocate_to_any(void* ptr, cudaStream_t stream) { return free_behind(ptr, stream, true); }

Result DevicePool::Impl::record_stream(void* ptr, cudaStream_t stream) {
  std::lock_guard lock(mu_);
  auto b = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (b == blocks_.end() || b->second.state != State::kLive)
    return {false, "record_stream on " + format_pointer(ptr) +
                       ": not a live block vramswap allocated"};
  if (ThreadCache* owner = b->second.owner) {
    // Used by another stream now: the pool's again (its free needs an event).
    owner->lock();
    const bool live = owner->disown(b->first);
    owner->unlock();
    if (!live)
      return {false, "record_stream on " + format_pointer(ptr) + ": not a live block vramswap allocated (freed)"};
    unlend(b);
  }
  if (stream != b->second.tag && std::find(b->second.also_on.begin(), b->second.also_on.end(), stream) ==
                                     b->second.also_on.end())
    b->second.also_on.push_back(stream);
  return {};
}

DevicePool::DevicePool(const PoolOptions& options) : impl_(std::make_unique<Impl>(options)) {}
DevicePool::~DevicePool() = default;
void* DevicePool::allocate(size_t size, cudaStream_t stream, std::string* error) {
  return impl_->allocate(size, stream, error);
}
Result DevicePool::deallocate(void* ptr, cudaStream_t stream) { return impl_->deallocate(ptr, stream); }
uint64_t DevicePool::take_allocated_high() { return impl_->take_allocated_high(); }
void DevicePool::begin_step() { impl_->begin_step(); }
Result DevicePool::record_stream(void* ptr, cudaStream_t stream) { return impl_->record_stream(ptr, stream); }
Result DevicePool::stream_destroyed(cudaStream_t stream) { return impl_->stream_destroyed(stream); }
Result DevicePool::grant_peer(int peer) { return impl_->grant_peer(peer); }
void DevicePool::empty_cache() { impl_->empty_cache(); }
PoolStats DevicePool::stats() const { return impl_->stats(); }
DevicePool::Census DevicePool::live_below(uint64_t bytes) const { return impl_->live_below(bytes); }
void DevicePool::record_history(size_t max_entries) { impl_->record_history(max_entries); }
DevicePool::MemoryView DevicePool::memory_view() const { return impl_->memory_view(); }
bool DevicePool::shares_granule_with_ordinary(const void* ptr) const { return impl_->shares_granule_with_ordinary(ptr); }
void* DevicePool::allocate_offloadable(size_t size, cudaStream_t stream, std::string* error, uint64_t* placed) {
  return impl_->allocate_offloadable(size, stream, error, placed);
}
Result DevicePool::unmap_block(void* ptr, bool* partly, uint64_t* freed) {
  return impl_->unmap_block(ptr, partly, freed);
}
void DevicePool::count_out_of_memory() { impl_->count_out_of_memory(); }
Result DevicePool::map_block(void* ptr, MapWait wait, cudaStream_t stream) {
  return impl_->map_block(ptr, wait, stream);
}
Result DevicePool::deallocate_to_any(void* ptr, cudaStream_t stream) { return impl_->deallocate_to_any(ptr, stream); }
void DevicePool::set_reclaimer(Reclaimer reclaimer) { impl_->set_reclaimer(std::move(reclaimer)); }
uint64_t DevicePool::granularity() const { return impl_->granularity(); }
uint64_t DevicePool::placed_size(uint64_t size) const { return impl_->placed_size(size); }
void DevicePool::reset_peaks() { impl_->reset_peaks(); }
std::string DevicePool::check_invariants() const { return impl_->check_invariants(); }
bool DevicePool::owns(const void* ptr) const { return impl_->owns(ptr); }
int DevicePool::device() const { return impl_->device(); }

}  // namespace vramswap::pool
