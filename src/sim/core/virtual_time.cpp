// Virtual time: engines, the host clock, scheduling, the timeline. See virtual_time.h.
#include "virtual_time.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>

#include "env.h"

namespace cudasim {
namespace {

// The process's start for real_now_ns(): set when the library is loaded.
const std::chrono::steady_clock::time_point g_start = std::chrono::steady_clock::now();

std::atomic<uint64_t> g_host_ns{0};

// The engines of one device: when each becomes free. Guarded by clock_mutex().
struct Engines {
  uint64_t compute = 0;
  uint64_t h2d = 0;
  uint64_t d2h = 0;  // unused with CUDASIM_PCIE_DUPLEX=shared: both directions use h2d
  uint64_t end = 0;  // the latest end of any operation on the device
};
constexpr int kMaxDevices = 16;  // CUDASIM_DEVICE_COUNT's bound
std::array<Engines, kMaxDevices> g_engines;
// The disk engine: the host's, so one for every device. Guarded by clock_mutex().
uint64_t g_disk = 0;

// Which engine an operation uses (nullptr: none) and how long it takes there.
uint64_t* engine_and_duration(const VirtualOp& op, Engines& e, uint64_t* duration) {
  const Settings& s = settings();
  auto at_rate = [](uint64_t bytes, double gbps) {  // GB/s == bytes/ns; round up
    return bytes == 0 ? 0 : uint64_t(std::ceil(double(bytes) / gbps));
  };
  switch (op.kind) {
    case OpKind::kKernel:
      *duration = op.kernel_ns;
      return &e.compute;
    case OpKind::kCopyH2D:
      *duration = at_rate(op.bytes, s.pcie_gbps);
      return &e.h2d;
    case OpKind::kCopyD2H:
      *duration = at_rate(op.bytes, s.pcie_gbps);
      return s.pcie_shared ? &e.h2d : &e.d2h;
    case OpKind::kCopyD2D:
    case OpKind::kMemset:
      *duration = at_rate(op.bytes, s.hbm_gbps);
      return &e.compute;
    case OpKind::kDiskRead:
    case OpKind::kDiskWrite:
      *duration = at_rate(op.bytes, s.disk_gbps);
      return &g_disk;
    case OpKind::kOther:
    case OpKind::kUntimed:
      break;
  }
  *duration = 0;
  return nullptr;
}

class Timeline {
 public:
  uint64_t append(const cudasim_timeline_entry& entry) {
    std::lock_guard lock(mu_);
    if (entries_.size() == kTimelineCapacity) {
      entries_.pop_front();
      ++first_id_;
    }
    entries_.push_back(entry);
    return first_id_ + entries_.size() - 1;
  }
  void set_times(uint64_t id, uint64_t start, uint64_t end) {
    std::lock_guard lock(mu_);
    if (id < first_id_ || id - first_id_ >= entries_.size()) return;  // dropped or cleared since
    auto& e = entries_[size_t(id - first_id_)];
    e.start_ns = start;
    e.end_ns = end;
  }
  size_t copy(cudasim_timeline_entry* out, size_t capacity) {
    std::lock_guard lock(mu_);
    if (out) std::copy_n(entries_.begin(), std::min(capacity, entries_.size()), out);
    return entries_.size();
  }
  void clear() {
    std::lock_guard lock(mu_);
    first_id_ += entries_.size();
    entries_.clear();
  }

 private:
  std::mutex mu_;
  std::deque<cudasim_timeline_entry> entries_;
  uint64_t first_id_ = 1;  // the id of entries_.front(); ids are never reused
};

Timeline& timeline() {
  static auto* t = new Timeline;  // leaked: stream workers may record during exit
  return *t;
}

cudasim_timeline_entry make_entry(const VirtualOp& op, const char* what, int device, uint64_t stream) {
  cudasim_timeline_entry e{};
  e.kind = uint32_t(op.kind);
  e.device = device;
  e.stream = stream;
  e.bytes = op.bytes;
  const char* label = op.label.empty() ? what : op.label.c_str();
  std::strncpy(e.label, label, kLabelSize - 1);
  return e;
}

}  // namespace

bool virtual_time() { return settings().virtual_time; }

uint64_t real_now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - g_start)
                      .count());
}

uint64_t host_now_ns() { return g_host_ns.load(std::memory_order_acquire); }

void advance_host_to(uint64_t t) {
  uint64_t cur = g_host_ns.load(std::memory_order_relaxed);
  while (t > cur && !g_host_ns.compare_exchange_weak(cur, t, std::memory_order_acq_rel)) {
  }
}

void charge_host(uint64_t ns) {
  if (ns != 0 && virtual_time()) g_host_ns.fetch_add(ns, std::memory_order_acq_rel);
}

std::mutex& clock_mutex() {
  static auto* mu = new std::mutex;  // leaked: usable during exit
  return *mu;
}

uint64_t schedule(const VirtualOp& op, const char* what, int device, uint64_t stream, StreamClock& clock,
                  uint64_t implicit_ns) {
  Engines& engines = g_engines[size_t(device)];
  const uint64_t host = host_now_ns();
  uint64_t duration = 0;
  uint64_t* engine = engine_and_duration(op, engines, &duration);
  const uint64_t free_at = engine ? *engine : 0;
  // The recurrence, and the same without the event wait (for stall).
  const uint64_t start = std::max({host, clock.end_ns, implicit_ns, op.wait_ns, free_at});
  const uint64_t unwaited_start = std::max({host, clock.unwaited_ns, implicit_ns, free_at});
  const uint64_t end = start + duration;
  if (engine) *engine = end;
  engines.end = std::max(engines.end, end);
  clock.end_ns = end;
  uint64_t stall = 0;
  if (op.kind == OpKind::kKernel) {
    stall = start - unwaited_start;
    clock.unwaited_ns = end;
  } else {
    // A delay from a wait is carried to the next kernel of the stream. (A wait on an
    // event of the same stream never delays anything, so leaving every wait out of this
    // recurrence leaves out exactly the cross-stream ones.)
    clock.unwaited_ns = unwaited_start + duration;
  }
  if (op.kind != OpKind::kUntimed) {
    cudasim_timeline_entry e = make_entry(op, what, device, stream);
    e.enqueue_ns = host;
    e.start_ns = start;
    e.end_ns = end;
    e.stall_ns = stall;
    timeline().append(e);
  }
  return end;
}

uint64_t device_end_ns(int device) {
  std::lock_guard lock(clock_mutex());
  if (device >= 0) return g_engines[size_t(device)].end;
  uint64_t end = 0;
  for (const Engines& e : g_engines) end = std::max(end, e.end);
  return end;
}

bool timeline_recording() { return settings().virtual_time || settings().timeline; }

uint64_t timeline_queued(const VirtualOp& op, const char* what, int device, uint64_t stream) {
  cudasim_timeline_entry e = make_entry(op, what, device, stream);
  e.enqueue_ns = real_now_ns();
  return timeline().append(e);
}

void timeline_ran(uint64_t id, uint64_t start_ns, uint64_t end_ns) { timeline().set_times(id, start_ns, end_ns); }

size_t timeline_copy(cudasim_timeline_entry* out, size_t capacity) { return timeline().copy(out, capacity); }

void timeline_clear() { timeline().clear(); }

}  // namespace cudasim
