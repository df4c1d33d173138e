"""Building and loading the LibTorch extension (csrc/cpu_sim.cpp).

The extension is compiled against the torch that is imported (its headers and libc10 /
libtorch_cpu), on first use, with the system C++ compiler, into a cache directory keyed by
the source and torch's version, so it always matches the running torch. Override:
  VRAMSWAP_TORCH_EXT      the path of a prebuilt extension library (e.g. from CMake)
  VRAMSWAP_CACHE_DIR      where built extensions are kept; default ~/.cache/vramswap
  CXX                     the compiler; default g++

Thread safety: load() is idempotent and guarded by a lock.
"""
import hashlib
import os
import subprocess
import threading
from pathlib import Path

import torch

_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_sim.cpp"
_lock = threading.Lock()
_loaded = False


def _include_dirs():
    # Debian's python3-torch keeps headers in /usr/include; wheels under torch/include.
    dirs = []
    pkg = Path(torch.__file__).resolve().parent / "include"
    for base in (pkg, Path("/usr/include")):
        if (base / "c10" / "core" / "CPUAllocator.h").exists():
            dirs += [base, base / "torch" / "csrc" / "api" / "include"]
            break
    return [str(d) for d in dirs]


def _lib_dirs():
    pkg_lib = Path(torch.__file__).resolve().parent / "lib"
    return [str(pkg_lib)] if (pkg_lib / "libc10.so").exists() else []


def build(out_dir=None):
    """Compiles the extension (if not cached) and returns its path."""
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + torch.__version__.encode()
                         + str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()).hexdigest()[:16]
    cache = Path(out_dir or os.environ.get("VRAMSWAP_CACHE_DIR")
                 or Path.home() / ".cache" / "vramswap")
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"libvramswap_torch_{key}.so"
    if out.exists():
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-fPIC", "-shared",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cmd += [f"-I{d}" for d in _include_dirs()]
    cmd += [str(_SOURCE), "-o", str(tmp)]
    for d in _lib_dirs():
        cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
    cmd += ["-lc10", "-ltorch_cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError("building vramswap's torch extension failed:\n"
                           + " ".join(cmd) + "\n" + res.stderr[-4000:])
    os.replace(tmp, out)
    return out


def load():
    """Loads the extension into torch (torch.ops.vramswap.*)."""
    global _loaded
    with _lock:
        if not _loaded:
            path = os.environ.get("VRAMSWAP_TORCH_EXT") or str(build())
            torch.ops.load_library(path)
            _loaded = True
    return torch.ops.vramswap
