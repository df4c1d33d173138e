// cuFile, NVIDIA's file I/O library for CUDA (libcufile.so.0, GPUDirect Storage), loaded
// at run time: the disk tier's stream-ordered I/O (residency/disk_tier.h,
// VRAMSWAP_DISK_IO=cufile). vramswap never links it, so a machine without it runs the
// disk tier on threads of its own and a machine without a disk tier never loads it.
//
// The toolkit ships no cufile.h, so the subset used is declared here with cuFile's ABI:
// an error is a pair {CUfileOpError, CUresult}, 0 is success, the library's own errors
// start at 5000; a file is registered from its descriptor (CU_FILE_HANDLE_TYPE_OPAQUE_FD);
// cuFileReadAsync/cuFileWriteAsync queue a transfer on a CUDA stream, after the work queued
// before it and before the work queued after it, and write the bytes moved (negative on
// failure) through their last pointer when the stream runs them. A stream registered with
// the three FIXED flags lets the library read the size and offsets at submission (so they
// need not outlive the call); the result pointer must stay valid until the transfer ran.
#pragma once

#include <cuda.h>
#include <sys/types.h>

#include <cstddef>
#include <string>

namespace vramswap::cuda {

struct CuFileError {
  int err;          // CUfileOpError: 0 success, else 5000 + n
  CUresult cu_err;  // the driver's error where err is CU_FILE_CUDA_DRIVER_ERROR (5011)
};

struct CuFileDescr {
  int type;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;  // nullptr: the kernel's filesystem
};

using CuFileHandle = void*;

inline constexpr int kCuFileHandleTypeOpaqueFd = 1;
// cuFileStreamRegister flags: buffer offset, file offset and size fixed at submission.
inline constexpr unsigned kCuFileStreamFixed = 1u | 2u | 4u;

// The entry points the disk tier uses.
struct CuFileApi {
  CuFileError (*driver_open)();
  CuFileError (*handle_register)(CuFileHandle*, CuFileDescr*);
  void (*handle_deregister)(CuFileHandle);
  CuFileError (*read_async)(CuFileHandle, void*, size_t*, off_t*, off_t*, ssize_t*, CUstream);
  CuFileError (*write_async)(CuFileHandle, void*, size_t*, off_t*, off_t*, ssize_t*, CUstream);
  CuFileError (*stream_register)(CUstream, unsigned);
  CuFileError (*stream_deregister)(CUstream);

  // The library, loaded once (libcufile.so.0 from the library path) and its driver opened;
  // nullptr with *error set (what is missing, or the driver's error) when it cannot be.
  // Thread-safe; the answer is the same for the process's lifetime.
  static const CuFileApi* load(std::string* error);
};

// "cuFile error 5022" and, for a driver error, its name.
std::string cufile_error_text(CuFileError e);

}  // namespace vramswap::cuda
