// Driver API: streams, events, host functions, stream capture and graphs; stream-ordered
// file I/O for cudasim's libcufile (file_io.h).
// The engine is stream.h; this file is argument checking and handle bookkeeping.
#include <cuda.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "address_space.h"
#include "api.h"
#include "cudasim.h"
#include "file_io.h"
#include "virtual_time.h"

namespace cudasim {
namespace {

constexpr int kLeastPriority = 0;
constexpr int kGreatestPriority = -5;

CUresult create_stream(CUstream* ph, unsigned flags, int priority) {
  if (!ph || (flags & ~unsigned(CU_STREAM_NON_BLOCKING))) return CUDA_ERROR_INVALID_VALUE;
  // CUDA clamps a priority outside the range to the nearest bound.
  priority = std::min(kLeastPriority, std::max(kGreatestPriority, priority));
  Device* dev = current_device();
  auto* h = new CUstream_st;
  auto s = std::make_shared<Stream>(dev, Stream::Kind::kCreated, flags, priority, reinterpret_cast<uint64_t>(h));
  h->stream = s;
  if (s->blocking()) dev->add_blocking_stream(s);
  dev->add_stream(s);
  stream_handles().add(h);
  *ph = h;
  return CUDA_SUCCESS;
}

// Using the legacy stream while a blocking stream of the device captures would make
// the capture depend on outside work: CUDA refuses it and invalidates the capture.
CUresult check_legacy_implicit(const std::shared_ptr<Stream>& s) {
  if (s->kind() != Stream::Kind::kLegacy) return CUDA_SUCCESS;
  CUresult r = CUDA_SUCCESS;
  for (auto& other : s->device()->blocking_streams())
    if (auto cap = other->capture()) {
      cap->invalidated = true;
      r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
  return r;
}

// The stream a handle names, for a call that must wait on or inspect its work: refused
// (*err set, null returned) while it captures, which invalidates the capture as CUDA does,
// or when it is the legacy stream and a blocking stream captures.
std::shared_ptr<Stream> resolve_for_host_wait(CUstream h, bool per_thread, CUresult* err) {
  auto s = resolve_stream(h, per_thread, err);
  if (!s) return nullptr;
  if (auto cap = s->capture()) {
    cap->invalidated = true;
    *err = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return nullptr;
  }
  if ((*err = check_legacy_implicit(s)) != CUDA_SUCCESS) return nullptr;
  return s;
}

CUresult stream_query(CUstream h, bool per_thread) {
  CUresult err;
  auto s = resolve_for_host_wait(h, per_thread, &err);
  if (!s) return err;
  return s->tail().host_query() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult stream_synchronize(CUstream h, bool per_thread) {
  CUresult err;
  auto s = resolve_for_host_wait(h, per_thread, &err);
  if (!s) return err;
  s->synchronize();
  return CUDA_SUCCESS;
}

CUresult stream_wait_event(CUstream h, CUevent e, unsigned flags, bool per_thread) {
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  if (!e || !event_handles().contains(e)) return CUDA_ERROR_INVALID_HANDLE;
  if (flags & ~unsigned(CU_EVENT_WAIT_EXTERNAL)) return CUDA_ERROR_INVALID_VALUE;
  std::unique_lock lock(e->mu);
  if (e->captured_in) {
    // Waiting on an event recorded inside a capture joins the waiting stream to it, while
    // it lasts; after its end the event is still one last recorded in a capture.
    if (e->captured_in->ended) return CUDA_ERROR_CAPTURED_EVENT;
    auto mine = s->capture();
    if (mine && mine != e->captured_in) return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
    if (!mine) s->set_capture(e->captured_in);
    return CUDA_SUCCESS;
  }
  if (s->capture()) return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;  // a dependency from outside the capture
  if (!e->recorded) return CUDA_SUCCESS;  // waiting on a never-recorded event is a no-op
  Operation op;
  op.what = "wait event";
  op.after.push_back(e->point);
  op.timing.wait_ns = e->point.end_ns;
  lock.unlock();
  if (CUresult r = check_legacy_implicit(s)) return r;
  s->enqueue(std::move(op));
  return CUDA_SUCCESS;
}

CUresult event_record(CUevent e, CUstream h, bool per_thread) {
  if (!e || !event_handles().contains(e)) return CUDA_ERROR_INVALID_HANDLE;
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  // "cudaEventRecord() will fail if the input event and input stream are associated to
  // different devices" (CUDA C++ Programming Guide, multi-device system).
  if (s->device()->ordinal() != e->device) return CUDA_ERROR_INVALID_HANDLE;
  if (CUresult r = check_legacy_implicit(s)) return r;
  std::lock_guard lock(e->mu);
  if (auto cap = s->capture()) {
    e->captured_in = cap;
    e->recorded = true;
    e->point = {};
    e->stamp.reset();
    return CUDA_SUCCESS;
  }
  auto stamp = std::make_shared<std::chrono::steady_clock::time_point>();
  Operation op;
  op.what = "event record";
  op.run = [stamp] { *stamp = std::chrono::steady_clock::now(); };
  e->point = s->enqueue(std::move(op));
  e->stamp = stamp;
  e->recorded = true;
  e->captured_in.reset();
  return CUDA_SUCCESS;
}

CUresult launch_host_func(CUstream h, CUhostFn fn, void* data, bool per_thread) {
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  if (CUresult r = check_legacy_implicit(s)) return r;
  Operation op;
  op.what = "host function";
  op.timing.kind = OpKind::kOther;
  op.run = [fn, data] {
    in_host_function() = true;
    fn(data);
    in_host_function() = false;
  };
  s->enqueue(std::move(op));
  return CUDA_SUCCESS;
}

CUresult add_callback(CUstream h, CUstreamCallback cb, void* data, unsigned flags, bool per_thread) {
  if (!cb || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  if (s->capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // callbacks cannot be captured
  Operation op;
  op.what = "stream callback";
  op.timing.kind = OpKind::kOther;
  op.run = [cb, data, h] {
    in_host_function() = true;
    cb(h, CUDA_SUCCESS, data);
    in_host_function() = false;
  };
  s->enqueue(std::move(op));
  return CUDA_SUCCESS;
}

CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, bool per_thread) {
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  if (s->kind() == Stream::Kind::kLegacy) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  if (s->capture()) return CUDA_ERROR_ILLEGAL_STATE;
  static std::atomic<uint64_t> next_id{1};
  auto cap = std::make_shared<Capture>();
  cap->graph = std::make_shared<Graph>();
  cap->mode = mode;
  cap->owner = std::this_thread::get_id();
  cap->id = next_id.fetch_add(1);
  s->set_capture(cap);
  register_capture(cap);
  return CUDA_SUCCESS;
}

CUresult end_capture(CUstream h, CUgraph* graph, bool per_thread) {
  if (!graph) return CUDA_ERROR_INVALID_VALUE;
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  auto cap = s->capture();
  if (!cap) return CUDA_ERROR_ILLEGAL_STATE;
  if (cap->owner != std::this_thread::get_id() && cap->mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
  // End the capture for every stream that joined it.
  for (int i = 0; i < device_count(); ++i)
    for (auto& other : device(i)->all_streams())
      if (other->capture() == cap) other->set_capture(nullptr);
  unregister_capture(cap);
  cap->ended = true;
  if (cap->invalidated) {
    *graph = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  auto* g = new CUgraph_st{cap->graph};
  graph_handles().add(g);
  *graph = g;
  return CUDA_SUCCESS;
}

CUresult is_capturing(CUstream h, CUstreamCaptureStatus* status, bool per_thread) {
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  if (s->kind() == Stream::Kind::kLegacy) {
    // Asking about the legacy stream while a blocking stream captures is refused, but,
    // as CUDA documents, the blocking stream's capture is not invalidated.
    for (auto& other : s->device()->blocking_streams())
      if (other->capture()) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  }
  auto cap = s->capture();
  *status = !cap ? CU_STREAM_CAPTURE_STATUS_NONE
                 : (cap->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE);
  return CUDA_SUCCESS;
}

// Real time: a kernel sleeps its duration up to this cap, enough to order streams in a
// test without making a long modelled kernel stall a real-time run.
constexpr uint64_t kRealKernelCapNs = 10'000'000;

CUresult kernel(CUstream h, uint64_t ns, const char* label) {
  CUresult err;
  auto s = resolve_stream(h, false, &err);
  if (!s) return err;
  if (CUresult r = check_legacy_implicit(s)) return r;
  Operation op;
  op.what = "kernel";
  op.timing.kind = OpKind::kKernel;
  op.timing.kernel_ns = ns;
  if (label) op.timing.label.assign(label, strnlen(label, kLabelSize - 1));
  if (!virtual_time())
    op.run = [ns] { std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(ns, kRealKernelCapNs))); };
  s->enqueue(std::move(op));  // while the stream captures, into the graph
  return CUDA_SUCCESS;
}

// The body of cudasim_internal_file_io (file_io.h).
CUresult file_io(CUstream h, bool write, int fd, void* buffer, size_t bytes, int64_t offset, int64_t* result) {
  CUresult err;
  auto s = resolve_stream(h, false, &err);
  if (!s) return err;
  if (fd < 0 || !result || (!buffer && bytes) || offset < 0 || bytes > uint64_t(INT64_MAX - offset))
    return CUDA_ERROR_INVALID_VALUE;
  if (auto cap = s->capture()) {
    cap->invalidated = true;  // a read or write of a file cannot be a graph's node
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  if (CUresult r = check_legacy_implicit(s)) return r;
  Operation op;
  op.what = write ? "file write" : "file read";
  op.timing.kind = write ? OpKind::kDiskWrite : OpKind::kDiskRead;
  op.timing.bytes = bytes;
  char* p = static_cast<char*>(buffer);
  if (settings().unbacked) {
    // Nothing moves, but device memory that pread/pwrite could not touch still fails.
    op.run = [write, p, bytes, result] {
      const PointerInfo info = classify(p, bytes);
      const bool device =
          info.type == PointerInfo::Type::kDevice || info.type == PointerInfo::Type::kUnmappedDevice;
      // A read from the file writes the buffer; a write to it reads the buffer.
      *result = device && first_inaccessible(p, bytes, !write) ? -EFAULT : int64_t(bytes);
    };
  } else {
    op.run = [write, fd, p, bytes, offset, result] { *result = transfer_file(write, fd, p, bytes, offset); };
  }
  s->enqueue(std::move(op));
  return CUDA_SUCCESS;
}

CUresult graph_launch(CUgraphExec exec, CUstream h, bool per_thread) {
  if (!exec || !graph_exec_handles().contains(exec)) return CUDA_ERROR_INVALID_HANDLE;
  CUresult err;
  auto s = resolve_stream(h, per_thread, &err);
  if (!s) return err;
  std::lock_guard lock(exec->graph->mu);
  for (const Operation& op : exec->graph->ops) s->enqueue(op);
  return CUDA_SUCCESS;
}

}  // namespace
}  // namespace cudasim

using namespace cudasim;

// Each entry point exists in its default-stream form and its per-thread (_ptsz) form.
#define CUDASIM_PAIR(name, params, ...)                 \
  CUresult name params {                                \
    Call call(#name);                                   \
    if (!call.ok()) return call.status();               \
    return call.ret(impl_##name(__VA_ARGS__, false));   \
  }                                                     \
  CUresult name##_ptsz params {                         \
    Call call(#name "_ptsz");                           \
    if (!call.ok()) return call.status();               \
    return call.ret(impl_##name(__VA_ARGS__, true));    \
  }

namespace {
// Adapters so the macro can name each implementation after its entry point.
CUresult impl_cuStreamQuery(CUstream h, bool pt) { return stream_query(h, pt); }
CUresult impl_cuStreamSynchronize(CUstream h, bool pt) { return stream_synchronize(h, pt); }
CUresult impl_cuStreamWaitEvent(CUstream h, CUevent e, unsigned f, bool pt) { return stream_wait_event(h, e, f, pt); }
CUresult impl_cuEventRecord(CUevent e, CUstream h, bool pt) { return event_record(e, h, pt); }
CUresult impl_cuLaunchHostFunc(CUstream h, CUhostFn fn, void* d, bool pt) { return launch_host_func(h, fn, d, pt); }
CUresult impl_cuStreamAddCallback(CUstream h, CUstreamCallback cb, void* d, unsigned f, bool pt) {
  return add_callback(h, cb, d, f, pt);
}
CUresult impl_cuStreamBeginCapture_v2(CUstream h, CUstreamCaptureMode m, bool pt) { return begin_capture(h, m, pt); }
CUresult impl_cuStreamEndCapture(CUstream h, CUgraph* g, bool pt) { return end_capture(h, g, pt); }
CUresult impl_cuStreamIsCapturing(CUstream h, CUstreamCaptureStatus* st, bool pt) { return is_capturing(h, st, pt); }
CUresult impl_cuGraphLaunch(CUgraphExec x, CUstream h, bool pt) { return graph_launch(x, h, pt); }

// A property of the stream a handle names, read by `get`.
template <class T, class Get>
CUresult stream_property(CUstream h, bool pt, T* out, Get get) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  CUresult err;
  auto s = resolve_stream(h, pt, &err);
  if (!s) return err;
  *out = get(*s);
  return CUDA_SUCCESS;
}
CUresult impl_cuStreamGetPriority(CUstream h, int* p, bool pt) {
  return stream_property(h, pt, p, [](Stream& s) { return s.priority(); });
}
CUresult impl_cuStreamGetFlags(CUstream h, unsigned* f, bool pt) {
  return stream_property(h, pt, f, [](Stream& s) { return s.flags(); });
}
CUresult impl_cuStreamGetId(CUstream h, unsigned long long* id, bool pt) {
  return stream_property(h, pt, id, [](Stream& s) { return static_cast<unsigned long long>(s.id()); });
}
CUresult impl_cuStreamGetDevice(CUstream h, CUdevice* d, bool pt) {
  return stream_property(h, pt, d, [](Stream& s) { return CUdevice(s.device()->ordinal()); });
}
}  // namespace

extern "C" {

CUDASIM_PAIR(cuStreamQuery, (CUstream h), h)
CUDASIM_PAIR(cuStreamSynchronize, (CUstream h), h)
CUDASIM_PAIR(cuStreamWaitEvent, (CUstream h, CUevent e, unsigned int flags), h, e, flags)
CUDASIM_PAIR(cuEventRecord, (CUevent e, CUstream h), e, h)
CUDASIM_PAIR(cuLaunchHostFunc, (CUstream h, CUhostFn fn, void* data), h, fn, data)
CUDASIM_PAIR(cuStreamAddCallback, (CUstream h, CUstreamCallback cb, void* data, unsigned int flags),
             h, cb, data, flags)
CUDASIM_PAIR(cuStreamBeginCapture_v2, (CUstream h, CUstreamCaptureMode mode), h, mode)
CUDASIM_PAIR(cuStreamEndCapture, (CUstream h, CUgraph* graph), h, graph)
CUDASIM_PAIR(cuStreamIsCapturing, (CUstream h, CUstreamCaptureStatus* status), h, status)
CUDASIM_PAIR(cuGraphLaunch, (CUgraphExec exec, CUstream h), exec, h)
CUDASIM_PAIR(cuStreamGetPriority, (CUstream h, int* priority), h, priority)
CUDASIM_PAIR(cuStreamGetFlags, (CUstream h, unsigned int* flags), h, flags)
CUDASIM_PAIR(cuStreamGetId, (CUstream h, unsigned long long* id), h, id)
CUDASIM_PAIR(cuStreamGetDevice, (CUstream h, CUdevice* dev), h, dev)

int cudasim_kernel(void* stream, uint64_t ns, const char* label) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("stream %p, %llu ns, %s", stream, (unsigned long long)ns, label ? label : "(no label)");
  return call.ret(kernel(static_cast<CUstream>(stream), ns, label));
}

CUresult cudasim_internal_file_io(CUstream stream, int write, int fd, void* buffer, size_t bytes,
                                  int64_t file_offset, int64_t* result) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  call.note("stream %p, %s fd %d, %zu bytes at %lld", (void*)stream, write ? "write" : "read", fd, bytes,
            (long long)file_offset);
  return call.ret(file_io(stream, write != 0, fd, buffer, bytes, file_offset, result));
}

CUresult cuEventRecordWithFlags(CUevent e, CUstream h, unsigned int flags) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (flags != 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  return call.ret(event_record(e, h, false));
}

CUresult cuStreamCreate(CUstream* ph, unsigned int flags) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  return call.ret(create_stream(ph, flags, 0));
}

CUresult cuStreamCreateWithPriority(CUstream* ph, unsigned int flags, int priority) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  return call.ret(create_stream(ph, flags, priority));
}

CUresult cuStreamDestroy_v2(CUstream h) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  // Work still queued completes; the worker then exits (CUDA releases the stream's
  // resources once the device has completed all work in it).
  if (!h || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) return call.ret(CUDA_ERROR_INVALID_HANDLE);
  if (!stream_handles().remove(h)) {
    if (stream_handles().was_destroyed(h)) destroyed_stream_used(h, "cuStreamDestroy (a second destruction)");
    return call.ret(CUDA_ERROR_INVALID_HANDLE);
  }
  h->stream->retire();
  delete h;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuEventCreate(CUevent* pe, unsigned int flags) {
  Call call(__func__, Call::kNeedsContext);
  if (!call.ok()) return call.status();
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (!pe || (flags & ~known)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  auto* e = new CUevent_st;
  e->flags = flags;
  e->device = current_device()->ordinal();
  event_handles().add(e);
  *pe = e;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent e) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!e || !event_handles().remove(e)) return call.ret(CUDA_ERROR_INVALID_HANDLE);
  delete e;  // queued records hold their own state, not the event
  return call.ret(CUDA_SUCCESS);
}

CUresult cuEventQuery(CUevent e) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!e || !event_handles().contains(e)) return call.ret(CUDA_ERROR_INVALID_HANDLE);
  if (CUresult r = check_unsafe_call()) return call.ret(r);  // a potentially unsafe call
  StreamPoint p;
  {
    std::lock_guard lock(e->mu);
    if (e->captured_in) return call.ret(CUDA_ERROR_CAPTURED_EVENT);  // last recorded in a capture
    p = e->point;
  }
  return call.ret(p.host_query() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY);
}

CUresult cuEventSynchronize(CUevent e) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!e || !event_handles().contains(e)) return call.ret(CUDA_ERROR_INVALID_HANDLE);
  if (CUresult r = check_unsafe_call()) return call.ret(r);  // a potentially unsafe call
  StreamPoint p;
  {
    std::lock_guard lock(e->mu);
    if (e->captured_in) return call.ret(CUDA_ERROR_CAPTURED_EVENT);  // last recorded in a capture
    p = e->point;
  }
  p.host_wait();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!ms) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (!start || !end || !event_handles().contains(start) || !event_handles().contains(end))
    return call.ret(CUDA_ERROR_INVALID_HANDLE);
  std::unique_lock lock_start(start->mu, std::defer_lock), lock_end(end->mu, std::defer_lock);
  if (start == end) lock_start.lock();
  else std::lock(lock_start, lock_end);
  if ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING) return call.ret(CUDA_ERROR_INVALID_HANDLE);
  if (!start->recorded || !end->recorded || !start->stamp || !end->stamp) return call.ret(CUDA_ERROR_INVALID_HANDLE);
  if (!start->point.host_query() || !end->point.host_query()) return call.ret(CUDA_ERROR_NOT_READY);
  if (virtual_time())  // the time between the two events' virtual completions
    *ms = float((double(end->point.end_ns) - double(start->point.end_ns)) / 1e6);
  else
    *ms = std::chrono::duration<float, std::milli>(*end->stamp - *start->stamp).count();
  return call.ret(CUDA_SUCCESS);
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!mode || (*mode != CU_STREAM_CAPTURE_MODE_GLOBAL && *mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
                *mode != CU_STREAM_CAPTURE_MODE_RELAXED))
    return call.ret(CUDA_ERROR_INVALID_VALUE);
  std::swap(*mode, thread_capture_mode());
  return call.ret(CUDA_SUCCESS);
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long flags) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!exec || flags != 0) return call.ret(CUDA_ERROR_INVALID_VALUE);
  if (!graph || !graph_handles().contains(graph)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  auto* x = new CUgraphExec_st{graph->graph};
  graph_exec_handles().add(x);
  *exec = x;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuGraphExecDestroy(CUgraphExec exec) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!exec || !graph_exec_handles().remove(exec)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  delete exec;
  return call.ret(CUDA_SUCCESS);
}

CUresult cuGraphDestroy(CUgraph graph) {
  Call call(__func__);
  if (!call.ok()) return call.status();
  if (!graph || !graph_handles().remove(graph)) return call.ret(CUDA_ERROR_INVALID_VALUE);
  delete graph;
  return call.ret(CUDA_SUCCESS);
}

}  // extern "C"
