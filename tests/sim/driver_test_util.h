// Helpers shared by the cudasim conformance tests that use only the driver API
// (libcuda.so.1). Assertion macros print the CUresult's name as well as its value;
// the printing looks names up with cuGetErrorName, which needs no initialization.
#ifndef CUDASIM_TESTS_DRIVER_TEST_UTIL_H
#define CUDASIM_TESTS_DRIVER_TEST_UTIL_H

#include <cuda.h>
#include <gtest/gtest.h>

#include <ostream>

#include "cudasim.h"

// GoogleTest finds PrintTo by argument-dependent lookup: CUresult is a global enum.
inline void PrintTo(CUresult result, std::ostream* os) {
  const char* name = nullptr;
  *os << static_cast<int>(result);
  if (cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) {
    *os << " (" << name << ")";
  }
}

#define ASSERT_CU_OK(call) ASSERT_EQ(CUDA_SUCCESS, (call)) << "in " #call
#define EXPECT_CU_OK(call) EXPECT_EQ(CUDA_SUCCESS, (call)) << "in " #call

namespace cudasim_test {

constexpr size_t kMiB = size_t{1} << 20;

// Reads device 0's counters; fails the test when they cannot be read.
inline cudasim_counters counters(int device = 0) {
  cudasim_counters c{};
  EXPECT_EQ(0, cudasim_get_counters(device, &c)) << "cudasim_get_counters(" << device << ")";
  return c;
}

}  // namespace cudasim_test

#endif  // CUDASIM_TESTS_DRIVER_TEST_UTIL_H
