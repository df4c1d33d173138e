// Fault injection: the table of functions that can fail, the rule parser, and the
// decision made at each call. See fault.h for the policy.
#include "fault.h"

#include <driver_types.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "api.h"
#include "env.h"

namespace cudasim {
namespace {

// Every function CUDASIM_FAIL can fail, with the code it then returns. The README's fault
// table is checked against this list (tests/sim/fault_test.cpp). Each code is one the
// function's documentation in the CUDA 13 headers lists; where the plausible failure of a
// real GPU is sticky (an earlier kernel's fault surfacing at a synchronization), the
// documented non-sticky code stands in for it, since an injected failure is never sticky.
// clang-format off
constexpr FaultApi kFaultApis[] = {
    // Runtime: memory.
    {"cudaMalloc", cudaErrorMemoryAllocation},
    {"cudaFree", cudaErrorInvalidValue},
    {"cudaMallocAsync", cudaErrorMemoryAllocation},
    {"cudaFreeAsync", cudaErrorInvalidValue},
    {"cudaHostAlloc", cudaErrorMemoryAllocation},
    {"cudaMallocHost", cudaErrorMemoryAllocation},
    {"cudaFreeHost", cudaErrorInvalidValue},
    {"cudaHostRegister", cudaErrorMemoryAllocation},
    {"cudaHostUnregister", cudaErrorInvalidValue},
    {"cudaMemcpy", cudaErrorInvalidValue},
    {"cudaMemcpyAsync", cudaErrorInvalidValue},
    {"cudaMemset", cudaErrorInvalidValue},
    {"cudaMemsetAsync", cudaErrorInvalidValue},
    {"cudaMemGetInfo", cudaErrorInvalidValue},
    // Runtime: streams and events.
    {"cudaStreamCreate", cudaErrorMemoryAllocation},
    {"cudaStreamCreateWithFlags", cudaErrorMemoryAllocation},
    {"cudaStreamCreateWithPriority", cudaErrorMemoryAllocation},
    {"cudaStreamDestroy", cudaErrorInvalidResourceHandle},
    {"cudaStreamSynchronize", cudaErrorInvalidResourceHandle},
    {"cudaStreamQuery", cudaErrorInvalidResourceHandle},
    {"cudaStreamWaitEvent", cudaErrorInvalidResourceHandle},
    {"cudaStreamIsCapturing", cudaErrorInvalidValue},
    {"cudaStreamGetDevice", cudaErrorInvalidValue},
    {"cudaLaunchHostFunc", cudaErrorInvalidValue},
    {"cudaEventCreate", cudaErrorMemoryAllocation},
    {"cudaEventCreateWithFlags", cudaErrorMemoryAllocation},
    {"cudaEventDestroy", cudaErrorInvalidResourceHandle},
    {"cudaEventRecord", cudaErrorInvalidResourceHandle},
    {"cudaEventQuery", cudaErrorInvalidResourceHandle},
    {"cudaEventSynchronize", cudaErrorInvalidResourceHandle},
    {"cudaThreadExchangeStreamCaptureMode", cudaErrorInvalidValue},
    // Runtime: devices.
    {"cudaGetDevice", cudaErrorDevicesUnavailable},
    {"cudaSetDevice", cudaErrorDevicesUnavailable},
    {"cudaDeviceSynchronize", cudaErrorDeviceUninitialized},
    {"cudaDeviceGetStreamPriorityRange", cudaErrorDeviceUninitialized},
    // Driver: initialization, devices, contexts.
    {"cuInit", CUDA_ERROR_NO_DEVICE},
    {"cuDeviceGet", CUDA_ERROR_INVALID_DEVICE},
    {"cuDeviceGetCount", CUDA_ERROR_INVALID_VALUE},
    {"cuDeviceGetAttribute", CUDA_ERROR_INVALID_DEVICE},
    {"cuDeviceTotalMem", CUDA_ERROR_INVALID_DEVICE},
    {"cuDevicePrimaryCtxRetain", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuCtxGetCurrent", CUDA_ERROR_DEINITIALIZED},
    {"cuCtxSetCurrent", CUDA_ERROR_INVALID_CONTEXT},
    {"cuCtxSynchronize", CUDA_ERROR_INVALID_CONTEXT},
    {"cuMemGetInfo", CUDA_ERROR_INVALID_VALUE},
    // Driver: virtual memory management.
    {"cuMemGetAllocationGranularity", CUDA_ERROR_INVALID_VALUE},
    {"cuMemAddressReserve", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuMemAddressFree", CUDA_ERROR_INVALID_VALUE},
    {"cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuMemRelease", CUDA_ERROR_INVALID_VALUE},
    {"cuMemMap", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuMemSetAccess", CUDA_ERROR_INVALID_VALUE},
    {"cuMemUnmap", CUDA_ERROR_INVALID_VALUE},
    // Driver: memory, copies, streams and events.
    {"cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuMemFree", CUDA_ERROR_INVALID_VALUE},
    {"cuMemAllocAsync", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuMemFreeAsync", CUDA_ERROR_INVALID_VALUE},
    {"cuMemHostAlloc", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuMemFreeHost", CUDA_ERROR_INVALID_VALUE},
    {"cuMemcpyAsync", CUDA_ERROR_INVALID_VALUE},
    {"cuMemcpyHtoDAsync", CUDA_ERROR_INVALID_VALUE},
    {"cuMemcpyDtoHAsync", CUDA_ERROR_INVALID_VALUE},
    {"cuMemsetD8Async", CUDA_ERROR_INVALID_VALUE},
    {"cuStreamCreate", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuStreamDestroy", CUDA_ERROR_INVALID_HANDLE},
    {"cuStreamSynchronize", CUDA_ERROR_INVALID_HANDLE},
    {"cuStreamWaitEvent", CUDA_ERROR_INVALID_HANDLE},
    {"cuEventCreate", CUDA_ERROR_OUT_OF_MEMORY},
    {"cuEventRecord", CUDA_ERROR_INVALID_HANDLE},
    {"cuEventQuery", CUDA_ERROR_INVALID_HANDLE},
    {"cuEventSynchronize", CUDA_ERROR_INVALID_HANDLE},
    {"cuThreadExchangeStreamCaptureMode", CUDA_ERROR_INVALID_VALUE},
};
// clang-format on

const FaultApi* find_api(std::string_view name) {
  for (const FaultApi& a : kFaultApis)
    if (name == a.name) return &a;
  return nullptr;
}

// The function a program means by an exported name: cuda.h's _v2/_v3 versions and the
// per-thread-stream forms (_ptsz, _ptds) are the function it wrote.
std::string_view plain_name(std::string_view s) {
  for (std::string_view suffix : {"_ptsz", "_ptds"})
    if (s.size() > suffix.size() && s.substr(s.size() - suffix.size()) == suffix) s.remove_suffix(suffix.size());
  for (std::string_view suffix : {"_v2", "_v3"})
    if (s.size() > suffix.size() && s.substr(s.size() - suffix.size()) == suffix) s.remove_suffix(suffix.size());
  return s;
}

// Edit distance, for "did you mean" on a misspelt function.
size_t distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t hash_name(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : s) h = (h ^ uint64_t(static_cast<unsigned char>(c))) * 0x100000001b3ull;
  return h;
}

struct Rule {
  enum class When { kNth, kFrom, kProbability, kAlways };
  const FaultApi* api = nullptr;
  When when = When::kAlways;
  uint64_t n = 0;      // kNth, kFrom
  double p = 0;        // kProbability
  int code = 0;        // what the failing call returns
  uint64_t rng = 0;    // kProbability: the generator's state
};

bool parse_count(std::string_view s, uint64_t* out) {
  if (s.empty() || s.size() > 18) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + uint64_t(c - '0');
  }
  *out = v;
  return true;
}

bool parse_code(std::string_view s, int* code, std::string* why) {
  uint64_t n;
  if (parse_count(s, &n)) {
    if (n == 0 || n > 100000) {
      *why = "'" + std::string(s) + "' is not an error code (a number from 1 to 100000, or a name)";
      return false;
    }
    *code = int(n);
    return true;
  }
  if (error_code_by_name(s, code)) {
    if (*code != 0) return true;
    *why = "'" + std::string(s) + "' is success, not an error";
    return false;
  }
  *why = "'" + std::string(s) + "' is not a CUDA error name (CUDA_ERROR_... or cudaError...) or number";
  return false;
}

bool parse_rule(std::string_view text, Rule* rule, std::string* why) {
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    *why = "rule '" + std::string(text) + "' has no ':'";
    return false;
  }
  const std::string_view name = text.substr(0, colon);
  std::string_view when = text.substr(colon + 1);
  std::string_view code;
  if (const size_t eq = when.find('='); eq != std::string_view::npos) {
    code = when.substr(eq + 1);
    when = when.substr(0, eq);
  }
  rule->api = find_api(plain_name(name));
  if (!rule->api) {
    *why = "'" + std::string(name) + "' is not a function cudasim can fail";
    const FaultApi* best = nullptr;
    size_t best_d = 4;  // more edits than this is not a misspelling
    for (const FaultApi& a : kFaultApis)
      if (size_t d = distance(plain_name(name), a.name); d < best_d) best_d = d, best = &a;
    if (best) *why += std::string(" (did you mean ") + best->name + "?)";
    return false;
  }
  if (when == "*") {
    rule->when = Rule::When::kAlways;
  } else if (!when.empty() && when[0] == 'p') {
    const std::string digits(when.substr(1));
    char* end = nullptr;
    errno = 0;
    const double p = digits.empty() ? -1 : std::strtod(digits.c_str(), &end);
    const bool digit_first = !digits.empty() && std::isdigit(static_cast<unsigned char>(digits[0]));
    if (!digit_first || errno || *end || !std::isfinite(p) || p < 0 || p > 1) {
      *why = "'" + std::string(when) + "' is not a probability (p and a decimal from 0 to 1, such as p0.01)";
      return false;
    }
    rule->when = Rule::When::kProbability;
    rule->p = p;
  } else {
    const bool from = !when.empty() && when.back() == '+';
    if (!parse_count(from ? when.substr(0, when.size() - 1) : when, &rule->n) || rule->n == 0) {
      *why = "'" + std::string(when) + "' is not N, N+, pX or * (N counts calls from 1)";
      return false;
    }
    rule->when = from ? Rule::When::kFrom : Rule::When::kNth;
  }
  rule->code = rule->api->code;
  if (code.data() && !parse_code(code, &rule->code, why)) return false;
  return true;
}

bool parse_rules(const char* spec, std::vector<Rule>* rules, std::string* why) {
  rules->clear();
  if (!spec) return true;
  std::string_view rest(spec);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view text = rest.substr(0, comma);
    Rule rule;
    if (text.empty()) {
      *why = "an empty rule";
      return false;
    }
    if (!parse_rule(text, &rule, why)) return false;
    rules->push_back(rule);
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
    if (rest.empty()) {
      *why = "an empty rule after the last ','";
      return false;
    }
  }
  return true;
}

// The rules in force and the call counts of the functions they name.
class Injector {
 public:
  Injector() {
    std::string why;
    // CUDASIM_FAIL was checked by settings(); a bad value never gets here.
    if (!set(settings().fail_spec.empty() ? nullptr : settings().fail_spec.c_str(), &why)) std::abort();
  }

  bool set(const char* spec, std::string* why) {
    std::vector<Rule> rules;
    if (!parse_rules(spec, &rules, why)) return false;
    for (size_t i = 0; i < rules.size(); ++i)
      rules[i].rng = splitmix(settings().fail_seed ^ splitmix(hash_name(rules[i].api->name) + i));
    std::lock_guard lock(mu_);
    rules_ = std::move(rules);
    calls_.clear();
    active_.store(!rules_.empty(), std::memory_order_release);
    return true;
  }

  int call(const char* entry_point) {
    if (!active_.load(std::memory_order_acquire)) return 0;
    const std::string_view name = plain_name(entry_point);
    std::lock_guard lock(mu_);
    const FaultApi* api = nullptr;
    for (const Rule& r : rules_)
      if (name == r.api->name) api = r.api;
    if (!api) return 0;
    const uint64_t n = ++calls_[api];
    int code = 0;
    for (Rule& r : rules_) {
      if (r.api != api) continue;
      bool fail = false;
      switch (r.when) {
        case Rule::When::kNth: fail = n == r.n; break;
        case Rule::When::kFrom: fail = n >= r.n; break;
        case Rule::When::kAlways: fail = true; break;
        case Rule::When::kProbability:
          // Every probability rule draws at every call, so the calls that fail depend only
          // on the seed and the numbering.
          r.rng = splitmix(r.rng);
          fail = double(r.rng >> 11) * 0x1.0p-53 < r.p;
          break;
      }
      if (fail && !code) code = r.code;
    }
    if (!code) return 0;
    injected_.fetch_add(1, std::memory_order_relaxed);
    if (log_enabled()) {
      const bool runtime = std::strncmp(api->name, "cuda", 4) == 0;
      const char* code_name = runtime ? runtime_error_name(code) : driver_error_name(CUresult(code));
      if (code_name) log_line("injected failure: %s call %llu -> %s", api->name, (unsigned long long)n, code_name);
      else log_line("injected failure: %s call %llu -> %d", api->name, (unsigned long long)n, code);
    }
    return code;
  }

  uint64_t injected() const { return injected_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> active_{false};
  std::atomic<uint64_t> injected_{0};
  std::mutex mu_;
  std::vector<Rule> rules_;
  std::unordered_map<const FaultApi*, uint64_t> calls_;
};

Injector& injector() {
  static Injector* i = new Injector;  // leaked: usable by calls made during exit
  return *i;
}

}  // namespace

const char* const kFailSpecAccepted =
    "a comma-separated list of <function>:<when>[=<code>] rules, where <function> is a CUDA function "
    "cudasim can fail (README, \"Fault injection\"), <when> is N (the Nth call, from 1), N+ (the Nth and "
    "every later call), pX (each call with probability X, 0 <= X <= 1) or * (every call), and <code> a "
    "CUDA error name or number; e.g. cuMemCreate:3,cudaMemcpyAsync:p0.01,cuMemMap:2=CUDA_ERROR_OUT_OF_MEMORY";

const FaultApi* fault_apis(size_t* count) {
  *count = std::size(kFaultApis);
  return kFaultApis;
}

bool check_fail_spec(const char* spec, std::string* why) {
  std::vector<Rule> rules;
  return parse_rules(spec, &rules, why);
}

bool configure_failures(const char* spec, std::string* why) { return injector().set(spec, why); }

uint64_t failures_injected() { return injector().injected(); }

int injected_failure(const char* entry_point) { return injector().call(entry_point); }

}  // namespace cudasim

using namespace cudasim;

extern "C" {

int cudasim_fail_configure(const char* spec) {
  std::string why;
  if (configure_failures(spec, &why)) return 0;
  std::fprintf(stderr, "cudasim: cudasim_fail_configure(\"%s\") is not valid: %s; accepted: %s\n", spec,
               why.c_str(), kFailSpecAccepted);
  std::fflush(stderr);
  return -1;
}

uint64_t cudasim_failures_injected(void) { return failures_injected(); }

size_t cudasim_fail_functions(const char** names, int* codes, size_t capacity) {
  size_t n = 0;
  const FaultApi* apis = fault_apis(&n);
  for (size_t i = 0; i < n && i < capacity; ++i) {
    if (names) names[i] = apis[i].name;
    if (codes) codes[i] = apis[i].code;
  }
  return n;
}

// For cudasim's runtime: its entry points nest around the driver calls they make.
void cudasim_internal_runtime_enter(void) { ++DriverCallDepth::runtime_depth(); }
void cudasim_internal_runtime_leave(void) { --DriverCallDepth::runtime_depth(); }
int cudasim_internal_runtime_fault(const char* entry_point) {
  if (DriverCallDepth::runtime_depth() != 1 || DriverCallDepth::depth() != 0) return 0;
  return injected_failure(entry_point);
}

}  // extern "C"
