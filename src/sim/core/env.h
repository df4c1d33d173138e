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

// Host time of the driver calls that take long on a real GPU, charged to the virtual host
// clock (virtual time only; virtual_time.h). CUDASIM_HOST_COSTS=none (the default): every
// call is free. h100: the figures measured on an NVIDIA H100 80GB HBM3, driver 580.159.04,
// idle device, by
// tests/gpu/vmm_cost.py (bench/results/vmm-2026-11-26-h100.json and the run beside
// bench/results/gpu-2026-11-26-h100-host-time.md), rounded: per call cuMemCreate 15 us,
// cuMemMap 4 us, cuMemRelease 18 us; per mapping a call covers, cuMemSetAccess 35 us and
// cuMemUnmap 24 us (one call over N separately created granules costs N times one);
// pinning 650 us and unpinning 130 us per MiB (cuMemHostAlloc / cuMemFreeHost). With the
// device busy the VMM calls cost 1.1-1.6x as much (tests/gpu/vmm_cost.py): these are lower
// bounds. Either may be followed by name=microseconds items that change one figure (env.cpp).
// Not the default: the benchmark's figures are quoted without host costs, as the issues'
// claims were made; `CUDASIM_HOST_COSTS=h100 vramswap bench` shows what they add.
struct HostCosts {
  uint64_t mem_create_ns = 0;
  uint64_t mem_map_ns = 0;
  uint64_t mem_set_access_ns = 0;  // per mapping
  uint64_t mem_unmap_ns = 0;       // per mapping
  uint64_t mem_release_ns = 0;
  uint64_t host_alloc_ns_per_mib = 0;
  uint64_t host_free_ns_per_mib = 0;
};

// The figures of CUDASIM_HOST_COSTS=h100.
constexpr HostCosts kH100HostCosts{15000, 4000, 35000, 24000, 18000, 650000, 130000};

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
  // CUDASIM_DISK_GBPS: the host's disk (stream-ordered file reads and writes, cuFile's);
  // about one PCIe 4.0 NVMe drive's sequential rate.
  double disk_gbps = 6;
  bool unbacked = false;                // CUDASIM_UNBACKED=1: copies, memsets, file I/O time but touch no data
  bool timeline = false;                // CUDASIM_TIMELINE=1: record the timeline in real-time mode too
  HostCosts host_costs;                 // CUDASIM_HOST_COSTS=none|h100[,name=us...]: slow calls' host time
  // CUDASIM_HOST_PINNED_LIMIT: the most host memory the process may have page-locked at once,
  // cuMemHostAlloc'ed and cuMemHostRegister'ed together (0: no limit, the default). A real
  // driver refuses to pin once the host cannot lock more pages (its RAM, or RLIMIT_MEMLOCK in
  // a container): pinning that would pass the limit fails with out-of-memory.
  uint64_t host_pinned_limit = 0;
  // CUDASIM_HOST_VMM=0|1 (default 1): whether the driver can place VMM physical memory on the
  // host (cuMemCreate with a host location; device attributes
  // CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED and
  // CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED). 0 models a driver with
  // neither: the attributes read 0 and such a cuMemCreate fails with CUDA_ERROR_NOT_SUPPORTED.
  bool host_vmm = true;
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
