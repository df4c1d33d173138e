// The process-wide allocator (allocator.h): the tracker protocol routed to the engine of
// the device that owns the block or handle (pack, mark_cold, unpack, release, prefetch;
// keep, use, unkeep), and record_stream routed to the owning pool.
#include "runtime/allocator.h"

#include <cstdio>

#include "config/units.h"

namespace vramswap {

uint64_t Allocator::pack(const void* ptr, cudaStream_t stream) {
  if (num_live_tagged_.load(std::memory_order_relaxed) == 0) return 0;
  const int owner = owner_of(ptr);
  return owner < 0 ? 0 : engine(owner)->pack(ptr, stream);
}

void Allocator::graph_begin() {
  const int bound = device_bound_.load(std::memory_order_acquire);
  for (int d = 0; d < bound; ++d)
    if (residency::Engine* e = engine(d)) e->graph_begin();
}

residency::Engine* Allocator::engine_of_handle(uint64_t handle, const char* what, std::string* error) const {
  if (handle == 0) {
    *error = std::string(what) + ": handle 0 names no block (vramswap_pack returns 0 for a block that cannot be "
                                 "offloaded)";
    return nullptr;
  }
  const int device = residency::Engine::handle_device(handle);
  if (residency::Engine* e = engine(device)) return e;
  *error = std::string(what) + ": handle " + format_hex(handle) + " was not given out by vramswap (it names device " +
           std::to_string(device) + ", where vramswap has allocated nothing)";
  return nullptr;
}

residency::Status Allocator::mark_cold(uint64_t handle, cudaStream_t stream) {
  std::string error;
  residency::Engine* e = engine_of_handle(handle, "mark_cold", &error);
  return e ? e->mark_cold(handle, stream) : residency::Status{false, error};
}

residency::Status Allocator::unpack(uint64_t handle, cudaStream_t stream) {
  std::string error;
  residency::Engine* e = engine_of_handle(handle, "unpack", &error);
  return e ? e->unpack(handle, stream) : residency::Status{false, error};
}

residency::Status Allocator::release(uint64_t handle) {
  std::string error;
  residency::Engine* e = engine_of_handle(handle, "release", &error);
  return e ? e->release(handle) : residency::Status{false, error};
}

residency::Status Allocator::prefetch(uint64_t handle) {
  std::string error;
  residency::Engine* e = engine_of_handle(handle, "prefetch", &error);
  return e ? e->prefetch(handle) : residency::Status{false, error};
}

uint64_t Allocator::keep(const void* ptr, bool frozen) {
  if (num_live_tagged_.load(std::memory_order_relaxed) == 0) return 0;
  const int owner = owner_of(ptr);
  return owner < 0 ? 0 : engine(owner)->keep(ptr, frozen);
}

residency::Status Allocator::use(uint64_t handle, cudaStream_t stream, residency::Engine::UseLane lane) {
  std::string error;
  residency::Engine* e = engine_of_handle(handle, "use", &error);
  return e ? e->use(handle, stream, lane) : residency::Status{false, error};
}

residency::Status Allocator::unkeep(uint64_t handle) {
  std::string error;
  residency::Engine* e = engine_of_handle(handle, "unkeep", &error);
  return e ? e->unkeep(handle) : residency::Status{false, error};
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

}  // namespace vramswap
