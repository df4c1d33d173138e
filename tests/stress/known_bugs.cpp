// The product bugs the stress test found that are not fixed yet. See known_bugs.h.
#include "known_bugs.h"

#include <iterator>

namespace stress {
namespace {

bool has(const std::string& text, const char* what) { return text.find(what) != std::string::npos; }

const KnownBug kKnownBugs[] = {
    {"pending-free-unmapped",
     "vramswap_free of an evicted tagged block (its pages unmapped) whose free must wait for other streams "
     "(record_stream) leaves a pending block over unmapped granules: vramswap_check_invariants reports "
     "\"granule N under a block in use is not mapped\" (the pool, or its check, misses that state). Alone: "
     "vramswap_stress --seed 101 --threads 1 --ops 174 --invariants-every 1",
     [](const std::string& failure, const std::string&) {
       return has(failure, "vramswap_check_invariants") && has(failure, "under a block in use is not mapped");
     }},
    {"unnamed-cuda-call",
     "a failed cudaStreamIsCapturing (src/cuda/stream.cpp, is_capturing) or cudaEventQuery (src/cuda/event.cpp, "
     "Event::query) is reported as \"e failed: <code>\": the last error does not name the CUDA call. Alone: "
     "vramswap_stress --seed 1 --threads 1 --ops 300 --faults cudaEventQuery:p0.03",
     [](const std::string& failure, const std::string&) {
       return has(failure, "does not name the CUDA call") && has(failure, "(\"e failed: ");
     }},
    {"leak-after-failed-unmap",
     "a cuMemUnmap that fails is ignored (cuda::Mapping's destructor): the pages stay mapped while the pool "
     "counts them unmapped, so their device memory is never freed and that address range cannot be mapped "
     "again (later cuMemMap calls there fail with CUDA_ERROR_INVALID_VALUE). Alone: vramswap_stress --seed 1 "
     "--threads 1 --ops 300 --faults cuMemUnmap:1 --invariants-every 0",
     [](const std::string& failure, const std::string& spec) {
       return has(spec, "cuMemUnmap") && has(failure, "cudasim physical_bytes");
     }},
    {"leak-after-failed-release",
     "a cuMemRelease that fails is ignored (cuda::PhysicalPages' destructor): the physical memory is never "
     "freed. Alone: vramswap_stress --seed 1 --threads 1 --ops 300 --faults cuMemRelease:1 --invariants-every 0",
     [](const std::string& failure, const std::string& spec) {
       return has(spec, "cuMemRelease") && has(failure, "cudasim physical_bytes");
     }},
};

}  // namespace

const KnownBug* find_known_bug(const std::string& name) {
  for (const KnownBug& b : kKnownBugs)
    if (name == b.name) return &b;
  return nullptr;
}

std::string known_bug_names() {
  std::string out;
  for (const KnownBug& b : kKnownBugs) out += (out.empty() ? "" : ", ") + std::string(b.name);
  return out;
}

}  // namespace stress
