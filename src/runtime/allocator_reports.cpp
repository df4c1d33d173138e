// The process-wide allocator (allocator.h): what it reports (a device's memory, the
// statistics document and file, the memory snapshot and its history, the invariants).
#include "runtime/allocator.h"

#include <unistd.h>

#include <cstdlib>

#include "cuda/host_time.h"
#include "runtime/snapshot_document.h"
#include "runtime/stats_document.h"
#include "stats/log.h"
#include "stats/stats_file.h"

namespace vramswap {

using config::LogLevel;
using stats::log;

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
  std::vector<DeviceStats> devices;
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d)) devices.push_back({d, p->stats(), engine(d)->stats()});
  return stats_document(devices, num_invalid_frees_.load(std::memory_order_relaxed), cuda::host_times());
}

void Allocator::mark_used() {
  if (user_pid_.load(std::memory_order_relaxed) == 0) user_pid_.store(static_cast<int>(::getpid()));
}

void Allocator::record_history(size_t max_entries) {
  std::lock_guard lock(mu_);  // a pool made meanwhile starts with the same setting
  history_entries_ = max_entries;
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d)) p->record_history(max_entries);
}

std::string Allocator::snapshot_json() const {
  std::vector<DeviceMemoryView> devices;
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d)) devices.push_back({d, p->memory_view()});
  return snapshot_document(devices);
}

std::string Allocator::check_invariants() const {
  std::string broken;
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d) {
    pool::DevicePool* p = pool(d);
    if (!p) continue;
    for (const std::string& why : {p->check_invariants(), engine(d)->check_invariants()})
      if (!why.empty()) broken += (broken.empty() ? "" : "; ") + ("device " + std::to_string(d) + ": ") + why;
  }
  return broken;
}

void Allocator::write_stats_file() const {
  if (user_pid_.load() != static_cast<int>(::getpid())) return;  // see allocator.h
  std::string path;
  {
    std::lock_guard lock(mu_);
    path = config_.stats_file;
  }
  if (path.empty()) return;
  path = stats::expand_stats_path(path, static_cast<long>(::getpid()), std::getenv("RANK"));
  std::string document;
  try {
    document = stats_json() + "\n";
  } catch (const std::exception& e) {
    log(LogLevel::kWarn, "cannot write the statistics to %s: %s", path.c_str(), e.what());
    return;
  }
  if (const std::string why = stats::write_stats_file(path, document); !why.empty()) {
    log(LogLevel::kWarn, "cannot write the statistics to %s: %s", path.c_str(), why.c_str());
    return;
  }
  log(LogLevel::kInfo, "statistics written to %s", path.c_str());
}

}  // namespace vramswap
