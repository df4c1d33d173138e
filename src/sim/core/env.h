// cudasim settings (CUDASIM_* environment variables) and its stderr log.
//
// Settings are read once, at the first use, from the process environment; a value
// that cannot be parsed is reported with the variable, the value and the accepted
// form, and the process exits with status 2 (as a program would fail to start on a
// misconfigured machine). Logging is a single line per call when CUDASIM_LOG=1.
#pragma once

#include <cstdint>
#include <string>

namespace cudasim {

struct Settings {
  uint64_t device_memory = 8ull << 30;  // CUDASIM_DEVICE_MEMORY: a size a laptop can emulate lazily
  int device_count = 1;                 // CUDASIM_DEVICE_COUNT: 1..16
  bool chaos = false;                   // CUDASIM_CHAOS=<seed>: random delays before stream operations
  uint64_t chaos_seed = 0;
  bool log = false;                     // CUDASIM_LOG=1: trace calls to stderr
  // Virtual time (virtual_time.h).
  bool virtual_time = false;            // CUDASIM_TIME=real|virtual
  double pcie_gbps = 55;                // CUDASIM_PCIE_GBPS: per direction; a PCIe 5.0 x16 link's practical rate
  bool pcie_shared = false;             // CUDASIM_PCIE_DUPLEX=full|shared: shared serializes H2D and D2H
  double hbm_gbps = 2000;               // CUDASIM_HBM_GBPS: d2d copies and memsets; an HBM3 card's order
  bool unbacked = false;                // CUDASIM_UNBACKED=1: copies and memsets time but touch no data
  bool timeline = false;                // CUDASIM_TIMELINE=1: record the timeline in real-time mode too
  std::string fail_spec;                // CUDASIM_FAIL: calls that fail on purpose (fault.h); checked here
  uint64_t fail_seed = 1;               // CUDASIM_FAIL_SEED: the generator of CUDASIM_FAIL's pX rules
};

// The process's settings, parsed on first use. Thread-safe (a function-local static).
const Settings& settings();

inline bool log_enabled() { return settings().log; }

// Writes "cudasim: <formatted>" and a newline to stderr in one write. Thread-safe.
void log_line(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Prints "cudasim: <name> is not supported by cudasim" once per name. Thread-safe.
void report_unsupported_once(const char* name);

}  // namespace cudasim
