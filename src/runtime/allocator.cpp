// The process-wide allocator (allocator.h, Note [The process-wide allocator]): its
// configuration, one pool and engine per device created on first use, allocations and
// frees routed to them, the offload scope. The tracker protocol is allocator_tracker.cpp,
// whole-device events allocator_devices.cpp, what it reports allocator_reports.cpp.
#include "runtime/allocator.h"

#include <cstdio>
#include <cstdlib>

#include "config/units.h"
#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/stream.h"
#include "stats/log.h"

namespace vramswap {
namespace {

using config::LogLevel;
using stats::log;

// The key a parse() error is about: its messages start "VRAMSWAP_X='value' ..." (config.h).
std::string key_of_error(const std::string& message) { return message.substr(0, message.find('=')); }

// The pool's report on one line, so that an out-of-memory is exactly one log line.
std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n') c = ' ';
  return text;
}

// The calling thread's offload scope depth (Allocator::scope_push). A plain int: it has no
// destructor, so it is safe in threads that outlive the library's teardown.
thread_local int t_scope_depth = 0;

void write_stats_at_exit() {
  // instance() is already constructed when this handler is registered.
  Allocator::instance().write_stats_file();
}

}  // namespace

Allocator& Allocator::instance() {
  // Leaked on purpose: see allocator.h.
  static Allocator* const allocator = new Allocator();
  return *allocator;
}

Allocator::Allocator() {
  config::ParseResult parsed = config::from_environment();
  config_ = parsed.config;
  min_offload_bytes_.store(config_.min_offload_bytes, std::memory_order_relaxed);
  stats::set_log_level(config_.log_level);
  for (const std::string& warning : parsed.warnings) log(LogLevel::kWarn, "%s", warning.c_str());
  environment_errors_ = parsed.errors;
  for (const std::string& error : parsed.errors) bad_environment_.emplace(key_of_error(error), error);
  blocked_.store(!bad_environment_.empty(), std::memory_order_release);
  std::atexit(write_stats_at_exit);
}

std::optional<std::string> Allocator::configure(std::string_view key, std::string_view value) {
  std::lock_guard lock(mu_);
  config::Config next = config_;
  if (std::optional<std::string> error = config::apply(next, key, value)) return error;
  if (any_pool_) {
    // Settings that became the options of the device pools and engines (the table's
    // "takes effect" column; Note [The process-wide allocator]).
    for (const config::KeySpec& spec : config::keys()) {
      if (spec.takes_effect == config::TakesEffect::kAtOnce || spec.same(next, config_)) continue;
      const std::string name(spec.name);
      return name + " cannot change to '" + std::string(value) +
             "' once vramswap has allocated: the device pools and engines were created under " + name + "=" +
             spec.show(config_, spec) + "; set it before the first allocation (in the environment or with "
             "vramswap_configure)";
    }
  }
  config_ = std::move(next);
  min_offload_bytes_.store(config_.min_offload_bytes, std::memory_order_relaxed);
  stats::set_log_level(config_.log_level);
  // A valid value clears a refused environment value of the key it sets: VRAMSWAP_CONF
  // sets the keys its items name (vramswap.h).
  std::vector<std::string> cleared{std::string(key)};
  if (key == config::kConfKey)
    for (std::string& named : config::keys_in_conf(value)) cleared.push_back(std::move(named));
  for (const std::string& k : cleared) bad_environment_.erase(k);
  blocked_.store(!bad_environment_.empty(), std::memory_order_release);
  return std::nullopt;
}

void Allocator::config_error(AllocError* error) {
  std::lock_guard lock(mu_);
  error->kind = AllocError::Kind::kConfig;
  error->message = "vramswap refuses to allocate until its configuration is fixed:";
  for (const auto& [key, message] : bad_environment_) error->message += " " + message + ";";
  error->message += " correct the environment or call vramswap_configure with a valid value";
  if (!config_error_logged_.exchange(true)) log(LogLevel::kError, "%s", error->message.c_str());
}

pool::DevicePool* Allocator::pool_or_create(int device, AllocError* error) {
  if (pool::DevicePool* p = pool(device)) return p;
  if (device < 0 || device >= kMaxDevices) {
    error->kind = AllocError::Kind::kInvalidDevice;
    error->code = cudaErrorInvalidDevice;
    error->message = "invalid device ordinal " + std::to_string(device);
    return nullptr;
  }
  std::lock_guard lock(mu_);
  if (pool::DevicePool* p = pool(device)) return p;  // another thread made it meanwhile
  uint64_t card_bytes = 0;
  uint64_t limit = 0;
  residency::EngineOptions engine_options;
  try {
    const cuda::DeviceInfo info = cuda::device_info(device);
    card_bytes = info.total_bytes;
    limit = config_.resolve_limit(card_bytes);
    if (limit < info.granularity) {
      // Every allocation maps at least one granule: such a limit would refuse them all.
      error->kind = AllocError::Kind::kConfig;
      error->message = "VRAMSWAP_LIMIT (" + format_size(limit) + " on device " + std::to_string(device) +
                       ") is below the device's allocation granularity (" + format_size(info.granularity) +
                       "), so nothing could be allocated: expected at least " + format_size(info.granularity);
      log(LogLevel::kError, "%s", error->message.c_str());
      return nullptr;
    }
    auto created = std::make_unique<pool::DevicePool>(
        pool::PoolOptions{device, limit, streams_reported_.load(std::memory_order_acquire), peers_[device],
                          &captures_[device]});
    engine_options.soft_limit_bytes = config_.resolve_soft_limit(limit);
    engine_options.host_limit_bytes = config_.host_limit.value_or(0);
    engine_options.disk_dir = config_.disk_dir;
    engine_options.disk_limit_bytes = config_.disk_limit.value_or(0);
    engine_options.disk_io =
        config_.disk_io == config::DiskIo::kCuFile ? residency::DiskIo::kCuFile : residency::DiskIo::kThreads;
    engine_options.horizon = static_cast<int>(config_.horizon);  // at most 1024 (the table's range)
    engine_options.verify = config_.verify;
    engine_options.plan = config_.plan == config::PlanMode::kAuto;
    engine_options.cold_probe = [this, device](cudaStream_t stream) -> uint64_t {
      const ColdProbe probe = cold_probe_.load(std::memory_order_acquire);
      return probe ? probe(device, stream) : 0;
    };
    // The engine installs itself as the pool's reclaimer; both are leaked together (see the
    // Note), the engine first so that whoever finds the pool finds its engine.
    auto engine = std::make_unique<residency::Engine>(*created, engine_options);
    if (history_entries_ > 0) created->record_history(history_entries_);
    engines_[device].store(engine.release(), std::memory_order_release);
    pools_[device].store(created.release(), std::memory_order_release);
  } catch (const cuda::CudaError& e) {
    const bool bad_ordinal = e.code() == CUDA_ERROR_INVALID_DEVICE || e.code() == cudaErrorInvalidDevice;
    error->kind = bad_ordinal ? AllocError::Kind::kInvalidDevice : AllocError::Kind::kCuda;
    error->code = bad_ordinal ? cudaErrorInvalidDevice : e.code();
    error->message = "cannot use device " + std::to_string(device) + ": " + e.what();
    log(LogLevel::kError, "%s", error->message.c_str());
    return nullptr;
  }
  any_pool_ = true;
  int bound = device_bound_.load(std::memory_order_relaxed);
  while (bound < device + 1 && !device_bound_.compare_exchange_weak(bound, device + 1)) {
  }
  if (!settings_logged_ && stats::log_enabled(LogLevel::kInfo)) {
    settings_logged_ = true;
    log(LogLevel::kInfo, "effective settings:\n%s", config::describe(config_).c_str());
  }
  log(LogLevel::kInfo, "device %d: pool created, limit %s of a %s card", device, format_size(limit).c_str(),
      format_size(card_bytes).c_str());
  log(LogLevel::kInfo, "device %d: eviction engine created, soft limit %s, host limit %s, horizon %d, verify %s",
      device, engine_options.soft_limit_bytes ? format_size(engine_options.soft_limit_bytes).c_str() : "none",
      engine_options.host_limit_bytes ? format_size(engine_options.host_limit_bytes).c_str() : "the default",
      engine_options.horizon, engine_options.verify ? "on" : "off");
  return pool(device);
}

void* Allocator::allocate(size_t size, int device, cudaStream_t stream, AllocError* error) {
  if (size == 0) return nullptr;  // never an error (vramswap.h), whatever the configuration
  if (blocked_.load(std::memory_order_acquire)) {
    config_error(error);
    return nullptr;
  }
  pool::DevicePool* p = pool_or_create(device, error);
  if (!p) return nullptr;
  const bool tagged = t_scope_depth > 0 && size >= min_offload_bytes_.load(std::memory_order_relaxed);
  void* ptr = nullptr;
  try {
    if (tagged) {
      ptr = engine(device)->allocate_tagged(size, stream, &error->message);
      if (ptr) num_live_tagged_.fetch_add(1, std::memory_order_relaxed);
    } else {
      ptr = p->allocate(size, stream, &error->message);
      // An untagged request that found no room: say what offloading holds, too.
      if (!ptr && !error->message.empty() && num_live_tagged_.load(std::memory_order_relaxed) > 0)
        error->message += " " + engine(device)->pressure_report();
    }
  } catch (const cuda::CudaError& e) {
    error->kind = e.out_of_memory() ? AllocError::Kind::kOutOfMemory : AllocError::Kind::kCuda;
    error->code = e.out_of_memory() ? cudaErrorMemoryAllocation : e.code();
    error->message = "allocation of " + std::to_string(size) + " bytes on device " + std::to_string(device) +
                     " failed: " + e.what();
    log(LogLevel::kWarn, "%s", one_line(error->message).c_str());
    return nullptr;
  }
  if (!ptr) {
    error->kind = AllocError::Kind::kOutOfMemory;
    error->code = cudaErrorMemoryAllocation;
    error->message += untagged_report(device);
    log(LogLevel::kWarn, "%s", one_line(error->message).c_str());
    return nullptr;
  }
  if (stats::log_enabled(LogLevel::kDebug))
    log(LogLevel::kDebug, "malloc %zu bytes on device %d, stream %p -> %p%s", size, device,
        static_cast<void*>(stream), ptr, tagged ? " (tagged)" : "");
  return ptr;
}

int Allocator::owner_of(const void* ptr) const {
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d); p && p->owns(ptr)) return d;
  return -1;
}

FreeOutcome Allocator::deallocate(void* ptr, int device_hint, cudaStream_t stream, std::string* error,
                                  int* owner_device) {
  int owner = -1;
  if (pool::DevicePool* p = pool(device_hint); p && p->owns(ptr))
    owner = device_hint;
  else
    owner = owner_of(ptr);
  if (owner < 0) {
    char text[96];
    std::snprintf(text, sizeof text, "free of %p: not a pointer vramswap allocated", ptr);
    *error = text;
    return FreeOutcome::kNotOwned;
  }
  if (owner_device) *owner_device = owner;
  // cudaStreamPerThread is one handle for every thread's own stream, so the pool cannot
  // tell their orders apart: another thread's allocation on it would reuse the block at once
  // while this thread's work on it still runs. A free on it first waits for the calling
  // thread's stream (both faces: the C ABI and the preload's cudaFreeAsync).
  if (stream == cudaStreamPerThread && !cuda::synchronize_stream(cudaStreamPerThread)) {
    char text[160];
    std::snprintf(text, sizeof text,
                  "free of %p on cudaStreamPerThread: synchronizing the calling thread's stream failed (or it "
                  "is capturing a CUDA graph); the block stays allocated",
                  ptr);
    *error = text;
    return FreeOutcome::kRefused;
  }
  // The count is read before the pointer can be one of the engine's: a tagged block is
  // counted before allocate() returns it.
  residency::Engine* e = engine(owner);
  const bool tagged = num_live_tagged_.load(std::memory_order_relaxed) > 0 && e->is_tagged(ptr);
  pool::Result r = tagged ? e->free_tagged(ptr, stream) : pool(owner)->deallocate(ptr, stream);
  if (tagged && r.ok) num_live_tagged_.fetch_sub(1, std::memory_order_relaxed);
  if (!r.ok) {
    // The engine refuses only a block freed by another thread since is_tagged(): say whose.
    if (tagged) r.message = "free of tagged block " + format_hex(reinterpret_cast<uintptr_t>(ptr)) + ": " + r.message;
    *error = std::move(r.message);
    return FreeOutcome::kRefused;
  }
  if (stats::log_enabled(LogLevel::kDebug))
    log(LogLevel::kDebug, "free %p on device %d, stream %p%s", ptr, owner, static_cast<void*>(stream),
        tagged ? " (tagged)" : "");
  return FreeOutcome::kFreed;
}

std::string Allocator::untagged_report(int device) const {
  pool::DevicePool* p = pool(device);
  if (!p) return "";
  const uint64_t allocated = p->stats().allocated_bytes;
  const uint64_t threshold = min_offload_bytes_.load(std::memory_order_relaxed);
  const pool::DevicePool::Census small = p->live_below(threshold);
  const uint64_t tagged = small.offloadable_bytes;  // tagged blocks are the offloadable ones
  if (allocated == 0 || tagged * 2 >= allocated) return "";  // most of it can be offloaded
  std::string s = " Only " + format_size(tagged) + " of the " + format_size(allocated) +
                  " live can be offloaded: offload takes only blocks allocated inside an offload scope "
                  "(vramswap.offload(), python3 -m vramswap run, vramswap_scope_push) of at least "
                  "VRAMSWAP_MIN_OFFLOAD_BYTES (" + format_size(threshold) + ").";
  // The blocks below the threshold are why only when they are a good share of what cannot be
  // offloaded; otherwise it is memory allocated outside any scope (backward's gradients,
  // parameters, optimizer state), which no setting makes offloadable.
  const uint64_t untagged = allocated - tagged;
  if (small.bytes > 0 && small.bytes * 4 >= untagged) {
    const uint64_t smaller = std::max<uint64_t>(threshold / 4 / 512 * 512, 512);
    const std::string example = smaller % 1024 == 0 ? std::to_string(smaller / 1024) + "KiB" : std::to_string(smaller);
    s += " " + format_size(small.bytes) + " are in " + std::to_string(small.blocks) +
         " blocks smaller than that, never offloaded: a smaller VRAMSWAP_MIN_OFFLOAD_BYTES (for example " + example +
         ") lets offload scopes take them.";
  } else {
    s += " " + format_size(untagged - small.bytes) +
         " are in blocks allocated outside any offload scope (backward's gradients, parameters, optimizer "
         "state), which offload scopes never take; optimizer state and frozen weights can be kept instead "
         "(vramswap.offload_optimizer, vramswap.offload_frozen).";
  }
  return s;
}

void Allocator::report_invalid_free(const std::string& message) {
  num_invalid_frees_.fetch_add(1, std::memory_order_relaxed);
  log(LogLevel::kWarn, "%s", message.c_str());
}

void Allocator::scope_push() { ++t_scope_depth; }

bool Allocator::scope_pop() {
  if (t_scope_depth == 0) return false;
  --t_scope_depth;
  return true;
}

int Allocator::scope_depth() { return t_scope_depth; }

}  // namespace vramswap
