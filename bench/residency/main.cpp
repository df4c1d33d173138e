// residency_bench: the eviction engine's figures, each beside its baseline in the same run
// (scenarios: cycle_bench.cpp, evict_restore_bench.cpp, prefetch_bench.cpp; what they
// share: residency_bench.h).
//
// Run with LD_LIBRARY_PATH=build/sim on a machine without a GPU. The run's context names
// the device (cudasim or a CUDA driver) and the CPU, since a figure is quoted with the
// machine it ran on.
#include <dlfcn.h>

#include <fstream>
#include <string>

#include "residency_bench.h"

namespace {

// The first "model name" of /proc/cpuinfo, or "unknown".
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  }
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  int emulated = 0;
  if (auto* fn = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "cudasim_is_emulated"))) emulated = fn();
  benchmark::AddCustomContext("device", emulated ? "cudasim (no GPU)" : "CUDA driver");
  benchmark::AddCustomContext("cpu_model", cpu_model());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
