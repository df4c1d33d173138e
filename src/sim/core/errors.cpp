// Error names and strings for both APIs, from the tables generated from the CUDA headers.
// cudasim's own messages for the common codes (those CUDA users see most) come first;
// any other code is described by the first sentence of its header documentation.
#include <cuda.h>
#include <driver_types.h>

#include "api.h"

namespace cudasim {
namespace {

struct ErrorEntry {
  int value;
  const char* name;
  const char* description;
};

const ErrorEntry kRuntimeErrors[] = {
#define CUDASIM_RT_ERROR(name, value, text) {value, #name, text},
#define CUDASIM_DRV_ERROR(name, value, text)
#include "error_tables.inc"
#undef CUDASIM_RT_ERROR
#undef CUDASIM_DRV_ERROR
};

const ErrorEntry kDriverErrors[] = {
#define CUDASIM_RT_ERROR(name, value, text)
#define CUDASIM_DRV_ERROR(name, value, text) {value, #name, text},
#include "error_tables.inc"
#undef CUDASIM_RT_ERROR
#undef CUDASIM_DRV_ERROR
};

// Short messages as CUDA prints them, for the codes a user meets most.
const char* common_message(int value) {
  switch (value) {
    case 0: return "no error";
    case 1: return "invalid argument";
    case 2: return "out of memory";
    case 3: return "initialization error";
    case 100: return "no CUDA-capable device is detected";
    case 101: return "invalid device ordinal";
    case 201: return "invalid device context";
    case 400: return "invalid resource handle";
    case 600: return "device not ready";
    case 700: return "an illegal memory access was encountered";
    case 712: return "part or all of the requested memory range is already mapped";
    case 713: return "pointer does not correspond to a registered memory region";
    case 800: return "operation not permitted";
    case 801: return "operation not supported";
    case 900: return "operation not permitted when stream is capturing";
    case 901: return "operation failed due to a previous error during capture";
    case 904: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return nullptr;
  }
}

const ErrorEntry* find(const ErrorEntry* table, size_t n, int value) {
  for (size_t i = 0; i < n; ++i)
    if (table[i].value == value) return &table[i];
  return nullptr;
}

}  // namespace

const char* driver_error_name(CUresult r) {
  const ErrorEntry* e = find(kDriverErrors, std::size(kDriverErrors), int(r));
  return e ? e->name : nullptr;
}

const char* runtime_error_name(int value) {
  const ErrorEntry* e = find(kRuntimeErrors, std::size(kRuntimeErrors), value);
  return e ? e->name : nullptr;
}

bool error_code_by_name(std::string_view name, int* code) {
  for (const ErrorEntry* table : {&kDriverErrors[0], &kRuntimeErrors[0]}) {
    const size_t n = table == kDriverErrors ? std::size(kDriverErrors) : std::size(kRuntimeErrors);
    for (size_t i = 0; i < n; ++i)
      if (name == table[i].name) {
        *code = table[i].value;
        return true;
      }
  }
  return false;
}

}  // namespace cudasim

using namespace cudasim;

// For cudasim's runtime: names and strings of cudaError_t values (nullptr when unknown).
extern "C" const char* cudasim_internal_runtime_error_name(int value) { return runtime_error_name(value); }

extern "C" const char* cudasim_internal_runtime_error_string(int value) {
  const ErrorEntry* e = find(kRuntimeErrors, std::size(kRuntimeErrors), value);
  if (!e) return nullptr;
  const char* common = common_message(value);
  return common ? common : e->description;
}

extern "C" CUresult cuGetErrorName(CUresult error, const char** pStr) {
  if (!pStr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorEntry* e = find(kDriverErrors, std::size(kDriverErrors), int(error));
  if (!e) {
    *pStr = nullptr;
    return CUDA_ERROR_INVALID_VALUE;
  }
  *pStr = e->name;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGetErrorString(CUresult error, const char** pStr) {
  if (!pStr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorEntry* e = find(kDriverErrors, std::size(kDriverErrors), int(error));
  if (!e) {
    *pStr = nullptr;
    return CUDA_ERROR_INVALID_VALUE;
  }
  const char* common = common_message(int(error));
  *pStr = common ? common : e->description;
  return CUDA_SUCCESS;
}
