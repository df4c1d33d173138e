# Helpers for test executables that link vramswap's libraries (hence the real toolkit's
# libcudart.so.13 and libcuda.so.1, as the plugin does) and run them on cudasim.
#
# Their RUNPATH is build/sim alone, so both when CTest lists their cases (PRE_TEST
# discovery, which cannot be given an environment on CMake 3.25) and when it runs them,
# the loader picks cudasim's libraries. Every case also runs with LD_LIBRARY_PATH=build/sim
# and a 1 GiB device.

set(VRAMSWAP_TEST_ENVIRONMENT "LD_LIBRARY_PATH=${CUDASIM_LIBRARY_DIR};CUDASIM_DEVICE_MEMORY=1GiB")
# A hang is a failure; every case takes a small fraction of this. A sanitizer build
# (cmake/Sanitizers.cmake) runs 2 to 20 times slower: three times as long.
set(VRAMSWAP_TEST_TIMEOUT 60)
if(VRAMSWAP_SANITIZE)
  set(VRAMSWAP_TEST_TIMEOUT 180)
endif()

# vramswap_add_test_executable(name LIBRARIES libs... SOURCES files...)
function(vramswap_add_test_executable name)
  cmake_parse_arguments(arg "" "" "LIBRARIES;SOURCES" ${ARGN})
  add_executable(${name} ${arg_SOURCES})
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/tests)
  # cudasim_headers: cudasim.h, for the counters' type (the functions are found with dlsym,
  # since the toolkit's libcuda.so that the test links has no such symbols).
  target_link_libraries(${name} PRIVATE ${arg_LIBRARIES} CUDA::cudart CUDA::cuda_driver
                                        cudasim_headers GTest::gtest_main Threads::Threads
                                        ${CMAKE_DL_LIBS} vramswap_warnings)
  # No build-tree RPATH of CMake's (it would name the toolkit's lib64 and load NVIDIA's
  # runtime); only cudasim's directory.
  set_target_properties(${name} PROPERTIES SKIP_BUILD_RPATH ON)
  target_link_options(${name} PRIVATE "LINKER:-rpath,${CUDASIM_LIBRARY_DIR}")
  # The libraries the tests run on are built with them.
  add_dependencies(${name} cudasim_cudart cudasim_driver cudasim_cufile)
endfunction()

# register_gtest_cases(name LABEL label TIMEOUT seconds [SUFFIX s] [FILTER f]
#                      [ENVIRONMENT vars...])
# Registers the cases of the GoogleTest executable `name` (all, or those matching FILTER, a
# --gtest_filter expression), with SUFFIX on their CTest names, discovered when CTest runs
# (PRE_TEST), to run with ENVIRONMENT. gtest_discover_tests splits a list-valued
# ENVIRONMENT into separate arguments of set_tests_properties, so the environment is set by
# a CTest include file of our own, read after the discovered tests (through TEST_LIST).
# tests/sim's helpers use it too.
function(register_gtest_cases name)
  cmake_parse_arguments(arg "" "LABEL;TIMEOUT;SUFFIX;FILTER" "ENVIRONMENT" ${ARGN})
  string(MAKE_C_IDENTIFIER "${name}${arg_SUFFIX}_TESTS" list)
  set(filter)
  if(arg_FILTER)
    set(filter TEST_FILTER "${arg_FILTER}")
  endif()
  gtest_discover_tests(${name}
    DISCOVERY_MODE PRE_TEST
    TEST_SUFFIX "${arg_SUFFIX}"
    ${filter}
    TEST_LIST ${list}
    PROPERTIES TIMEOUT ${arg_TIMEOUT} LABELS ${arg_LABEL})
  set(env_file "${CMAKE_CURRENT_BINARY_DIR}/${list}_environment.cmake")
  file(WRITE "${env_file}"
    "if(${list})\n"
    "  set_tests_properties(\${${list}} PROPERTIES ENVIRONMENT \"${arg_ENVIRONMENT}\")\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${env_file}")
endfunction()

# vramswap_register_tests(name LABEL label [SUFFIX s] [FILTER f] [ENVIRONMENT vars...])
# register_gtest_cases with this project's timeout and VRAMSWAP_TEST_ENVIRONMENT plus
# ENVIRONMENT.
function(vramswap_register_tests name)
  cmake_parse_arguments(arg "" "LABEL;SUFFIX;FILTER" "ENVIRONMENT" ${ARGN})
  register_gtest_cases(${name} LABEL ${arg_LABEL} TIMEOUT ${VRAMSWAP_TEST_TIMEOUT} SUFFIX "${arg_SUFFIX}"
                       FILTER "${arg_FILTER}" ENVIRONMENT ${VRAMSWAP_TEST_ENVIRONMENT} ${arg_ENVIRONMENT})
endfunction()
