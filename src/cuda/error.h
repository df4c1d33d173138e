// Checked CUDA calls: a failed call becomes a CudaError exception carrying the CUDA code,
// the call's text and file:line. Only src/cuda calls CUDA; everything above it sees
// CudaError or the small types of this directory.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace vramswap::cuda {

class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
  // The CUresult or cudaError_t value (the two share their numbering).
  int code() const { return code_; }
  // True for the out-of-memory codes of either API.
  bool out_of_memory() const { return code_ == CUDA_ERROR_OUT_OF_MEMORY; }

 private:
  int code_;
};

[[noreturn]] void throw_driver_error(CUresult r, const char* expr, const char* file, int line);
[[noreturn]] void throw_runtime_error(cudaError_t e, const char* expr, const char* file, int line);

}  // namespace vramswap::cuda

#define VRAMSWAP_CU(expr)                                                                        \
  do {                                                                                          \
    CUresult vramswap_cu_result_ = (expr);                                                      \
    if (vramswap_cu_result_ != CUDA_SUCCESS)                                                    \
      ::vramswap::cuda::throw_driver_error(vramswap_cu_result_, #expr, __FILE__, __LINE__);     \
  } while (0)

#define VRAMSWAP_CUDART(expr)                                                                    \
  do {                                                                                          \
    cudaError_t vramswap_rt_result_ = (expr);                                                   \
    if (vramswap_rt_result_ != cudaSuccess)                                                     \
      ::vramswap::cuda::throw_runtime_error(vramswap_rt_result_, #expr, __FILE__, __LINE__);    \
  } while (0)
