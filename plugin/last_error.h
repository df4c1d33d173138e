// The thread-local last error of the C ABI (vramswap_last_error).
//
// A fixed buffer per thread rather than a std::string: it has no destructor, so it is
// safe in threads that outlive the library's teardown and costs nothing to create; a
// message longer than the buffer is cut, ending in "...". Thread-safe (thread-local).
#pragma once

#include <string_view>

namespace vramswap {

// Makes the calling thread's last error "" (every C ABI call starts with it).
void clear_last_error() noexcept;

// Sets the calling thread's last error.
void set_last_error(std::string_view message) noexcept;

// The calling thread's last error; never nullptr; valid until the thread's next set/clear.
const char* last_error() noexcept;

}  // namespace vramswap
