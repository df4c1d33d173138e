// The stderr logger. See log.h.
#include "stats/log.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace vramswap::stats {
namespace {

// Room for one formatted message and for the prefixed copy written out. The output
// buffer allows for the prefix on each line of a multi-line message (describe() output).
constexpr size_t kMessageBytes = 4096;
constexpr size_t kOutputBytes = 3 * kMessageBytes;
constexpr char kPrefix[] = "vramswap: ";

std::atomic<LogLevel> g_level{LogLevel::kWarn};

const char* level_word(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return "error: ";
    case LogLevel::kWarn: return "warning: ";
    default: return "";
  }
}

// Appends `text` (n bytes) to out[*used..cap), stopping silently at the end.
void append(char* out, size_t cap, size_t* used, const char* text, size_t n) {
  size_t room = cap - *used;
  if (n > room) n = room;
  std::memcpy(out + *used, text, n);
  *used += n;
}

void write_all(const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(STDERR_FILENO, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // stderr closed or full: there is nowhere to report it
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// Prefixes every line of `message` and writes the result with one write(2).
void emit(LogLevel level, const char* message) {
  char out[kOutputBytes];
  size_t used = 0;
  const char* word = level_word(level);
  const char* line = message;
  // Reserve one byte for the final newline, so a truncated message still ends a line.
  const size_t cap = sizeof out - 1;
  for (;;) {
    const char* end = std::strchr(line, '\n');
    size_t len = end ? static_cast<size_t>(end - line) : std::strlen(line);
    if (!end && len == 0 && line != message) break;  // message ended with '\n'
    append(out, cap, &used, kPrefix, sizeof kPrefix - 1);
    append(out, cap, &used, word, std::strlen(word));
    append(out, cap, &used, line, len);
    append(out, cap, &used, "\n", 1);
    if (!end) break;
    line = end + 1;
  }
  if (used == 0 || out[used - 1] != '\n') out[used++] = '\n';
  write_all(out, used);
}

}  // namespace

void set_log_level(LogLevel level) { g_level.store(level, std::memory_order_relaxed); }

LogLevel log_level() { return g_level.load(std::memory_order_relaxed); }

bool log_enabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) <= static_cast<int>(log_level());
}

void log(LogLevel level, const char* format, ...) {
  if (!log_enabled(level)) return;
  char message[kMessageBytes];
  va_list args;
  va_start(args, format);
  int n = std::vsnprintf(message, sizeof message, format, args);
  va_end(args);
  if (n < 0) return;
  if (static_cast<size_t>(n) >= sizeof message) std::memcpy(message + sizeof message - 4, "...", 4);
  emit(level, message);
}

void log_always(LogLevel level, const char* text) { emit(level, text); }

}  // namespace vramswap::stats
