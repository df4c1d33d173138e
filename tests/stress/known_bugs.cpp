// The product bugs the stress test found that are not fixed yet. See known_bugs.h.
#include "known_bugs.h"

#include <vector>

namespace stress {
namespace {

// None is open now: the seven bugs this test found so far are fixed (this file's history
// lists each with its reproduction). A new one goes here with its signature and the
// command that reproduces it alone, and its name in tests/stress/CMakeLists.txt.
const std::vector<KnownBug> kKnownBugs = {};

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
