# VRAMSWAP_SANITIZE: builds all project code (vramswap's libraries, cudasim, the tests, the
# benchmarks) with GCC's sanitizers; scripts/sanitize configures build-asan/ and build-tsan/
# with it. The value is a comma-separated list of -fsanitize= names:
#
#   (empty)             no sanitizer: the ordinary build
#   address,undefined   AddressSanitizer (with LeakSanitizer) + UndefinedBehaviorSanitizer
#   thread              ThreadSanitizer (it cannot be combined with address)
#
# Undefined behaviour aborts the process (-fno-sanitize-recover), so it fails the test it
# happens in, as an ASan report does; a TSan report makes the process exit with status 66.
# The runtimes are linked dynamically (GCC's default), and every shared library built here
# names its runtime: a process that loads one of them without being built with the same
# sanitizer (python3, /bin/true under LD_PRELOAD) must preload the runtime first. Its path
# is VRAMSWAP_SANITIZER_PRELOAD (empty without a sanitizer); tests/plugin puts it before
# libvramswap_preload.so in LD_PRELOAD.
set(VRAMSWAP_SANITIZE "" CACHE STRING
    "Sanitizers for project code: empty, 'address,undefined' or 'thread' (scripts/sanitize)")

set(VRAMSWAP_SANITIZER_PRELOAD "")
if(VRAMSWAP_SANITIZE)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    message(FATAL_ERROR "VRAMSWAP_SANITIZE is set up for GCC (found ${CMAKE_CXX_COMPILER_ID})")
  endif()
  string(REPLACE "," ";" vramswap_sanitizers "${VRAMSWAP_SANITIZE}")
  foreach(name IN LISTS vramswap_sanitizers)
    if(NOT name MATCHES "^(address|undefined|thread)$")
      message(FATAL_ERROR "VRAMSWAP_SANITIZE='${VRAMSWAP_SANITIZE}': '${name}' is not one of "
                          "address, undefined, thread (accepted: 'address,undefined' or 'thread')")
    endif()
  endforeach()
  if("thread" IN_LIST vramswap_sanitizers AND "address" IN_LIST vramswap_sanitizers)
    message(FATAL_ERROR "VRAMSWAP_SANITIZE='${VRAMSWAP_SANITIZE}': thread and address cannot be combined")
  endif()

  # Frame pointers: whole stacks in reports at -O2.
  add_compile_options(-fsanitize=${VRAMSWAP_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST vramswap_sanitizers)
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
  add_link_options(-fsanitize=${VRAMSWAP_SANITIZE})

  # The runtime a foreign process must preload: ASan's must come first in the process (it
  # checks); TSan's must be there before any instrumented library runs. UBSan's alone needs
  # no preload, and with ASan it is loaded as the libraries' dependency.
  if("address" IN_LIST vramswap_sanitizers)
    set(vramswap_runtime libasan.so)
  elseif("thread" IN_LIST vramswap_sanitizers)
    set(vramswap_runtime libtsan.so)
  endif()
  if(vramswap_runtime)
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=${vramswap_runtime}
                    OUTPUT_VARIABLE VRAMSWAP_SANITIZER_PRELOAD OUTPUT_STRIP_TRAILING_WHITESPACE)
    get_filename_component(VRAMSWAP_SANITIZER_PRELOAD "${VRAMSWAP_SANITIZER_PRELOAD}" REALPATH)
    if(NOT EXISTS "${VRAMSWAP_SANITIZER_PRELOAD}")
      message(FATAL_ERROR "VRAMSWAP_SANITIZE='${VRAMSWAP_SANITIZE}': ${CMAKE_CXX_COMPILER} has no "
                          "${vramswap_runtime} (Debian: libgcc-12-dev's libasan8 / libtsan2)")
    endif()
  endif()
  message(STATUS "vramswap: sanitizers ${VRAMSWAP_SANITIZE}; runtime to preload: "
                 "${VRAMSWAP_SANITIZER_PRELOAD}")
endif()
