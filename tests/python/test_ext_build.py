#!/usr/bin/python3
"""How vramswap's torch extensions are built (vramswap/_ext.py):
  - one C++ runtime: a compiler that links libstdc++ statically into shared objects (here
    g++ with -static-libstdc++, as some toolchains installed beside the system's do) still
    gives an extension that uses the process's libstdc++ (it is NEEDED, and the extension
    defines none of its symbols); a build that carries its own copy anyway is refused with
    a message that says so (Note [One C++ runtime]);
  - the C++ standard follows torch's version: C++17 up to 2.11, C++20 from 2.12;
  - csrc/cpu_sim.cpp's torch >= 2.3 branch compiles against torch 2.3+'s c10::Allocator
    (tests/python/torch_2_3_api), and its older branch does not;
  - csrc/cuda_alloc.cpp compiles against torch 2.x's pluggable allocator as declared there,
    setting the graph-pool hooks from torch 2.3 and naming none before.
Usage: python3 tests/python/test_ext_build.py   (exit status 0: every check held)
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

from vramswap import _ext  # noqa: E402  (after the path)

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def needed(path):
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def compiler(directory, body):
    """A CXX for _ext.build(): a shell script that runs g++ as `body` says."""
    path = Path(directory) / "cxx"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def build_with(cxx, out_dir):
    old = os.environ.get("CXX")
    os.environ["CXX"] = cxx
    try:
        return _ext.build(out_dir=out_dir)
    finally:
        if old is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = old


with tempfile.TemporaryDirectory(prefix="vramswap-ext-build-") as tmp:
    runtime = _ext.loaded_libstdcxx()
    check(runtime is not None and Path(runtime).exists(), f"the process's libstdc++ is found ({runtime})")

    # A toolchain that links libstdc++ into what it builds.
    static = compiler(tmp, 'exec g++ -static-libstdc++ "$@"')
    path = build_with(static, Path(tmp) / "static")
    deps = needed(path)
    check(any(d.startswith("libstdc++.so") for d in deps),
          f"built with -static-libstdc++, the extension still needs the shared libstdc++ ({deps})")
    check(_ext._own_runtime(path) is False, "and defines none of libstdc++'s symbols itself")
    check(subprocess.run([sys.executable, "-c", f"import torch; torch.ops.load_library({str(path)!r})"],
                         capture_output=True).returncode == 0, "and loads into torch")

    # A toolchain that ignores the runtime it is given: the build is refused, nothing is kept.
    ignoring = compiler(tmp, 'for a; do shift; case "$a" in */libstdc++.so*) ;; *) set -- "$@" "$a";; esac; done\n'
                             'exec g++ -static-libstdc++ "$@"')
    out_dir = Path(tmp) / "ignoring"
    try:
        build_with(ignoring, out_dir)
        check(False, "a build that links its own copy of libstdc++ is refused")
    except RuntimeError as e:
        check("copy of the C++ runtime" in str(e) and "CXX" in str(e),
              f"a build that links its own copy of libstdc++ is refused, saying why: {str(e)[:160]}")
    check(not list(out_dir.glob("*.so")) and not list(out_dir.glob("*.tmp")),
          "and leaves no extension in the cache")

# The torch >= 2.3 branch of csrc/cpu_sim.cpp against torch 2.3+'s c10::Allocator, declared
# in tests/python/torch_2_3_api (only torch 1.13 is installed here; a GPU machine's torch 2.11
# built it for real on 2026-11-26). Declared as torch 2.2, the file takes its older branch,
# which that interface must refuse: the declaration is strict enough to tell them apart.
api = REPO / "tests" / "python" / "torch_2_3_api"
source = REPO / "plugin" / "python" / "vramswap" / "csrc" / "cpu_sim.cpp"
for minor, compiles in ((3, True), (11, True), (2, False)):
    res = subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-fsyntax-only", f"-I{api}",
                          f"-DFAKE_TORCH_MINOR={minor}", str(source)], capture_output=True, text=True)
    check((res.returncode == 0) == compiles,
          f"csrc/cpu_sim.cpp declared as torch 2.{minor} {'compiles' if compiles else 'is refused'} against "
          f"torch 2.3+'s c10::Allocator" + ("" if (res.returncode == 0) == compiles else f": {res.stderr[-600:]}"))

# csrc/cuda_alloc.cpp (vramswap.install()'s extension) against torch 2.x's pluggable allocator,
# declared there too: from torch 2.3 it sets the graph-pool hooks (captures reported to
# vramswap), before 2.3 it must not name them (the declaration as 2.2 lacks them).
cuda_source = REPO / "plugin" / "python" / "vramswap" / "csrc" / "cuda_alloc.cpp"
nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
cuda_include = Path(os.environ.get("CUDA_HOME", Path(nvcc).resolve().parent.parent)) / "include"
for minor in (3, 11, 2):
    res = subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-fsyntax-only", f"-I{api}",
                          f"-I{cuda_include}", f"-DFAKE_TORCH_MINOR={minor}", str(cuda_source)],
                         capture_output=True, text=True)
    check(res.returncode == 0, f"csrc/cuda_alloc.cpp declared as torch 2.{minor} compiles against its "
          f"pluggable allocator{' (graph-pool hooks set)' if minor >= 3 else ' (no graph-pool hooks)'}"
          + ("" if res.returncode == 0 else f": {res.stderr[-600:]}"))

for version, flag in (("1.13.1", "-std=c++17"), ("2.3.0", "-std=c++17"), ("2.11.0+cu130", "-std=c++17"),
                      ("2.12.0", "-std=c++20"), ("2.14.1+cu130", "-std=c++20"), ("3.0.0", "-std=c++20")):
    check(_ext.cxx_standard(version) == flag, f"torch {version} extensions are compiled with {flag}")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks held")
