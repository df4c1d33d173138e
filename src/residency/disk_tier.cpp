// The disk tier's file, its extents and its I/O, on threads or on streams (Note [The disk
// tier] in disk_tier.h).
#include "residency/disk_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "config/units.h"
#include "cuda/device.h"
#include "cuda/error.h"

namespace vramswap::residency {
namespace {

std::string errno_text(int e) { return std::strerror(e); }

}  // namespace

std::unique_ptr<DiskTier> DiskTier::open(const DiskTierOptions& options, std::string* error) {
  const std::string& dir = options.dir;
  if (dir.empty()) {
    *error = "VRAMSWAP_DISK_DIR is empty: name an existing directory the process may write";
    return nullptr;
  }
  int fd = -1;
  if (!options.named_file) {
    fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    // EISDIR or EOPNOTSUPP: a kernel or filesystem without O_TMPFILE; the named path below.
    if (fd < 0 && errno != EISDIR && errno != EOPNOTSUPP && errno != EINVAL) {
      *error = "VRAMSWAP_DISK_DIR='" + dir + "': cannot create the disk tier's file there: " + errno_text(errno);
      return nullptr;
    }
  }
  if (fd < 0) {
    std::string path = dir + "/vramswap-disk-XXXXXX";
    fd = ::mkostemp(path.data(), O_CLOEXEC);  // mode 0600
    if (fd < 0) {
      *error = "VRAMSWAP_DISK_DIR='" + dir + "': cannot create the disk tier's file there: " + errno_text(errno);
      return nullptr;
    }
    if (::unlink(path.c_str()) != 0) {
      const int e = errno;
      ::close(fd);
      *error = "VRAMSWAP_DISK_DIR='" + dir + "': cannot unlink the disk tier's file " + path + ": " + errno_text(e);
      return nullptr;
    }
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(fd, options));
  if (options.io == DiskIo::kCuFile) {
    if (std::string why = tier->start_cufile(options); !why.empty()) {
      *error = "VRAMSWAP_DISK_IO=cufile: " + why;
      return nullptr;
    }
  }
  return tier;
}

DiskTier::DiskTier(int fd, const DiskTierOptions& options)
    : fd_(fd), dir_(options.dir), limit_(options.limit_bytes), device_(options.device) {
  if (options.io == DiskIo::kThreads)
    for (int i = 0; i < std::max(1, options.io_threads); ++i) threads_.emplace_back([this] { run_io(); });
}

std::string DiskTier::start_cufile(const DiskTierOptions& options) {
  std::string error;
  const cuda::CuFileApi* api = cuda::CuFileApi::load(&error);
  if (!api) return error;
  cuda::CuFileDescr descr{};
  descr.type = cuda::kCuFileHandleTypeOpaqueFd;
  descr.handle.fd = fd_;
  if (const cuda::CuFileError e = api->handle_register(&handle_, &descr); e.err != 0)
    return "cuFileHandleRegister of the disk tier's file in " + dir_ + " failed: " + cuda::cufile_error_text(e);
  cufile_ = api;  // from here the destructor deregisters what was registered
  try {
    write_stream_ = cuda::Stream::create(options.device);
    read_stream_ = cuda::Stream::create(options.device);
  } catch (const std::exception& e) {
    return std::string("cannot create the disk tier's streams: ") + e.what();
  }
  for (const cuda::Stream* s : {&write_stream_, &read_stream_}) {
    const CUstream stream = reinterpret_cast<CUstream>(s->get());
    if (const cuda::CuFileError e = cufile_->stream_register(stream, cuda::kCuFileStreamFixed); e.err != 0)
      return "cuFileStreamRegister failed: " + cuda::cufile_error_text(e);
    registered_.push_back(stream);
  }
  return "";
}

DiskTier::~DiskTier() {
  {
    std::lock_guard lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  if (cufile_) {
    // Every job's result field must outlive its transfer.
    for (const cuda::Stream* s : {&write_stream_, &read_stream_})
      if (*s) cuda::synchronize_stream(s->get());
    for (CUstream stream : registered_) cufile_->stream_deregister(stream);
    cufile_->handle_deregister(handle_);
  }
  ::close(fd_);
}

std::optional<uint64_t> DiskTier::reserve(uint64_t bytes, std::string* error) {
  const uint64_t size = round_up(std::max<uint64_t>(bytes, 1), kDiskUnit);
  std::lock_guard lock(mu_);
  if (used_ + size > limit_) {
    *error = "the disk tier in " + dir_ + " is full: " + format_size(used_) + " of its VRAMSWAP_DISK_LIMIT of " +
             format_size(limit_) + " reserved, " + format_size(size) + " more asked for";
    return std::nullopt;
  }
  uint64_t offset;
  auto fit = pool::best_fit(free_, size);
  if (fit != free_.end()) {
    offset = fit->second;
    const uint64_t had = fit->first;
    free_.erase(fit);
    Extent& e = extents_.at(offset);
    if (had > size) {  // the rest stays free, right after it
      extents_.emplace(offset + size, Extent{had - size, false});
      free_.emplace(had - size, offset + size);
      e.size = size;
    }
    e.live = true;
  } else {
    offset = file_bytes_;
    if (const int e = ::posix_fallocate(fd_, offset, static_cast<off_t>(size)); e != 0) {
      *error = "cannot reserve " + format_size(size) + " for the disk tier in " + dir_ +
               " (VRAMSWAP_DISK_DIR): " + errno_text(e) + "; " + format_size(used_) + " of it in use";
      return std::nullopt;
    }
    extents_.emplace(offset, Extent{size, true});
    file_bytes_ += size;
  }
  used_ += size;
  peak_used_ = std::max(peak_used_, used_);
  return offset;
}

bool DiskTier::release(uint64_t offset, std::string* error) {
  std::lock_guard lock(mu_);
  auto it = extents_.find(offset);
  if (it == extents_.end() || !it->second.live) {
    *error = "release of disk tier offset " + std::to_string(offset) + ": " +
             (it == extents_.end() ? "no extent starts there" : "already released (double release)");
    return false;
  }
  used_ -= it->second.size;
  it->second.live = false;
  it = pool::coalesce(
      extents_, it, [](const Extent& n) { return !n.live; },
      [&](ExtentMap::iterator n) { free_.erase({n->second.size, n->first}); }, [](Extent&, const Extent&) {});
  if (it->first + it->second.size == file_bytes_) {
    // The file's last extent: the file shrinks (the space goes back to the filesystem).
    if (::ftruncate(fd_, static_cast<off_t>(it->first)) == 0) {
      file_bytes_ = it->first;
      extents_.erase(it);
      return true;
    }
  }
  free_.emplace(it->second.size, it->first);
  return true;
}

DiskTier::JobRef DiskTier::write(uint64_t offset, const void* src, uint64_t bytes) {
  return queue(true, offset, const_cast<void*>(src), bytes);
}

DiskTier::JobRef DiskTier::read(uint64_t offset, void* dst, uint64_t bytes) { return queue(false, offset, dst, bytes); }

DiskTier::JobRef DiskTier::queue(bool write, uint64_t offset, void* buffer, uint64_t bytes) {
  if (cufile_) return queue_on_stream(write, offset, buffer, bytes);
  auto job = std::make_shared<Job>();
  job->write = write;
  job->offset = offset;
  job->buffer = buffer;
  job->bytes = bytes;
  {
    std::lock_guard lock(queue_mu_);
    queue_.push_back(job);
  }
  queue_cv_.notify_one();
  return job;
}

DiskTier::JobRef DiskTier::queue_on_stream(bool write, uint64_t offset, void* buffer, uint64_t bytes) {
  auto job = std::make_shared<Job>();
  job->write = write;
  job->offset = offset;
  job->buffer = buffer;
  job->bytes = bytes;
  job->size_arg = bytes;
  job->file_offset_arg = static_cast<off_t>(offset);
  cudaStream_t stream = write ? write_stream_.get() : read_stream_.get();
  {
    // In flight before it is queued: the stream writes its result field.
    std::lock_guard lock(queue_mu_);
    std::erase_if(in_flight_, [](const JobRef& j) { return j->finished(); });
    in_flight_.push_back(job);
  }
  cuda::RelaxedCaptureScope relaxed;
  const cuda::CuFileError e =
      (write ? cufile_->write_async : cufile_->read_async)(handle_, buffer, &job->size_arg, &job->file_offset_arg,
                                                            &job->buffer_offset_arg, &job->result,
                                                            reinterpret_cast<CUstream>(stream));
  if (e.err != 0) {
    std::call_once(job->finish_once, [&] {
      job->error = failure(*job, "could not be queued: " + cuda::cufile_error_text(e));
      failed_.fetch_add(1, std::memory_order_relaxed);
      job->state_.store(Job::kFailed, std::memory_order_release);
    });
    return job;
  }
  try {
    cuda::ContextScope scope(device_);
    job->event = cuda::Event::create();
    job->event.record(stream);
  } catch (const cuda::CudaError&) {
    // No event to ask: the transfer is waited for now, and the job has its outcome.
    job->event = cuda::Event();
    cuda::synchronize_stream(stream);
    finish(*job);
  }
  return job;
}

bool DiskTier::done(const JobRef& job) {
  if (job->finished()) return true;
  if (!cufile_ || !job->event || !job->event.query()) return false;
  finish(*job);
  return true;
}

std::string DiskTier::wait(const JobRef& job) {
  if (cufile_) {
    if (!job->finished()) {
      job->event.synchronize();
      finish(*job);
    }
  } else {
    std::unique_lock lock(queue_mu_);
    queue_cv_.wait(lock, [&] { return job->finished(); });
  }
  return job->state_.load(std::memory_order_acquire) == Job::kOk ? std::string() : job->error;
}

void DiskTier::finish(Job& job) {
  std::call_once(job.finish_once, [&] {
    if (job.result >= 0 && static_cast<uint64_t>(job.result) == job.bytes) {
      (job.write ? bytes_written_ : bytes_read_).fetch_add(job.bytes, std::memory_order_relaxed);
      job.state_.store(Job::kOk, std::memory_order_release);
      return;
    }
    // cuFile's result: the bytes moved, or a negative errno or cuFile error.
    std::string why;
    if (job.result >= 0)
      why = "only " + std::to_string(job.result) + " bytes moved";
    else if (-job.result < 5000)
      why = errno_text(static_cast<int>(-job.result));
    else
      why = "cuFile error " + std::to_string(-job.result);
    job.error = failure(job, why);
    failed_.fetch_add(1, std::memory_order_relaxed);
    job.state_.store(Job::kFailed, std::memory_order_release);
  });
}

std::string DiskTier::failure(const Job& job, const std::string& why) const {
  return std::string(job.write ? "writing " : "reading ") + format_size(job.bytes) + " at offset " +
         std::to_string(job.offset) + " of the disk tier's file in " + dir_ + " failed: " + why;
}

void DiskTier::run_io() {
  for (;;) {
    JobRef job;
    {
      std::unique_lock lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to do
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    perform(*job);
    {
      std::lock_guard lock(queue_mu_);  // so that a waiter cannot miss the notification
    }
    queue_cv_.notify_all();
  }
}

void DiskTier::perform(Job& job) {
  auto* p = static_cast<char*>(job.buffer);
  uint64_t done = 0;
  while (done < job.bytes) {
    const off_t at = static_cast<off_t>(job.offset + done);
    const ssize_t n = job.write ? ::pwrite(fd_, p + done, job.bytes - done, at) : ::pread(fd_, p + done, job.bytes - done, at);
    if (n > 0) {
      done += static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    job.error = failure(job, n == 0 ? std::string("the file ends there") : errno_text(errno));
    failed_.fetch_add(1, std::memory_order_relaxed);
    job.state_.store(Job::kFailed, std::memory_order_release);
    return;
  }
  (job.write ? bytes_written_ : bytes_read_).fetch_add(job.bytes, std::memory_order_relaxed);
  job.state_.store(Job::kOk, std::memory_order_release);
}

DiskTierStats DiskTier::stats() const {
  DiskTierStats s;
  {
    std::lock_guard lock(mu_);
    s.used_bytes = used_;
    s.peak_used_bytes = peak_used_;
    s.file_bytes = file_bytes_;
  }
  s.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  s.num_failed_jobs = failed_.load(std::memory_order_relaxed);
  return s;
}

unsigned DiskTier::file_mode() const {
  struct stat st {};
  return ::fstat(fd_, &st) == 0 ? st.st_mode & 0777 : 0;
}

}  // namespace vramswap::residency
