#include "cuda/error.h"

#include <cstring>

namespace vramswap::cuda {
namespace {
const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

void throw_driver_error(CUresult r, const char* expr, const char* file, int line) {
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  throw CudaError(std::string(expr) + " failed: " + (name ? name : "CUDA error " + std::to_string(int(r))) + " (" +
                      (text ? text : "no description") + ") at " + base_name(file) + ":" + std::to_string(line),
                  int(r));
}

void throw_runtime_error(cudaError_t e, const char* expr, const char* file, int line) {
  cudaGetLastError();  // the error is reported here; do not leave it for the program to find
  throw CudaError(std::string(expr) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") at " +
                      base_name(file) + ":" + std::to_string(line),
                  int(e));
}

}  // namespace vramswap::cuda
