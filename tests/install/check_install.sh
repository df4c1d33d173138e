#!/usr/bin/env bash
# tests/install/check_install.sh BUILD_DIR SIM_DIR WORK_DIR
#
# Installs BUILD_DIR into a fresh prefix under WORK_DIR (`cmake --install --prefix`), then
# checks what a user of the installed package gets:
#   1. the libraries carry a versioned soname (libvramswap.so.0) and no RPATH;
#   2. a CMake project (tests/install/consumer) finds it with find_package(vramswap CONFIG
#      REQUIRED), links vramswap::vramswap, and its program runs on cudasim (SIM_DIR);
#   3. the same program built with nothing but `pkg-config --cflags --libs vramswap` runs too;
#   4. both programs load the installed library, not the build tree's.
# The CUDA runtime is the process's: LD_LIBRARY_PATH=SIM_DIR puts cudasim's stand-ins there.
set -euo pipefail
build_dir="$(readlink -f "$1")"
sim_dir="$(readlink -f "$2")"
work="$3"
here="$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")"

fail() { echo "check_install: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
cmake --install "$build_dir" --prefix "$prefix" >"$work/install.log" || fail "cmake --install failed: $(cat "$work/install.log")"

lib="$prefix/lib/libvramswap.so.0"
[[ -f "$lib" ]] || fail "$lib was not installed"
[[ -f "$prefix/include/vramswap/vramswap.h" ]] || fail "the header was not installed"
for name in vramswap vramswap_preload; do
  soname="$(readelf -d "$prefix/lib/lib$name.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')"
  [[ "$soname" == "lib$name.so.0" ]] || fail "lib$name.so has soname '$soname', not lib$name.so.0"
  if readelf -d "$prefix/lib/lib$name.so" | grep -qE 'RPATH|RUNPATH'; then
    fail "lib$name.so carries an RPATH: it must load the process's CUDA runtime"
  fi
done

# The libraries link libcudart.so.13 and libcuda.so.1; the linker resolves them from SIM_DIR
# (a user's link finds the toolkit's).
export LIBRARY_PATH="$sim_dir${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$sim_dir"

# 2. find_package.
cmake -S "$here/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$sim_dir" >"$work/configure.log" 2>&1 \
  || fail "configuring the consumer failed: $(cat "$work/configure.log")"
cmake --build "$work/consumer" >"$work/build.log" 2>&1 || fail "building the consumer failed: $(cat "$work/build.log")"
"$work/consumer/consumer" || fail "the find_package consumer failed"
needed="$(readelf -d "$work/consumer/consumer" | sed -n 's/.*Shared library: \[\(libvramswap[^]]*\)\]/\1/p')"
[[ "$needed" == "libvramswap.so.0" ]] || fail "the consumer needs '$needed', not libvramswap.so.0"

# 3. pkg-config.
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
version="$(pkg-config --modversion vramswap)" || fail "pkg-config does not find vramswap.pc"
[[ -n "$version" ]] || fail "vramswap.pc has no version"
# shellcheck disable=SC2046
cc -o "$work/consumer_pc" "$here/consumer/consumer.c" $(pkg-config --cflags --libs vramswap) \
   -Wl,-rpath-link,"$sim_dir" || fail "building with pkg-config's flags failed"
LD_LIBRARY_PATH="$prefix/lib:$sim_dir" "$work/consumer_pc" || fail "the pkg-config consumer failed"

# 4. The installed library is the one that ran. expect_installed WHICH PROGRAM (with the
# LD_LIBRARY_PATH in force for it).
expect_installed() {
  local loaded
  loaded="$(LD_TRACE_LOADED_OBJECTS=1 "$2" | sed -n 's/.*libvramswap.so.0 => \([^ ]*\).*/\1/p')"
  [[ "$(readlink -f "$loaded")" == "$(readlink -f "$lib")" ]] || fail "the $1 consumer loaded '$loaded', not $lib"
}
LD_LIBRARY_PATH="$prefix/lib:$sim_dir" expect_installed pkg-config "$work/consumer_pc"
expect_installed find_package "$work/consumer/consumer"
echo "check_install: vramswap $version installed, found by find_package and pkg-config, and run from $prefix"
