// Stream-ordered file I/O: the driver's entry point behind cudasim's libcufile.so.0
// (src/sim/cufile), exported by libcuda.so.1 for it alone, and the transfer loop both use.
// Shared by both, so that the definition and the caller agree on the signature.
#pragma once

#include <cuda.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

namespace cudasim {

// pread (`write` false) or pwrite of `bytes` at `offset` until done, the end of the file,
// or an error; EINTR and partial transfers are retried. Returns the bytes moved, or
// -errno. The offset range was checked (offset + bytes <= INT64_MAX).
inline int64_t transfer_file(bool write, int fd, char* buffer, size_t bytes, int64_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const off_t at = off_t(offset + int64_t(done));
    const ssize_t n =
        write ? ::pwrite(fd, buffer + done, bytes - done, at) : ::pread(fd, buffer + done, bytes - done, at);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -int64_t(errno);
    }
    if (n == 0) break;  // the end of the file (and a write that moves nothing would never finish)
    done += size_t(n);
  }
  return int64_t(done);
}

}  // namespace cudasim

extern "C" {

// Queues on `stream` (resolved as cuMemcpyAsync resolves it: NULL is the legacy stream,
// CU_STREAM_LEGACY and CU_STREAM_PER_THREAD name theirs, and the legacy stream's implicit
// synchronization applies) a read (`write` 0) or write of `bytes` between `buffer` and the
// file `fd` at `file_offset`. When the stream runs it, transfer_file moves the bytes and
// *result gets the bytes moved, or -errno when a call failed (even after some bytes
// moved: a disk that fills half-way is a failure). `buffer` and `result` must stay valid
// until then. With CUDASIM_UNBACKED=1 no byte moves (as for copies): *result gets `bytes`,
// or -EFAULT when `buffer` is device memory the transfer could not touch (as pread/pwrite
// would find it).
// Virtual time: a disk read or write (timeline kinds 6 and 7) of `bytes` on the process's
// one disk engine at CUDASIM_DISK_GBPS, whatever the file holds (virtual_time.h).
// Returns CUDA_SUCCESS; CUDA_ERROR_INVALID_HANDLE for an unknown stream;
// CUDA_ERROR_INVALID_VALUE for fd < 0, no result, no buffer with bytes > 0, or an offset
// that is negative or would pass INT64_MAX; CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED while the
// stream captures (the capture is invalidated: file I/O cannot go into a graph); and what
// every driver call returns (not initialized, inside a host function, no context for a
// default stream, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT on the legacy stream while a blocking
// stream captures).
CUresult cudasim_internal_file_io(CUstream stream, int write, int fd, void* buffer, size_t bytes,
                                  int64_t file_offset, int64_t* result);

}  // extern "C"
