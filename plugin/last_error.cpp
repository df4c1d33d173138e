// The thread-local last error. See last_error.h.
#include "last_error.h"

#include <cstring>

namespace vramswap {
namespace {

// Room for the longest report vramswap writes (an out-of-memory with the pool's numbers,
// a configuration error listing several keys) with space to spare.
constexpr size_t kLastErrorBytes = 2048;
thread_local char t_last_error[kLastErrorBytes];

}  // namespace

void clear_last_error() noexcept { t_last_error[0] = '\0'; }

void set_last_error(std::string_view message) noexcept {
  size_t n = message.size();
  if (n >= kLastErrorBytes) {
    std::memcpy(t_last_error, message.data(), kLastErrorBytes - 4);
    std::memcpy(t_last_error + kLastErrorBytes - 4, "...", 4);
    return;
  }
  std::memcpy(t_last_error, message.data(), n);
  t_last_error[n] = '\0';
}

const char* last_error() noexcept { return t_last_error; }

}  // namespace vramswap
