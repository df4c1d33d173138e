// Loading cuFile (cufile.h).
#include "cuda/cufile.h"

#include <dlfcn.h>

#include <mutex>
#include <type_traits>

namespace vramswap::cuda {
namespace {

struct Loaded {
  CuFileApi api{};
  std::string error;  // "": loaded
};

Loaded load_once() {
  Loaded l;
  void* lib = dlopen("libcufile.so.0", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    l.error = "cannot load libcufile.so.0: " + std::string(why ? why : "not found");
    return l;
  }
  auto sym = [&](const char* name, auto& field) {
    if (!l.error.empty()) return;
    void* p = dlsym(lib, name);
    if (p == nullptr) l.error = std::string("libcufile.so.0 has no ") + name;
    field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p);
  };
  sym("cuFileDriverOpen", l.api.driver_open);
  sym("cuFileHandleRegister", l.api.handle_register);
  sym("cuFileHandleDeregister", l.api.handle_deregister);
  sym("cuFileReadAsync", l.api.read_async);
  sym("cuFileWriteAsync", l.api.write_async);
  sym("cuFileStreamRegister", l.api.stream_register);
  sym("cuFileStreamDeregister", l.api.stream_deregister);
  if (!l.error.empty()) return l;
  // Opened once for the process and never closed: the library's own threads and buffers
  // stay until exit, as a driver's do.
  if (const CuFileError e = l.api.driver_open(); e.err != 0) l.error = "cuFileDriverOpen failed: " + cufile_error_text(e);
  return l;
}

}  // namespace

const CuFileApi* CuFileApi::load(std::string* error) {
  static const Loaded loaded = load_once();
  if (!loaded.error.empty()) {
    *error = loaded.error;
    return nullptr;
  }
  return &loaded.api;
}

std::string cufile_error_text(CuFileError e) {
  std::string text = "cuFile error " + std::to_string(e.err);
  if (e.cu_err != CUDA_SUCCESS) {
    const char* name = nullptr;
    text += " (driver: " + std::string(cuGetErrorName(e.cu_err, &name) == CUDA_SUCCESS && name ? name : "?") + ")";
  }
  return text;
}

}  // namespace vramswap::cuda
