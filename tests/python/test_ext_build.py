#!/usr/bin/python3
"""How vramswap's torch extensions are built (vramswap/_ext.py):
  - one C++ runtime: a compiler that links libstdc++ statically into shared objects (here
    g++ with -static-libstdc++, as some toolchains installed beside the system's do) still
    gives an extension that uses the process's libstdc++ (it is NEEDED, and the extension
    defines none of its symbols); a build that carries its own copy anyway is refused with
    a message that says so (Note [One C++ runtime]);
  - the C++ standard follows torch's version: C++17 up to 2.11, C++20 from 2.12;
  - both extensions compile against the imported torch's real headers, with warnings as
    errors, and load into it: csrc/cpu_sim.cpp (torch.ops.vramswap) and, where torch is a
    CUDA build (which imports with no GPU), csrc/cuda_alloc.cpp (torch.ops.vramswap_cuda);
  - a torch older than the extensions' interface (2.3) is refused before compiling, saying
    which version is needed.
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

# Both extensions against the real headers of the torch imported here, each in a fresh
# process so that it loads into a torch that has loaded neither. -Wall -Wextra -Werror rides
# on CXX: the project's own code is held to warnings as errors, this code too.
import torch  # noqa: E402

with tempfile.TemporaryDirectory(prefix="vramswap-ext-real-") as tmp:
    strict = compiler(tmp, 'exec g++ -Wall -Wextra -Werror "$@"')
    kinds = [("cpu", "vramswap", "install_cpu_allocator")]
    if torch.version.cuda:
        kinds.append(("cuda", "vramswap_cuda", "install_cuda_allocator"))
    else:
        print(f"skip the CUDA extension: torch {torch.__version__} is built without CUDA")
    for kind, namespace, op in kinds:
        old = os.environ.get("CXX")
        os.environ["CXX"] = strict
        try:
            path = _ext.build(out_dir=Path(tmp) / kind, kind=kind)
            error = ""
        except Exception as e:  # noqa: BLE001  (the message is the check's detail)
            path, error = None, str(e)[-1500:]
        finally:
            if old is None:
                del os.environ["CXX"]
            else:
                os.environ["CXX"] = old
        check(path is not None, f"the {kind} extension compiles against torch {torch.__version__}'s headers "
              f"with -Wall -Wextra -Werror{': ' + error if error else ''}")
        if path is None:
            continue
        res = subprocess.run([sys.executable, "-c", f"import torch; torch.ops.load_library({str(path)!r}); "
                              f"print(hasattr(torch.ops.{namespace}, {op!r}))"], capture_output=True, text=True)
        check(res.returncode == 0 and res.stdout.strip() == "True",
              f"and loads into torch, registering torch.ops.{namespace}.{op} ({res.stdout.strip()} {res.stderr[-400:]})")

# A torch older than the extensions' interface is refused before any compiler runs.
real_version = torch.__version__
torch.__version__ = "2.2.2"
try:
    _ext.build(out_dir=tempfile.gettempdir(), kind="cpu")
    check(False, "torch 2.2 is refused before compiling")
except _ext.ExtensionUnavailable as e:
    check("2.2.2" in str(e) and "2.3 or newer" in str(e), f"torch 2.2 is refused before compiling, saying why: {e}")
finally:
    torch.__version__ = real_version

for version, flag in (("1.13.1", "-std=c++17"), ("2.3.0", "-std=c++17"), ("2.11.0+cu130", "-std=c++17"),
                      ("2.12.0", "-std=c++20"), ("2.14.1+cu130", "-std=c++20"), ("3.0.0", "-std=c++20")):
    check(_ext.cxx_standard(version) == flag, f"torch {version} extensions are compiled with {flag}")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks held")
