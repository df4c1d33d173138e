/* cufile.h: the subset of NVIDIA's cuFile API (GPUDirect Storage, libcufile.so.0) that
 * cudasim's stand-in implements, declared with cuFile's ABI: the types, values and
 * signatures below are those of NVIDIA's cufile.h, so a program built against either
 * header runs on either library. The CUDA 13 toolkit cudasim builds with has no cufile.h.
 *
 * cudasim's libcufile.so.0 (src/sim/cufile) sits beside its libcuda.so.1 and reads and
 * writes files with pread/pwrite on the host; "device" buffers are cudasim's host-visible
 * device memory. Its stream-ordered calls queue the I/O on a CUDA stream, where in virtual
 * time (CUDASIM_TIME=virtual) it runs on the process's one disk engine at
 * CUDASIM_DISK_GBPS (timeline kinds 6, disk read, and 7, disk write; cudasim.h). The
 * synchronous calls take no virtual time.
 *
 * Deliberately stricter than cuFile, so that code that passes on cudasim passes on CUDA:
 *   - cuFileReadAsync / cuFileWriteAsync need a stream registered (cuFileStreamRegister)
 *     with all of CU_FILE_STREAM_FIXED_BUF_OFFSET, CU_FILE_STREAM_FIXED_FILE_OFFSET and
 *     CU_FILE_STREAM_FIXED_FILE_SIZE, else they return CU_FILE_INVALID_VALUE. cuFile reads
 *     *size_p and the offsets when the stream reaches the operation unless those flags say
 *     they are fixed at submission; cudasim times an operation when it is queued, so it
 *     needs them then, and reads them during the call.
 *   - cuFileBufRegister's flags must be 0 (cuFile reserves them).
 *   - A stream-ordered call on a capturing stream fails (CU_FILE_CUDA_DRIVER_ERROR with
 *     CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidates the capture.
 *
 * Thread safety: every function may be called from any thread (one mutex guards the
 * registrations; no I/O runs under it).
 */
#ifndef CUDASIM_CUFILE_H
#define CUDASIM_CUFILE_H

#include <cuda.h>
#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The codes cudasim returns, with cuFile's values (cuFile has more). */
typedef enum CUfileOpError {
  CU_FILE_SUCCESS = 0,
  CUFILEOP_BASE_ERR = 5000,
  CU_FILE_DRIVER_NOT_INITIALIZED = CUFILEOP_BASE_ERR + 1,     /* before cuFileDriverOpen */
  CU_FILE_IO_NOT_SUPPORTED = CUFILEOP_BASE_ERR + 8,
  CU_FILE_CUDA_DRIVER_ERROR = CUFILEOP_BASE_ERR + 11,         /* the CUDA driver refused: see cu_err */
  CU_FILE_INVALID_FILE_TYPE = CUFILEOP_BASE_ERR + 18,
  CU_FILE_INVALID_VALUE = CUFILEOP_BASE_ERR + 22,
  CU_FILE_MEMORY_ALREADY_REGISTERED = CUFILEOP_BASE_ERR + 23,
  CU_FILE_MEMORY_NOT_REGISTERED = CUFILEOP_BASE_ERR + 24,
  CU_FILE_HANDLE_NOT_REGISTERED = CUFILEOP_BASE_ERR + 27,
  CU_FILE_HANDLE_ALREADY_REGISTERED = CUFILEOP_BASE_ERR + 28,
  CU_FILE_INTERNAL_ERROR = CUFILEOP_BASE_ERR + 30
} CUfileOpError;

/* err: the cuFile code; cu_err: the CUDA driver's, when err is CU_FILE_CUDA_DRIVER_ERROR. */
typedef struct CUfileError {
  CUfileOpError err;
  CUresult cu_err;
} CUfileError_t;

typedef enum CUfileFileHandleType {
  CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1,     /* a Linux file descriptor: the only type cudasim takes */
  CU_FILE_HANDLE_TYPE_OPAQUE_WIN32 = 2,
  CU_FILE_HANDLE_TYPE_USERSPACE_FS = 3
} CUfileFileHandleType;

typedef struct CUfileFSOps CUfileFSOps_t;  /* user-space file systems' table: unused by cudasim */

typedef struct CUfileDescr_t {
  CUfileFileHandleType type;
  union {
    int fd;        /* CU_FILE_HANDLE_TYPE_OPAQUE_FD */
    void* handle;  /* CU_FILE_HANDLE_TYPE_OPAQUE_WIN32 */
  } handle;
  const CUfileFSOps_t* fs_ops;
} CUfileDescr_t;

typedef void* CUfileHandle_t;

/* cuFileStreamRegister's flags: what stays fixed from submission on. */
#define CU_FILE_STREAM_FIXED_BUF_OFFSET 1
#define CU_FILE_STREAM_FIXED_FILE_OFFSET 2
#define CU_FILE_STREAM_FIXED_FILE_SIZE 4
#define CU_FILE_STREAM_PAGE_ALIGNED_INPUTS 8

/* Every call below but cuFileDriverOpen and cuFileGetVersion returns
 * CU_FILE_DRIVER_NOT_INITIALIZED (cuFileRead/Write: its negation) while the driver is not
 * open. Opening is counted: each cuFileDriverOpen needs a close, and the last close
 * forgets every handle, buffer and stream registration. Closing a driver that is not open
 * returns CU_FILE_DRIVER_NOT_INITIALIZED. */
CUfileError_t cuFileDriverOpen(void);
CUfileError_t cuFileDriverClose(void);
CUfileError_t cuFileDriverClose_v2(void);

/* Registers descr->handle.fd, which must be CU_FILE_HANDLE_TYPE_OPAQUE_FD (else
 * CU_FILE_INVALID_FILE_TYPE) of a regular file or block device (else
 * CU_FILE_INVALID_FILE_TYPE) that fstat accepts (else CU_FILE_INVALID_VALUE); a null
 * argument is CU_FILE_INVALID_VALUE and an fd already registered
 * CU_FILE_HANDLE_ALREADY_REGISTERED. The handle holds the fd, not a copy: the caller keeps
 * it open until cuFileHandleDeregister. */
CUfileError_t cuFileHandleRegister(CUfileHandle_t* fh, CUfileDescr_t* descr);
/* Forgets fh (an unknown handle is ignored). */
void cuFileHandleDeregister(CUfileHandle_t fh);

/* Bookkeeping only (I/O needs no registration): registering a base twice is
 * CU_FILE_MEMORY_ALREADY_REGISTERED, deregistering one never registered
 * CU_FILE_MEMORY_NOT_REGISTERED; a null base, a length of 0 or flags other than 0 are
 * CU_FILE_INVALID_VALUE. */
CUfileError_t cuFileBufRegister(const void* bufPtr_base, size_t length, int flags);
CUfileError_t cuFileBufDeregister(const void* bufPtr_base);

/* Reads (writes) `size` bytes at file_offset into (from) bufPtr_base + bufPtr_offset, at
 * once, on the calling thread. Returns the bytes moved (a read stops at the end of the
 * file), -1 with errno set when the operating system refused, or a negative CUfileOpError:
 * -CU_FILE_DRIVER_NOT_INITIALIZED, -CU_FILE_HANDLE_NOT_REGISTERED, -CU_FILE_INVALID_VALUE
 * (a null buffer, a negative offset). */
ssize_t cuFileRead(CUfileHandle_t fh, void* bufPtr_base, size_t size, off_t file_offset, off_t bufPtr_offset);
ssize_t cuFileWrite(CUfileHandle_t fh, const void* bufPtr_base, size_t size, off_t file_offset,
                    off_t bufPtr_offset);

/* Queues on `stream` (NULL: the legacy default stream) a read (write) of *size_p bytes at
 * *file_offset_p into (from) bufPtr_base + *bufPtr_offset_p; when the stream runs it,
 * *bytes_read_p (*bytes_written_p) gets the bytes moved, or -errno when the operating
 * system refused (cuFile's own failures there are -1 or a negative CUfileOpError: test
 * for < 0). The stream must be registered with the three FIXED flags (see above): the
 * values are read during the call, and the output must stay valid until the stream has
 * run the operation. Returns CU_FILE_SUCCESS; CU_FILE_INVALID_VALUE for a null argument,
 * a negative offset or a stream not registered so; CU_FILE_HANDLE_NOT_REGISTERED;
 * CU_FILE_CUDA_DRIVER_ERROR with cu_err set when the CUDA driver refused to queue it (an
 * unknown stream, a capturing one, no current context for the default stream...). */
CUfileError_t cuFileReadAsync(CUfileHandle_t fh, void* bufPtr_base, size_t* size_p, off_t* file_offset_p,
                              off_t* bufPtr_offset_p, ssize_t* bytes_read_p, CUstream stream);
CUfileError_t cuFileWriteAsync(CUfileHandle_t fh, void* bufPtr_base, size_t* size_p, off_t* file_offset_p,
                               off_t* bufPtr_offset_p, ssize_t* bytes_written_p, CUstream stream);

/* Registers `stream` for stream-ordered I/O with CU_FILE_STREAM_* flags: flags outside
 * 0xF, or a stream already registered, are CU_FILE_INVALID_VALUE. The stream handle is
 * checked when I/O is queued on it. Deregister a stream before destroying it. */
CUfileError_t cuFileStreamRegister(CUstream stream, unsigned flags);
/* CU_FILE_INVALID_VALUE for a stream not registered. */
CUfileError_t cuFileStreamDeregister(CUstream stream);

/* *version = 1000 * major + 10 * minor + patch of the cuFile cudasim stands for: 1150
 * (cuFile 1.15.0, CUDA 13.0's). CU_FILE_INVALID_VALUE for a null pointer. */
CUfileError_t cuFileGetVersion(int* version);

#ifdef __cplusplus
}
#endif

#endif /* CUDASIM_CUFILE_H */
