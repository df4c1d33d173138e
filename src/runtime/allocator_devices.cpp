// The process-wide allocator (allocator.h): what happens to a whole device or process
// (captures begun and ended, peer access granted, a stream destroyed, the cache emptied,
// the peaks reset), passed on to every pool and engine concerned.
#include "runtime/allocator.h"

namespace vramswap {

namespace {

// False with *error set ("<what>: expected devices 0 to N") for a device past kMaxDevices.
bool devices_in_range(std::initializer_list<int> devices, const std::string& what, std::string* error) {
  for (int d : devices) {
    if (d < 0 || d >= Allocator::kMaxDevices) {
      *error = what + ": expected devices 0 to " + std::to_string(Allocator::kMaxDevices - 1);
      return false;
    }
  }
  return true;
}

}  // namespace

bool Allocator::capture_began(int device, std::string* error) {
  if (!devices_in_range({device}, "capture begins on device " + std::to_string(device), error)) return false;
  captures_[device].fetch_add(1, std::memory_order_acq_rel);
  return true;
}

bool Allocator::capture_ended(int device, std::string* error) {
  if (!devices_in_range({device}, "capture ends on device " + std::to_string(device), error)) return false;
  int n = captures_[device].load(std::memory_order_acquire);
  while (n > 0 && !captures_[device].compare_exchange_weak(n, n - 1, std::memory_order_acq_rel)) {
  }
  if (n > 0) return true;
  *error = "capture ends on device " + std::to_string(device) + ": no capture had begun there";
  return false;
}

bool Allocator::enable_peer_access(int device, int peer, std::string* error) {
  if (!devices_in_range({device, peer},
                        "peer access from device " + std::to_string(device) + " to device " + std::to_string(peer),
                        error))
    return false;
  if (device == peer) return true;
  pool::DevicePool* p = nullptr;
  {
    std::lock_guard lock(mu_);
    peers_[peer] |= uint64_t(1) << device;  // a pool created from now on grants it from the start
    p = pool(peer);
  }
  if (!p) return true;
  pool::Result r = p->grant_peer(device);
  if (!r.ok) *error = std::move(r.message);
  return r.ok;
}

bool Allocator::stream_destroyed(cudaStream_t stream, std::string* error) {
  const int bound = device_bound_.load(std::memory_order_acquire);
  bool ok = true;
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d)) {
      pool::Result r = p->stream_destroyed(stream);
      if (!r.ok) {
        if (ok) *error = std::move(r.message);
        ok = false;
      }
    }
  return ok;
}

void Allocator::empty_cache() {
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (pool::DevicePool* p = pool(d)) {
      p->empty_cache();
      if (residency::Engine* e = engine(d)) e->trim_host();  // the device was just synchronized
    }
}

void Allocator::reset_peaks() {
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d) {
    if (pool::DevicePool* p = pool(d)) {
      p->reset_peaks();
      engine(d)->reset_peaks();
    }
  }
}

}  // namespace vramswap
