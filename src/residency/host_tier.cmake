# The pinned host tier (host_tier.h), included by src/residency/CMakeLists.txt.
#
#   vramswap_host_tier           HostTier with best-fit placement: what the product links
#   vramswap_host_tier_mimalloc  + the measured candidate placement, mimalloc's arena API over
#                                the same chunks (make_mimalloc_arena_placer); for the
#                                benchmark and the tests only. Built when mimalloc.h and
#                                libmimalloc are found (Debian: libmimalloc-dev). libmimalloc
#                                is dlopen'ed at run time, never linked: Debian's exports
#                                malloc and free, and linking it would replace glibc's malloc
#                                in the whole process.
#
# Consumers include "residency/host_tier.h" (and "residency/host_memory.h": the memory the
# process may use, from which the tier's default limit follows).

add_library(vramswap_host_tier STATIC ${CMAKE_CURRENT_LIST_DIR}/host_tier.cpp
                                      ${CMAKE_CURRENT_LIST_DIR}/host_tier_best_fit.cpp
                                      ${CMAKE_CURRENT_LIST_DIR}/host_memory.cpp)
target_include_directories(vramswap_host_tier PUBLIC ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(vramswap_host_tier PUBLIC vramswap_cuda PRIVATE vramswap_units vramswap_warnings)
set_target_properties(vramswap_host_tier PROPERTIES POSITION_INDEPENDENT_CODE ON)

find_path(MIMALLOC_INCLUDE_DIR mimalloc.h)
find_library(MIMALLOC_LIBRARY NAMES mimalloc)
if(MIMALLOC_INCLUDE_DIR AND MIMALLOC_LIBRARY)
  add_library(vramswap_host_tier_mimalloc STATIC ${CMAKE_CURRENT_LIST_DIR}/host_tier_mimalloc.cpp)
  target_include_directories(vramswap_host_tier_mimalloc PRIVATE ${MIMALLOC_INCLUDE_DIR})
  target_compile_definitions(vramswap_host_tier_mimalloc PRIVATE
    VRAMSWAP_MIMALLOC_LIBRARY="${MIMALLOC_LIBRARY}")
  target_link_libraries(vramswap_host_tier_mimalloc PUBLIC vramswap_host_tier Threads::Threads
                                                           ${CMAKE_DL_LIBS}
                                                    PRIVATE vramswap_units vramswap_warnings)
  set_target_properties(vramswap_host_tier_mimalloc PROPERTIES POSITION_INDEPENDENT_CODE ON)
  message(STATUS "host tier: mimalloc arena candidate with ${MIMALLOC_LIBRARY}")
else()
  message(STATUS "host tier: mimalloc not found (Debian: libmimalloc-dev); the benchmark and "
                 "tests measure best fit alone")
endif()
