// torch >= 2.3's c10::Allocator, reduced to what an allocator must implement (see README.md).
#pragma once
#include <cstddef>
#include <cstdint>

namespace c10 {
enum class DeviceType : int8_t { CPU = 0, CUDA = 1 };
struct Device {
  explicit Device(DeviceType type, int8_t index = -1) : type(type), index(index) {}
  DeviceType type;
  int8_t index;
};
using DeleterFnPtr = void (*)(void*);
class DataPtr {
 public:
  DataPtr(void* data, void* ctx, DeleterFnPtr deleter, Device device)
      : data_(data), ctx_(ctx), deleter_(deleter), device_(device) {}

 private:
  void* data_;
  void* ctx_;
  DeleterFnPtr deleter_;
  Device device_;
};
struct Allocator {
  virtual ~Allocator() = default;
  virtual DataPtr allocate(std::size_t n) = 0;
  virtual DeleterFnPtr raw_deleter() const { return nullptr; }
  virtual void copy_data(void* dest, const void* src, std::size_t count) const = 0;

 protected:
  void default_copy_data(void* dest, const void* src, std::size_t count) const;
};
}  // namespace c10
