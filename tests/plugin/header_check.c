/* include/vramswap/vramswap.h is C: it compiles as C99 (-pedantic-errors) with no CUDA
   header, and its declarations have the types C callers use. Built as part of the tests;
   never run. */
#include "vramswap/vramswap.h"

struct vramswap_header_check {
  void* (*malloc_fn)(size_t, int, struct CUstream_st*);
  void* (*torch_malloc_fn)(size_t, int, struct CUstream_st*);
  void (*free_fn)(void*, size_t, int, struct CUstream_st*);
  void (*record_stream_fn)(void*, struct CUstream_st*);
  void (*empty_cache_fn)(void);
  int (*configure_fn)(const char*, const char*);
  const char* (*last_error_fn)(void);
  size_t (*stats_json_fn)(char*, size_t);
  void (*reset_peak_stats_fn)(void);
  void (*scope_push_fn)(void);
  void (*scope_pop_fn)(void);
  uint64_t (*pack_fn)(const void*, struct CUstream_st*);
  void (*graph_begin_fn)(void);
  int (*mark_cold_fn)(uint64_t, struct CUstream_st*);
  int (*unpack_fn)(uint64_t, struct CUstream_st*);
  int (*release_fn)(uint64_t);
  int (*prefetch_fn)(uint64_t);
};

const struct vramswap_header_check vramswap_header_check_c = {
    vramswap_malloc,      vramswap_torch_malloc, vramswap_free,       vramswap_record_stream,
    vramswap_empty_cache, vramswap_configure,    vramswap_last_error, vramswap_stats_json,
    vramswap_reset_peak_stats,
    vramswap_scope_push,  vramswap_scope_pop,    vramswap_pack,       vramswap_graph_begin,
    vramswap_mark_cold,   vramswap_unpack,       vramswap_release,    vramswap_prefetch,
};
