// What csrc/cuda_alloc.cpp uses of torch's pluggable CUDA allocator, declared as torch 2.x
// declares it (torch/csrc/cuda/CUDAPluggableAllocator.h, c10/cuda/CUDACachingAllocator.h):
// the graph-pool hooks exist from torch 2.3 (FAKE_TORCH_MINOR, torch/version.h).
#pragma once
#include <cuda_runtime_api.h>
#include <torch/version.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

namespace c10::cuda {
using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;
namespace CUDACachingAllocator {
class CUDAAllocator {
 public:
  virtual ~CUDAAllocator() = default;
};
}  // namespace CUDACachingAllocator
}  // namespace c10::cuda

namespace torch::cuda::CUDAPluggableAllocator {
class CUDAPluggableAllocator : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  void set_init_fn(std::function<void(int)> init_fn);
  void set_reset_fn(std::function<void()> reset_fn);
  void set_memory_fraction_fn(std::function<void(double, int)> memory_fraction_fn);
  void set_record_stream_fn(std::function<void(void* ptr, cudaStream_t stream)> record_stream_fn);
#if TORCH_VERSION_MINOR >= 3
  void set_begin_allocate_to_pool(
      std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> capture_begin_fn);
  void set_end_allocate_to_pool_fn(std::function<void(int, c10::cuda::MempoolId_t)> capture_about_to_end_fn);
  void set_release_pool(std::function<void(int, c10::cuda::MempoolId_t)> capture_destroy_fn);
#endif
};
std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> createCustomAllocator(
    std::function<void*(size_t, int, cudaStream_t)> alloc_fn,
    std::function<void(void*, size_t, int, cudaStream_t)> free_fn);
void changeCurrentAllocator(const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>& allocator);
}  // namespace torch::cuda::CUDAPluggableAllocator
