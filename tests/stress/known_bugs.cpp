// The product bugs the stress test found that are not fixed yet. See known_bugs.h.
#include "known_bugs.h"

#include <iterator>

namespace stress {
namespace {

bool has(const std::string& text, const char* what) { return text.find(what) != std::string::npos; }

const KnownBug kKnownBugs[] = {
    {"leak-after-failed-map-release",
     "when cuMemMap or cuMemSetAccess of newly created pages fails, the pool gives the pages back with "
     "cuMemRelease; when that fails too, the physical memory is never freed (the refused release is not kept to "
     "try again, as release_spare() now does). Alone: vramswap_stress --seed 1 --threads 1 --ops 10 --faults "
     "cuMemMap:1,cuMemRelease:1 (or cuMemSetAccess:1,cuMemRelease:1)",
     [](const std::string& failure, const std::string& spec) {
       return has(spec, "cuMemRelease") && (has(spec, "cuMemMap") || has(spec, "cuMemSetAccess")) &&
              has(failure, "cudasim physical_bytes");
     }},
    {"pinned-leak-after-failed-free-host",
     "when cudaFreeHost of a host tier chunk fails (src/residency/host_tier.cpp), the chunk is forgotten: its "
     "256 MiB of pinned memory are never freed. Alone: vramswap_stress --seed 1 --threads 1 --ops 250 --faults "
     "cudaFreeHost:1",
     [](const std::string& failure, const std::string& spec) {
       return has(spec, "cudaFreeHost") && has(failure, "cudasim pinned_bytes");
     }},
    {"leak-after-failed-unmap-and-create",
     "with several threads, failed cuMemUnmap and cuMemCreate calls together sometimes leave 2 MiB of device "
     "memory allocated after everything was freed and the cache emptied (not reproduced with one thread). "
     "About 1 seed in 10: vramswap_stress --seed 1200 --seeds 16 --fork --keep-going --threads 3 --ops 300 "
     "--faults cuMemUnmap:p0.05,cuMemCreate:p0.2",
     [](const std::string& failure, const std::string& spec) {
       return has(spec, "cuMemUnmap") && has(failure, "cudasim physical_bytes");
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
