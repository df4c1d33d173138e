// What cpu_sim.cpp uses of torch/library.h and ATen, declared only to accept its calls.
#pragma once
#include <c10/core/Allocator.h>

#include <cstddef>
#include <stdexcept>

namespace c10 {
struct StorageImpl {};
template <class T>
struct weak_intrusive_ptr {
  std::size_t use_count() const { return 0; }
};
struct Storage {
  std::size_t use_count() const { return 1; }
  weak_intrusive_ptr<StorageImpl> getWeakStorageImpl() const { return {}; }
};
}  // namespace c10
namespace at {
struct Tensor {
  bool has_storage() const { return true; }
  c10::Storage storage() const { return {}; }
};
}  // namespace at
namespace torch {
struct Library {
  template <class F>
  Library& def(const char*, F&&) { return *this; }
};
}  // namespace torch
#define TORCH_CHECK(cond, ...) \
  do {                         \
    if (!(cond)) throw std::runtime_error(#cond); \
  } while (0)
#define TORCH_CHECK_WITH(kind, cond, ...) TORCH_CHECK(cond, __VA_ARGS__)
#define TORCH_LIBRARY(ns, m) [[maybe_unused]] static void torch_library_init_##ns(torch::Library& m)
