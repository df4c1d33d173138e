// The product bugs the stress test found that are not fixed yet. See known_bugs.h.
#include "known_bugs.h"

#include <vector>

namespace stress {
namespace {

bool has(const std::string& text, const char* what) { return text.find(what) != std::string::npos; }

// The bugs this test found earlier are fixed (this file's history lists each with its
// reproduction). A new one goes here with its signature and the command that reproduces it
// alone, and its name in tests/stress/CMakeLists.txt.
const std::vector<KnownBug> kKnownBugs = {
    {"leak-after-failed-set-access-rollback",
     "(fixed: Mapping's constructor retries the undoing unmap; kept as the mechanism's example) "
     "when cuMemSetAccess fails while a granule is mapped (src/cuda/vmm.cpp, Mapping's constructor), the "
     "cuMemUnmap that undoes the map was not checked: when it fails too, the pages stay mapped while the pool "
     "counts the granule unmapped, so their 2 MiB are never freed and every later cuMemMap there fails with "
     "CUDA_ERROR_INVALID_VALUE (the allocations that need it run out of memory). Alone: vramswap_stress --seed 1 "
     "--threads 1 --ops 5 --faults cuMemSetAccess:1,cuMemUnmap:1",
     [](const std::string& failure, const std::string& spec) {
       return has(spec, "cuMemSetAccess") && has(spec, "cuMemUnmap") && has(failure, "cudasim physical_bytes");
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
  return out.empty() ? "(none open)" : out;
}

}  // namespace stress
