// Allocator: the process-wide engine behind both faces (the C ABI of libvramswap.so and
// the cudaMalloc interposer of libvramswap_preload.so).
//
// Note [The process-wide allocator]
// ---------------------------------
// There is one Allocator per process (per loaded library), created by the first call that
// needs it and never destroyed: frees can arrive from static destructors and atexit
// handlers of the program after ours have run, and a leaked pool is harmless at exit
// whereas a destroyed one would turn those frees into crashes.
//
// Configuration is read once, from the VRAMSWAP_* environment, when the Allocator is
// created; configure() (vramswap_configure) changes it afterwards:
//   - VRAMSWAP_LOG, VRAMSWAP_STATS_FILE and VRAMSWAP_MIN_OFFLOAD_BYTES take effect at once;
//   - VRAMSWAP_LIMIT is resolved against each card when that device's pool is created (by
//     the first allocation on it), and VRAMSWAP_SOFT_LIMIT (against that limit),
//     VRAMSWAP_HOST_LIMIT, VRAMSWAP_HORIZON and VRAMSWAP_VERIFY become the options of the
//     device's engine, created with the pool. Once any pool exists these are frozen:
//     configure() refuses a different value (so every device runs under the settings the
//     user set) and accepts the same value as a no-op.
// A refused environment value (a typo in VRAMSWAP_LIMIT) must not be silently replaced by
// the default: that would run uncapped a program the user meant to cap. The preload stops
// the program (exit status 2) at load; through the C ABI every allocation fails with the
// error until configure() sets that key to a valid value.
//
// Pools: one pool::DevicePool per device, created lazily under mu_ and then published in
// pools_ (an atomic pointer per ordinal), so the hot path (allocate/deallocate of an
// existing pool) takes no lock of the Allocator: only the pool's own mutex. A free is
// routed to the pool whose VA reservation holds the pointer (the device argument is only
// a hint of where to look first).
//
// Engines: each pool has a residency::Engine (engine.h), created with it and published in
// engines_ before the pool, so a thread that sees a pool sees its engine. Routing:
//   - allocate(): while the calling thread has an offload scope open (scope_push, depth
//     > 0) and the request is at least VRAMSWAP_MIN_OFFLOAD_BYTES, the engine places a
//     tagged block (offloadable, evictable once packed and cold); otherwise the pool serves
//     it as before. The depth is per thread and per loaded library.
//   - deallocate(): a tagged block goes back through the engine (free_tagged, correct in
//     any residency state), every other block to the pool. The engine is asked only while
//     tagged blocks are live (num_live_tagged_), so a program that never opens a scope
//     frees with no lock but the pool's.
//   - the tracker protocol (pack, mark_cold, unpack, release, prefetch, keep, use, unkeep) goes to the engine
//     of the device that owns the pointer, or the device a handle names (its top byte).
// Under pressure the pool calls its engine (the reclaimer) to evict cold blocks, for tagged
// and untagged requests alike.
//
// Statistics: the pools and engines count; the Allocator adds up the devices and counts
// refused frees.
// The JSON document (stats_json) is what vramswap_stats_json returns and what is written
// to VRAMSWAP_STATS_FILE at exit, by the process that used the allocator (a forked child,
// or a process that merely loaded the preload and made no CUDA allocation, writes nothing,
// so a shell between the user and the program cannot overwrite the program's file).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "pool/device_pool.h"
#include "residency/engine.h"

namespace vramswap {

// Why an allocation returned nullptr (size 0 is not a failure: kind stays kNone).
struct AllocError {
  enum class Kind {
    kNone,
    kOutOfMemory,    // the limit or the device's memory
    kInvalidDevice,  // not a device ordinal vramswap can use
    kConfig,         // a VRAMSWAP_* value was refused and not corrected
    kCuda,           // a CUDA call failed (code holds its cudaError_t/CUresult)
  };
  Kind kind = Kind::kNone;
  int code = 0;
  std::string message;
};

enum class FreeOutcome {
  kFreed,     // returned to its pool
  kNotOwned,  // no pool's address range holds the pointer: not vramswap's
  kRefused,   // inside a pool but not a live block (double free, interior pointer)
};

class Allocator {
 public:
  // Ordinals above this are refused (the limit of src/cuda's primary-context table).
  static constexpr int kMaxDevices = 64;

  // The allocator, created on first use (reading the environment). Thread-safe.
  static Allocator& instance();

  // The environment's refused values, as read at creation ("VRAMSWAP_X='v' is not valid
  // ...: expected ..."); the preload stops the program on any. Thread-safe: immutable after
  // creation.
  const std::vector<std::string>& environment_errors() const { return environment_errors_; }

  // Sets one key (see Note [The process-wide allocator] for when it takes effect). The
  // error message, or nullopt on success. Thread-safe (mu_).
  std::optional<std::string> configure(std::string_view key, std::string_view value);

  // A block of `size` bytes on `device` for `stream`; nullptr with error->kind set on
  // failure (an out-of-memory is also logged as one warning), nullptr with kNone for size 0.
  // Thread-safe: an existing pool is reached with no lock but the pool's own.
  void* allocate(size_t size, int device, cudaStream_t stream, AllocError* error);

  // Returns `ptr` to the pool that owns it, to be reused in `stream`'s order. `device_hint`
  // is the pool looked at first (-1: none). kRefused and kNotOwned set *error; the caller
  // decides whether kNotOwned is an error (C ABI) or someone else's memory (preload).
  // *owner_device is set to the owning device on kFreed and kRefused. Thread-safe.
  FreeOutcome deallocate(void* ptr, int device_hint, cudaStream_t stream, std::string* error,
                         int* owner_device = nullptr);

  // Counts a free the caller refused (num_invalid_frees) and logs it at warn. Thread-safe.
  void report_invalid_free(const std::string& message);

  // ---- The offload scope (vramswap_scope_push/pop) ----
  // Opens a scope on the calling thread: until the matching scope_pop(), its allocations
  // of at least VRAMSWAP_MIN_OFFLOAD_BYTES are tagged. Scopes nest. Thread-safe
  // (thread-local).
  static void scope_push();
  // Closes the calling thread's innermost scope; false (nothing changes) when it has none.
  // Thread-safe (thread-local).
  static bool scope_pop();
  // The calling thread's scope depth (0: not in a scope). Thread-safe (thread-local).
  static int scope_depth();

  // ---- The tracker protocol (residency::Engine, Note [Block states]) ----
  // The handle of the tagged block holding `ptr`, or 0 when no live tagged block of any
  // device does (an untagged block, a pointer vramswap did not hand out). Thread-safe.
  uint64_t pack(const void* ptr, cudaStream_t stream);
  // A new forward starts, on every device's engine. Thread-safe.
  void graph_begin();
  // The engine calls for a handle, routed by its device. A handle of 0, or one naming a
  // device with no engine, is refused with a message naming the handle. Thread-safe.
  residency::Status mark_cold(uint64_t handle, cudaStream_t stream);
  residency::Status unpack(uint64_t handle, cudaStream_t stream);
  residency::Status release(uint64_t handle);
  residency::Status prefetch(uint64_t handle);
  // Kept blocks (Note [Kept blocks] in residency/engine.h): routed as pack and unpack are.
  uint64_t keep(const void* ptr, bool frozen);
  residency::Status use(uint64_t handle, cudaStream_t stream, residency::Engine::UseLane lane);
  residency::Status unkeep(uint64_t handle);
  // The tracker's cold probe (vramswap_set_cold_probe; nullptr removes it): every engine
  // calls it, for its device, when an allocation finds memory short. Thread-safe (atomic).
  using ColdProbe = size_t (*)(int device, cudaStream_t stream);
  void set_cold_probe(ColdProbe probe) { cold_probe_.store(probe, std::memory_order_release); }

  // record_stream on the pool that owns `ptr`. False with *error set if none does or the
  // block is not live. Thread-safe.
  bool record_stream(void* ptr, cudaStream_t stream, std::string* error);

  // From now on the program reports every stream before destroying it (stream_destroyed:
  // the preload, which interposes cudaStreamDestroy). The pools created after this call
  // retire other streams' cached blocks by synchronizing those streams, never the device
  // (PoolOptions::streams_reported). Call it before the first allocation. Thread-safe.
  void streams_are_reported() { streams_reported_.store(true, std::memory_order_release); }

  // A CUDA graph capture on a stream of `device` begins (or another period in which a stream
  // of it may capture: torch's begin-allocate-to-pool hook), or ends. Counted, so they nest
  // and overlap; while any is underway the device's pool never synchronizes the device
  // (PoolOptions::captures), which would invalidate every capture on it. False with *error
  // set for a device out of range, or an end with none begun. Thread-safe.
  bool capture_began(int device, std::string* error);
  bool capture_ended(int device, std::string* error);

  // Device `device` may access the blocks of device `peer` from now on (the program enabled
  // peer access, cudaDeviceEnablePeerAccess(peer) with `device` current): `peer`'s pool
  // grants `device` access to every mapping, now and later (DevicePool::grant_peer). False
  // with *error set for a device out of range or a refused grant. Thread-safe.
  bool enable_peer_access(int device, int peer, std::string* error);

  // The program is about to destroy `stream`: stream_destroyed on every pool (DevicePool's
  // promise: none names it to CUDA again). False with *error set if a pool could not
  // synchronize it. Thread-safe.
  bool stream_destroyed(cudaStream_t stream, std::string* error);

  // The device whose pool's address range holds `ptr`, or -1. Thread-safe: lock-free.
  int owner_of(const void* ptr) const;

  // empty_cache() on every pool; reset_peaks() on every pool and engine. Thread-safe (each
  // pool's lock in turn).
  void empty_cache();
  void reset_peaks();

  // What a device looks like through vramswap: its limit, and the pool's allocated and
  // reserved bytes (0 before the pool exists; the limit is then resolved against
  // `card_bytes`). Creates nothing. Thread-safe.
  struct DeviceMemory {
    uint64_t limit_bytes = 0;
    uint64_t allocated_bytes = 0;
    uint64_t reserved_bytes = 0;
  };
  DeviceMemory device_memory(int device, uint64_t card_bytes) const;

  // Every device's pool and engine invariants (vramswap_check_invariants): "" when all
  // hold, else each broken one, "; "-separated and prefixed with its device. Thread-safe.
  std::string check_invariants() const;

  // From now on every device's pool records its actions, keeping the last `max_entries`
  // (0: none, and those kept go): vramswap_record_history. Thread-safe.
  void record_history(size_t max_entries);

  // The memory snapshot document (runtime/snapshot_document.h): vramswap_snapshot_json.
  // Thread-safe; consistent per device, not across devices.
  std::string snapshot_json() const;

  // The statistics document (see vramswap.h, vramswap_stats_json, for its keys).
  // Thread-safe; consistent per device, not across devices.
  std::string stats_json() const;

  // Records that this process uses the allocator, so that it writes the stats file at exit.
  // Cheap after the first call. Thread-safe (atomic).
  void mark_used();

  // Writes stats_json() to VRAMSWAP_STATS_FILE if one is set (stats::write_stats_file: a
  // regular file is replaced atomically, a FIFO or device is written in place and never
  // replaced, a symlink is followed). Logs a failure at warn.
  // Thread-safe; called by the atexit handler.
  void write_stats_file() const;

 private:
  Allocator();

  pool::DevicePool* pool(int device) const {
    return device >= 0 && device < kMaxDevices ? pools_[device].load(std::memory_order_acquire) : nullptr;
  }
  residency::Engine* engine(int device) const {
    return device >= 0 && device < kMaxDevices ? engines_[device].load(std::memory_order_acquire) : nullptr;
  }
  pool::DevicePool* pool_or_create(int device, AllocError* error);
  // For an out-of-memory report, when less than half the live bytes are tagged: what can be
  // offloaded at all, and how much is in blocks below VRAMSWAP_MIN_OFFLOAD_BYTES ("" when
  // most of the live memory is tagged).
  std::string untagged_report(int device) const;
  // The engine a handle names, or nullptr with *error set ("<what>: handle ... ").
  residency::Engine* engine_of_handle(uint64_t handle, const char* what, std::string* error) const;
  // The AllocError for allocations refused while an environment value is wrong.
  void config_error(AllocError* error);

  // Guards config_, bad_environment_, pool creation and any_pool_.
  mutable std::mutex mu_;
  config::Config config_;
  std::vector<std::string> environment_errors_;
  // Keys whose environment value was refused and not corrected since, with the message.
  std::map<std::string, std::string, std::less<>> bad_environment_;
  std::atomic<bool> blocked_{false};  // !bad_environment_.empty(), for the hot path
  std::atomic<bool> streams_reported_{false};
  std::array<uint64_t, kMaxDevices> peers_{};  // per pool: the devices granted access (under mu_)
  std::array<std::atomic<int>, kMaxDevices> captures_{};  // per device: captures reported underway
  bool any_pool_ = false;
  bool settings_logged_ = false;

  std::array<std::atomic<pool::DevicePool*>, kMaxDevices> pools_{};
  std::array<std::atomic<residency::Engine*>, kMaxDevices> engines_{};  // set before pools_
  std::atomic<int> device_bound_{0};  // one past the highest ordinal with a pool

  // VRAMSWAP_MIN_OFFLOAD_BYTES, read by every allocation in a scope (config_ holds it too).
  std::atomic<uint64_t> min_offload_bytes_{0};
  // Tagged blocks handed out and not yet freed, over all devices: while 0, a free does not
  // ask the engine whether its block is tagged.
  std::atomic<uint64_t> num_live_tagged_{0};
  std::atomic<ColdProbe> cold_probe_{nullptr};

  std::atomic<uint64_t> num_invalid_frees_{0};
  size_t history_entries_ = 0;  // record_history's setting, for pools made later (under mu_)
  std::atomic<bool> config_error_logged_{false};
  std::atomic<int> user_pid_{0};  // the process that used the allocator (0: none yet)
};

}  // namespace vramswap
