// cudasim's libcufile.so.0: cuFile's API (cufile.h) on the host. Registrations are
// bookkeeping under one mutex; the synchronous calls read and write the file themselves;
// the stream-ordered calls hand the transfer to cudasim's driver (file_io.h), which queues
// it on the stream and, in virtual time, times it on the disk engine.
#include "cufile.h"

#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <type_traits>

#include "file_io.h"

namespace {

// The driver writes the result of a stream-ordered transfer as int64_t.
static_assert(std::is_same_v<ssize_t, int64_t>, "cuFile's ssize_t must be the driver's int64_t");

// What the stream-ordered calls need of a stream: everything fixed at submission (cufile.h).
constexpr unsigned kFixed =
    CU_FILE_STREAM_FIXED_BUF_OFFSET | CU_FILE_STREAM_FIXED_FILE_OFFSET | CU_FILE_STREAM_FIXED_FILE_SIZE;
constexpr unsigned kStreamFlags = kFixed | CU_FILE_STREAM_PAGE_ALIGNED_INPUTS;
// CU_FILE_STREAM_PAGE_ALIGNED_INPUTS promises sizes and offsets in whole pages of this size.
constexpr int64_t kPage = 4096;

struct State {
  std::mutex mu;
  int opens = 0;                          // cuFileDriverOpen calls not yet closed
  uintptr_t next_handle = 1;              // handles are numbers, never reused
  std::map<uintptr_t, int> handles;       // handle -> its fd
  std::set<const void*> buffers;          // cuFileBufRegister'ed bases
  std::map<CUstream, unsigned> streams;   // cuFileStreamRegister'ed streams -> flags
};

State& state() {
  static auto* s = new State;  // leaked: usable during exit
  return *s;
}

CUfileError_t result(CUfileOpError err, CUresult cu_err = CUDA_SUCCESS) { return CUfileError_t{err, cu_err}; }

uintptr_t handle_id(CUfileHandle_t fh) { return reinterpret_cast<uintptr_t>(fh); }

// The fd of a registered handle, or -1. Caller holds the mutex.
int fd_of(const State& s, CUfileHandle_t fh) {
  auto it = s.handles.find(handle_id(fh));
  return it == s.handles.end() ? -1 : it->second;
}

// Offsets and a size that a transfer may use: none negative, and the file's end and the
// buffer's end representable.
bool valid_range(size_t size, off_t file_offset, off_t buf_offset) {
  return file_offset >= 0 && buf_offset >= 0 && size <= size_t(INT64_MAX - file_offset) &&
         size <= size_t(INT64_MAX - buf_offset);
}

ssize_t sync_io(bool write, CUfileHandle_t fh, const void* base, size_t size, off_t file_offset, off_t buf_offset) {
  int fd;
  {
    State& s = state();
    std::lock_guard lock(s.mu);
    if (s.opens == 0) return -CU_FILE_DRIVER_NOT_INITIALIZED;
    if (!base || !valid_range(size, file_offset, buf_offset)) return -CU_FILE_INVALID_VALUE;
    if ((fd = fd_of(s, fh)) < 0) return -CU_FILE_HANDLE_NOT_REGISTERED;
  }
  // cuFile writes from a const buffer; transfer_file only reads it then.
  char* p = const_cast<char*>(static_cast<const char*>(base)) + buf_offset;
  const int64_t moved = cudasim::transfer_file(write, fd, p, size, file_offset);
  if (moved < 0) {
    errno = int(-moved);
    return -1;
  }
  return moved;
}

CUfileError_t async_io(bool write, CUfileHandle_t fh, void* base, size_t* size_p, off_t* file_offset_p,
                       off_t* buf_offset_p, ssize_t* bytes_p, CUstream stream) {
  int fd;
  {
    State& s = state();
    std::lock_guard lock(s.mu);
    if (s.opens == 0) return result(CU_FILE_DRIVER_NOT_INITIALIZED);
    auto registered = s.streams.find(stream);
    if (registered == s.streams.end() || (registered->second & kFixed) != kFixed)
      return result(CU_FILE_INVALID_VALUE);
    if (!base || !size_p || !file_offset_p || !buf_offset_p || !bytes_p) return result(CU_FILE_INVALID_VALUE);
    if (!valid_range(*size_p, *file_offset_p, *buf_offset_p)) return result(CU_FILE_INVALID_VALUE);
    if ((registered->second & CU_FILE_STREAM_PAGE_ALIGNED_INPUTS) &&
        (int64_t(*size_p) % kPage || *file_offset_p % kPage || *buf_offset_p % kPage))
      return result(CU_FILE_INVALID_VALUE);
    if ((fd = fd_of(s, fh)) < 0) return result(CU_FILE_HANDLE_NOT_REGISTERED);
  }
  const CUresult r = cudasim_internal_file_io(stream, write ? 1 : 0, fd, static_cast<char*>(base) + *buf_offset_p,
                                              *size_p, *file_offset_p, bytes_p);
  return r == CUDA_SUCCESS ? result(CU_FILE_SUCCESS) : result(CU_FILE_CUDA_DRIVER_ERROR, r);
}

}  // namespace

extern "C" {

CUfileError_t cuFileDriverOpen(void) {
  State& s = state();
  std::lock_guard lock(s.mu);
  ++s.opens;
  return result(CU_FILE_SUCCESS);
}

CUfileError_t cuFileDriverClose(void) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.opens == 0) return result(CU_FILE_DRIVER_NOT_INITIALIZED);
  if (--s.opens == 0) {
    s.handles.clear();
    s.buffers.clear();
    s.streams.clear();
  }
  return result(CU_FILE_SUCCESS);
}

CUfileError_t cuFileDriverClose_v2(void) { return cuFileDriverClose(); }

CUfileError_t cuFileHandleRegister(CUfileHandle_t* fh, CUfileDescr_t* descr) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.opens == 0) return result(CU_FILE_DRIVER_NOT_INITIALIZED);
  if (!fh || !descr) return result(CU_FILE_INVALID_VALUE);
  if (descr->type != CU_FILE_HANDLE_TYPE_OPAQUE_FD) return result(CU_FILE_INVALID_FILE_TYPE);
  const int fd = descr->handle.fd;
  struct stat st;
  if (fd < 0 || ::fstat(fd, &st) != 0) return result(CU_FILE_INVALID_VALUE);
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) return result(CU_FILE_INVALID_FILE_TYPE);
  for (const auto& [id, registered_fd] : s.handles)
    if (registered_fd == fd) return result(CU_FILE_HANDLE_ALREADY_REGISTERED);
  const uintptr_t id = s.next_handle++;
  s.handles[id] = fd;
  *fh = reinterpret_cast<CUfileHandle_t>(id);
  return result(CU_FILE_SUCCESS);
}

void cuFileHandleDeregister(CUfileHandle_t fh) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.handles.erase(handle_id(fh));
}

CUfileError_t cuFileBufRegister(const void* base, size_t length, int flags) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.opens == 0) return result(CU_FILE_DRIVER_NOT_INITIALIZED);
  if (!base || length == 0 || flags != 0) return result(CU_FILE_INVALID_VALUE);
  if (!s.buffers.insert(base).second) return result(CU_FILE_MEMORY_ALREADY_REGISTERED);
  return result(CU_FILE_SUCCESS);
}

CUfileError_t cuFileBufDeregister(const void* base) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.opens == 0) return result(CU_FILE_DRIVER_NOT_INITIALIZED);
  if (s.buffers.erase(base) != 1) return result(CU_FILE_MEMORY_NOT_REGISTERED);
  return result(CU_FILE_SUCCESS);
}

ssize_t cuFileRead(CUfileHandle_t fh, void* base, size_t size, off_t file_offset, off_t buf_offset) {
  return sync_io(false, fh, base, size, file_offset, buf_offset);
}

ssize_t cuFileWrite(CUfileHandle_t fh, const void* base, size_t size, off_t file_offset, off_t buf_offset) {
  return sync_io(true, fh, base, size, file_offset, buf_offset);
}

CUfileError_t cuFileReadAsync(CUfileHandle_t fh, void* base, size_t* size_p, off_t* file_offset_p,
                              off_t* buf_offset_p, ssize_t* bytes_read_p, CUstream stream) {
  return async_io(false, fh, base, size_p, file_offset_p, buf_offset_p, bytes_read_p, stream);
}

CUfileError_t cuFileWriteAsync(CUfileHandle_t fh, void* base, size_t* size_p, off_t* file_offset_p,
                               off_t* buf_offset_p, ssize_t* bytes_written_p, CUstream stream) {
  return async_io(true, fh, base, size_p, file_offset_p, buf_offset_p, bytes_written_p, stream);
}

CUfileError_t cuFileStreamRegister(CUstream stream, unsigned flags) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.opens == 0) return result(CU_FILE_DRIVER_NOT_INITIALIZED);
  if (flags & ~kStreamFlags) return result(CU_FILE_INVALID_VALUE);
  if (!s.streams.emplace(stream, flags).second) return result(CU_FILE_INVALID_VALUE);
  return result(CU_FILE_SUCCESS);
}

CUfileError_t cuFileStreamDeregister(CUstream stream) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (s.opens == 0) return result(CU_FILE_DRIVER_NOT_INITIALIZED);
  if (s.streams.erase(stream) != 1) return result(CU_FILE_INVALID_VALUE);
  return result(CU_FILE_SUCCESS);
}

CUfileError_t cuFileGetVersion(int* version) {
  if (!version) return result(CU_FILE_INVALID_VALUE);
  *version = 1150;  // cuFile 1.15.0, CUDA 13.0's (cufile.h)
  return result(CU_FILE_SUCCESS);
}

}  // extern "C"
