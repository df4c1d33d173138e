// The statistics file. See stats_file.h.
#include "stats/stats_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <cstring>
#include <string>

namespace vramswap::stats {
namespace {

std::string reason(const std::string& path, int error) { return path + ": " + std::strerror(error); }

// Writes all of `data` to `fd`. 0, or the errno of the failure.
int write_all(int fd, const std::string& data) {
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    const ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EAGAIN) return EAGAIN;  // a FIFO whose reader does not read
    if (w <= 0) return w < 0 ? errno : EIO;
    p += w;
    left -= static_cast<size_t>(w);
  }
  return 0;
}

// What a chain of symbolic links at `path` finally names (which need not exist yet), or
// `path` itself when it is not a link. Sets `why` and returns "" after 40 links (as the
// kernel) or at a link that neither this user nor root owns: vramswap resolves links
// itself, so the kernel's fs.protected_symlinks, which refuses another user's link in a
// shared directory such as /tmp, would not apply, and a link planted there would choose
// what the statistics overwrite.
std::string follow_links(std::string path, std::string* why) {
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
    if (st.st_uid != ::geteuid() && st.st_uid != 0) {
      *why = path + ": a symbolic link owned by another user (uid " + std::to_string(st.st_uid) +
             "); not followed, so that nobody else chooses what this file overwrites";
      return "";
    }
    std::string target(size_t(st.st_size > 0 ? st.st_size : 4096) + 1, '\0');
    const ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
    if (n < 0) return path;
    target.resize(size_t(n));
    if (!target.empty() && target[0] != '/') {
      const size_t slash = path.rfind('/');
      target = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + target;
    }
    path = target;
  }
  *why = path + ": too many levels of symbolic links";
  return "";
}

std::string write_in_place(const std::string& path, const std::string& document) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    if (errno == ENXIO) return path + ": a FIFO with no reader (nothing was written)";
    return reason(path, errno);
  }
  const int error = write_all(fd, document);
  const bool closed = ::close(fd) == 0;
  if (error != 0) return reason(path, error);
  if (!closed) return reason(path, errno);
  return "";
}

// Creates a temporary file beside `path` that nobody else can have prepared: a random
// name, created exclusively (O_EXCL, which also refuses a symbolic link at that name), mode
// 0644 less the umask as any new file. Returns its descriptor and sets `name`, or -1 with
// errno set.
int create_temporary(const std::string& path, std::string* name) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    uint64_t bits = 0;
    if (::getrandom(&bits, sizeof bits, 0) != sizeof bits) {
      bits = uint64_t(::getpid()) * 0x9e3779b97f4a7c15ull ^ uint64_t(::clock()) ^ uint64_t(attempt) << 48;
    }
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, ".%016llx", static_cast<unsigned long long>(bits));
    *name = path + suffix + ".tmp";
    const int fd = ::open(name->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

std::string replace_atomically(const std::string& path, const std::string& document) {
  std::string temporary;
  const int fd = create_temporary(path, &temporary);
  if (fd < 0) return reason(temporary, errno);
  int error = write_all(fd, document);
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error == 0 && ::rename(temporary.c_str(), path.c_str()) != 0) error = errno;
  if (error != 0) {
    ::unlink(temporary.c_str());
    return reason(path, error);
  }
  return "";
}

}  // namespace

std::string expand_stats_path(const std::string& path, long pid, const char* rank) {
  std::string rank_text = "0";
  if (rank != nullptr && *rank != '\0') {
    bool digits = true;
    for (const char* c = rank; *c; ++c) digits = digits && *c >= '0' && *c <= '9';
    if (digits) rank_text = rank;
  }
  std::string out;
  for (size_t i = 0; i < path.size();) {
    if (path.compare(i, 5, "{pid}") == 0) {
      out += std::to_string(pid);
      i += 5;
    } else if (path.compare(i, 6, "{rank}") == 0) {
      out += rank_text;
      i += 6;
    } else {
      out += path[i++];
    }
  }
  return out;
}

std::string write_stats_file(const std::string& path, const std::string& document) {
  std::string why;
  const std::string target = follow_links(path, &why);
  if (target.empty()) return why;
  struct stat st;
  if (::stat(target.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return target + ": is a directory";
    if (!S_ISREG(st.st_mode)) return write_in_place(target, document);
  }
  return replace_atomically(target, document);
}

}  // namespace vramswap::stats
