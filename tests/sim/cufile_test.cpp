// cudasim's libcufile.so.0 (src/sim/include/cufile.h): cuFile's calls, their errors, and
// stream-ordered file I/O on the disk engine of virtual time.
//
// Registered per suite with the environment each needs (tests/sim/CMakeLists.txt):
//   CuFile, CuFileErrors       the default environment (CuFile again under CUDASIM_CHAOS=7)
//   CuFileVirtualTime          CUDASIM_TIME=virtual, CUDASIM_DISK_GBPS=6
//   CuFileVirtualTimeDevices   the same with two devices
//   CuFileUnbacked             the same with CUDASIM_UNBACKED=1
// A suite run without its environment skips, saying which it needs.
//
// At 6 GB/s a transfer of 6,000,000 bytes takes 1 ms, and one of 60,000,000 bytes 10 ms.
#include "cufile.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "runtime_test_util.h"
#include "timeline_test_util.h"

// GoogleTest compares and prints a CUfileError_t (a global C type) through these.
inline bool operator==(const CUfileError_t& a, const CUfileError_t& b) {
  return a.err == b.err && a.cu_err == b.cu_err;
}
inline void PrintTo(const CUfileError_t& e, std::ostream* os) {
  *os << "{err " << int(e.err) << ", cu_err ";
  PrintTo(e.cu_err, os);
  *os << "}";
}

namespace {

using cudasim_test::DeviceBuffer;
using cudasim_test::kMiB;
using cudasim_test::only;
using cudasim_test::pattern;
using cudasim_test::PinnedBuffer;
using cudasim_test::Stream;
using cudasim_test::timeline;
using cudasim_test::StreamGate;
using cudasim_test::Watchdog;

constexpr unsigned kFixed =
    CU_FILE_STREAM_FIXED_BUF_OFFSET | CU_FILE_STREAM_FIXED_FILE_OFFSET | CU_FILE_STREAM_FIXED_FILE_SIZE;
constexpr ssize_t kUnset = -12345;  // an output the stream has not written
constexpr uint32_t kDiskRead = 6, kDiskWrite = 7, kD2H = 2;  // cudasim_timeline_entry.kind

CUfileError_t ok() { return {CU_FILE_SUCCESS, CUDA_SUCCESS}; }
CUfileError_t fails(CUfileOpError err, CUresult cu_err = CUDA_SUCCESS) { return {err, cu_err}; }

#define ASSERT_CUFILE_OK(call) ASSERT_EQ(ok(), (call)) << "in " #call
#define EXPECT_CUFILE_OK(call) EXPECT_EQ(ok(), (call)) << "in " #call

CUstream cu(cudaStream_t s) { return reinterpret_cast<CUstream>(s); }

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}



// A file of its own under TMPDIR (or /tmp), removed on destruction.
class TempFile {
 public:
  TempFile() {
    const char* dir = std::getenv("TMPDIR");
    path_ = std::string(dir && *dir ? dir : "/tmp") + "/cudasim_cufile_XXXXXX";
    fd_ = ::mkstemp(path_.data());
  }
  ~TempFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(path_.c_str());
    }
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  off_t size() const {
    struct stat st {};
    return ::fstat(fd_, &st) == 0 ? st.st_size : -1;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

CUfileDescr_t descriptor(int fd) {
  CUfileDescr_t d{};
  d.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
  d.handle.fd = fd;
  return d;
}

// The driver open, a temporary file registered (fh_), and a non-blocking stream registered
// with the three FIXED flags (stream_). Everything is deregistered and closed afterwards,
// so the cases leave the library as they found it.
class CuFile : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CUDA_OK(cudaSetDevice(0));
    ASSERT_CUFILE_OK(cuFileDriverOpen());
    opened_ = true;
    ASSERT_GE(file_.fd(), 0) << "mkstemp: " << std::strerror(errno);
    CUfileDescr_t d = descriptor(file_.fd());
    ASSERT_CUFILE_OK(cuFileHandleRegister(&fh_, &d));
    stream_ = std::make_unique<Stream>(cudaStreamNonBlocking);
    ASSERT_CUDA_OK(stream_->status());
    ASSERT_CUFILE_OK(cuFileStreamRegister(cu(*stream_), kFixed));
  }
  void TearDown() override {
    cudaDeviceSynchronize();
    if (stream_) cuFileStreamDeregister(cu(*stream_));
    cuFileHandleDeregister(fh_);
    if (opened_) cuFileDriverClose();
  }

  cudaStream_t stream() const { return *stream_; }

  // Queue a transfer of `n` bytes at `file_offset`. The size and offsets are locals that
  // die when the call returns: the FIXED flags let cuFile read them at submission.
  CUfileError_t read_async(void* buffer, size_t n, off_t file_offset, ssize_t* out, cudaStream_t s) {
    size_t size = n;
    off_t at = file_offset, buffer_offset = 0;
    return cuFileReadAsync(fh_, buffer, &size, &at, &buffer_offset, out, cu(s));
  }
  CUfileError_t write_async(const void* buffer, size_t n, off_t file_offset, ssize_t* out, cudaStream_t s) {
    size_t size = n;
    off_t at = file_offset, buffer_offset = 0;
    return cuFileWriteAsync(fh_, const_cast<void*>(buffer), &size, &at, &buffer_offset, out, cu(s));
  }
  // Fills the file with `bytes` at `offset`, directly.
  void put(const std::vector<unsigned char>& bytes, off_t offset) {
    ASSERT_EQ(ssize_t(bytes.size()), ::pwrite(file_.fd(), bytes.data(), bytes.size(), offset));
  }
  // A read into reserved device memory that nothing is mapped to: pread would fault there,
  // so the result is -EFAULT (with or without CUDASIM_UNBACKED).
  void expect_read_into_unmapped_device_memory_fails() {
    put(pattern(4096, 1), 0);
    CUdeviceptr va = 0;
    ASSERT_CU_OK(cuMemAddressReserve(&va, 2 * kMiB, 0, 0, 0));
    ssize_t got = kUnset;
    EXPECT_CUFILE_OK(read_async(reinterpret_cast<void*>(va), 4096, 0, &got, stream()));
    EXPECT_CUDA_OK(cudaStreamSynchronize(stream()));
    EXPECT_EQ(-EFAULT, got);
    EXPECT_CU_OK(cuMemAddressFree(va, 2 * kMiB));
  }

  TempFile file_;
  CUfileHandle_t fh_ = nullptr;
  std::unique_ptr<Stream> stream_;
  bool opened_ = false;
};

// ---- Data -------------------------------------------------------------------------------

TEST_F(CuFile, HostBuffersRoundTripThroughTheFileOnAStream) {
  const size_t n = kMiB + 123;
  const auto src = pattern(n, 7);
  std::vector<unsigned char> dst(n, 0xee);
  ssize_t written = kUnset, read = kUnset;
  ASSERT_CUFILE_OK(write_async(src.data(), n, 8192, &written, stream()));
  ASSERT_CUFILE_OK(read_async(dst.data(), n, 8192, &read, stream()));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(ssize_t(n), written);
  EXPECT_EQ(ssize_t(n), read);
  EXPECT_TRUE(dst == src);
  EXPECT_EQ(off_t(8192 + n), file_.size());
  std::vector<unsigned char> on_disk(n);
  ASSERT_EQ(ssize_t(n), ::pread(file_.fd(), on_disk.data(), n, 8192));
  EXPECT_TRUE(on_disk == src);
}

// Device memory written to the file and read back into another device buffer, checked
// through copies queued on the same stream.
TEST_F(CuFile, DeviceBuffersRoundTripThroughTheFile) {
  const size_t n = 3 * kMiB + 5;
  const auto src = pattern(n, 11);
  DeviceBuffer a(n), b(n);
  PinnedBuffer out(n, 0);
  ASSERT_CUDA_OK(a.status());
  ASSERT_CUDA_OK(b.status());
  ASSERT_CUDA_OK(out.status());
  ssize_t written = kUnset, read = kUnset;
  ASSERT_CUDA_OK(cudaMemcpyAsync(a.get(), src.data(), n, cudaMemcpyHostToDevice, stream()));
  ASSERT_CUFILE_OK(write_async(a.get(), n, 0, &written, stream()));
  ASSERT_CUFILE_OK(read_async(b.get(), n, 0, &read, stream()));
  ASSERT_CUDA_OK(cudaMemcpyAsync(out.get(), b.get(), n, cudaMemcpyDeviceToHost, stream()));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(ssize_t(n), written);
  EXPECT_EQ(ssize_t(n), read);
  EXPECT_EQ(0, std::memcmp(out.get(), src.data(), n));
}

// The read is queued, not done: it waits for the work before it on the stream, and the copy
// queued after it sees its data.
TEST_F(CuFile, AReadRunsInStreamOrder) {
  const size_t n = kMiB;
  const auto src = pattern(n, 3);
  put(src, 0);
  DeviceBuffer d(n);
  PinnedBuffer out(n, 0);
  ASSERT_CUDA_OK(d.status());
  ASSERT_CUDA_OK(out.status());
  ssize_t read = kUnset;
  StreamGate gate;
  Watchdog watchdog(gate);
  ASSERT_CUDA_OK(gate.hold(stream()));
  ASSERT_CUFILE_OK(read_async(d.get(), n, 0, &read, stream()));
  ASSERT_CUDA_OK(cudaMemcpyAsync(out.get(), d.get(), n, cudaMemcpyDeviceToHost, stream()));
  ASSERT_TRUE(gate.wait_entered());
  EXPECT_EQ(kUnset, read) << "the read ran before the stream reached it";
  gate.open();
  watchdog.cancel();
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_FALSE(watchdog.fired());
  EXPECT_EQ(ssize_t(n), read);
  EXPECT_EQ(0, std::memcmp(out.get(), src.data(), n));
}

TEST_F(CuFile, AReadStopsAtTheEndOfTheFile) {
  put(pattern(1000, 5), 0);
  std::vector<unsigned char> dst(4096);
  ssize_t short_read = kUnset, past_end = kUnset;
  ASSERT_CUFILE_OK(read_async(dst.data(), 4096, 0, &short_read, stream()));
  ASSERT_CUFILE_OK(read_async(dst.data(), 4096, 5000, &past_end, stream()));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(1000, short_read);
  EXPECT_EQ(0, past_end);
}

TEST_F(CuFile, SynchronousReadAndWriteUseTheBufferOffset) {
  const size_t n = 100'000;
  const auto src = pattern(n + 7, 9);
  std::vector<unsigned char> dst(n + 3, 0);
  EXPECT_EQ(ssize_t(n), cuFileWrite(fh_, src.data(), n, 100, 7));
  EXPECT_EQ(ssize_t(n), cuFileRead(fh_, dst.data(), n, 100, 3));
  EXPECT_EQ(0, std::memcmp(dst.data() + 3, src.data() + 7, n));
  EXPECT_EQ(off_t(100 + n), file_.size());
  EXPECT_EQ(0, cuFileRead(fh_, dst.data(), n, 100 + off_t(n), 0)) << "at the end of the file";
}

TEST_F(CuFile, TheLegacyDefaultStreamTakesIo) {
  ASSERT_CUFILE_OK(cuFileStreamRegister(nullptr, kFixed));
  const auto src = pattern(4096, 2);
  std::vector<unsigned char> dst(4096, 0);
  ssize_t written = kUnset, read = kUnset;
  EXPECT_CUFILE_OK(write_async(src.data(), 4096, 0, &written, nullptr));
  EXPECT_CUFILE_OK(read_async(dst.data(), 4096, 0, &read, nullptr));
  EXPECT_CUDA_OK(cudaStreamSynchronize(nullptr));
  EXPECT_EQ(4096, written);
  EXPECT_EQ(4096, read);
  EXPECT_TRUE(dst == src);
  EXPECT_CUFILE_OK(cuFileStreamDeregister(nullptr));
}

// ---- Errors -----------------------------------------------------------------------------

// An OS error: the stream-ordered result is -errno; the synchronous call returns -1 and
// sets errno.
TEST_F(CuFile, AnOperatingSystemErrorIsReported) {
  const int read_only = ::open(file_.path().c_str(), O_RDONLY);
  ASSERT_GE(read_only, 0);
  CUfileDescr_t d = descriptor(read_only);
  CUfileHandle_t fh = nullptr;
  ASSERT_CUFILE_OK(cuFileHandleRegister(&fh, &d));
  const auto src = pattern(4096, 4);
  ssize_t written = kUnset;
  size_t size = 4096;
  off_t at = 0, buffer_offset = 0;
  EXPECT_CUFILE_OK(cuFileWriteAsync(fh, const_cast<unsigned char*>(src.data()), &size, &at, &buffer_offset,
                                    &written, cu(stream())));
  EXPECT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(-EBADF, written);
  errno = 0;
  EXPECT_EQ(-1, cuFileWrite(fh, src.data(), 4096, 0, 0));
  EXPECT_EQ(EBADF, errno);
  cuFileHandleDeregister(fh);
  ::close(read_only);
}

TEST_F(CuFile, AReadIntoUnmappedDeviceMemoryFails) { expect_read_into_unmapped_device_memory_fails(); }

// Before cuFileDriverOpen (and after the last close) every call but the open and the version
// fails with CU_FILE_DRIVER_NOT_INITIALIZED.
TEST(CuFileErrors, EveryCallButOpenAndVersionNeedsTheDriverOpen) {
  ASSERT_CUDA_OK(cudaSetDevice(0));
  ASSERT_EQ(fails(CU_FILE_DRIVER_NOT_INITIALIZED), cuFileDriverClose()) << "the driver must not be open yet";
  const auto not_open = fails(CU_FILE_DRIVER_NOT_INITIALIZED);
  TempFile file;
  CUfileDescr_t d = descriptor(file.fd());
  CUfileHandle_t fh = nullptr;
  char buffer[64] = {};
  size_t size = sizeof buffer;
  off_t at = 0, buffer_offset = 0;
  ssize_t out = kUnset;
  EXPECT_EQ(not_open, cuFileHandleRegister(&fh, &d));
  EXPECT_EQ(not_open, cuFileBufRegister(buffer, sizeof buffer, 0));
  EXPECT_EQ(not_open, cuFileBufDeregister(buffer));
  EXPECT_EQ(not_open, cuFileStreamRegister(nullptr, kFixed));
  EXPECT_EQ(not_open, cuFileStreamDeregister(nullptr));
  EXPECT_EQ(not_open, cuFileReadAsync(fh, buffer, &size, &at, &buffer_offset, &out, nullptr));
  EXPECT_EQ(not_open, cuFileWriteAsync(fh, buffer, &size, &at, &buffer_offset, &out, nullptr));
  EXPECT_EQ(-CU_FILE_DRIVER_NOT_INITIALIZED, cuFileRead(fh, buffer, sizeof buffer, 0, 0));
  EXPECT_EQ(-CU_FILE_DRIVER_NOT_INITIALIZED, cuFileWrite(fh, buffer, sizeof buffer, 0, 0));
  EXPECT_EQ(not_open, cuFileDriverClose_v2());
  EXPECT_EQ(kUnset, out);
  int version = 0;
  EXPECT_CUFILE_OK(cuFileGetVersion(&version));
  EXPECT_EQ(1150, version);
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileGetVersion(nullptr));
}

// Opens are counted; the last close forgets every registration.
TEST(CuFileErrors, OpeningIsCountedAndTheLastCloseForgetsRegistrations) {
  ASSERT_CUDA_OK(cudaSetDevice(0));
  TempFile file;
  CUfileDescr_t d = descriptor(file.fd());
  CUfileHandle_t fh = nullptr;
  ASSERT_CUFILE_OK(cuFileDriverOpen());
  ASSERT_CUFILE_OK(cuFileDriverOpen());
  EXPECT_CUFILE_OK(cuFileDriverClose());
  EXPECT_CUFILE_OK(cuFileHandleRegister(&fh, &d)) << "one open is left";
  EXPECT_CUFILE_OK(cuFileStreamRegister(nullptr, kFixed));
  EXPECT_CUFILE_OK(cuFileDriverClose_v2());
  EXPECT_EQ(fails(CU_FILE_DRIVER_NOT_INITIALIZED), cuFileHandleRegister(&fh, &d));
  EXPECT_EQ(fails(CU_FILE_DRIVER_NOT_INITIALIZED), cuFileDriverClose());
  ASSERT_CUFILE_OK(cuFileDriverOpen());
  EXPECT_EQ(-CU_FILE_HANDLE_NOT_REGISTERED, cuFileRead(fh, &d, 1, 0, 0)) << "the handle was forgotten";
  EXPECT_CUFILE_OK(cuFileHandleRegister(&fh, &d)) << "so was its fd";
  EXPECT_CUFILE_OK(cuFileStreamRegister(nullptr, kFixed)) << "and the stream";
  EXPECT_CUFILE_OK(cuFileStreamDeregister(nullptr));
  cuFileHandleDeregister(fh);
  EXPECT_CUFILE_OK(cuFileDriverClose());
}

TEST_F(CuFile, HandleRegistrationTakesAFileDescriptorOnce) {
  CUfileHandle_t fh = nullptr;
  CUfileDescr_t d = descriptor(file_.fd());
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileHandleRegister(nullptr, &d));
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileHandleRegister(&fh, nullptr));
  EXPECT_EQ(fails(CU_FILE_HANDLE_ALREADY_REGISTERED), cuFileHandleRegister(&fh, &d));
  for (int type : {int(CU_FILE_HANDLE_TYPE_OPAQUE_WIN32), int(CU_FILE_HANDLE_TYPE_USERSPACE_FS), 0}) {
    CUfileDescr_t other = descriptor(file_.fd());
    other.type = static_cast<CUfileFileHandleType>(type);
    EXPECT_EQ(fails(CU_FILE_INVALID_FILE_TYPE), cuFileHandleRegister(&fh, &other)) << "type " << type;
  }
  CUfileDescr_t negative = descriptor(-1);
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileHandleRegister(&fh, &negative));
  const int closed = ::dup(file_.fd());
  ASSERT_GE(closed, 0);
  ::close(closed);
  CUfileDescr_t gone = descriptor(closed);
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileHandleRegister(&fh, &gone)) << "fstat refuses a closed fd";
  int pipe_fds[2];
  ASSERT_EQ(0, ::pipe(pipe_fds));
  CUfileDescr_t pipe_end = descriptor(pipe_fds[0]);
  EXPECT_EQ(fails(CU_FILE_INVALID_FILE_TYPE), cuFileHandleRegister(&fh, &pipe_end)) << "not a file";
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  // Another descriptor of the same file is another registration.
  const int second = ::dup(file_.fd());
  ASSERT_GE(second, 0);
  CUfileDescr_t again = descriptor(second);
  EXPECT_CUFILE_OK(cuFileHandleRegister(&fh, &again));
  EXPECT_NE(fh_, fh);
  cuFileHandleDeregister(fh);
  EXPECT_CUFILE_OK(cuFileHandleRegister(&fh, &again)) << "after its deregistration";
  cuFileHandleDeregister(fh);
  cuFileHandleDeregister(fh);  // an unknown handle is ignored
  ::close(second);
}

TEST_F(CuFile, BufferRegistrationIsCheckedBookkeeping) {
  std::vector<unsigned char> buffer(4096);
  EXPECT_CUFILE_OK(cuFileBufRegister(buffer.data(), buffer.size(), 0));
  EXPECT_EQ(fails(CU_FILE_MEMORY_ALREADY_REGISTERED), cuFileBufRegister(buffer.data(), buffer.size(), 0));
  EXPECT_CUFILE_OK(cuFileBufDeregister(buffer.data()));
  EXPECT_EQ(fails(CU_FILE_MEMORY_NOT_REGISTERED), cuFileBufDeregister(buffer.data()));
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileBufRegister(nullptr, 4096, 0));
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileBufRegister(buffer.data(), 0, 0));
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileBufRegister(buffer.data(), buffer.size(), 1));
  // I/O needs no registration (cuFile stages unregistered buffers).
  EXPECT_EQ(4096, cuFileWrite(fh_, buffer.data(), buffer.size(), 0, 0));
}

TEST_F(CuFile, CallsCheckTheHandleAndTheirArguments) {
  char buffer[4096] = {};
  CUfileHandle_t unknown = fh_;
  cuFileHandleDeregister(unknown);
  fh_ = nullptr;
  EXPECT_EQ(-CU_FILE_HANDLE_NOT_REGISTERED, cuFileRead(unknown, buffer, sizeof buffer, 0, 0));
  EXPECT_EQ(-CU_FILE_HANDLE_NOT_REGISTERED, cuFileWrite(unknown, buffer, sizeof buffer, 0, 0));
  size_t size = sizeof buffer;
  off_t at = 0, buffer_offset = 0;
  ssize_t out = kUnset;
  EXPECT_EQ(fails(CU_FILE_HANDLE_NOT_REGISTERED),
            cuFileReadAsync(unknown, buffer, &size, &at, &buffer_offset, &out, cu(stream())));
  EXPECT_EQ(fails(CU_FILE_HANDLE_NOT_REGISTERED),
            cuFileWriteAsync(unknown, buffer, &size, &at, &buffer_offset, &out, cu(stream())));

  CUfileDescr_t d = descriptor(file_.fd());
  ASSERT_CUFILE_OK(cuFileHandleRegister(&fh_, &d));
  EXPECT_EQ(-CU_FILE_INVALID_VALUE, cuFileRead(fh_, nullptr, sizeof buffer, 0, 0));
  EXPECT_EQ(-CU_FILE_INVALID_VALUE, cuFileWrite(fh_, buffer, sizeof buffer, -1, 0));
  EXPECT_EQ(-CU_FILE_INVALID_VALUE, cuFileRead(fh_, buffer, sizeof buffer, 0, -1));
  const CUstream s = cu(stream());
  const auto invalid = fails(CU_FILE_INVALID_VALUE);
  EXPECT_EQ(invalid, cuFileReadAsync(fh_, nullptr, &size, &at, &buffer_offset, &out, s));
  EXPECT_EQ(invalid, cuFileReadAsync(fh_, buffer, nullptr, &at, &buffer_offset, &out, s));
  EXPECT_EQ(invalid, cuFileReadAsync(fh_, buffer, &size, nullptr, &buffer_offset, &out, s));
  EXPECT_EQ(invalid, cuFileReadAsync(fh_, buffer, &size, &at, nullptr, &out, s));
  EXPECT_EQ(invalid, cuFileReadAsync(fh_, buffer, &size, &at, &buffer_offset, nullptr, s));
  off_t negative = -4096;
  EXPECT_EQ(invalid, cuFileWriteAsync(fh_, buffer, &size, &negative, &buffer_offset, &out, s));
  EXPECT_EQ(invalid, cuFileWriteAsync(fh_, buffer, &size, &at, &negative, &out, s));
  EXPECT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(kUnset, out) << "nothing was queued";
}

// cudasim is stricter than cuFile: stream-ordered I/O needs the size and offsets fixed at
// submission (cufile.h).
TEST_F(CuFile, AsyncCallsNeedAStreamRegisteredWithEveryFixedFlag) {
  char buffer[4096] = {};
  ssize_t out = kUnset;
  Stream other(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(other.status());
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), read_async(buffer, sizeof buffer, 0, &out, other)) << "not registered";
  for (unsigned missing : {unsigned(CU_FILE_STREAM_FIXED_BUF_OFFSET), unsigned(CU_FILE_STREAM_FIXED_FILE_OFFSET),
                           unsigned(CU_FILE_STREAM_FIXED_FILE_SIZE), kFixed}) {
    ASSERT_CUFILE_OK(cuFileStreamRegister(cu(other), (kFixed & ~missing) | CU_FILE_STREAM_PAGE_ALIGNED_INPUTS));
    EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), read_async(buffer, sizeof buffer, 0, &out, other)) << "without " << missing;
    EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), write_async(buffer, sizeof buffer, 0, &out, other));
    ASSERT_CUFILE_OK(cuFileStreamDeregister(cu(other)));
  }
  EXPECT_CUDA_OK(cudaStreamSynchronize(other));
  EXPECT_EQ(kUnset, out) << "nothing was queued";
}

TEST_F(CuFile, PageAlignedInputsMustBeWholePages) {
  Stream aligned(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(aligned.status());
  ASSERT_CUFILE_OK(cuFileStreamRegister(cu(aligned), kFixed | CU_FILE_STREAM_PAGE_ALIGNED_INPUTS));
  std::vector<unsigned char> buffer(8192);
  ssize_t out = kUnset;
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), write_async(buffer.data(), 4000, 0, &out, aligned));
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), write_async(buffer.data(), 4096, 100, &out, aligned));
  EXPECT_CUFILE_OK(write_async(buffer.data(), 8192, 4096, &out, aligned));
  EXPECT_CUDA_OK(cudaStreamSynchronize(aligned));
  EXPECT_EQ(8192, out);
  EXPECT_CUFILE_OK(cuFileStreamDeregister(cu(aligned)));
}

TEST_F(CuFile, StreamRegistrationChecksFlagsAndTwice) {
  Stream other(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(other.status());
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileStreamRegister(cu(other), 0x10));
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileStreamRegister(cu(stream()), kFixed)) << "registered twice";
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileStreamDeregister(cu(other))) << "never registered";
  EXPECT_CUFILE_OK(cuFileStreamRegister(cu(other), 0xF));
  EXPECT_CUFILE_OK(cuFileStreamDeregister(cu(other)));
  EXPECT_EQ(fails(CU_FILE_INVALID_VALUE), cuFileStreamDeregister(cu(other))) << "deregistered twice";
}

// The driver refuses to queue on a stream it does not know: its code comes back in cu_err.
TEST_F(CuFile, ADriverRefusalIsReportedWithItsCode) {
  const auto bogus = reinterpret_cast<cudaStream_t>(uintptr_t{0x1234});
  ASSERT_CUFILE_OK(cuFileStreamRegister(cu(bogus), kFixed));
  char buffer[16] = {};
  ssize_t out = kUnset;
  EXPECT_EQ(fails(CU_FILE_CUDA_DRIVER_ERROR, CUDA_ERROR_INVALID_HANDLE),
            read_async(buffer, sizeof buffer, 0, &out, bogus));
  EXPECT_EQ(kUnset, out);
  EXPECT_CUFILE_OK(cuFileStreamDeregister(cu(bogus)));
}

// File I/O cannot be captured into a graph: the call fails and the capture is invalidated.
TEST_F(CuFile, ACapturingStreamRefusesIo) {
  char buffer[16] = {};
  ssize_t out = kUnset;
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeGlobal));
  EXPECT_EQ(fails(CU_FILE_CUDA_DRIVER_ERROR, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
            read_async(buffer, sizeof buffer, 0, &out, stream()));
  EXPECT_EQ(fails(CU_FILE_CUDA_DRIVER_ERROR, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
            write_async(buffer, sizeof buffer, 0, &out, stream()));
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(stream(), &graph));
  EXPECT_EQ(nullptr, graph);
  cudaGetLastError();
  EXPECT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(kUnset, out);
}

// ---- Virtual time -----------------------------------------------------------------------

constexpr size_t kMillisecondOfDisk = 6'000'000;  // bytes at 6 GB/s
constexpr uint64_t kMs = 1'000'000;

// CuFile in virtual time at 6 GB/s; the timeline starts empty and t0_ is the host clock.
class CuFileVirtualTime : public CuFile {
 protected:
  void SetUp() override {
    if (!cudasim_virtual_time() || !env_is("CUDASIM_DISK_GBPS", "6"))
      GTEST_SKIP() << "needs CUDASIM_TIME=virtual CUDASIM_DISK_GBPS=6 (ctest sets them)";
    CuFile::SetUp();
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    cudasim_timeline_clear();
    t0_ = cudasim_now_ns();
  }
  uint64_t t0_ = 0;
};

// A 60 MB read takes 10 ms on the disk engine, and the copy queued behind it starts at its
// end.
TEST_F(CuFileVirtualTime, ASixtyMegabyteReadTakesTenMilliseconds) {
  const size_t n = 10 * kMillisecondOfDisk;
  ASSERT_EQ(0, ::ftruncate(file_.fd(), off_t(n)));
  DeviceBuffer d(n);
  PinnedBuffer out(kMiB);
  ASSERT_CUDA_OK(d.status());
  ASSERT_CUDA_OK(out.status());
  ssize_t read = kUnset;
  ASSERT_CUFILE_OK(read_async(d.get(), n, 0, &read, stream()));
  ASSERT_CUDA_OK(cudaMemcpyAsync(out.get(), d.get(), kMiB, cudaMemcpyDeviceToHost, stream()));
  EXPECT_EQ(t0_, cudasim_now_ns()) << "queueing I/O does not move the host clock";
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(ssize_t(n), read);
  const auto r = only(kDiskRead);
  EXPECT_EQ(n, r.bytes);
  EXPECT_EQ(0, r.device);
  EXPECT_EQ(reinterpret_cast<uint64_t>(stream()), r.stream);
  EXPECT_EQ(t0_, r.enqueue_ns);
  EXPECT_EQ(t0_, r.start_ns);
  EXPECT_EQ(t0_ + 10 * kMs, r.end_ns);
  EXPECT_STREQ("file read", r.label);
  const auto c = only(kD2H);
  EXPECT_EQ(r.end_ns, c.start_ns);
  EXPECT_EQ(c.end_ns, cudasim_now_ns());
}

TEST_F(CuFileVirtualTime, SynchronizingAfterAReadMovesTheHostClockToItsEnd) {
  ASSERT_EQ(0, ::ftruncate(file_.fd(), off_t(kMillisecondOfDisk)));
  std::vector<unsigned char> buffer(kMillisecondOfDisk);
  ssize_t read = kUnset;
  ASSERT_CUFILE_OK(read_async(buffer.data(), buffer.size(), 0, &read, stream()));
  EXPECT_EQ(t0_, cudasim_now_ns());
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(t0_ + kMs, cudasim_now_ns());
  EXPECT_EQ(ssize_t(kMillisecondOfDisk), read);
}

// Reads and writes share the one disk: a write and a read queued together on two streams
// run one after the other, in enqueue order.
TEST_F(CuFileVirtualTime, AWriteAndAReadOnTwoStreamsTakeTurns) {
  Stream other(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(other.status());
  ASSERT_CUFILE_OK(cuFileStreamRegister(cu(other), kFixed));
  const auto src = pattern(kMillisecondOfDisk, 1);
  std::vector<unsigned char> dst(kMillisecondOfDisk);
  ssize_t written = kUnset, read = kUnset;
  ASSERT_CUFILE_OK(write_async(src.data(), src.size(), 0, &written, stream()));
  ASSERT_CUFILE_OK(read_async(dst.data(), dst.size(), off_t(kMillisecondOfDisk), &read, other));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const auto w = only(kDiskWrite), r = only(kDiskRead);
  EXPECT_EQ(t0_, w.start_ns);
  EXPECT_EQ(t0_ + kMs, w.end_ns);
  EXPECT_STREQ("file write", w.label);
  EXPECT_EQ(w.end_ns, r.start_ns) << "the read waited for the disk";
  EXPECT_EQ(t0_ + 2 * kMs, r.end_ns);
  EXPECT_EQ(reinterpret_cast<uint64_t>(other.get()), r.stream);
  EXPECT_EQ(t0_ + 2 * kMs, cudasim_now_ns());
  EXPECT_EQ(ssize_t(kMillisecondOfDisk), written);
  EXPECT_EQ(0, read) << "past the end of the file";
  EXPECT_CUFILE_OK(cuFileStreamDeregister(cu(other)));
}

// The disk is the host's: devices take turns on it too.
class CuFileVirtualTimeDevices : public CuFileVirtualTime {};

TEST_F(CuFileVirtualTimeDevices, DevicesShareTheDisk) {
  int devices = 0;
  ASSERT_CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs CUDASIM_DEVICE_COUNT=2 (ctest sets it)";
  ASSERT_CUDA_OK(cudaSetDevice(1));
  Stream on_one(cudaStreamNonBlocking);
  ASSERT_CUDA_OK(on_one.status());
  ASSERT_CUDA_OK(cudaSetDevice(0));
  ASSERT_CUFILE_OK(cuFileStreamRegister(cu(on_one), kFixed));
  ASSERT_EQ(0, ::ftruncate(file_.fd(), off_t(kMillisecondOfDisk)));
  std::vector<unsigned char> a(kMillisecondOfDisk), b(kMillisecondOfDisk);
  ssize_t read_a = kUnset, read_b = kUnset;
  ASSERT_CUFILE_OK(read_async(a.data(), a.size(), 0, &read_a, stream()));
  ASSERT_CUFILE_OK(read_async(b.data(), b.size(), 0, &read_b, on_one));
  ASSERT_CUDA_OK(cudaStreamSynchronize(on_one));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  const auto tl = timeline();
  ASSERT_EQ(2u, tl.size());
  EXPECT_EQ(0, tl[0].device);
  EXPECT_EQ(1, tl[1].device);
  EXPECT_EQ(t0_ + kMs, tl[0].end_ns);
  EXPECT_EQ(tl[0].end_ns, tl[1].start_ns);
  EXPECT_EQ(t0_ + 2 * kMs, tl[1].end_ns);
  EXPECT_EQ(ssize_t(kMillisecondOfDisk), read_b);
  EXPECT_CUFILE_OK(cuFileStreamDeregister(cu(on_one)));
}

// CUDASIM_UNBACKED=1: I/O is timed but moves no bytes, as copies do.
class CuFileUnbacked : public CuFileVirtualTime {
 protected:
  void SetUp() override {
    if (!env_is("CUDASIM_UNBACKED", "1")) GTEST_SKIP() << "needs CUDASIM_UNBACKED=1 (ctest sets it)";
    CuFileVirtualTime::SetUp();
  }
};

TEST_F(CuFileUnbacked, IoMovesNoBytesButTakesItsTime) {
  const auto src = pattern(kMillisecondOfDisk, 6);
  std::vector<unsigned char> dst(kMillisecondOfDisk, 0xee);
  ssize_t written = kUnset, read = kUnset;
  ASSERT_CUFILE_OK(write_async(src.data(), src.size(), 0, &written, stream()));
  ASSERT_CUFILE_OK(read_async(dst.data(), dst.size(), 0, &read, stream()));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream()));
  EXPECT_EQ(ssize_t(kMillisecondOfDisk), written);
  EXPECT_EQ(ssize_t(kMillisecondOfDisk), read) << "every byte asked for, whatever the file holds";
  EXPECT_EQ(0, file_.size());
  EXPECT_EQ(std::vector<unsigned char>(kMillisecondOfDisk, 0xee), dst);
  EXPECT_EQ(t0_ + 2 * kMs, cudasim_now_ns());
}

TEST_F(CuFileUnbacked, AReadIntoUnmappedDeviceMemoryFails) { expect_read_into_unmapped_device_memory_fails(); }

}  // namespace
