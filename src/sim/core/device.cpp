// Devices, capacity, physical memory and the driver's global state. See device.h.
#include "device.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "env.h"
#include "stream.h"
#include "virtual_time.h"

namespace cudasim {

namespace {

std::string device_file_name(int ordinal) { return "cudasim-device-" + std::to_string(ordinal); }

}  // namespace

MemoryFile::MemoryFile(const char* name, uint64_t size) {
  fd_ = ::memfd_create(name, MFD_CLOEXEC);
  if (fd_ < 0 || ::ftruncate(fd_, off_t(size)) != 0) {
    std::fprintf(stderr, "cudasim: cannot create the memory file %s that stands for physical memory: %s\n", name,
                 std::strerror(errno));
    std::_Exit(2);
  }
  free_[0] = size;
}

bool MemoryFile::allocate(uint64_t size, uint64_t* offset) {
  std::lock_guard lock(mu_);
  // Best fit: the smallest free extent that holds `size`.
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->second >= size && (best == free_.end() || it->second < best->second)) best = it;
  if (best == free_.end()) return false;
  *offset = best->first;
  uint64_t rest = best->second - size, rest_at = best->first + size;
  free_.erase(best);
  if (rest) free_[rest_at] = rest;
  return true;
}

void MemoryFile::free(uint64_t offset, uint64_t size) {
  // Give the pages back to the host; a later extent here reads zeros.
  ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(offset), off_t(size));
  std::lock_guard lock(mu_);
  auto [it, inserted] = free_.emplace(offset, size);
  (void)inserted;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

MemoryFile& host_memory() {
  // Sparse, so its size costs nothing: far more than a host pins, so that extents never
  // fail for fragmentation (CUDASIM_HOST_PINNED_LIMIT, when set, bounds what is in use).
  static MemoryFile* file = new MemoryFile("cudasim-host-vmm", 4ull << 40);  // leaked: used during exit
  return *file;
}

// The device's file is sparse: pages exist only where memory was written. It is larger than
// the capacity so that physical extents never fail for fragmentation; the charge enforces
// the capacity itself.
Device::Device(int ordinal, uint64_t capacity)
    : ordinal_(ordinal), capacity_(capacity), memory_(device_file_name(ordinal).c_str(), capacity * 2 + (1ull << 30)) {
  primary_.device = this;
  legacy_ = std::make_shared<Stream>(this, Stream::Kind::kLegacy, 0, 0, 0);
}

bool Device::charge(uint64_t bytes) {
  uint64_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > capacity_ - cur) return false;
  } while (!used_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  uint64_t now = cur + bytes, peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return true;
}

void Device::uncharge(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

bool Device::allocate_physical(uint64_t size, uint64_t* file_offset) {
  if (!charge(size)) return false;
  if (memory_.allocate(size, file_offset)) return true;
  uncharge(size);
  return false;
}

void Device::free_physical(uint64_t file_offset, uint64_t size) {
  memory_.free(file_offset, size);
  uncharge(size);
}

void Device::fill_counters(cudasim_counters* out) const {
  out->bytes_h2d = counters_.bytes_h2d.load();
  out->bytes_d2h = counters_.bytes_d2h.load();
  out->bytes_d2d = counters_.bytes_d2d.load();
  out->bytes_h2h = counters_.bytes_h2h.load();
  out->bytes_memset = counters_.bytes_memset.load();
  out->ops_executed = counters_.ops_executed.load();
  out->physical_bytes = used_.load();
  out->peak_physical_bytes = peak_.load();
  out->mapped_bytes = counters_.mapped_bytes.load();
  out->capacity_bytes = capacity_;
  out->pinned_bytes = pinned_host_bytes().load();
  out->registered_bytes = registered_host_bytes().load();
}

std::atomic<uint64_t>& pinned_host_bytes() {
  static std::atomic<uint64_t> bytes{0};
  return bytes;
}

std::atomic<uint64_t>& registered_host_bytes() {
  static std::atomic<uint64_t> bytes{0};
  return bytes;
}

bool lock_host_pages(std::atomic<uint64_t>& counter, uint64_t bytes) {
  const uint64_t limit = settings().host_pinned_limit;
  if (limit == 0) {
    counter.fetch_add(bytes);
    return true;
  }
  // One lock for the check and the count, so that two threads cannot both pass the limit;
  // releases only subtract, and may do so without it.
  static std::mutex mu;
  std::lock_guard lock(mu);
  const uint64_t locked = pinned_host_bytes().load() + registered_host_bytes().load();
  if (bytes > limit || locked > limit - bytes) return false;
  counter.fetch_add(bytes);
  return true;
}

void Device::reset_counters() {
  for (auto* c : {&counters_.bytes_h2d, &counters_.bytes_d2h, &counters_.bytes_d2d, &counters_.bytes_h2h,
                  &counters_.bytes_memset, &counters_.ops_executed})
    c->store(0);
  peak_.store(used_.load());
}

void Device::add_blocking_stream(const std::shared_ptr<Stream>& s) {
  std::lock_guard lock(streams_mu_);
  std::erase_if(blocking_, [](const auto& w) { return w.expired(); });
  blocking_.push_back(s);
}

std::vector<std::shared_ptr<Stream>> Device::blocking_streams() {
  std::lock_guard lock(streams_mu_);
  std::vector<std::shared_ptr<Stream>> out;
  for (auto& w : blocking_)
    if (auto s = w.lock()) out.push_back(std::move(s));
  return out;
}

void Device::add_stream(const std::shared_ptr<Stream>& s) {
  std::lock_guard lock(streams_mu_);
  std::erase_if(streams_, [](const auto& w) { return w.expired(); });
  streams_.push_back(s);
}

std::vector<std::shared_ptr<Stream>> Device::all_streams() {
  std::lock_guard lock(streams_mu_);
  std::vector<std::shared_ptr<Stream>> out{legacy_};
  for (auto& w : streams_)
    if (auto s = w.lock()) out.push_back(std::move(s));
  return out;
}

void Device::synchronize() {
  // Read the virtual end first: work queued by other threads meanwhile is not awaited.
  const uint64_t end_ns = virtual_time() ? device_end_ns(ordinal_) : 0;
  for (auto& s : all_streams()) s->synchronize();
  if (virtual_time()) advance_host_to(end_ns);
}

namespace {
std::atomic<Driver*> g_driver{nullptr};
std::mutex g_init_mu;
}  // namespace

Driver* driver() { return g_driver.load(std::memory_order_acquire); }

CUresult initialize() {
  if (driver()) return CUDA_SUCCESS;
  std::lock_guard lock(g_init_mu);
  if (driver()) return CUDA_SUCCESS;
  const Settings& s = settings();
  auto* d = new Driver;  // never destroyed: see device.h
  for (int i = 0; i < s.device_count; ++i) d->devices.push_back(std::make_unique<Device>(i, s.device_memory));
  install_fault_reporter();
  g_driver.store(d, std::memory_order_release);
  if (s.log) {
    log_line("initialized: %d device(s) of %llu bytes%s%s", s.device_count, (unsigned long long)s.device_memory,
             s.chaos ? ", chaos on" : "", s.unbacked ? ", unbacked" : "");
    if (s.virtual_time)
      log_line("virtual time: PCIe %g GB/s per direction (%s duplex), HBM %g GB/s", s.pcie_gbps,
               s.pcie_shared ? "shared" : "full", s.hbm_gbps);
  }
  return CUDA_SUCCESS;
}

Device* device(int ordinal) {
  Driver* d = driver();
  if (!d || ordinal < 0 || ordinal >= int(d->devices.size())) return nullptr;
  return d->devices[size_t(ordinal)].get();
}

int device_count() {
  Driver* d = driver();
  return d ? int(d->devices.size()) : 0;
}

CUctx_st*& current_context() {
  thread_local CUctx_st* ctx = nullptr;
  return ctx;
}

Device* current_device() {
  CUctx_st* ctx = current_context();
  return ctx ? ctx->device : nullptr;
}

bool& in_host_function() {
  thread_local bool flag = false;
  return flag;
}

}  // namespace cudasim
