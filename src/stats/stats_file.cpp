// The statistics file. See stats_file.h.
#include "stats/stats_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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
// `path` itself when it is not a link. Gives up (returns "") after 40 links, as the kernel.
std::string follow_links(std::string path) {
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
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

std::string replace_atomically(const std::string& path, const std::string& document) {
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
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
  const std::string target = follow_links(path);
  if (target.empty()) return path + ": too many levels of symbolic links";
  struct stat st;
  if (::stat(target.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return target + ": is a directory";
    if (!S_ISREG(st.st_mode)) return write_in_place(target, document);
  }
  return replace_atomically(target, document);
}

}  // namespace vramswap::stats
