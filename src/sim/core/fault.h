// cudasim's fault injection: calls that fail on purpose, so that a program's error paths
// run without a broken GPU.
//
// Policy. A rule names a function as a program writes it (cuMemAlloc, not the
// cuMemAlloc_v2 that cuda.h's macros make of it; a _ptsz / _ptds per-thread form counts as
// its plain function) and when it fails: the Nth call (N), the Nth and every later call
// (N+), each call with probability X (pX, drawn from a generator seeded with
// CUDASIM_FAIL_SEED, so a single-threaded run fails the same calls every time), or every
// call (*). A failing call returns at its entry, after the checks every call makes
// (initialization, a current context, not inside a host function), before it does
// anything: nothing is allocated, mapped, queued, waited for or freed. So an injected
// failure is never sticky: the next call works, and a stream's queued work is untouched.
// The code it returns is the table's (fault.cpp, kFaultApis): one the real function
// documents, for its most plausible failure, preferring one that is not sticky on a real
// GPU either; `=CODE` overrides it.
//
// Counting: calls of a function are numbered from 1 from the moment the rules were set
// (CUDASIM_FAIL at the first CUDA call, or cudasim_fail_configure), among calls that
// pass the entry checks. A call the program makes counts; the driver calls cudasim's
// runtime makes to carry out a runtime call do not.
//
// Thread safety: every function here may be called from any thread. The rules and their
// counts are under one mutex, taken only while rules are set; with several threads the
// order calls are numbered in is the order they reach it, so which call fails is
// reproducible only as far as the threads' interleaving is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cudasim {

// One function that can be failed, and the code an injected failure returns.
struct FaultApi {
  const char* name;  // as a program writes it: cuMemCreate, cudaMemcpyAsync
  int code;          // CUresult or cudaError_t (the two share their numbering)
};

// The functions CUDASIM_FAIL accepts, in the README's order. Never empty.
const FaultApi* fault_apis(size_t* count);

// What a rule list may hold, for error messages.
extern const char* const kFailSpecAccepted;

// Checks a rule list without applying it; false with *why set when it is not valid.
bool check_fail_spec(const char* spec, std::string* why);

// Replaces the rules (nullptr or "": none). Returns false, with *why set and the rules
// unchanged, for a bad spec.
bool configure_failures(const char* spec, std::string* why);

// How many calls have failed on purpose since the process started.
uint64_t failures_injected();

// One call of `entry_point` (its exported name, e.g. cuMemAlloc_v2_ptds) that passed its
// entry checks: counts it and returns the code it must fail with, or 0. Logs the failure
// with CUDASIM_LOG=1.
int injected_failure(const char* entry_point);

// Nesting of entry points on this thread: only the outermost call of a program is counted
// (a driver call made by cudasim's runtime, or by another driver entry point, is not).
// The driver's Call and the runtime's Api hold one each for their call.
class DriverCallDepth {
 public:
  DriverCallDepth() { ++depth(); }
  ~DriverCallDepth() { --depth(); }
  DriverCallDepth(const DriverCallDepth&) = delete;
  DriverCallDepth& operator=(const DriverCallDepth&) = delete;
  // True for the outermost driver call of a program (not made by the runtime).
  static bool outermost() { return depth() == 1 && runtime_depth() == 0; }
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static int& runtime_depth() {
    thread_local int d = 0;
    return d;
  }
};

}  // namespace cudasim
