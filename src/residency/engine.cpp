// The eviction engine's tracker protocol: tagged allocations and frees, pack (a saved
// block's handle), mark_cold (nothing but backward will touch it: it may leave), unpack
// (backward needs it: it must be here), release and prefetch, and the public class
// forwarding to Impl. The states and rules are Note [Block states] in engine.h; the state
// and invariants are in engine_impl.h.
#include "residency/engine_impl.h"

namespace vramswap::residency {

Engine::Impl::Impl(pool::DevicePool& pool, const EngineOptions& options)
    : pool_(pool),
      options_(options),
      device_(pool.device()),
      d2h_(cuda::Stream::create(pool.device())),
      h2d_(cuda::Stream::create(pool.device(), cuda::greatest_priority(pool.device()))),
      d2h_done_(cuda::Stream::create(pool.device())),
      h2d_done_(cuda::Stream::create(pool.device())),
      events_(pool.device()),
      host_(HostTierOptions{options.host_limit_bytes, 0, pool.device()}),
      recorder_(options.plan, pool.stats().limit_bytes),
      timed_(pool.device(), true) {
  try {
    host_vmm_ = cuda::host_vmm_supported(device_);
  } catch (const cuda::CudaError&) {
    host_vmm_ = false;  // kept blocks go through the host tier as any block
  }
  if (!options.disk_dir.empty()) {
    const uint64_t limit = options.disk_limit_bytes ? options.disk_limit_bytes : UINT64_MAX;
    DiskTierOptions disk{options.disk_dir, limit};
    disk.io = options.disk_io;
    disk.device = device_;
    disk_ = DiskTier::open(disk, &disk_refusal_);
    if (!disk_ && disk.io == DiskIo::kCuFile) {
      // The library or its driver is missing: the tier still works, on threads.
      stats::log(stats::LogLevel::kWarn, "device %d: %s; the disk tier runs its I/O on threads of its own", device_,
                 disk_refusal_.c_str());
      disk.io = DiskIo::kThreads;
      disk_refusal_.clear();
      disk_ = DiskTier::open(disk, &disk_refusal_);
    }
    if (!disk_)
      stats::log(stats::LogLevel::kWarn, "device %d: no disk tier: %s (eviction stops when the host tier is full)",
                 device_, disk_refusal_.c_str());
  }
}

Engine::Impl::~Impl() {
  // The host tier waits for nothing, and kept blocks' host memory of the VMM API goes with
  // their slots: the copies still queued on the copy streams must land first. A failure
  // (a driver shutting down) leaves nothing to wait for.
  cuda::synchronize_stream(d2h_.get());
  cuda::synchronize_stream(h2d_.get());
}

void* Engine::Impl::allocate_tagged(size_t size, cudaStream_t stream, std::string* error) {
  cuda::RelaxedCaptureScope relaxed;
  // The pool may call reclaim() (our lock) from here: not under mu_.
  uint64_t placed = 0;
  void* p = pool_.allocate_offloadable(size, stream, error, &placed);
  if (!p) {
    if (!error->empty()) *error += " " + pressure_report();
    return nullptr;
  }
  std::lock_guard lock(mu_);
  try {
    register_block(p, size, placed);
  } catch (...) {
    // Not registered: the block goes back, so that a failed allocation holds nothing.
    pool_.deallocate(p, pool::any_stream());
    throw;
  }
  // The size asked for, not the size placed: where and how the pool places a block may change
  // from one step to the next (Note [A step without pressure] in pool/device_pool.h), and the
  // step is the same one.
  note_point(policy::PointKind::kAlloc, policy::kNoPoint, size);
  background("a tagged allocation");
  update_peaks();
  return p;
}

void Engine::Impl::register_block(void* p, size_t size, uint64_t placed) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
  } else {
    slots_.emplace_back();
    slot = uint32_t(slots_.size() - 1);
    free_slots_.push_back(slot);
  }
  by_addr_[addr] = slot;
  try {
    std::lock_guard tlock(tagged_mu_);
    tagged_.insert(addr);
  } catch (...) {
    by_addr_.erase(addr);
    throw;
  }
  free_slots_.pop_back();  // nothing below throws
  Slot& s = slots_[slot];
  // A reused slot starts anew: only its generation carries over, so that the handles of the
  // block before stay stale (a mark left by that block, such as pages kept for a read ahead,
  // once made the new block's fetch skip mapping its pages).
  const uint32_t generation = s.generation;
  s = Slot{};
  s.generation = generation;
  s.live = true;
  s.addr = addr;
  s.requested = size;
  s.placed = placed;
  s.residency = Residency::kResident;
  st_.tagged_bytes += s.placed;
  st_.tagged_waste_bytes += s.placed - s.requested;
  st_.peak_tagged_waste_bytes = std::max(st_.peak_tagged_waste_bytes, st_.tagged_waste_bytes);
}

void Engine::Impl::background(const char* after) {
  try {
    complete_copies(false);
    reactive().soft_evict(options_.soft_limit_bytes);
    write_ahead();
  } catch (const std::exception& e) {
    // Background work only: the call that triggered it succeeded. Every step is undone on
    // failure (the blocks concerned stay where they were), so nothing is lost.
    stats::log(stats::LogLevel::kWarn, "background eviction after %s on device %d failed: %s", after, device_,
               e.what());
  }
}

void Engine::Impl::untrack(Slot& s, uint32_t slot) {
  if (s.packs > 0 || s.kept) order_.erase(s.key, slot);
  if (s.packs > 0) --st_.num_tracked_blocks;
  if (s.kept) st_.kept_bytes -= s.placed;
  s.packs = 0;
  s.later_packs.clear();
  s.kept = false;
  s.frozen = false;
  s.fresh_copy = false;
  s.cold = false;
  s.unpacked = false;
  s.step_block = policy::kNoPoint;
  if (s.cold_event) events_.release(std::move(s.cold_event));
  ++s.generation;  // every handle of this block is stale from now on
}

void Engine::Impl::reorder(uint32_t slot, bool was_in_order) {
  Slot& s = slots_[slot];
  if (was_in_order) order_.erase(s.key, slot);
  if (s.packs == 0 && !s.kept) return;
  if (s.packs > 0 && s.kept) s.key = policy::needed_before(s.next_use, s.pack_key) ? s.next_use : s.pack_key;
  else s.key = s.packs > 0 ? s.pack_key : s.next_use;
  order_.insert(s.key, slot);
}

uint32_t Engine::Impl::slot_holding(uintptr_t addr) const {
  auto it = by_addr_.upper_bound(addr);
  if (it == by_addr_.begin()) return UINT32_MAX;
  --it;
  const Slot& s = slots_[it->second];
  return addr - s.addr < s.placed ? it->second : UINT32_MAX;
}

pool::Result Engine::Impl::free_tagged(void* ptr, cudaStream_t stream) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  auto it = by_addr_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == by_addr_.end()) return {false, "not a live tagged block"};
  const uint32_t slot = it->second;
  try {
    complete_copies(false);
  } catch (const std::exception&) {
    // A copy whose completion cannot be read now is handled as still in flight below.
  }
  Slot& s = slots_[slot];
  const bool copying = s.residency == Residency::kEvicting || s.residency == Residency::kFetching;
  // A copy still reads or writes the block: the pool must not reuse it before that copy is
  // done (record_stream on a stream that waits for the copy's event), and the host buffers
  // must outlive the copy. Recorded on the copy stream itself, the reuse would wait for
  // every copy queued after this one: on gpt-1.3b-flash at half its peak, an allocation of
  // backward waited 190 ms for the planned fetches queued behind a block it had freed.
  if (copying) {
    const bool out = s.residency == Residency::kEvicting;
    cudaStream_t after = out ? d2h_done_.get() : h2d_done_.get();
    try {
      cuda::wait_event(after, s.copy_event);
    } catch (const cuda::CudaError&) {
      after = out ? d2h_.get() : h2d_.get();  // later than needed, never too early
    }
    pool_.record_stream(ptr, after);
  }
  // A copy whose event was never recorded may still use the pages: their reuse waits for
  // its stream too (Note [A queued copy cannot be taken back] in engine_copies.cpp).
  if (s.unordered_copy) {
    if (pool::Result used = pool_.record_stream(ptr, s.unordered_copy); !used.ok) return used;
    debug("freed with a copy queued whose event was never recorded: reused behind that copy's stream", s);
  }
  // Its granules are likely wanted soon by a prefetch on the copy stream: free it behind an
  // event, not behind the next device synchronization. The pool first: if it refuses, the
  // engine has changed nothing and the handle stays valid.
  // Its host memory leaves its address before the pool can place anything there (Note [Kept
  // blocks stay addressable] in engine_copies.cpp), once the work queued on the freeing
  // stream, which may still read it there, is done.
  if (s.backing && s.backing->at_block) {
    if (!cuda::synchronize_stream(stream == pool::any_stream() ? nullptr : stream))
      return {false, "free of " + format_hex(s.addr) + ": synchronizing its stream failed (its host copy is mapped "
                         "at its address until the work queued there is done); the block stays allocated"};
    if (std::string error; !unaddress_on_host(s, &error))
      return {false, "free of " + format_hex(s.addr) + ": " + error + "; the block stays allocated"};
  }
  // A block placed with others (below half a granule) goes back as any block does (its stream's quick list, when
  // nothing waits): tagging changes no placement.
  pool::Result freed = s.placed < pool_.granularity() ? pool_.deallocate(ptr, stream)
                                                      : pool_.deallocate_to_any(ptr, stream);
  if (!freed.ok) {
    if (s.backing && s.residency == Residency::kEvicted && !s.pages_kept) address_on_host(s);
    return freed;
  }
  switch (s.residency) {
    case Residency::kResident:
      break;
    case Residency::kClean:
      forget_host_copy(s);
      break;
    case Residency::kEvicted:
      if (s.reading) finish_read(slot, true);  // its buffer is the read's until it is done
      if (s.writing) finish_write(slot, true, true);
      if (s.on_disk()) forget_disk_copy(s);
      else give_back_host(s);
      st_.evicted_bytes -= s.placed;
      break;
    case Residency::kEvicting:
    case Residency::kFetching:
      // The host copy goes behind the copy's event: a buffer of the tier, or the block's host
      // memory of the VMM API.
      if (s.backing) {
        s.host = nullptr;
        deferred_.push_back({nullptr, std::move(s.copy_event), s.unordered_copy, std::move(s.backing)});
      } else {
        deferred_.push_back({s.host, std::move(s.copy_event), s.unordered_copy, nullptr});
      }
      if (s.check) deferred_.push_back({s.check, cuda::Event(), h2d_.get(), nullptr});
      std::erase(in_flight_, slot);
      st_.in_flight_bytes -= s.placed;
      if (s.residency == Residency::kFetching) st_.evicted_bytes -= s.placed;
      break;
  }
  release_backing(s, s.unordered_copy);
  s.host = nullptr;
  s.check = nullptr;
  s.unordered_copy = nullptr;
  untrack(s, slot);
  s.live = false;
  s.residency = Residency::kResident;
  by_addr_.erase(it);
  {
    std::lock_guard tlock(tagged_mu_);
    tagged_.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  free_slots_.push_back(slot);
  st_.tagged_bytes -= s.placed;
  st_.tagged_waste_bytes -= s.placed - s.requested;
  end_step_if_done();
  return {};
}

uint64_t Engine::Impl::pack(const void* ptr, cudaStream_t stream) {
  (void)stream;  // the save is ordered by the caller; pack queues no work
  std::lock_guard lock(mu_);
  const uint32_t slot = slot_holding(reinterpret_cast<uintptr_t>(ptr));
  if (slot == UINT32_MAX) return 0;
  Slot& s = slots_[slot];
  const policy::UseKey key{graph_, ++seq_};
  // Saved again: needed at the earliest of its saves (the latest one, in backward). A kept
  // block remembers the others: it is cold between their uses (release).
  if (s.packs == 0 || policy::needed_before(key, s.pack_key)) {
    const bool in_order = s.packs > 0 || s.kept;
    if (s.packs == 0) ++st_.num_tracked_blocks;
    else if (s.kept) s.later_packs.push_back(s.pack_key);
    s.pack_key = key;
    ++s.packs;
    reorder(slot, in_order);
  } else {
    if (s.kept) s.later_packs.push_back(key);
    ++s.packs;
  }
  if (s.later_packs.size() > 1)
    std::sort(s.later_packs.begin(), s.later_packs.end(), policy::needed_before);
  if (recorder_.active() && s.step_block == policy::kNoPoint) {
    s.step_block = recorder_.new_block(s.placed);
    if (s.step_block != policy::kNoPoint) {
      if (step_slots_.size() <= s.step_block) step_slots_.resize(s.step_block + 1, UINT32_MAX);
      step_slots_[s.step_block] = slot;
    }
  }
  note_point(policy::PointKind::kPack, s.step_block, s.requested);  // as an allocation's point
  return handle_of(slot);
}

Slot* Engine::Impl::resolve(uint64_t handle, const char* what, std::string* error) {
  const uint32_t slot = slot_of(handle);
  const uint32_t generation = uint32_t(handle);
  if (handle == 0) {
    *error = std::string(what) + ": handle 0 names no block (pack returned 0: the block is not offloadable)";
    return nullptr;
  }
  if (int(handle >> kDeviceShift) != device_ || slot >= slots_.size()) {
    *error = std::string(what) + ": handle " + format_hex(handle) + " was not given out by vramswap";
    return nullptr;
  }
  Slot& s = slots_[slot];
  if (!s.live || s.generation != generation || (s.packs == 0 && !s.kept)) {
    *error = std::string(what) + ": handle " + format_hex(handle) +
             " is stale: its block was released or freed since it was packed";
    return nullptr;
  }
  return &s;
}

Status Engine::Impl::mark_cold(uint64_t handle, cudaStream_t stream) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "mark_cold", &error);
  if (!s) return {false, error};
  const std::string block = "mark_cold: block " + format_hex(s->addr);
  try {
    if (cuda::is_capturing(stream))
      return {false, block + ": its stream is capturing a CUDA graph, where the point of no use cannot be "
                             "recorded; the block stays in use (not evictable)"};
    record_cold(*s, stream);
  } catch (const cuda::CudaError& e) {
    return {false, block + ": " + e.what() + "; the block stays in use (not evictable)"};
  }
  debug("cold", *s);
  note_point(policy::PointKind::kCold, s->step_block, 0, stream);
  // The plan's victim: its copy starts now, while the copy engine is idle; its pages stay
  // mapped (clean) until an allocation needs them.
  if (recorder_.planned_victim(s->step_block)) start_planned_copy(slot_of(handle), "after mark_cold");
  background("mark_cold");
  return {};
}

Status Engine::Impl::unpack(uint64_t handle, cudaStream_t stream) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "unpack", &error);
  if (!s) return {false, error};
  if (s->packs == 0) return {false, "unpack: handle " + format_hex(handle) + " is kept but not packed: use it (vramswap_use)"};
  backward_since_graph_ = true;
  return bring_in(slot_of(handle), stream, s->pack_key, "unpack");
}

Status Engine::Impl::use(uint64_t handle, cudaStream_t stream, Engine::UseLane lane) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "use", &error);
  if (!s) return {false, error};
  if (!s->kept) return {false, "use: handle " + format_hex(handle) + " names a block that is not kept (vramswap_keep)"};
  // Where this use falls in the order of use (Note [Kept blocks] in engine.h).
  const uint8_t lane_id = lane == Engine::UseLane::kForward ? policy::kForwardLane : policy::kAfterBackwardLane;
  const uint64_t graph = lane == Engine::UseLane::kForward && backward_since_graph_ ? graph_ + 1 : graph_;
  const bool same_run = last_use_.graph == graph && last_use_.lane == lane_id;
  const policy::UseKey now{graph, same_run ? last_use_.seq + 1 : 0, lane_id};
  last_use_ = now;
  const uint32_t slot = slot_of(handle);
  s->next_use = {graph + 1, now.seq, lane_id};
  reorder(slot, true);
  return bring_in(slot, stream, now, "use");
}

Status Engine::Impl::bring_in(uint32_t slot, cudaStream_t stream, const policy::UseKey& cursor, const char* what) {
  Slot* s = &slots_[slot];
  bool capturing = false;
  try {
    capturing = cuda::is_capturing(stream);
    complete_copies(false);
  } catch (const cuda::CudaError& e) {
    return {false, std::string(what) + " of block " + format_hex(s->addr) + ": " + e.what()};
  }
  switch (s->residency) {
    case Residency::kResident:
      break;
    case Residency::kEvicting:
      s->cancel = true;  // its pages are still mapped and hold the data
      break;
    case Residency::kClean:  // never given up: no copy back at all
      ++st_.num_clean_reuses;
      debug("used while clean (no copy back)", *s);
      if (!s->frozen) forget_host_copy(*s);  // a frozen block's host copy stays valid
      break;
    case Residency::kEvicted: {
      if (capturing)
        return {false, std::string(what) + " of an evicted block (" + format_hex(s->addr) +
                           ") on a stream that is capturing a CUDA graph: it cannot be fetched now"};
      ++st_.num_faults;
      Status r = start_fetch(slot, Fetch::kNeeded);
      if (!r.ok) return r;
      break;
    }
    case Residency::kFetching:
      if (!s->copy_event.query()) {
        ++st_.num_late_prefetches;
        debug("used while its fetch is in flight (late)", *s);
        if (!capturing) time_use_of_fetch(*s, stream);
      }
      break;
  }
  s = &slots_[slot];
  // Valid for work queued on `stream` from now on: after the fetch, or, for a block that
  // never left, after the work queued on the stream that marked it cold (the last writes).
  try {
    const cuda::Event* after = nullptr;
    if (s->residency == Residency::kFetching) after = &s->copy_event;
    else if (s->cold && s->cold_event && s->cold_stream != stream) after = &s->cold_event;
    if (after && capturing) {
      after->synchronize();  // an event from outside the capture cannot join it: wait here
    } else if (after) {
      cuda::wait_event(stream, *after);
    }
  } catch (const cuda::CudaError& e) {
    return {false, std::string(what) + " of block " + format_hex(s->addr) + ": ordering the stream after its data failed: " +
                       e.what() + "; the block is on the device, call " + what + " again"};
  }
  s->unpacked = true;
  s->cold = false;
  s->fresh_copy = false;
  s->use_stream = stream;
  order_.set_cursor(cursor);
  note_point(policy::PointKind::kUnpack, s->step_block, 0, capturing ? nullptr : stream);
  // Prefetch the window (making room for it by giving up what is needed furthest away), and
  // past it (policy/reactive.h).
  if (options_.horizon > 0) {
    try {
      reactive().after_unpack();
    } catch (const std::exception& e) {
      stats::log(stats::LogLevel::kWarn, "prefetch after %s on device %d failed: %s (the blocks concerned "
                 "stay on the host and are fetched when used)", what, device_, e.what());
    }
  }
  update_peaks();
  return {};
}

Status Engine::Impl::release(uint64_t handle) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "release", &error);
  if (!s) return {false, error};
  if (s->packs == 0) return {false, "release: handle " + format_hex(handle) + " is kept but not packed: nothing to release"};
  const uint32_t slot = slot_of(handle);
  note_point(policy::PointKind::kRelease, s->step_block, 0);
  if (s->packs > 1) {
    --s->packs;
    // Kept: backward is done with this save; it is needed next at the next save's use, whose
    // unpack fetches it if it leaves meanwhile.
    if (s->kept) {
      cold_after_backward(*s);
      if (!s->later_packs.empty()) {
        s->pack_key = s->later_packs.front();
        s->later_packs.erase(s->later_packs.begin());
        reorder(slot, true);
      }
    }
    return {};
  }
  if (!s->kept) return make_ordinary(slot, "release");
  // Kept: backward is done with it. Its next use is the kept one; after its use by backward
  // it is cold again from the work queued so far on the stream it was unpacked on.
  s->packs = 0;
  s->later_packs.clear();
  --st_.num_tracked_blocks;
  s->step_block = policy::kNoPoint;
  reorder(slot, true);
  cold_after_backward(*s);
  end_step_if_done();
  return {};
}

void Engine::Impl::record_cold(Slot& s, cudaStream_t stream) {
  // Recorded before anything changes: a failure leaves the block as it was (not cold).
  if (!s.cold_event) s.cold_event = events_.acquire();
  s.cold_event.record(stream);  // everything that could still touch the block is before it
  s.cold = true;
  s.cold_stream = stream;
  s.unpacked = false;
}

void Engine::Impl::cold_after_backward(Slot& s) {
  if (!s.unpacked) return;  // not in use by backward (released unused, or cold already)
  try {
    record_cold(s, s.use_stream);
  } catch (const cuda::CudaError& e) {
    stats::log(stats::LogLevel::kWarn, "release of kept block %s on device %d: marking it cold failed: %s (it "
               "stays in use until marked cold)", format_hex(s.addr).c_str(), device_, e.what());
  }
}

Status Engine::Impl::make_ordinary(uint32_t slot, const char* what) {
  // Released without an unpack (backward did not need it), or kept and away: it may be on
  // the host: bring it back first, waiting, so that nothing is lost; if that is refused
  // the block stays packed (or kept) and the handle valid.
  Slot* s = &slots_[slot];
  if (s->residency == Residency::kEvicting) s->cancel = true;
  if (s->residency == Residency::kClean) forget_host_copy(*s);
  const bool frozen = s->frozen;
  s->frozen = false;  // the fetch below lands as an ordinary block's: its host copy goes
  if (s->residency == Residency::kEvicted) {
    Status r = start_fetch(slot, Fetch::kNeeded);
    if (!r.ok) {
      slots_[slot].frozen = frozen;
      return {false, std::string(what) + ": " + r.message + "; the block stays where it was, its handle valid",
              r.out_of_memory};
    }
  }
  // A fetch still in flight: an unpacked block's stream already waits for it; a block that
  // was never unpacked has no reader ordered after the fetch, so wait here.
  if (slots_[slot].residency == Residency::kFetching && !slots_[slot].unpacked) {
    try {
      slots_[slot].copy_event.synchronize();
      complete_copies(false);
    } catch (const cuda::CudaError& e) {
      return {false, std::string(what) + ": waiting for the fetch of block " + format_hex(slots_[slot].addr) +
                         " failed: " + e.what() + "; the block stays where it was, its handle valid"};
    }
  }
  // No longer kept: its host memory goes (after the fetch in flight, when there is one).
  if (slots_[slot].residency == Residency::kResident) release_backing(slots_[slot], slots_[slot].unordered_copy);
  untrack(slots_[slot], slot);
  end_step_if_done();
  return {};
}

uint64_t Engine::Impl::keep(const void* ptr, bool frozen) {
  std::lock_guard lock(mu_);
  const uint32_t slot = slot_holding(reinterpret_cast<uintptr_t>(ptr));
  if (slot == UINT32_MAX) return 0;
  Slot& s = slots_[slot];
  if (s.kept) {
    // Kept again: frozen only while every keep says so.
    if (!frozen && s.frozen) {
      s.frozen = false;
      if (s.residency == Residency::kClean && !s.cold) forget_host_copy(s);
    }
    return handle_of(slot);
  }
  s.kept = true;
  s.frozen = frozen;
  st_.kept_bytes += s.placed;
  // Until its first use, predicted after everything known now.
  s.next_use = {graph_ + 1, UINT64_MAX, policy::kAfterBackwardLane};
  reorder(slot, s.packs > 0);
  return handle_of(slot);
}

Status Engine::Impl::unkeep(uint64_t handle) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "unkeep", &error);
  if (!s) return {false, error};
  if (!s->kept) return {false, "unkeep: handle " + format_hex(handle) + " names a block that is not kept"};
  const uint32_t slot = slot_of(handle);
  if (s->packs == 0) return make_ordinary(slot, "unkeep");
  // Still packed: a packed block now, whose host copy is not kept while it is used.
  s->kept = false;
  s->frozen = false;
  s->later_packs.clear();
  st_.kept_bytes -= s->placed;
  if (s->residency == Residency::kClean && !s->cold) forget_host_copy(*s);
  if (s->residency == Residency::kResident) release_backing(*s, s->unordered_copy);
  reorder(slot, true);
  return {};
}

Status Engine::Impl::prefetch(uint64_t handle) {
  cuda::RelaxedCaptureScope relaxed;
  std::lock_guard lock(mu_);
  std::string error;
  Slot* s = resolve(handle, "prefetch", &error);
  if (!s) return {false, error};
  const uint32_t slot = slot_of(handle);
  complete_copies(false);
  if (s->residency == Residency::kEvicting) s->cancel = true;
  if (s->residency != Residency::kEvicted) return {};  // on the device (a clean block too)
  Status r = start_fetch(slot, Fetch::kHint);
  if (r.ok) ++st_.num_prefetches;
  return r;
}

Engine::Engine(pool::DevicePool& pool, const EngineOptions& options)
    : impl_(std::make_unique<Impl>(pool, options)) {
  pool.set_reclaimer([impl = impl_.get()](uint64_t bytes, ReclaimMode mode, cudaStream_t stream) {
    return impl->reclaim(bytes, mode, stream);
  });
}
Engine::~Engine() { impl_->detach(); }
void* Engine::allocate_tagged(size_t size, cudaStream_t stream, std::string* error) {
  return impl_->allocate_tagged(size, stream, error);
}
bool Engine::is_tagged(const void* ptr) const { return impl_->is_tagged(ptr); }
pool::Result Engine::free_tagged(void* ptr, cudaStream_t stream) { return impl_->free_tagged(ptr, stream); }
uint64_t Engine::pack(const void* ptr, cudaStream_t stream) { return impl_->pack(ptr, stream); }
void Engine::graph_begin() { impl_->graph_begin(); }
Status Engine::mark_cold(uint64_t h, cudaStream_t stream) { return impl_->mark_cold(h, stream); }
// An out-of-memory bringing a block back ends with the report of what holds the memory, as
// an allocation's does (taken once the engine's lock is released: the report takes it).
static Status with_report(Status r, const Engine& engine) {
  if (!r.ok && r.out_of_memory) r.message += " " + engine.pressure_report();
  return r;
}
Status Engine::unpack(uint64_t h, cudaStream_t stream) { return with_report(impl_->unpack(h, stream), *this); }
Status Engine::release(uint64_t h) { return with_report(impl_->release(h), *this); }
Status Engine::prefetch(uint64_t h) { return impl_->prefetch(h); }
uint64_t Engine::keep(const void* ptr, bool frozen) { return impl_->keep(ptr, frozen); }
Status Engine::use(uint64_t h, cudaStream_t stream, UseLane lane) {
  return with_report(impl_->use(h, stream, lane), *this);
}
Status Engine::unkeep(uint64_t h) { return with_report(impl_->unkeep(h), *this); }
uint64_t Engine::reclaim(uint64_t bytes, ReclaimMode mode, cudaStream_t stream) {
  return impl_->reclaim(bytes, mode, stream);
}
EngineStats Engine::stats() const { return impl_->stats(); }
void Engine::trim_host() { impl_->trim_host(); }
std::string Engine::pressure_report() const { return impl_->pressure_report(); }
void Engine::reset_peaks() { impl_->reset_peaks(); }
std::string Engine::check_invariants() const { return impl_->check_invariants(); }
int Engine::handle_device(uint64_t handle) { return handle == 0 ? -1 : int(handle >> kDeviceShift); }

}  // namespace vramswap::residency
