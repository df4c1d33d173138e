// cudasim streams, events and stream capture.
//
// A stream is an in-order queue of operations executed by its own worker thread, so
// work really happens after the call that queued it returned. Each operation gets a
// sequence number; `completed` is the highest one finished. An operation may depend on
// other streams' sequence numbers (event waits, the legacy stream's implicit
// synchronization): the worker waits for those before running it. An event record
// captures (stream, sequence) at record time, which is exactly CUDA's "the event
// completes when all work queued before the record has completed".
//
// Legacy default stream (CUDA's "NULL stream"): an operation on it first waits for all
// work already queued on every blocking stream of the device, and an operation on a
// blocking stream first waits for all work already queued on the legacy stream.
// cudaStreamNonBlocking streams take part in neither.
//
// Capture: while a stream captures, queued operations are recorded into a graph
// instead of running; a stream that waits on an event recorded by a capturing stream
// joins that capture. A graph replays its operations, in the order they were captured,
// on the stream it is launched on.
//
// CUDASIM_CHAOS=<seed>: before each operation a worker may sleep for a random time,
// drawn from a generator seeded by the seed and the stream's creation number, so a
// missing synchronization shows up as a wrong result, reproducibly per seed.
//
// Virtual time (CUDASIM_TIME=virtual, virtual_time.h): each operation also gets a
// virtual end when it is queued (the queue and the virtual order are the same order),
// and a StreamPoint carries the virtual end of the work it names. The workers still run
// every operation for real; host waits wait for them and then move the host clock.
//
// Thread safety: every public member may be called from any thread. A stream's mutex
// is never held while an operation runs or while waiting for another stream.
#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "virtual_time.h"

namespace cudasim {

class Device;
class Stream;

// A point in a stream's order: done once `stream` completed `seq`.
struct StreamPoint {
  std::shared_ptr<Stream> stream;
  uint64_t seq = 0;
  uint64_t end_ns = 0;  // virtual time: when the work up to `seq` ends (0 in real time)
  bool done() const;
  // Blocks until done (workers waiting on dependencies use this).
  void wait() const;
  // The host waits: wait(), then in virtual time the host clock moves to end_ns.
  void host_wait() const;
  // The host asks: in real time done(); in virtual time end_ns <= the host clock, after
  // which it waits for the real work, so that the answer depends on virtual time only.
  bool host_query() const;
};

struct Operation {
  const char* what = "";                 // for CUDASIM_LOG, fault reports and the timeline
  std::function<void()> run;
  std::vector<StreamPoint> after;        // must be done before `run`
  bool counts = true;                    // counted in ops_executed
  VirtualOp timing;                      // its kind and cost in virtual time
  uint64_t timeline_id = 0;              // real-time timeline: the entry that gets its real times
};

struct Graph;

// One capture sequence: the graph being built and the streams taking part.
struct Capture {
  std::shared_ptr<Graph> graph;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  std::thread::id owner;
  std::atomic<bool> invalidated{false};  // set by any thread's prohibited call
  std::atomic<bool> ended{false};        // cuStreamEndCapture ran: no stream can join it any more
  uint64_t id = 0;
};

struct Graph {
  std::mutex mu;
  std::vector<Operation> ops;  // in capture order
};

class Stream : public std::enable_shared_from_this<Stream> {
 public:
  enum class Kind { kLegacy, kPerThread, kCreated };

  // `handle`: the value programs name it by (the timeline's stream): 0 for the legacy
  // stream, CU_STREAM_PER_THREAD for a per-thread one, else its CUstream.
  Stream(Device* device, Kind kind, unsigned flags, int priority, uint64_t handle);
  ~Stream();

  Device* device() const { return device_; }
  Kind kind() const { return kind_; }
  unsigned flags() const { return flags_; }
  int priority() const { return priority_; }
  uint64_t id() const { return id_; }
  uint64_t handle() const { return handle_; }
  bool blocking() const { return kind_ != Kind::kLegacy && !(flags_ & CU_STREAM_NON_BLOCKING); }

  // Queues an operation (adding the legacy-stream dependencies) and returns its point.
  // While the stream captures, the operation goes to the capture's graph instead and the
  // returned point has no stream.
  StreamPoint enqueue(Operation op);

  // The point after everything queued so far.
  StreamPoint tail();
  // Blocks the calling (host) thread until everything queued so far has completed; in
  // virtual time the host clock then moves to its virtual end.
  void synchronize();
  // No more work will be queued; the worker exits once the queue drains.
  void retire();

  // Capture state (see the file comment).
  std::shared_ptr<Capture> capture();
  void set_capture(std::shared_ptr<Capture> c);

  // Progress, for StreamPoint.
  bool completed_at_least(uint64_t seq);
  void wait_for(uint64_t seq);

 private:
  // Queues `op` after implicit dependencies ending at virtual time `implicit_ns`. In
  // virtual time the caller holds clock_mutex().
  StreamPoint submit(Operation op, uint64_t implicit_ns);
  void start_worker_locked();
  void worker_loop();
  void chaos_delay();

  Device* const device_;
  const Kind kind_;
  const unsigned flags_;
  const int priority_;
  const uint64_t id_;
  const uint64_t handle_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, Operation>> queue_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  bool retired_ = false;
  bool worker_started_ = false;
  std::shared_ptr<Capture> capture_;
  StreamClock clock_;  // written under clock_mutex() and mu_, read under either
  std::mt19937_64 chaos_rng_;
};

// The per-thread default stream of `device` for the calling thread (created on first use,
// retired when the thread exits).
std::shared_ptr<Stream> per_thread_stream(Device* device);

// Capture sequences in progress, for the rules on "potentially unsafe" calls.
void register_capture(const std::shared_ptr<Capture>& c);
void unregister_capture(const std::shared_ptr<Capture>& c);
// The calling thread's capture interaction mode (cuThreadExchangeStreamCaptureMode).
CUstreamCaptureMode& thread_capture_mode();
// CUDA_SUCCESS, or CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED when an active capture prohibits
// potentially unsafe calls (cudaMalloc, synchronous copies, synchronization) on this
// thread; the prohibiting captures are then invalidated, as CUDA does.
CUresult check_unsafe_call();
// CUDA_SUCCESS, or CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED when a stream of `device` (of every
// device: nullptr) is capturing. "It is also invalid to query the execution status of or
// synchronize a broader handle which encompasses an active stream capture, such as a device
// or context handle when any associated stream is in capture mode" (CUDA C++ Programming
// Guide, stream capture): in every capture mode, the relaxed one included; those captures are
// invalidated. For device and context synchronization and the frees that synchronize.
CUresult check_device_sync(Device* device);

// Installs the SIGSEGV reporter that names the faulting address and operation.
void install_fault_reporter();

}  // namespace cudasim

// Handles given to the program. The registry in handles.h validates them.
struct CUstream_st {
  std::shared_ptr<cudasim::Stream> stream;
};

struct CUevent_st {
  unsigned flags = 0;
  int device = 0;  // current at creation: the event is recorded only on that device's streams
  std::mutex mu;
  bool recorded = false;
  cudasim::StreamPoint point;                               // completion of the last record
  std::shared_ptr<std::chrono::steady_clock::time_point> stamp;  // set when that record ran
  std::shared_ptr<cudasim::Capture> captured_in;            // recorded during this capture
};

struct CUgraph_st {
  std::shared_ptr<cudasim::Graph> graph;
};

struct CUgraphExec_st {
  std::shared_ptr<cudasim::Graph> graph;
};
