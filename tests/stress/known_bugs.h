// Product bugs the stress test has found and that are not fixed yet, each with the
// signature of the failure it causes. A run given --known-bug NAME reports a failure with
// that signature as "known bug NAME" instead of failing (and does not stop the seed for it),
// so that the CTest cases keep finding every other failure until the fix lands; then the
// flag goes (tests/stress/CMakeLists.txt), and the failure fails the case again.
//
// Thread safety: the table is constant.
#pragma once

#include <string>

namespace stress {

struct KnownBug {
  const char* name;
  const char* what;  // the bug, and how to reproduce it alone
  // Whether `failure` (a failure message of a seed whose fault rules are `spec`) is this bug.
  bool (*matches)(const std::string& failure, const std::string& spec);
};

// The bug called `name`, or nullptr.
const KnownBug* find_known_bug(const std::string& name);

// Every known bug's name, separated by ", " (for usage messages).
std::string known_bug_names();

}  // namespace stress
