// vramswap's logger: messages to stderr, filtered by VRAMSWAP_LOG.
//
// Every message goes out as "vramswap: <text>" (warnings and errors as "vramswap: warning:
// <text>" and "vramswap: error: <text>"); a message of several lines gets the prefix on each
// line. A message is one write(2) to file descriptor 2, so messages from different threads
// or processes sharing stderr never interleave within a message, and nothing is buffered:
// a message is out before an abort or _exit that follows it. No allocation, no lock and no
// CUDA call, so it can be used from any context vramswap runs in (including at exit).
//
// The level starts at warn (VRAMSWAP_LOG's default) until set_log_level() is called.
#pragma once

#include "config/config.h"

namespace vramswap::stats {

using config::LogLevel;

// Sets the most verbose level that is written. Thread-safe (atomic).
void set_log_level(LogLevel level);

// The current level. Thread-safe (atomic).
LogLevel log_level();

// True when a message at `level` would be written: a caller can skip building an
// expensive message. kOff is never "enabled". Thread-safe (atomic).
bool log_enabled(LogLevel level);

// Writes a printf-style message at `level` if log_enabled(level). The text is truncated
// (ending in "...") past 4 KiB. Thread-safe.
void log(LogLevel level, const char* format, ...) __attribute__((format(printf, 2, 3)));

// Writes `text` as log() would at `level`, whatever the current level: for messages that
// must be seen (a configuration error that stops the program). Thread-safe.
void log_always(LogLevel level, const char* text);

}  // namespace vramswap::stats
