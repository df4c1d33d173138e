// include/vramswap/vramswap.h in C++ beside the CUDA runtime's header: its stream type is
// cudaStream_t, vramswap_malloc/vramswap_torch_malloc/vramswap_free have exactly the
// signatures torch's CUDAPluggableAllocator takes, and every function is noexcept except
// vramswap_torch_malloc, which throws on purpose. Built, never run.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "vramswap/vramswap.h"

static_assert(std::is_same_v<decltype(&vramswap_malloc), void* (*)(size_t, int, cudaStream_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_torch_malloc), void* (*)(size_t, int, cudaStream_t)>);
static_assert(!noexcept(vramswap_torch_malloc(0, 0, nullptr)), "vramswap_torch_malloc throws on failure");
static_assert(std::is_same_v<decltype(&vramswap_free), void (*)(void*, size_t, int, cudaStream_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_record_stream), void (*)(void*, cudaStream_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_empty_cache), void (*)() noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_configure), int (*)(const char*, const char*) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_last_error), const char* (*)() noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_stats_json), size_t (*)(char*, size_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_reset_peak_stats), void (*)() noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_scope_push), void (*)() noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_scope_pop), void (*)() noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_pack), uint64_t (*)(const void*, cudaStream_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_graph_begin), void (*)() noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_mark_cold), int (*)(uint64_t, cudaStream_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_unpack), int (*)(uint64_t, cudaStream_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_release), int (*)(uint64_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_prefetch), int (*)(uint64_t) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_keep), uint64_t (*)(const void*, int) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_use), int (*)(uint64_t, cudaStream_t, int) noexcept>);
static_assert(std::is_same_v<decltype(&vramswap_unkeep), int (*)(uint64_t) noexcept>);
static_assert(VRAMSWAP_USE_FORWARD == 0 && VRAMSWAP_USE_AFTER_BACKWARD == 1);
// torch's pluggable allocator stores plain function pointers of these types.
using TorchMalloc = void* (*)(size_t, int, cudaStream_t);
using TorchFree = void (*)(void*, size_t, int, cudaStream_t);
[[maybe_unused]] static TorchMalloc torch_malloc = vramswap_malloc;
[[maybe_unused]] static TorchMalloc torch_throwing_malloc = vramswap_torch_malloc;
[[maybe_unused]] static TorchFree torch_free = vramswap_free;
