// CUDASIM_* settings, parsed once; the stderr log. See env.h.
#include "env.h"

#include "config/units.h"
#include "fault.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unistd.h>

namespace cudasim {
namespace {

[[noreturn]] void bad_setting(const char* name, const char* value, const char* accepted) {
  std::fprintf(stderr, "cudasim: %s='%s' is not valid; accepted: %s\n", name, value, accepted);
  std::fflush(stderr);
  std::_Exit(2);
}

// The same, saying what is wrong with the value first.
[[noreturn]] void bad_setting(const char* name, const char* value, const std::string& why, const char* accepted) {
  std::fprintf(stderr, "cudasim: %s='%s' is not valid: %s; accepted: %s\n", name, value, why.c_str(), accepted);
  std::fflush(stderr);
  std::_Exit(2);
}

std::optional<uint64_t> parse_uint(std::string_view s) {
  if (s.empty()) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    if (v > (UINT64_MAX - uint64_t(c - '0')) / 10) return std::nullopt;
    v = v * 10 + uint64_t(c - '0');
  }
  return v;
}

// A decimal rate in GB/s: finite, above 0, at most 1e6 (a sanity bound far above any link).
std::optional<double> parse_rate(const char* s) {
  if (!*s) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s, &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v) || v <= 0 || v > 1e6) return std::nullopt;
  return v;
}

// A 0|1 switch.
bool parse_switch(const char* name, const char* v) {
  if (std::strcmp(v, "1") == 0) return true;
  if (std::strcmp(v, "0") != 0) bad_setting(name, v, "0 or 1");
  return false;
}

// CUDASIM_HOST_COSTS: "h100", "none", or either followed by name=us items (env.h).
bool parse_host_costs(const char* text, HostCosts* out) {
  HostCosts c;  // none's
  std::string_view rest(text);
  bool first = true;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (first && (item == "h100" || item == "none")) {
      if (item == "h100") c = kH100HostCosts;
      first = false;
      continue;
    }
    first = false;
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) return false;
    const std::string_view name = item.substr(0, eq);
    const std::string number(item.substr(eq + 1));
    auto us = parse_uint(number.c_str());
    if (!us || *us > 1000000000ull) return false;
    const uint64_t ns = *us * 1000;
    if (name == "create") c.mem_create_ns = ns;
    else if (name == "map") c.mem_map_ns = ns;
    else if (name == "access") c.mem_set_access_ns = ns;
    else if (name == "unmap") c.mem_unmap_ns = ns;
    else if (name == "release") c.mem_release_ns = ns;
    else if (name == "pin") c.host_alloc_ns_per_mib = ns;
    else if (name == "unpin") c.host_free_ns_per_mib = ns;
    else return false;
  }
  *out = c;
  return true;
}

// How a size setting is written (vramswap::parse_size).
constexpr char kSizeForm[] = "as a number with an optional unit B, K, KiB, M, MiB, G, GiB, T, TiB (1024-based)";

Settings read_settings() {
  Settings s;
  if (const char* v = std::getenv("CUDASIM_DEVICE_MEMORY")) {
    auto bytes = vramswap::parse_size(v);
    if (!bytes || *bytes < (64ull << 20) || *bytes > (1ull << 40))
      bad_setting("CUDASIM_DEVICE_MEMORY", v, (std::string("a size from 64MiB to 1TiB, ") + kSizeForm).c_str());
    s.device_memory = *bytes;
  }
  if (const char* v = std::getenv("CUDASIM_DEVICE_COUNT")) {
    auto n = parse_uint(v);
    if (!n || *n < 1 || *n > 16) bad_setting("CUDASIM_DEVICE_COUNT", v, "an integer from 1 to 16");
    s.device_count = int(*n);
  }
  if (const char* v = std::getenv("CUDASIM_CHAOS"); v && *v) {
    auto seed = parse_uint(v);
    if (!seed) bad_setting("CUDASIM_CHAOS", v, "an unsigned integer seed");
    s.chaos = true;
    s.chaos_seed = *seed;
  }
  if (const char* v = std::getenv("CUDASIM_LOG"); v && *v) s.log = parse_switch("CUDASIM_LOG", v);
  if (const char* v = std::getenv("CUDASIM_TIME"); v && *v) {
    if (std::strcmp(v, "virtual") == 0) s.virtual_time = true;
    else if (std::strcmp(v, "real") != 0) bad_setting("CUDASIM_TIME", v, "real or virtual");
  }
  if (const char* v = std::getenv("CUDASIM_PCIE_GBPS")) {
    auto r = parse_rate(v);
    if (!r) bad_setting("CUDASIM_PCIE_GBPS", v, "a decimal number of GB/s (1e9 bytes/s) above 0, at most 1e6");
    s.pcie_gbps = *r;
  }
  if (const char* v = std::getenv("CUDASIM_PCIE_DUPLEX"); v && *v) {
    if (std::strcmp(v, "shared") == 0) s.pcie_shared = true;
    else if (std::strcmp(v, "full") != 0) bad_setting("CUDASIM_PCIE_DUPLEX", v, "full or shared");
  }
  if (const char* v = std::getenv("CUDASIM_HBM_GBPS")) {
    auto r = parse_rate(v);
    if (!r) bad_setting("CUDASIM_HBM_GBPS", v, "a decimal number of GB/s (1e9 bytes/s) above 0, at most 1e6");
    s.hbm_gbps = *r;
  }
  if (const char* v = std::getenv("CUDASIM_DISK_GBPS")) {
    auto r = parse_rate(v);
    if (!r) bad_setting("CUDASIM_DISK_GBPS", v, "a decimal number of GB/s (1e9 bytes/s) above 0, at most 1e6");
    s.disk_gbps = *r;
  }
  if (const char* v = std::getenv("CUDASIM_UNBACKED"); v && *v) s.unbacked = parse_switch("CUDASIM_UNBACKED", v);
  if (const char* v = std::getenv("CUDASIM_TIMELINE"); v && *v) s.timeline = parse_switch("CUDASIM_TIMELINE", v);
  if (const char* v = std::getenv("CUDASIM_HOST_COSTS"); v && *v) {
    if (!parse_host_costs(v, &s.host_costs))
      bad_setting("CUDASIM_HOST_COSTS", v,
                  "none, h100, or either followed by a comma-separated list of name=microseconds "
                  "(create, map, access, unmap, release: per call or mapping; pin, unpin: per MiB), "
                  "e.g. none,pin=650 or h100,access=0");
  }
  if (const char* v = std::getenv("CUDASIM_HOST_PINNED_LIMIT"); v && *v) {
    auto bytes = vramswap::parse_size(v);
    if (!bytes || *bytes > (1ull << 50))
      bad_setting("CUDASIM_HOST_PINNED_LIMIT", v, (std::string("a size up to 1PiB (0: no limit), ") + kSizeForm).c_str());
    s.host_pinned_limit = *bytes;
  }
  if (const char* v = std::getenv("CUDASIM_HOST_VMM"); v && *v) s.host_vmm = parse_switch("CUDASIM_HOST_VMM", v);
  if (const char* v = std::getenv("CUDASIM_FAIL"); v && *v) {
    std::string why;
    if (!check_fail_spec(v, &why)) bad_setting("CUDASIM_FAIL", v, why, kFailSpecAccepted);
    s.fail_spec = v;
  }
  if (const char* v = std::getenv("CUDASIM_FAIL_SEED"); v && *v) {
    auto seed = parse_uint(v);
    if (!seed) bad_setting("CUDASIM_FAIL_SEED", v, "an unsigned integer seed");
    s.fail_seed = *seed;
  }
  return s;
}

}  // namespace

const Settings& settings() {
  static const Settings s = read_settings();
  return s;
}

void log_line(const char* fmt, ...) {
  char buf[1024];
  int n = std::snprintf(buf, sizeof buf, "cudasim: ");
  va_list ap;
  va_start(ap, fmt);
  int m = std::vsnprintf(buf + n, sizeof buf - size_t(n) - 1, fmt, ap);
  va_end(ap);
  size_t len = std::min(sizeof buf - 2, size_t(n) + size_t(m < 0 ? 0 : m));
  buf[len++] = '\n';
  ssize_t ignored = ::write(STDERR_FILENO, buf, len);
  (void)ignored;
}

void report_unsupported_once(const char* name) {
  static std::mutex mu;
  static std::set<std::string>* seen = new std::set<std::string>;  // leaked: usable during exit
  std::lock_guard lock(mu);
  if (seen->insert(name).second) log_line("%s is not supported by cudasim; it returns 801 (not supported)", name);
}

}  // namespace cudasim
