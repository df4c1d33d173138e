// DiskTier: a file past pinned memory, for blocks the pinned host tier has no room for
// (axolotl's `activation_offloading: disk`). This class is the file, its space and its
// I/O; which blocks move there, and when they come back, is the engine's to decide.
//
// Note [The disk tier]
// --------------------
// One file per tier, in the directory the user names, that nobody else can open: it is
// created unlinked (O_TMPFILE; where the filesystem lacks it, a mkstemp name removed at
// once), so a crash leaves nothing behind, and with mode 0600.
//
// Space is extents of the file in 4 KiB units (the page: reads and writes of whole pages
// into page-aligned pinned buffers are what the page cache and the block layer handle
// best), placed by the coalescing free list the memory tiers use (pool/free_list.h): best
// fit, freed extents merged with their free neighbours. The file grows at its end when no
// free extent fits, and shrinks when its last extent is freed. reserve() allocates the
// space at once (posix_fallocate), so a full filesystem is found before a block leaves the
// host and said then, naming the directory, and a write into reserved space cannot run out
// of room. The tier never holds more than its limit (VRAMSWAP_DISK_LIMIT).
//
// I/O (VRAMSWAP_DISK_IO) runs one of two ways. write() and read() queue a job and return it
// at once; done() asks whether it finished, wait() waits and returns its error. A failed
// write leaves its source untouched and a failed read says so: nothing that was on the
// host is lost.
//   threads  A few threads of the tier's own run pread/pwrite, retried until whole; jobs
//            start in the order they were queued. Whoever waits, waits on a condition
//            variable.
//   cufile   Stream-ordered: each job is a cuFileWriteAsync or cuFileReadAsync (cuda/
//            cufile.h) on one of two streams of the tier's own (writes, reads) and an event
//            recorded after it; done() queries the event and wait() synchronizes with it.
//            So the disk is CUDA work: a GPU's driver runs it in stream order, and
//            cudasim times it on its disk engine (CUDASIM_DISK_GBPS), so that a step that
//            waits for a read is charged for it in virtual time (Note [Disk time] in
//            DESIGN.md). A job's result field is written when the stream runs it: the tier
//            keeps every job in flight until its event has completed.
//
// Thread safety: every member may be called from any thread (one mutex guards the
// extents, another the job queue and the jobs in flight); a job's buffer must stay valid
// until the job is done.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cufile.h"
#include "cuda/event.h"
#include "cuda/stream.h"
#include "pool/free_list.h"

namespace vramswap::residency {

inline constexpr uint64_t kDiskUnit = 4096;

// How the tier's reads and writes run (Note [The disk tier]).
enum class DiskIo { kThreads, kCuFile };

struct DiskTierOptions {
  std::string dir;           // VRAMSWAP_DISK_DIR: an existing, writable directory
  uint64_t limit_bytes = 0;  // VRAMSWAP_DISK_LIMIT: the most file space the tier holds
  int io_threads = 2;        // threads running the reads and writes
  bool named_file = false;   // tests: the mkstemp path even where O_TMPFILE works
  DiskIo io = DiskIo::kThreads;  // VRAMSWAP_DISK_IO
  int device = 0;                // kCuFile: the device whose streams carry the I/O
};

struct DiskTierStats {
  uint64_t used_bytes = 0;  // reserved extents
  uint64_t peak_used_bytes = 0;
  uint64_t file_bytes = 0;  // the file's length
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t num_failed_jobs = 0;
};

class DiskTier {
 public:
  // A write or read queued by write()/read().
  class Job {
   private:
    friend class DiskTier;
    enum State : int { kQueued, kOk, kFailed };
    bool finished() const { return state_.load(std::memory_order_acquire) != kQueued; }
    bool write = false;
    uint64_t offset = 0, bytes = 0;
    void* buffer = nullptr;
    std::atomic<int> state_{kQueued};
    std::string error;
    // kCuFile: the transfer's arguments (read at submission), its result (written when the
    // stream runs it) and the event after it.
    size_t size_arg = 0;
    off_t file_offset_arg = 0, buffer_offset_arg = 0;
    ssize_t result = 0;
    cuda::Event event;
    std::once_flag finish_once;
  };
  using JobRef = std::shared_ptr<Job>;

  // Opens the tier's file in options.dir; nullptr with *error set (naming the directory
  // and why) when it cannot.
  static std::unique_ptr<DiskTier> open(const DiskTierOptions& options, std::string* error);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // An extent of at least `bytes` (rounded up to kDiskUnit), its space allocated on disk:
  // its offset, or nullopt with *error set (the limit, or the filesystem full or failing).
  std::optional<uint64_t> reserve(uint64_t bytes, std::string* error);
  // Gives an extent back. False with *error set for an offset that is not a reserved
  // extent's (a double release is reported, never accepted).
  bool release(uint64_t offset, std::string* error);

  // Queues a copy of `bytes` from `src` into the extent at `offset` (a write) or from the
  // extent into `dst` (a read). `bytes` must fit in the extent.
  JobRef write(uint64_t offset, const void* src, uint64_t bytes);
  JobRef read(uint64_t offset, void* dst, uint64_t bytes);
  // Whether the job has finished (successfully or not), without waiting.
  bool done(const JobRef& job);
  // Waits for the job; "" when it succeeded, else why not (naming the directory).
  std::string wait(const JobRef& job);

  DiskTierStats stats() const;
  uint64_t limit_bytes() const { return limit_; }
  const std::string& dir() const { return dir_; }
  // The file's permission bits (0600), for tests.
  unsigned file_mode() const;
  DiskIo io() const { return cufile_ ? DiskIo::kCuFile : DiskIo::kThreads; }

 private:
  DiskTier(int fd, const DiskTierOptions& options);
  // kCuFile: registers the file and the streams; "" or why not.
  std::string start_cufile(const DiskTierOptions& options);
  JobRef queue(bool write, uint64_t offset, void* buffer, uint64_t bytes);
  JobRef queue_on_stream(bool write, uint64_t offset, void* buffer, uint64_t bytes);
  void run_io();
  void perform(Job& job);
  // kCuFile: the job's outcome from its result, once (its event has completed).
  void finish(Job& job);
  std::string failure(const Job& job, const std::string& why) const;

  struct Extent {
    uint64_t size;
    bool live;
  };
  using ExtentMap = std::map<uint64_t, Extent>;

  const int fd_;
  const std::string dir_;
  const uint64_t limit_;
  const int device_;

  mutable std::mutex mu_;  // the extents and the counters below
  ExtentMap extents_;      // tiles [0, file_bytes_)
  pool::FreeIndex free_;
  uint64_t file_bytes_ = 0, used_ = 0, peak_used_ = 0;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<JobRef> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;

  // kCuFile (else null): the library, the registered file, the streams, the jobs in flight.
  const cuda::CuFileApi* cufile_ = nullptr;
  cuda::CuFileHandle handle_ = nullptr;
  cuda::Stream write_stream_, read_stream_;
  std::vector<CUstream> registered_;  // the streams cuFileStreamRegister took
  std::vector<JobRef> in_flight_;  // guarded by queue_mu_

  std::atomic<uint64_t> bytes_written_{0}, bytes_read_{0}, failed_{0};
};

}  // namespace vramswap::residency
