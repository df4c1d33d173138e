// The engine's copies: an eviction's copy to the host once the block is cold, fetches back
// (ahead of use, as the plan says, or on demand at unpack), the blocks sharing a granule
// that leave and come back together, and completing the copies in flight (a block whose
// copy out landed is clean; its pages go only when memory is needed).
#include "residency/engine_impl.h"

namespace vramswap::residency {

// Note [A queued copy cannot be taken back]
// ------------------------------------------
// Once a copy is queued on a copy stream, nothing unqueues it: when a call after it fails
// (the record of its event, a timing record), the copy still runs whenever its stream reaches
// it, reading the block's pages or its host buffer and writing the other. The engine then
// undoes its own bookkeeping (the block stays where it was, so that a later call tries again),
// but never the copy's claim on that memory. The rule: whatever such a copy uses goes back
// only behind its stream. A host buffer of its own goes to deferred_ with that stream at once;
// the block remembers the stream (Slot::unordered_copy) until a later copy of it on that
// stream records its event, and meanwhile its free names the stream to the pool
// (record_stream: the pages are reused or unmapped only after the work queued there before
// the free), and its own host buffer goes back behind the stream (give_back_host). No call
// waits for it. (The eviction used to free only its pinned buffer behind the stream and count
// the block as untouched: a free let the pool unmap pages the queued copy had still to read,
// and the fault-injected stress test stopped with "illegal address ... during memcpy DtoH";
// tests/residency/queued_copy_test.cpp.)

// Note [Kept blocks stay addressable]
// ------------------------------------
// A kept block is one the program can reach outside the tracker's brackets: a frozen weight
// read by torch.save or a parameter sum after training, optimizer state read by a checkpoint.
// Given up as a saved tensor is, its address faulted on such a read (cudasim: "host access to
// reserved device VA that is not mapped"; a GPU: an illegal memory access). So where the
// driver has host memory of the VMM API (cuda::host_vmm_supported), a kept block that owns
// its granules (owns_granules: placed for eviction from a granule boundary over whole
// granules, so no other block can come onto them) gets at its first eviction a host
// allocation H of exactly its granule span (HostBacking), mapped once at an address of its
// own: its copies out and back go there, never through the host tier, so H never moves on
// to the disk and lives until the block is freed or unkept. A drop gives the device pages
// up (the pool's unmap_block) and maps H at the block's granules; a fetch unmaps H there
// first, then maps device pages (map_block) and copies from H's own address; a free unmaps
// H from the block before the pool may place anything there. A stray access while the block
// is away is then an access over the link to the right bytes: slow, never wrong. A frozen
// block's H stays valid, so its later drops cost two VMM calls and no copy; a write through
// the block's address while it is away lands in H and comes back with the fetch. H counts
// as host memory (host_bytes), and against VRAMSWAP_HOST_LIMIT when it is made.
// A kept block that does not own its granules (below half a granule it shares them with
// others; placed densely across granules its ends may be shared) cannot be remapped alone:
// it never leaves the device there (stays_on_device; the policy sees it in use), so that no
// kept block is ever an address that faults. Such blocks are a small share of a model's
// weights (biases, norms). Where the driver has no host VMM (CUDASIM_HOST_VMM=0, or when
// making H fails) a kept block is evicted as any block, through the host tier, and the
// Python layer's state_dict and load_state_dict hooks and vramswap.materialize() are the
// cover (README, Guarantees). Not covered: a block's granules that a refused cuMemUnmap
// left mapped (the block is then evicted as any block), peers' access to H, and a read that
// races with the block's fetch ahead of its use: the copy into the device pages is not
// ordered before a read nobody announced, so such a read is exact only after the device is
// synchronized (vramswap.h says so; the stress test's reads of cold kept blocks do that).

void* Engine::Impl::backing_host(uint32_t slot, std::string* why) {
  Slot& s = slots_[slot];
  if (s.backing) return s.backing->host();
  if (!s.kept || !host_vmm_ || !owns_granules(s)) return nullptr;
  const uint64_t used = host_.used_bytes() + backed_bytes_;
  if (used + s.placed > host_.limit_bytes()) {
    *why = "the host limit (VRAMSWAP_HOST_LIMIT, " + format_size(host_.limit_bytes()) + ") has " +
           format_size(host_.limit_bytes() - std::min(host_.limit_bytes(), used)) + " left";
    return nullptr;
  }
  auto b = std::make_unique<HostBacking>();
  try {
    b->pages = cuda::PhysicalPages::on_host(device_, s.placed);
  } catch (const cuda::CudaError& e) {
    *why = e.what();
    return nullptr;
  }
  // Counted from here: a failure below gives the pages back through free_backing, which
  // keeps what CUDA refuses to release for later (a destructor could only drop it).
  backed_bytes_ += b->pages.size();
  try {
    if (b->pages.size() != s.placed)
      throw cuda::CudaError("host memory comes in " + format_size(b->pages.size()) + " for a span of " +
                                format_size(s.placed),
                            CUDA_ERROR_NOT_SUPPORTED);
    b->va = cuda::VaReservation(s.placed, pool_.granularity());
    b->own = cuda::Mapping(b->va.base(), b->pages);
  } catch (const cuda::CudaError& e) {
    *why = e.what();
    free_backing(std::move(b));
    return nullptr;
  }
  s.backing = std::move(b);
  update_peaks();
  return s.backing->host();
}

void Engine::Impl::address_on_host(Slot& s) {
  if (!s.backing || s.backing->at_block) return;
  try {
    s.backing->at_block = cuda::Mapping(s.addr, s.backing->pages);
    debug("its host memory mapped at its address", s);
  } catch (const cuda::CudaError& e) {
    stats::log(stats::LogLevel::kWarn, "device %d: mapping kept block %s's host copy at its address failed: %s (it "
               "is unaddressable until fetched)", device_, format_hex(s.addr).c_str(), e.what());
  }
}

bool Engine::Impl::unaddress_on_host(Slot& s, std::string* error) {
  if (!s.backing || !s.backing->at_block) return true;
  try {
    s.backing->at_block.unmap();
  } catch (const cuda::CudaError& e) {
    *error = "unmapping its host copy from its address failed: " + std::string(e.what());
    return false;
  }
  return true;
}

void Engine::Impl::release_backing(Slot& s, cudaStream_t stream) {
  if (!s.backing) return;
  if (s.host == s.backing->host()) s.host = nullptr;
  if (std::string error; !unaddress_on_host(s, &error))
    stats::log(stats::LogLevel::kWarn, "device %d: kept block %s: %s", device_, format_hex(s.addr).c_str(),
               error.c_str());
  if (stream) deferred_.push_back({nullptr, cuda::Event(), stream, std::move(s.backing)});
  else free_backing(std::move(s.backing));
}

void Engine::Impl::free_backing(std::unique_ptr<HostBacking> b) {
  const uint64_t bytes = b->pages.size();
  try {
    b->at_block.unmap();
    b->own.unmap();
    b->pages.release();
  } catch (const cuda::CudaError& e) {
    stats::log(stats::LogLevel::kWarn, "device %d: giving back %s of host VMM memory failed: %s (tried again later)",
               device_, format_size(bytes).c_str(), e.what());
    unreleased_.push_back(std::move(b));
    return;
  }
  backed_bytes_ -= bytes;
}

uint64_t Engine::Impl::host_checksum(const Slot& s) {
  if (!s.backing) return checksum(s.host, s.requested);
  // Host memory of the VMM API is the device's to reach: read it through a copy.
  std::vector<unsigned char> bytes(s.requested);
  cuda::copy_async(bytes.data(), s.host, s.requested, d2h_.get());
  cuda::synchronize_stream(d2h_.get());
  return checksum(bytes.data(), bytes.size());
}

bool Engine::Impl::start_eviction(uint32_t slot) {
  Slot& s = slots_[slot];
  if (stays_on_device(s)) return false;  // the policy never picks it; a plan made without that may
  std::string no_backing;
  void* backed = backing_host(slot, &no_backing);
  if (!no_backing.empty())
    stats::log(stats::LogLevel::kDebug, "device %d: kept block %s has no host memory of the VMM API (%s): its "
               "host copy goes to the host tier", device_, format_hex(s.addr).c_str(), no_backing.c_str());
  if (!backed && s.requested > host_.limit_bytes()) {
    const std::string why = "block " + format_hex(s.addr) + " (" + format_size(s.requested) +
                            ") is larger than the host tier's limit (VRAMSWAP_HOST_LIMIT, " +
                            format_size(host_.limit_bytes()) + ")";
    if (disk_) return evict_through_bounce(slot, why);  // Note [Blocks larger than the pinned tier]
    host_refusal_ = why + " and there is no disk tier (VRAMSWAP_DISK_DIR): it can never be evicted";
    return false;
  }
  std::string error;
  void* host = backed ? backed : host_allocate(s.requested, slot, &error);
  if (!host) {
    const std::string why =
        "no pinned host memory for block " + format_hex(s.addr) + " (" + format_size(s.requested) + "): " + error;
    if (disk_) return evict_through_bounce(slot, why);
    host_refusal_ = why;
    return false;
  }
  cuda::Event copied;
  bool queued = false;
  try {
    copied = events_.acquire();
    cuda::wait_event(d2h_.get(), s.cold_event);
    // A few copies of each recorded step are timed: the copy rate the plan needs.
    const bool timing = recorder_.active() && timed_copies_.size() < kTimedCopies && s.requested >= (1u << 20);
    cuda::Event t0, t1;
    if (timing) {
      t0 = timed_.acquire();
      t0.record(d2h_.get());
    }
    cuda::copy_async(host, reinterpret_cast<void*>(s.addr), s.requested, d2h_.get());
    queued = true;
    copied.record(d2h_.get());
    if (timing) {
      t1 = timed_.acquire();
      t1.record(d2h_.get());
      timed_copies_.push_back({std::move(t0), std::move(t1), s.requested});
    }
  } catch (const cuda::CudaError& e) {
    // Nothing left the device: the block stays resident and cold. A copy that was queued
    // still reads its pages and writes the host buffer (Note [A queued copy cannot be taken
    // back]): both go back only behind d2h_.
    if (copied) events_.release(std::move(copied));
    give_back_after_failed_copy(s, host, queued ? d2h_.get() : nullptr);
    throw;
  }
  copy_ordered(s, d2h_.get());
  s.copy_event = std::move(copied);
  s.host = host;
  s.cancel = false;
  s.residency = Residency::kEvicting;
  s.copy_seq = ++copy_seq_;
  in_flight_.push_back(slot);
  st_.in_flight_bytes += s.placed;
  update_peaks();
  debug("copy out started", s);
  return true;
}

// A kept block the plan wants out, cold again while the fetch that brought it back is still
// in flight as far as the host knows (Note [Kept blocks in the plan] in engine.h): its copy
// out is queued now, behind its use (which waited for the fetch), into the host buffer the
// fetch read from. As far as the block's bookkeeping goes the fetch is over: the copy out
// takes its place in flight.
void Engine::Impl::evict_after_fetch(uint32_t slot) {
  Slot& s = slots_[slot];
  cuda::Event copied = events_.acquire();
  bool queued = false;
  try {
    cuda::wait_event(d2h_.get(), s.cold_event);
    cuda::copy_async(s.host, reinterpret_cast<void*>(s.addr), s.requested, d2h_.get());
    queued = true;
    copied.record(d2h_.get());
  } catch (...) {
    // The fetch goes on as before; a copy out that was queued still reads the pages and
    // writes the host buffer (Note [A queued copy cannot be taken back]).
    events_.release(std::move(copied));
    if (queued) s.unordered_copy = d2h_.get();
    throw;
  }
  copy_ordered(s, d2h_.get());
  st_.evicted_bytes -= s.placed;  // the fetch landed, as far as the block's data goes
  events_.release(std::move(s.copy_event));
  s.copy_event = std::move(copied);
  s.cancel = false;
  s.residency = Residency::kEvicting;
  s.copy_seq = ++copy_seq_;
  s.planned = true;
  update_peaks();
  debug("copy out queued behind its fetch", s);
}

void Engine::Impl::start_planned_copy(uint32_t slot, const char* when) {
  Slot& s = slots_[slot];
  try {
    if (s.residency == Residency::kResident) {
      if (start_eviction(slot)) slots_[slot].planned = true;
    } else if (s.residency == Residency::kFetching && s.kept && !s.frozen && s.packs == 0 && !s.check) {
      // Used for the last time in this step, its fetch still in flight as far as the host
      // knows: its copy out for the next step is queued behind that use.
      evict_after_fetch(slot);
    }
  } catch (const std::exception& e) {
    stats::log(stats::LogLevel::kWarn, "planned eviction %s on device %d failed: %s (the block stays on the device)",
               when, device_, e.what());
  }
}

void* Engine::Impl::host_allocate(uint64_t bytes, uint32_t except, std::string* error, bool needed) {
  void* host = host_.allocate(bytes, error);
  // Writes ahead under way free their buffers when done: wait for them, oldest first, before
  // sending more blocks to the disk.
  while (host == nullptr && !writing_.empty()) {
    finish_write(writing_.front(), true);
    error->clear();
    host = host_.allocate(bytes, error);
  }
  if (host == nullptr && needed) {
    // Needed now: the copies in flight and the buffers freed behind them give pinned memory
    // back as they land, sooner than a write to the disk would. Wait for them first.
    complete_copies(true);
    error->clear();
    host = host_.allocate(bytes, error);
  }
  while (host == nullptr && disk_) {
    // The pinned tier is full: the evicted block needed furthest away moves on to the disk.
    uint32_t victim = policy::kNoSlot;
    order_.each_furthest_first([&](uint32_t slot) {
      const Slot& s = slots_[slot];
      if (slot == except || !s.live || s.residency != Residency::kEvicted || s.on_disk() || s.fetch_pending ||
          s.writing || s.backing)
        return true;
      victim = slot;
      return false;
    });
    std::string why;
    if (victim == policy::kNoSlot) break;
    if (!spill(victim, &why)) {
      *error += "; the disk tier could not take more: " + why;
      break;
    }
    error->clear();
    host = host_.allocate(bytes, error);
  }
  if (host == nullptr && needed) {
    // Needed now, and nothing left that can go to the disk: blocks copied out but still on
    // the device (clean) give up their host copies, needed furthest away first. They are
    // resident again, and copied out anew if they must leave.
    order_.each_furthest_first([&](uint32_t slot) {
      Slot& s = slots_[slot];
      if (slot == except || !s.live || s.residency != Residency::kClean || s.backing) return true;
      forget_host_copy(s);
      debug("host copy given up for a block needed now", s);
      error->clear();
      host = host_.allocate(bytes, error);
      return host == nullptr;
    });
  }
  return host;
}

bool Engine::Impl::spill(uint32_t slot, std::string* error) {
  Slot& s = slots_[slot];
  const std::optional<uint64_t> offset = disk_->reserve(s.requested, error);
  if (!offset) return false;
  if (std::string failed = disk_->wait(disk_->write(*offset, s.host, s.requested)); !failed.empty()) {
    std::string ignored;
    disk_->release(*offset, &ignored);
    *error = std::move(failed);
    return false;  // the host copy stays as it was
  }
  give_back_host(s);
  s.disk = *offset;
  st_.disk_bytes += s.requested;
  st_.disk_bytes_written += s.requested;
  debug("moved on to the disk tier", s);
  return true;
}

Status Engine::Impl::unspill(uint32_t slot, bool* no_room) {
  Slot& s = slots_[slot];
  if (s.reading) {
    finish_read(slot, true);
    if (!s.on_disk()) return {};
  }
  std::string error;
  void* host = host_allocate(s.requested, slot, &error, true);
  *no_room = host == nullptr;
  if (host == nullptr)
    return {false, "cannot bring block " + format_hex(s.addr) + " (" + format_size(s.requested) +
                       ") back from the disk tier: no pinned memory to read it into: " + error +
                       "; it stays on the disk"};
  if (std::string failed = disk_->wait(disk_->read(s.disk, host, s.requested)); !failed.empty()) {
    host_.free(host);
    return {false, "cannot bring block " + format_hex(s.addr) + " back from the disk tier: " + failed +
                       "; it stays on the disk"};
  }
  forget_disk_copy(s);
  s.host = host;
  st_.disk_bytes_read += s.requested;
  debug("read back from the disk tier", s);
  return {};
}

// Note [Blocks larger than the pinned tier]
// -----------------------------------------
// A block moves between the device and the disk through pinned memory. When the pinned tier
// cannot hold the block (it is larger than VRAMSWAP_HOST_LIMIT, or what holds the tier cannot
// move: host copies of frozen weights on the device, buffers of copies in flight), the block
// goes through a bounce buffer instead: a pinned buffer of up to kBounceBytes taken from the
// tier for the move and given back after it, chunk by chunk, waiting for each copy and each
// disk job. Out: the copy to the bounce buffer, then its write; the block ends evicted and on
// the disk, its pages given up as a clean block's are. In: the read, then the copy to the
// block's pages, mapped first; the block ends resident. So the disk tier serves blocks of
// any size, behind a pinned tier of any size, and a block needed from the disk never fails
// for want of pinned memory: the bounce buffer is the least the tier can give (down to
// kMinBounceBytes, making room as for any block needed now). The move waits, where the
// pinned path overlaps its copies with compute: it is the path of last resort, counted in
// disk_bytes_bounced.

void* Engine::Impl::bounce_allocate(uint64_t bytes, uint32_t except, uint64_t* chunk, std::string* error) {
  // Whole disk units, so that every chunk after the first starts page-aligned in the file.
  const uint64_t whole = (bytes + kDiskUnit - 1) / kDiskUnit * kDiskUnit;
  for (uint64_t size = std::min(kBounceBytes, whole); size >= kMinBounceBytes; size = size / 2 / kDiskUnit * kDiskUnit) {
    if (void* p = host_.allocate(size, error)) {
      *chunk = size;
      return p;
    }
  }
  error->clear();
  const uint64_t least = std::min(kMinBounceBytes, whole);
  void* p = host_allocate(least, except, error, true);
  if (p) *chunk = least;
  return p;
}

bool Engine::Impl::evict_through_bounce(uint32_t slot, const std::string& not_pinned) {
  std::string error;
  const std::optional<uint64_t> offset = disk_->reserve(slots_[slot].requested, &error);
  if (!offset) {
    host_refusal_ = not_pinned + "; nor can it go to the disk tier through a bounce buffer: " + error;
    return false;
  }
  auto give_back_extent = [&] {
    std::string ignored;
    disk_->release(*offset, &ignored);
  };
  uint64_t chunk = 0;
  void* bounce = bounce_allocate(slots_[slot].requested, slot, &chunk, &error);
  if (!bounce) {
    give_back_extent();
    host_refusal_ = not_pinned + "; nor is there pinned memory for a bounce buffer to move it to the disk tier: " + error;
    return false;
  }
  Slot& s = slots_[slot];
  cuda::Event landed;
  bool queued = false;
  uint64_t sum = kChecksumStart;
  std::string failed;
  try {
    landed = events_.acquire();
    cuda::wait_event(d2h_.get(), s.cold_event);
    for (uint64_t done = 0; done < s.requested && failed.empty(); done += chunk) {
      const uint64_t n = std::min(chunk, s.requested - done);
      cuda::copy_async(bounce, reinterpret_cast<void*>(s.addr + done), n, d2h_.get());
      queued = true;
      landed.record(d2h_.get());
      landed.synchronize();
      queued = false;
      if (options_.verify) sum = checksum(bounce, n, sum);
      failed = disk_->wait(disk_->write(*offset + done, bounce, n));
    }
  } catch (const cuda::CudaError&) {
    // The block stays resident; a copy still queued reads its pages and writes the bounce
    // buffer (Note [A queued copy cannot be taken back]).
    if (landed) events_.release(std::move(landed));
    give_back_extent();
    give_back_after_failed_copy(s, bounce, queued ? d2h_.get() : nullptr);
    throw;
  }
  events_.release(std::move(landed));
  host_.free(bounce);
  copy_ordered(s, d2h_.get());
  if (!failed.empty()) {
    give_back_extent();
    host_refusal_ = not_pinned + "; nor could it move to the disk tier through a bounce buffer: " + failed;
    return false;
  }
  s.disk = *offset;
  st_.disk_bytes += s.requested;
  st_.disk_bytes_written += s.requested;
  st_.disk_bytes_bounced += s.requested;
  st_.bytes_evicted_total += s.requested;
  ++st_.num_evictions;
  if (s.frozen) st_.frozen_bytes_d2h += s.requested;
  if (options_.verify) s.checksum = sum;
  // Its data is on the disk: its pages go as a clean block's do.
  s.residency = Residency::kClean;
  s.cancel = false;
  s.fresh_copy = true;
  st_.clean_bytes += s.placed;
  debug("copied out to the disk tier through the bounce buffer", s);
  try {
    drop(slot);
  } catch (const cuda::CudaError&) {
    Slot& d = slots_[slot];
    if (d.residency == Residency::kClean) {  // nothing was unmapped: it stays resident
      forget_disk_copy(d);
      d.residency = Residency::kResident;
      st_.clean_bytes -= d.placed;
    }
    throw;
  }
  return true;
}

Status Engine::Impl::fetch_through_bounce(uint32_t slot, void* bounce, uint64_t chunk) {
  Slot& s = slots_[slot];
  s.pages_kept = true;  // mapped for it: a failure below leaves them for the next try
  const std::string what = "cannot bring block " + format_hex(s.addr) + " (" + format_size(s.requested) +
                           ") back from the disk tier through the bounce buffer: ";
  cuda::Event landed;
  bool queued = false;
  uint64_t sum = kChecksumStart;
  std::string failed;
  try {
    landed = events_.acquire();
    for (uint64_t done = 0; done < s.requested; done += chunk) {
      const uint64_t n = std::min(chunk, s.requested - done);
      failed = disk_->wait(disk_->read(s.disk + done, bounce, n));
      if (!failed.empty()) break;
      if (options_.verify) sum = checksum(bounce, n, sum);
      cuda::copy_async(reinterpret_cast<void*>(s.addr + done), bounce, n, h2d_.get());
      queued = true;
      landed.record(h2d_.get());
      landed.synchronize();
      queued = false;
    }
  } catch (const cuda::CudaError& e) {
    // A copy still queued reads the bounce buffer and writes the pages (Note [A queued copy
    // cannot be taken back]); the block stays on the disk.
    if (landed) events_.release(std::move(landed));
    give_back_after_failed_copy(s, bounce, queued ? h2d_.get() : nullptr);
    return {false, what + e.what() + "; it stays on the disk (a later unpack tries again)"};
  }
  events_.release(std::move(landed));
  host_.free(bounce);
  if (!failed.empty()) return {false, what + failed + "; it stays on the disk"};
  copy_ordered(s, h2d_.get());
  if (options_.verify) check_restored(s, sum);
  forget_disk_copy(s);
  s.pages_kept = false;
  st_.disk_bytes_read += s.requested;
  st_.disk_bytes_bounced += s.requested;
  st_.evicted_bytes -= s.placed;
  st_.bytes_prefetched_total += s.requested;
  s.residency = Residency::kResident;
  debug("read back from the disk tier through the bounce buffer, resident", s);
  return {};
}

// Note [Reading ahead from the disk]
// ----------------------------------
// A block on the disk needed now is read back waiting (unspill). One the window, the fetch
// ahead, a hint or the plan asks for first gets a pinned buffer from free pinned memory (see
// below; none: nothing is mapped or read), then its device pages, as any fetch of that kind
// would (when it cannot, the buffer goes back and nothing is read: the window walk stops
// there, as for a block on the host); then a read is queued on the disk tier's I/O, and
// the call returns. The block stays
// evicted and on the disk with its pages mapped (Slot::pages_kept), `reading` set, until a
// later call finds the read done (complete_copies polls, as it does for copies) and starts
// its copy to the device into those pages. An unpack or a free of it meanwhile waits for
// the read first. So the disk's latency overlaps the compute before the block's turn, where
// before every read waited under the engine's lock. A failed read leaves the block on the
// disk (its extent kept, its pages mapped for the next try), logged.
// Reading ahead with no device room for the block held its buffer in pinned memory until a
// later prefetch and pushed other blocks to the disk: test_disk_tier.py moved 283 MB
// through the disk where reading at use moved 193; with the pages first it moves 191.
// The pinned buffer is taken only where the tier has it free. Making room for it sent the
// evicted block needed furthest away to the disk, which is one needed before the block read
// whenever the pinned tier holds only blocks needed sooner (as Belady's order leaves it),
// and every such block crosses the disk twice more. On the benchmark's disk step at 60% of
// its peak (gpt-small-disk, following its plan) that sent 1.74 GiB through the disk each
// way, 1.39x the least the step needs, in 630 ms; reading only into free pinned memory,
// 1.46 / 1.32 GiB (written / read; 1.11x) in 504 ms. A read that found no room is made
// later, by the window or the plan, or at use, when a block is needed now (unspill).
// The buffer is taken before the pages are mapped, and a fetch that finds none maps nothing:
// mapped first, the pages were unmapped again when the read could not start, and the plan
// tries its due fetches at every point, so the benchmark's disk step at 75% of its peak made
// 7,339 maps and 7,346 unmaps in a step of 84 evictions (each tens of microseconds of host
// time on a GPU; DiskSpill.AReadAheadWithNoPinnedRoomMapsNothing).
void Engine::Impl::start_read(uint32_t slot, void* host) {
  Slot& s = slots_[slot];
  reading_.push_back(slot);  // before the read: a failure of push_back leaves nothing queued
  s.host = host;
  s.reading = disk_->read(s.disk, host, s.requested);
  debug("read back from the disk tier started (ahead of use)", s);
}

void Engine::Impl::finish_read(uint32_t slot, bool wait) {
  Slot& s = slots_[slot];
  if (!wait && !disk_->done(s.reading)) return;
  const std::string failed = disk_->wait(s.reading);
  s.reading.reset();
  std::erase(reading_, slot);
  if (!failed.empty()) {
    host_.free(s.host);
    s.host = nullptr;
    stats::log(stats::LogLevel::kWarn, "device %d: reading block %s back from the disk tier failed: %s (it stays "
               "there; the next fetch tries again)", device_, format_hex(s.addr).c_str(), failed.c_str());
    return;
  }
  forget_disk_copy(s);
  st_.disk_bytes_read += s.requested;
  st_.disk_bytes_read_ahead += s.requested;
  debug("read back from the disk tier (ahead of use)", s);
  // Its pages were mapped for it: on to the device now (a caller that waited goes on itself).
  if (!wait && s.pages_kept) {
    try {
      Status r = start_fetch(slot, Fetch::kKept);
      if (!r.ok)
        stats::log(stats::LogLevel::kWarn, "device %d: %s (fetched when needed)", device_, r.message.c_str());
    } catch (const std::exception& e) {
      stats::log(stats::LogLevel::kWarn, "device %d: the fetch after reading block %s from the disk failed: %s",
                 device_, format_hex(s.addr).c_str(), e.what());
    }
  }
}

// Note [Writing ahead to the disk]
// ---------------------------------
// Sending a block to the disk when an eviction finds the pinned tier full makes that
// eviction (and the allocation waiting for it) wait for the write. So, in the background
// work after a tagged allocation or a cold mark, while the pinned tier has less than a
// quarter of its limit free (counting what the writes under way will free) and less than
// the cold blocks on the device would need, the evicted blocks needed furthest away
// (outside the prefetch window) start their writes to the disk on the tier's threads, until
// that much is free. A block being written is still an evicted block with its host
// copy: a fetch or a free of it waits for the write, gives the extent back and keeps the
// host copy; a completed write (found by complete_copies' polling) frees the host buffer
// and leaves the block on the disk. An eviction that finds the tier full waits for the
// writes under way, oldest first, before it sends more blocks to the disk itself.
// The cost: a write ahead is a guess that evictions will come. When none does (the forward
// ended with cold blocks still on the device), the block went to the disk for nothing and is
// read back ahead of use like any other: DiskSpill.BlocksPastAFullHostTierGoToDiskAndComeBackWhole
// writes 12 MiB where waiting for each need wrote 8, in exchange for evictions that never
// wait for the disk.
// Following a plan there is no guess to make: the plan says how many bytes will be out at
// each point (StepRecorder::planned_out_ahead, the most from the current point to the
// step's end), so the disk must hold what of that the pinned tier cannot, and the writes
// ahead go on, furthest needed first, only until the disk holds or is being written that
// much. The guess above wrote more: on the benchmark's disk step at 60% of its peak
// (gpt-small-disk) it kept a quarter of the pinned tier free through the forward and sent
// 2.14 GiB through the disk each way, 1.72x the least the step needs, in 782 ms; counting
// the plan's bytes, 1.74 GiB (1.39x) in 630 ms (tests/bench_py/test_runner.py holds it
// within 1.5x).
void Engine::Impl::write_ahead() {
  if (!disk_) return;
  const uint64_t limit = host_.limit_bytes();
  // The prefetch window, made only once a write is wanted (this runs after every tagged
  // allocation and cold mark, and most calls return before).
  std::optional<policy::Window> window;
  auto in_window = [&](uint32_t slot) {
    if (!window) window = policy::window_of(order_, options_.horizon);
    return window->count(slot) > 0;
  };
  uint64_t to_write = 0;  // bytes to start writing now
  if (recorder_.following()) {
    // Following a plan: the disk must hold what the plan has out beyond the pinned tier at
    // the worst point still to come; the writes on the disk or under way count toward it.
    const uint64_t out = recorder_.planned_out_ahead();
    const uint64_t need = out > limit ? out - limit : 0;
    const uint64_t held = st_.disk_bytes + writing_bytes_;
    if (need <= held) return;
    to_write = need - held;
  } else {
    const uint64_t used = host_.used_bytes() - std::min(host_.used_bytes(), writing_bytes_);
    const uint64_t free = limit - std::min(limit, used);
    if (free >= limit / 4) return;
    // Room is wanted only for the evictions that can come: the cold blocks on the device, as
    // far as a quarter of the tier (the walk stops there: it runs after allocations).
    uint64_t evictable = 0;
    order_.each_furthest_first([&](uint32_t slot) {
      if (policy::evictable(view(slot), in_window(slot))) evictable += slots_[slot].requested;
      return evictable < limit / 4;
    });
    const uint64_t wanted = std::min(evictable, limit / 4);
    if (free >= wanted) return;
    to_write = wanted - free;
  }
  std::vector<uint32_t> victims;
  uint64_t planned = 0;
  order_.each_furthest_first([&](uint32_t slot) {
    if (planned >= to_write) return false;
    const Slot& s = slots_[slot];
    if (!s.live || s.residency != Residency::kEvicted || s.on_disk() || s.writing || s.fetch_pending || s.backing ||
        in_window(slot))
      return true;
    victims.push_back(slot);
    planned += s.requested;
    return true;
  });
  for (uint32_t slot : victims) {
    Slot& s = slots_[slot];
    std::string error;
    const std::optional<uint64_t> offset = disk_->reserve(s.requested, &error);
    if (!offset) return;  // the disk is full: evictions will say so when it matters
    writing_.push_back(slot);
    s.write_offset = *offset;
    s.writing = disk_->write(*offset, s.host, s.requested);
    writing_bytes_ += s.requested;
    debug("write to the disk tier started (ahead of need)", s);
  }
}

void Engine::Impl::finish_write(uint32_t slot, bool wait, bool keep_host) {
  Slot& s = slots_[slot];
  if (!wait && !disk_->done(s.writing)) return;
  const std::string failed = disk_->wait(s.writing);
  s.writing.reset();
  std::erase(writing_, slot);
  writing_bytes_ -= s.requested;
  if (!failed.empty() || keep_host) {
    std::string ignored;
    disk_->release(s.write_offset, &ignored);
    if (!failed.empty())
      stats::log(stats::LogLevel::kWarn, "device %d: writing block %s to the disk tier failed: %s (it stays in "
                 "pinned memory)", device_, format_hex(s.addr).c_str(), failed.c_str());
    return;
  }
  give_back_host(s);
  s.disk = s.write_offset;
  st_.disk_bytes += s.requested;
  st_.disk_bytes_written += s.requested;
  st_.disk_bytes_written_ahead += s.requested;
  debug("moved on to the disk tier (written ahead of need)", s);
}

void Engine::Impl::forget_disk_copy(Slot& s) {
  std::string error;
  if (!disk_->release(s.disk, &error))
    stats::log(stats::LogLevel::kWarn, "device %d: block %s: %s", device_, format_hex(s.addr).c_str(), error.c_str());
  s.disk = Slot::kNoDisk;
  st_.disk_bytes -= s.requested;
}

Status Engine::Impl::start_fetch(uint32_t slot, Fetch kind, cudaStream_t stream) {
  Slot& s = slots_[slot];
  if (s.writing) finish_write(slot, true, true);  // its host copy is what comes back
  if (s.on_disk() && s.reading && kind != Fetch::kNeeded) return {};  // on its way already
  // Making room below may evict other blocks, whose host buffers may send copies to the disk:
  // never this one's.
  s.fetch_pending = true;
  struct Unpend {
    Slot& s;
    ~Unpend() { s.fetch_pending = false; }
  } unpend{s};
  // A pinned buffer freed when this returns, unless a read or a copy takes it.
  struct Staging {
    HostTier& tier;
    void* host = nullptr;
    ~Staging() {
      if (host) tier.free(host);
    }
  } staging{host_}, bounce{host_};
  uint64_t chunk = 0;
  // Needed now: disk -> pinned memory first, waiting (Note [The disk tier]); then as any
  // evicted block. With no pinned memory for it, a bounce buffer, taken before its pages are
  // mapped (Note [Blocks larger than the pinned tier]). Ahead of use: its pages first, then
  // the read (below).
  if (s.on_disk() && kind == Fetch::kNeeded) {
    bool no_room = false;
    if (Status r = unspill(slot, &no_room); !r.ok) {
      if (!no_room) return r;
      std::string error;
      bounce.host = bounce_allocate(s.requested, slot, &chunk, &error);
      if (!bounce.host) return {false, r.message + "; and no bounce buffer to read it through: " + error};
    }
  }
  // Ahead of use, a block on the disk reads into a pinned buffer of its own, from free pinned
  // memory only (making room would send another block to the disk, to cross it twice for a
  // read that can wait), taken before its pages are mapped (Note [Reading ahead from the
  // disk]).
  if (s.on_disk() && !s.reading && !bounce.host) {
    std::string error;
    staging.host = host_.allocate(s.requested, &error);
    if (!staging.host)
      return {false, "cannot read block " + format_hex(s.addr) + " back from the disk tier ahead of use: " + error};
  }
  using MapWait = pool::DevicePool::MapWait;
  void* const addr = reinterpret_cast<void*>(s.addr);
  pool::Result mapped;
  if (s.pages_kept) kind = Fetch::kKept;
  // Its host memory leaves its address before device pages come there (Note [Kept blocks
  // stay addressable]); mapped there again if they cannot come.
  if (std::string error; !unaddress_on_host(s, &error))
    return {false, "cannot bring block " + format_hex(s.addr) + " back to the device: " + error};
  struct Readdress {
    Engine::Impl& engine;
    Slot& s;
    bool fetched = false;
    ~Readdress() {
      if (!fetched && !s.pages_kept) engine.address_on_host(s);
    }
  } readdress{*this, s};
  switch (kind) {
    case Fetch::kKept:  // a failed fetch left the pages mapped: nothing to map
      s.pages_kept = false;
      break;
    case Fetch::kAhead:
      mapped = pool_.map_block(addr, MapWait::kNone);
      break;
    case Fetch::kHint:
      mapped = pool_.map_block(addr, MapWait::kPendingFrees);
      break;
    case Fetch::kPlanned:  // the plan says the memory is there: the caller's stream's cache too
      mapped = pool_.map_block(addr, MapWait::kStream, stream);
      break;
    case Fetch::kPrefetch:
      // Never synchronizes the device: memory free at once or freed behind an event (a tagged
      // block freed by backward), waiting for that event; else clean blocks needed later.
      mapped = pool_.map_block(addr, MapWait::kPendingFrees);
      if (!mapped.ok && reactive().make_room(s.placed, slot) > 0) mapped = pool_.map_block(addr, MapWait::kPendingFrees);
      break;
    case Fetch::kNeeded:
      mapped = pool_.map_block(addr, MapWait::kSynchronize);
      if (!mapped.ok) {
        reactive().reclaim(s.placed, true, slot);
        mapped = pool_.map_block(addr, MapWait::kSynchronize);
      }
      break;
  }
  if (!mapped.ok) {
    // Needed now and refused for want of memory: the program's out-of-memory (the caller
    // raises it as one), counted as the pool counts its own.
    const bool out_of_memory = kind == Fetch::kNeeded && mapped.out_of_memory;
    if (out_of_memory) pool_.count_out_of_memory();
    return {false,
            "cannot bring block " + format_hex(s.addr) + " (" + format_size(s.placed) + ") back to the device: " +
                mapped.message,
            out_of_memory};
  }
  if (bounce.host) return fetch_through_bounce(slot, std::exchange(bounce.host, nullptr), chunk);
  if (s.on_disk()) {
    // Ahead of use (Note [Reading ahead from the disk]): its pages are mapped for it; the read
    // starts now and its copy to the device when the read is found done.
    s.pages_kept = true;
    start_read(slot, std::exchange(staging.host, nullptr));
    return {};
  }
  void* check = nullptr;
  cuda::Event copied;
  try {
    copied = events_.acquire();
    cuda::Event started;
    time_fetch_start(&started);
    cuda::copy_async(addr, s.host, s.requested, h2d_.get());
    if (options_.verify) {
      // Read the restored block back before anyone can use it (readers wait for the event
      // recorded after this): a later check would see the program's own writes.
      std::string error;
      check = host_.allocate(s.requested, &error);
      if (check) cuda::copy_async(check, addr, s.requested, h2d_.get());
    }
    copied.record(h2d_.get());
    time_fetch_end(s, std::move(started));
  } catch (const cuda::CudaError& e) {
    // The block stays on the host, unmapped as it was, so that a later call can try again.
    if (copied) events_.release(std::move(copied));
    const bool quiet = cuda::synchronize_stream(h2d_.get());
    if (check) {
      if (quiet) host_.free(check);
      else deferred_.push_back({check, cuda::Event(), h2d_.get(), nullptr});
    }
    // Unmapped again once no copy can touch the pages; else they stay, and the next fetch
    // uses them as they are. A copy still queued writes them and reads the host copy (Note [A
    // queued copy cannot be taken back]).
    bool partly = false;
    if (!quiet || (!pool_.unmap_block(addr, &partly).ok && !partly)) s.pages_kept = true;
    if (!quiet) s.unordered_copy = h2d_.get();
    return {false, "cannot bring block " + format_hex(s.addr) + " back to the device: " + e.what() +
                       "; it stays on the host (a later unpack tries again)"};
  }
  static constexpr const char* kWhy[] = {"fetch started (needed now: a fault)", "fetch started (prefetch window)",
                                         "fetch started (ahead of the window)", "fetch started (hint)",
                                         "fetch started (planned)", "fetch started (pages kept)"};
  debug(kWhy[int(kind)], s);
  readdress.fetched = true;
  copy_ordered(s, h2d_.get());
  s.copy_event = std::move(copied);
  s.check = check;
  s.residency = Residency::kFetching;
  in_flight_.push_back(slot);
  st_.in_flight_bytes += s.placed;
  st_.bytes_prefetched_total += s.requested;
  if (kind != Fetch::kAhead) fetch_granule_mates(slot);
  return {};
}

// Note [A shared granule goes as a whole]
// ----------------------------------------
// Evicting one small block of a shared granule frees nothing while another block on it is
// in use: make_room counted its bytes as covered anyway, stopped short, and copied out
// blocks whose pages stayed. A small victim now takes its granule with it: when every other
// tagged block on the granules it touches is evictable (cold, outside the window), away,
// leaving, or copied out (clean: dropped with the others), and no ordinary block lives
// there, all the evictable ones start their copies together and the granules' bytes count
// as covered; otherwise none moves (the granule is not a victim yet) and the next
// candidate is looked at.
// The same holds for a block of one granule placed densely across two (after a step without
// pressure: Note [A step without pressure] in pool/device_pool.h), each shared with a
// neighbour: alone it frees no page, so it goes with the blocks on its granules
// (shares_granules: it covers no granule whole). Belady's victims can be every other block
// of such a run (backward's order is not the placement's): copied out one by one they freed
// nothing, and an allocation ran out of memory with 12 MiB of them cold
// (EngineTest.ABlockPlacedAcrossGranulesGoesWithTheBlocksOnThem).
uint64_t Engine::Impl::evict_granule(uint32_t slot, const policy::Window& window) {
  const Slot& s = slots_[slot];
  if (pool_.shares_granule_with_ordinary(reinterpret_cast<void*>(s.addr))) return 0;
  uintptr_t lo, hi;
  granule_span(s, &lo, &hi);
  std::vector<uint32_t> group;
  // A block starting before `lo` may run onto it: start the walk at the one before.
  auto it = by_addr_.lower_bound(lo);
  if (it != by_addr_.begin()) --it;
  for (; it != by_addr_.end() && it->first < hi; ++it) {
    const Slot& m = slots_[it->second];
    if (!m.live || m.addr + m.placed <= lo) continue;
    switch (policy::granule_mate(view(it->second), window.count(it->second))) {
      case policy::Mate::kJoins:
        group.push_back(it->second);
        break;
      case policy::Mate::kAway:
        break;
      case policy::Mate::kHolds:
        return 0;  // in use, in the window or fetching: the page stays
    }
  }
  for (uint32_t m : group)
    if (!start_eviction(m)) return 0;  // the host tier is full: what started frees later
  return hi - lo;
}

// Note [A shared granule comes back whole]
// ----------------------------------------
// Small tagged blocks saved one after another share granules (Note [Placing for eviction]
// in device_pool.h); a granule's pages go only when all of them are away, so they leave
// together, and backward needs them back together. When the first of them is fetched the
// granule is mapped for it anyway: the others' copies start with it (as fetches ahead:
// kAhead maps nothing new, and they are counted as prefetches), so that backward finds them
// on their way instead of faulting one by one. A block that runs onto a granule the fetch did
// not map waits for its own fetch.
void Engine::Impl::fetch_granule_mates(uint32_t slot) {
  const Slot& s = slots_[slot];
  if (!shares_granules(s)) return;
  // Fetched early, the others hold the granule until the last of them is used, where alone
  // it would go between their uses: only below the soft limit, as fetches ahead.
  if (pool_.stats().mapped_bytes > soft_limit()) return;
  uintptr_t lo, hi;
  granule_span(s, &lo, &hi);
  std::vector<uint32_t> mates;
  for (auto it = by_addr_.lower_bound(lo); it != by_addr_.end() && it->first < hi; ++it) {
    const Slot& m = slots_[it->second];
    if (it->second != slot && m.live && m.residency == Residency::kEvicted && !m.pages_kept && m.addr + m.placed <= hi)
      mates.push_back(it->second);
  }
  for (uint32_t m : mates)
    if (start_fetch(m, Fetch::kAhead).ok) ++st_.num_prefetches;
}

void Engine::Impl::finish(uint32_t slot) {
  Slot& s = slots_[slot];
  st_.in_flight_bytes -= s.placed;
  const bool planned = s.planned;
  s.planned = false;
  if (s.residency == Residency::kEvicting) {
    if (s.cancel) {  // wanted again before the copy ended: it never left
      give_back_host(s);
      s.residency = Residency::kResident;
      debug("eviction cancelled (used again before its copy landed)", s);
    } else {  // clean: its pages go when memory is needed (drop)
      if (options_.verify) s.checksum = host_checksum(s);
      if (planned) st_.planned_bytes_d2h += s.requested;
      if (s.frozen) st_.frozen_bytes_d2h += s.requested;
      s.fresh_copy = true;
      s.residency = Residency::kClean;
      debug(planned ? "copied out, clean (a planned victim)" : "copied out, clean", s);
      st_.clean_bytes += s.placed;
      st_.bytes_evicted_total += s.requested;
      ++st_.num_evictions;
    }
  } else {  // a fetch
    if (s.check) {
      // The readback queued behind the fetch (start_fetch) has landed with it.
      const uint64_t got = checksum(s.check, s.requested);
      host_.free(s.check);
      s.check = nullptr;
      check_restored(s, got);
    }
    st_.evicted_bytes -= s.placed;
    // A frozen block's host copy stays valid (Note [Kept blocks] in engine.h), unless a copy
    // out queued behind the fetch lost its event: clean, its pages could be dropped under it.
    if (s.frozen && !s.unordered_copy) {
      s.residency = Residency::kClean;
      st_.clean_bytes += s.placed;
      debug("fetch landed, clean (frozen: its host copy stays)", s);
    } else {
      give_back_host(s);  // behind d2h_ when a copy out queued behind the fetch lost its event
      s.residency = Residency::kResident;
      debug("fetch landed, resident", s);
    }
  }
  events_.release(std::move(s.copy_event));
}

void Engine::Impl::check_restored(const Slot& s, uint64_t got) {
  if (got == s.checksum) return;
  ++st_.num_verify_failures;
  stats::log_always(stats::LogLevel::kError,
                    ("VRAMSWAP_VERIFY: block " + format_hex(s.addr) + " (" + std::to_string(s.requested) +
                     " bytes) on device " + std::to_string(device_) +
                     " came back different from what was evicted (checksum " + format_hex(got) + ", expected " +
                     format_hex(s.checksum) + ")")
                        .c_str());
}

void Engine::Impl::complete_copies(bool wait) {
  drop_deferred(wait);
  for (size_t i = reading_.size(); i-- > 0;) finish_read(reading_[i], wait);
  for (size_t i = writing_.size(); i-- > 0;) finish_write(writing_[i], wait);
  for (size_t i = 0; i < in_flight_.size();) {
    const uint32_t slot = in_flight_[i];
    Slot& s = slots_[slot];
    if (wait) s.copy_event.synchronize();
    else if (!s.copy_event.query()) {
      ++i;
      continue;
    }
    in_flight_[i] = in_flight_.back();
    in_flight_.pop_back();
    finish(slot);
  }
}

void Engine::Impl::drop_deferred(bool wait) {
  if (!unreleased_.empty()) {
    std::vector<std::unique_ptr<HostBacking>> again = std::move(unreleased_);
    unreleased_.clear();
    for (auto& b : again) free_backing(std::move(b));
  }
  for (size_t i = 0; i < deferred_.size();) {
    Deferred& d = deferred_[i];
    // Without an event, a call that must not wait only asks whether the stream is idle: a
    // synchronization here made every engine call wait for the whole fetch queue behind a
    // freed block's VRAMSWAP_VERIFY readback.
    bool done = !d.event || (wait ? (d.event.synchronize(), true) : d.event.query());
    if (done && d.stream) done = wait ? cuda::synchronize_stream(d.stream) : cuda::stream_done(d.stream);
    if (!done) {
      ++i;
      continue;
    }
    if (d.host) host_.free(d.host);
    if (d.backing) free_backing(std::move(d.backing));
    if (d.event) events_.release(std::move(d.event));
    deferred_[i] = std::move(deferred_.back());
    deferred_.pop_back();
  }
}

}  // namespace vramswap::residency
