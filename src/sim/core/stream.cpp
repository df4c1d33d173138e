// Streams: in-order queues on worker threads; the legacy stream's implicit
// synchronization; capture; chaos delays; fault reports. See stream.h.
#include "stream.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "address_space.h"
#include "device.h"
#include "env.h"

namespace cudasim {
namespace {

std::atomic<uint64_t> g_next_stream_id{1};

// What the calling worker thread is running, for the fault report.
thread_local const char* t_current_op = nullptr;
thread_local uint64_t t_current_stream = 0;

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

bool StreamPoint::done() const { return !stream || stream->completed_at_least(seq); }

void StreamPoint::wait() const {
  if (stream) stream->wait_for(seq);
}

void StreamPoint::host_wait() const {
  wait();
  if (virtual_time()) advance_host_to(end_ns);
}

bool StreamPoint::host_query() const {
  if (!virtual_time()) return done();
  if (end_ns > host_now_ns()) return false;
  wait();  // virtually complete: the data must be there too
  return true;
}

Stream::Stream(Device* device, Kind kind, unsigned flags, int priority, uint64_t handle)
    : device_(device),
      kind_(kind),
      flags_(flags),
      priority_(priority),
      id_(g_next_stream_id.fetch_add(1)),
      handle_(handle),
      chaos_rng_(splitmix(settings().chaos_seed ^ splitmix(id_))) {}

Stream::~Stream() = default;

StreamPoint Stream::enqueue(Operation op) {
  if (auto cap = capture()) {
    std::lock_guard lock(cap->graph->mu);
    op.after.clear();  // inside a graph, order is capture order
    cap->graph->ops.push_back(std::move(op));
    return {};
  }
  // In virtual time the whole enqueue is one step of the clock: the implicit dependencies
  // are read and the operation queued with no other enqueue in between.
  std::unique_lock<std::mutex> clock_lock;
  if (virtual_time()) clock_lock = std::unique_lock(clock_mutex());
  // Virtual time depends on the dependencies' virtual ends, never on whether the real
  // work happens to be done yet.
  uint64_t implicit_ns = 0;
  auto depend_on = [&](StreamPoint p) {
    implicit_ns = std::max(implicit_ns, p.end_ns);
    if (!p.done()) op.after.push_back(std::move(p));
  };
  if (kind_ == Kind::kLegacy) {
    for (auto& s : device_->blocking_streams()) depend_on(s->tail());
  } else if (blocking()) {
    depend_on(device_->legacy_stream().tail());
  }
  return submit(std::move(op), implicit_ns);
}

StreamPoint Stream::submit(Operation op, uint64_t implicit_ns) {
  std::lock_guard lock(mu_);
  uint64_t end_ns = 0;
  if (virtual_time())
    end_ns = schedule(op.timing, op.what, device_->ordinal(), handle_, clock_, implicit_ns);
  else if (op.timing.kind != OpKind::kUntimed && timeline_recording())
    op.timeline_id = timeline_queued(op.timing, op.what, device_->ordinal(), handle_);
  uint64_t seq = ++submitted_;
  queue_.emplace_back(seq, std::move(op));
  if (!worker_started_) start_worker_locked();
  cv_.notify_all();
  return {shared_from_this(), seq, end_ns};
}

StreamPoint Stream::tail() {
  std::lock_guard lock(mu_);
  return {shared_from_this(), submitted_, clock_.end_ns};
}

void Stream::synchronize() { tail().host_wait(); }

void Stream::retire() {
  std::lock_guard lock(mu_);
  retired_ = true;
  cv_.notify_all();
}

std::shared_ptr<Capture> Stream::capture() {
  std::lock_guard lock(mu_);
  return capture_;
}

void Stream::set_capture(std::shared_ptr<Capture> c) {
  std::lock_guard lock(mu_);
  capture_ = std::move(c);
}

bool Stream::completed_at_least(uint64_t seq) {
  std::lock_guard lock(mu_);
  return completed_ >= seq;
}

void Stream::wait_for(uint64_t seq) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return completed_ >= seq; });
}

void Stream::start_worker_locked() {
  worker_started_ = true;
  // The worker owns a reference: a retired stream lives until its queue drains.
  std::thread([self = shared_from_this()] { self->worker_loop(); }).detach();
}

void Stream::chaos_delay() {
  if (!settings().chaos) return;
  uint64_t r = chaos_rng_();
  // Most operations run at once; about a third wait up to 300 us, one in 61 waits 3 ms:
  // enough to reorder unsynchronized streams without slowing tests much.
  if (r % 61 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(3));
  else if (r % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds((r >> 8) % 300));
}

void Stream::worker_loop() {
  t_current_stream = id_;
  for (;;) {
    uint64_t seq;
    Operation op;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return !queue_.empty() || retired_; });
      if (queue_.empty()) return;  // retired and drained
      seq = queue_.front().first;
      op = std::move(queue_.front().second);
      queue_.pop_front();
    }
    for (const StreamPoint& p : op.after) p.wait();
    chaos_delay();
    t_current_op = op.what;
    const uint64_t started = op.timeline_id ? real_now_ns() : 0;
    if (op.run) op.run();
    if (op.timeline_id) timeline_ran(op.timeline_id, started, real_now_ns());
    t_current_op = nullptr;
    if (op.counts) device_->counters().ops_executed.fetch_add(1, std::memory_order_relaxed);
    op = Operation{};  // release captured state before announcing completion
    {
      std::lock_guard lock(mu_);
      completed_ = seq;
    }
    cv_.notify_all();
  }
}

namespace {

struct PerThreadStreams {
  std::vector<std::shared_ptr<Stream>> streams;
  ~PerThreadStreams() {
    for (auto& s : streams)
      if (s) s->retire();
  }
};

}  // namespace

std::shared_ptr<Stream> per_thread_stream(Device* device) {
  thread_local PerThreadStreams mine;
  auto index = size_t(device->ordinal());
  if (mine.streams.size() <= index) mine.streams.resize(index + 1);
  auto& s = mine.streams[index];
  if (!s) {
    s = std::make_shared<Stream>(device, Stream::Kind::kPerThread, 0, 0,
                                 reinterpret_cast<uint64_t>(CU_STREAM_PER_THREAD));
    device->add_blocking_stream(s);
    device->add_stream(s);
  }
  return s;
}

// ---- Capture bookkeeping -----------------------------------------------------------

namespace {
std::mutex g_captures_mu;
std::vector<std::shared_ptr<Capture>> g_captures;
}  // namespace

void register_capture(const std::shared_ptr<Capture>& c) {
  std::lock_guard lock(g_captures_mu);
  g_captures.push_back(c);
}

void unregister_capture(const std::shared_ptr<Capture>& c) {
  std::lock_guard lock(g_captures_mu);
  std::erase(g_captures, c);
}

CUstreamCaptureMode& thread_capture_mode() {
  thread_local CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  return mode;
}

CUresult check_unsafe_call() {
  CUstreamCaptureMode mode = thread_capture_mode();
  if (mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  auto me = std::this_thread::get_id();
  bool prohibited = false;
  std::lock_guard lock(g_captures_mu);
  for (auto& c : g_captures) {
    if (c->mode == CU_STREAM_CAPTURE_MODE_RELAXED) continue;
    bool own = c->owner == me;
    if (own || (mode == CU_STREAM_CAPTURE_MODE_GLOBAL && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL)) {
      c->invalidated = true;
      prohibited = true;
    }
  }
  return prohibited ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

CUresult check_device_sync(Device* device) {
  bool prohibited = false;
  auto check = [&](Device* d) {
    for (auto& s : d->all_streams()) {
      if (std::shared_ptr<Capture> c = s->capture()) {
        c->invalidated = true;
        prohibited = true;
      }
    }
  };
  if (device) {
    check(device);
  } else {
    for (int i = 0; i < device_count(); ++i) check(cudasim::device(i));
  }
  return prohibited ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

// ---- Fault reports ----------------------------------------------------------------
// A touch of device VA that is not mapped, or mapped without the access, raises SIGSEGV.
// Before the process dies, say what faulted; then the previous disposition applies.

namespace {

struct sigaction g_previous_segv;

void on_segv(int sig, siginfo_t* info, void* context) {
  auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  AddressSpace& as = address_space();
  bool in_reservation = false;
  if (as.mu.try_lock_shared()) {
    Region* r = as.find(addr);
    in_reservation = r && r->kind == RegionKind::kReservation;
    as.mu.unlock_shared();
  }
  if (in_reservation || t_current_op) {
    char buf[256];
    int n;
    if (t_current_op)
      n = std::snprintf(buf, sizeof buf,
                        "cudasim: illegal address 0x%lx during %s on stream %llu (device memory that is not "
                        "mapped, or mapped without access)\n",
                        (unsigned long)addr, t_current_op, (unsigned long long)t_current_stream);
    else
      n = std::snprintf(buf, sizeof buf,
                        "cudasim: illegal address 0x%lx: host access to reserved device VA that is not mapped, or "
                        "mapped without access\n",
                        (unsigned long)addr);
    if (n > 0) {
      ssize_t ignored = ::write(STDERR_FILENO, buf, size_t(std::min<int>(n, int(sizeof buf) - 1)));
      (void)ignored;
    }
  }
  // Hand over to whoever handled SIGSEGV before; returning re-runs the faulting access.
  if (g_previous_segv.sa_flags & SA_SIGINFO) {
    if (g_previous_segv.sa_sigaction) return g_previous_segv.sa_sigaction(sig, info, context);
  } else if (g_previous_segv.sa_handler != SIG_DFL && g_previous_segv.sa_handler != SIG_IGN) {
    return g_previous_segv.sa_handler(sig);
  }
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
}

}  // namespace

void install_fault_reporter() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
  });
}

}  // namespace cudasim
