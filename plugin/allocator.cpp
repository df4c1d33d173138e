// The process-wide allocator. See allocator.h, Note [The process-wide allocator].
#include "allocator.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "config/units.h"
#include "cuda/device.h"
#include "cuda/error.h"
#include "stats/json_writer.h"
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

void write_stats_at_exit() {
  // instance() is already constructed when this handler is registered.
  Allocator::instance().write_stats_file();
}

// The members shared by the totals and each device's object, in the documented order.
void write_counters(stats::JsonWriter& json, const pool::PoolStats& s) {
  json.field("allocated_bytes", s.allocated_bytes)
      .field("reserved_bytes", s.reserved_bytes)
      .field("peak_allocated_bytes", s.peak_allocated_bytes)
      .field("peak_reserved_bytes", s.peak_reserved_bytes)
      .field("device_limit_bytes", s.limit_bytes)
      .field("num_allocs", s.num_allocs)
      .field("num_frees", s.num_frees)
      .field("num_cache_hits", s.num_cache_hits)
      .field("num_ooms", s.num_ooms);
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
  if (any_pool_ && !(next.limit == config_.limit)) {
    return "VRAMSWAP_LIMIT cannot change to '" + std::string(value) +
           "' once vramswap has allocated: the device pools were created under VRAMSWAP_LIMIT=" +
           config::size_or_percent_text(config_.limit) +
           "; set it before the first allocation (in the environment or with vramswap_configure)";
  }
  config_ = std::move(next);
  stats::set_log_level(config_.log_level);
  if (auto it = bad_environment_.find(key); it != bad_environment_.end()) {
    bad_environment_.erase(it);
    blocked_.store(!bad_environment_.empty(), std::memory_order_release);
  }
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
  try {
    card_bytes = cuda::device_info(device).total_bytes;
    limit = config_.resolve_limit(card_bytes);
    auto created = std::make_unique<pool::DevicePool>(pool::PoolOptions{device, limit});
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
  return pool(device);
}

void* Allocator::allocate(size_t size, int device, cudaStream_t stream, AllocError* error) {
  if (blocked_.load(std::memory_order_acquire)) {
    config_error(error);
    return nullptr;
  }
  if (size == 0) return nullptr;
  pool::DevicePool* p = pool_or_create(device, error);
  if (!p) return nullptr;
  void* ptr = nullptr;
  try {
    ptr = p->allocate(size, stream, &error->message);
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
    log(LogLevel::kWarn, "%s", one_line(error->message).c_str());
    return nullptr;
  }
  if (stats::log_enabled(LogLevel::kDebug))
    log(LogLevel::kDebug, "malloc %zu bytes on device %d, stream %p -> %p", size, device,
        static_cast<void*>(stream), ptr);
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
  pool::Result r = pool(owner)->deallocate(ptr, stream);
  if (!r.ok) {
    *error = std::move(r.message);
    return FreeOutcome::kRefused;
  }
  if (stats::log_enabled(LogLevel::kDebug))
    log(LogLevel::kDebug, "free %p on device %d, stream %p", ptr, owner, static_cast<void*>(stream));
  return FreeOutcome::kFreed;
}

void Allocator::report_invalid_free(const std::string& message) {
  num_invalid_frees_.fetch_add(1, std::memory_order_relaxed);
  log(LogLevel::kWarn, "%s", message.c_str());
}

bool Allocator::record_stream(void* ptr, cudaStream_t stream, std::string* error) {
  const int owner = owner_of(ptr);
  if (owner < 0) {
    char text[112];
    std::snprintf(text, sizeof text, "record_stream on %p: not a pointer vramswap allocated", ptr);
    *error = text;
    return false;
  }
  pool::Result r = pool(owner)->record_stream(ptr, stream);
  if (!r.ok) *error = std::move(r.message);
  return r.ok;
}

void Allocator::empty_cache() {
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d)) p->empty_cache();
}

void Allocator::reset_peaks() {
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d)) p->reset_peaks();
}

Allocator::DeviceMemory Allocator::device_memory(int device, uint64_t card_bytes) const {
  DeviceMemory m;
  if (pool::DevicePool* p = pool(device)) {
    pool::PoolStats s = p->stats();
    m.limit_bytes = s.limit_bytes;
    m.allocated_bytes = s.allocated_bytes;
    m.reserved_bytes = s.reserved_bytes;
    return m;
  }
  std::lock_guard lock(mu_);
  m.limit_bytes = config_.resolve_limit(card_bytes);
  return m;
}

std::string Allocator::stats_json() const {
  std::vector<pool::PoolStats> devices;
  std::vector<int> ordinals;
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d) {
    if (pool::DevicePool* p = pool(d)) {
      devices.push_back(p->stats());
      ordinals.push_back(d);
    }
  }
  pool::PoolStats total;
  for (const pool::PoolStats& s : devices) {
    total.allocated_bytes += s.allocated_bytes;
    total.reserved_bytes += s.reserved_bytes;
    total.peak_allocated_bytes += s.peak_allocated_bytes;
    total.peak_reserved_bytes += s.peak_reserved_bytes;
    total.limit_bytes += s.limit_bytes;
    total.num_allocs += s.num_allocs;
    total.num_frees += s.num_frees;
    total.num_cache_hits += s.num_cache_hits;
    total.num_ooms += s.num_ooms;
  }
  stats::JsonWriter json;
  json.begin_object();
  write_counters(json, total);
  json.field("num_invalid_frees", num_invalid_frees_.load(std::memory_order_relaxed));
  json.begin_array("devices");
  for (size_t i = 0; i < devices.size(); ++i) {
    json.begin_object().field("device", ordinals[i]);
    write_counters(json, devices[i]);
    json.field("num_free_blocks", devices[i].num_free_blocks)
        .field("va_reserved_bytes", devices[i].va_reserved_bytes)
        .end_object();
  }
  json.end_array().end_object();
  return json.str();
}

void Allocator::mark_used() {
  if (user_pid_.load(std::memory_order_relaxed) == 0) user_pid_.store(static_cast<int>(::getpid()));
}

void Allocator::write_stats_file() const {
  if (user_pid_.load() != static_cast<int>(::getpid())) return;  // see allocator.h
  std::string path;
  {
    std::lock_guard lock(mu_);
    path = config_.stats_file;
  }
  if (path.empty()) return;
  std::string document;
  try {
    document = stats_json() + "\n";
  } catch (const std::exception& e) {
    log(LogLevel::kWarn, "cannot write the statistics to %s: %s", path.c_str(), e.what());
    return;
  }
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    log(LogLevel::kWarn, "cannot write the statistics to %s: %s", temporary.c_str(), std::strerror(errno));
    return;
  }
  const char* data = document.data();
  size_t left = document.size();
  bool ok = true;
  while (left > 0) {
    ssize_t w = ::write(fd, data, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ok = false;
      break;
    }
    data += w;
    left -= static_cast<size_t>(w);
  }
  const int saved_errno = errno;
  if (::close(fd) != 0) ok = false;
  if (!ok || ::rename(temporary.c_str(), path.c_str()) != 0) {
    log(LogLevel::kWarn, "cannot write the statistics to %s: %s", path.c_str(),
        std::strerror(ok ? errno : saved_errno));
    ::unlink(temporary.c_str());
    return;
  }
  log(LogLevel::kInfo, "statistics written to %s", path.c_str());
}

}  // namespace vramswap
