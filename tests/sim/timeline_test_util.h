// Reading cudasim's timeline (cudasim.h) in the tests of virtual time and of the disk
// engine: every entry recorded so far, and the one entry of a kind.
#ifndef CUDASIM_TESTS_TIMELINE_TEST_UTIL_H
#define CUDASIM_TESTS_TIMELINE_TEST_UTIL_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cudasim.h"

namespace cudasim_test {

// The timeline's entries, oldest first.
inline std::vector<cudasim_timeline_entry> timeline() {
  const size_t n = cudasim_timeline(nullptr, 0);
  std::vector<cudasim_timeline_entry> out(n);
  out.resize(std::min(n, cudasim_timeline(out.data(), n)));
  return out;
}

// The one entry of `kind` in the timeline; fails when there is not exactly one.
inline cudasim_timeline_entry only(uint32_t kind) {
  cudasim_timeline_entry found{};
  int n = 0;
  for (const auto& e : timeline())
    if (e.kind == kind) {
      found = e;
      ++n;
    }
  EXPECT_EQ(1, n) << "entries of kind " << kind;
  return found;
}

}  // namespace cudasim_test

#endif  // CUDASIM_TESTS_TIMELINE_TEST_UTIL_H
