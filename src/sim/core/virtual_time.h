// cudasim's virtual time (CUDASIM_TIME=virtual) and its timeline.
//
// In virtual time every stream operation gets a start and an end on a simulated clock,
// computed once, when the operation is queued, from nothing but the order of the calls:
//
//   start = max(host clock at enqueue,
//               end of the previous operation on the same stream,
//               the implicit dependencies of the legacy default stream (the virtual ends
//                 of the streams it synchronizes with),
//               the virtual completion of the event it waits on (cuStreamWaitEvent),
//               the time its engine becomes free)
//   end   = start + duration
//
// Engines, per device, each a FIFO in enqueue order (no back-filling of idle gaps):
//   compute  kernels (cudasim_kernel), device-to-device copies and memsets, all streams;
//            d2d copies and memsets run on the SMs and HBM that kernels use, so they take
//            turns with kernels, at CUDASIM_HBM_GBPS
//   h2d/d2h  one copy engine per direction at CUDASIM_PCIE_GBPS each
//            (CUDASIM_PCIE_DUPLEX=full), or one engine both directions share
//            (CUDASIM_PCIE_DUPLEX=shared: a link whose bandwidth the directions split)
// and one engine for the whole process, FIFO in enqueue order too:
//   disk     the host's disk, which every device's streams share: stream-ordered file
//            reads and writes (cudasim_internal_file_io, behind libcufile's
//            cuFileReadAsync / cuFileWriteAsync), the two taking turns, at CUDASIM_DISK_GBPS
// Durations: a copy, memset, file read or file write of N bytes takes N / rate ns (GB/s is
// bytes per ns), rounded up (a read takes the time of the bytes asked for, whatever the
// file holds); a kernel takes the ns it was given; event records, stream waits, host
// functions, host-to-host copies and stream-ordered frees take 0 and use no engine.
//
// The host has one clock, process-wide, starting at 0. API calls take no virtual time;
// the clock moves only when the host waits: a synchronization (stream, event, context,
// device, a synchronous copy, cuMemFree...) really waits for the work, then sets the
// clock to max(clock, the virtual end of the work it waited for). Queries (event and
// stream) answer from the virtual clock alone: complete iff the virtual end <= the host
// clock; when that says complete but the worker thread has not finished, the query waits
// for it, so the data is there and the answer never depends on real thread timing.
// (So a query can block where real time would answer "not ready": a program whose host
// function waits for the host to query first deadlocks in virtual time.)
// With one host thread, a call sequence therefore gives the same times every run, with
// or without CUDASIM_CHAOS (which only delays the real workers).
//
// Stall: a kernel's stall_ns is how much later it starts than it would have if the
// event waits queued on its stream since its previous kernel had not been there (only
// a wait on an event of another stream can delay anything). Each stream keeps, beside
// its virtual end, an "unwaited" end: the same recurrence with the waits' times left
// out; a kernel's stall is its start minus its start by that recurrence, and the
// stream's unwaited end then catches up with its end (the stall is charged once, to the
// first kernel after the waits).
//
// Timeline: in virtual time every kernel, copy, memset, file read or write and host
// function is recorded with its virtual times at enqueue (event records, waits and frees
// are not). In real time, with CUDASIM_TIMELINE=1, the entries get real times (ns since
// start) when they run.
// At most kTimelineCapacity entries are kept; the oldest go first.
//
// Thread safety: scheduling happens under clock_mutex(), which the caller holds (lock
// order: clock mutex, then a stream's mutex); the host clock is an atomic; the timeline
// has its own mutex. Determinism is promised for one host thread only: with several,
// their interleaving decides the order of enqueues and so the times.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "cudasim.h"

namespace cudasim {

// cudasim_timeline_entry.kind, plus kUntimed for operations the timeline leaves out.
enum class OpKind : uint32_t {
  kKernel = 0,
  kCopyH2D = 1,
  kCopyD2H = 2,
  kCopyD2D = 3,
  kMemset = 4,
  kOther = 5,      // host functions, host-to-host copies
  kDiskRead = 6,   // stream-ordered file reads (the disk engine)
  kDiskWrite = 7,  // stream-ordered file writes (the disk engine)
  kUntimed = 8     // event records, stream waits, frees: 0 ns, no engine, not recorded
};

// What an operation is, for virtual time and the timeline.
struct VirtualOp {
  OpKind kind = OpKind::kUntimed;
  uint64_t bytes = 0;              // copies, memsets, file reads and writes
  uint64_t kernel_ns = 0;          // kernels
  uint64_t wait_ns = 0;            // stream waits: the awaited event's virtual completion
  std::string label;               // kernels: the caller's label (<= 47 chars); others: empty
};

// A stream's position on the virtual clock. Guarded by clock_mutex().
struct StreamClock {
  uint64_t end_ns = 0;       // virtual end of everything queued on the stream
  uint64_t unwaited_ns = 0;  // the same, leaving out event waits since the last kernel
};

// The most timeline entries kept (~100 MiB at most); older entries are dropped first.
constexpr size_t kTimelineCapacity = size_t{1} << 20;
// A label's room, with its terminating NUL.
constexpr size_t kLabelSize = sizeof(cudasim_timeline_entry{}.label);

// CUDASIM_TIME=virtual.
bool virtual_time();
// Nanoseconds of the monotonic clock since the library was loaded.
uint64_t real_now_ns();
// The host's virtual clock (0 at start). Thread-safe.
uint64_t host_now_ns();
// Moves the host's virtual clock to `t` when that is later. Thread-safe.
void advance_host_to(uint64_t t);
// In virtual time, moves the host's virtual clock `ns` on: the host time a call took
// (env.h, HostCosts). Nothing in real time. Thread-safe.
void charge_host(uint64_t ns);

// Serializes scheduling: held across the computation of an operation's times and its
// insertion into its stream's queue, so that virtual order is enqueue order.
std::mutex& clock_mutex();

// Computes the times of `op` on `device`, queued on the stream with handle value `stream`
// whose clock is `clock` (updated), after implicit dependencies ending at `implicit_ns`;
// updates the engine and records the timeline entry. Returns the virtual end.
// Caller holds clock_mutex().
uint64_t schedule(const VirtualOp& op, const char* what, int device, uint64_t stream, StreamClock& clock,
                  uint64_t implicit_ns);

// The latest virtual end of any operation queued on `device` (all devices: -1); a file
// read or write counts for the device of the stream it was queued on.
uint64_t device_end_ns(int device);

// The timeline. recording(): on in virtual time, or with CUDASIM_TIMELINE=1.
bool timeline_recording();
// Real time: records an operation when it is queued; returns the id that timeline_ran
// completes with its real start and end.
uint64_t timeline_queued(const VirtualOp& op, const char* what, int device, uint64_t stream);
void timeline_ran(uint64_t id, uint64_t start_ns, uint64_t end_ns);
// cudasim_timeline / cudasim_timeline_clear.
size_t timeline_copy(cudasim_timeline_entry* out, size_t capacity);
void timeline_clear();

}  // namespace cudasim
