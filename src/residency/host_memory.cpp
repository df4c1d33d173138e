// Host memory the process may use. See host_memory.h.
#include "residency/host_memory.h"

#include <unistd.h>

#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace vramswap::residency {

std::optional<uint64_t> parse_cgroup_memory_limit(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  if (text.empty() || text.size() > 20) return std::nullopt;
  uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;  // "max", or anything unexpected
    const uint64_t digit = static_cast<uint64_t>(c - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  return value;
}

namespace {

std::optional<uint64_t> read_cgroup_limit(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return parse_cgroup_memory_limit(line);
}

// This process's cgroup v2 directory ("0::/path" in /proc/self/cgroup), or "" when none.
std::string cgroup_v2_path() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0) return line.substr(3);
  }
  return "";
}

}  // namespace

uint64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  uint64_t bytes = pages > 0 && page_size > 0 ? uint64_t(pages) * uint64_t(page_size) : 0;
  std::vector<std::string> files = {"/sys/fs/cgroup/memory.max",
                                    "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
  const std::string own = cgroup_v2_path();
  if (!own.empty() && own != "/") files.insert(files.begin(), "/sys/fs/cgroup" + own + "/memory.max");
  for (const std::string& f : files) {
    if (auto limit = read_cgroup_limit(f); limit && *limit > 0 && (bytes == 0 || *limit < bytes)) {
      bytes = *limit;
    }
  }
  return bytes;
}

}  // namespace vramswap::residency
