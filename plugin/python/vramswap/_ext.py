"""Building and loading vramswap's LibTorch extensions (csrc/*.cpp).

Two extensions, each compiled against the torch that is imported (its headers and
libraries), on first use, with the system C++ compiler, into a cache directory keyed by the
source and torch's version, so it always matches the running torch:
  csrc/cpu_sim.cpp     the CPU-emulation mode's allocator and the tracker's storage use
                       count (torch.ops.vramswap); load() / build()
  csrc/cuda_alloc.cpp  vramswap.install()'s CUDA allocator through LibTorch's
                       CUDAPluggableAllocator (torch.ops.vramswap_cuda); load_cuda() /
                       build(kind="cuda"). It needs a torch 2.x built with CUDA, with its
                       C++ headers (torch/csrc/cuda/CUDAPluggableAllocator.h; torch's wheels
                       ship them) and libraries (libc10_cuda, libtorch_cuda), and the CUDA
                       runtime's headers.
Overrides:
  VRAMSWAP_TORCH_EXT      the path of a prebuilt CPU extension (e.g. from CMake)
  VRAMSWAP_CACHE_DIR      where built extensions are kept; default ~/.cache/vramswap
  CXX                     the compiler; default g++
  CUDA_HOME / CUDA_PATH   the CUDA Toolkit whose include/ the CUDA extension is compiled
                          with; default: the toolkit of the nvcc on PATH, /usr/local/cuda,
                          the CUDA runtime wheels beside torch, or torch.utils.cpp_extension's
                          choice (cuda_include_dir())

Thread safety: load() and load_cuda() are idempotent and guarded by a lock.
"""
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE = _CSRC / "cpu_sim.cpp"
_CUDA_SOURCE = _CSRC / "cuda_alloc.cpp"
_CUDA_HEADER = Path("torch") / "csrc" / "cuda" / "CUDAPluggableAllocator.h"
_lock = threading.Lock()
_loaded = False
_cuda_loaded = False


class ExtensionUnavailable(RuntimeError):
    """The extension cannot be built with this torch (headers or toolkit missing); the
    message says what is missing."""


class ExtensionBuildError(RuntimeError):
    """The compiler refused the extension. The message holds the command and the tail of
    the compiler's output; `compiler_output` holds all of it (its first errors are the
    cause, which a long cascade pushes out of the tail)."""

    def __init__(self, message, compiler_output):
        super().__init__(message)
        self.compiler_output = compiler_output


def _torch_include_base():
    # torch's wheels keep the C++ headers under torch/include; a distribution's package may
    # put them in /usr/include.
    pkg = Path(torch.__file__).resolve().parent / "include"
    for base in (pkg, Path("/usr/include")):
        if (base / "c10" / "core" / "CPUAllocator.h").exists():
            return base
    return None


def _include_dirs():
    base = _torch_include_base()
    return [str(base), str(base / "torch" / "csrc" / "api" / "include")] if base else []


def _lib_dirs():
    pkg_lib = Path(torch.__file__).resolve().parent / "lib"
    return [str(pkg_lib)] if (pkg_lib / "libc10.so").exists() else []


def cuda_include_dir():
    """The directory holding cuda_runtime_api.h for the CUDA extension, or None. Looked for in
    CUDA_HOME, CUDA_PATH, the toolkit of the nvcc on PATH, /usr/local/cuda, pip's CUDA runtime
    wheels (torch's own dependency, in site-packages), and last where torch's cpp_extension
    guesses (importing it warns when it finds no toolkit, so only when all else failed)."""
    import shutil
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    dirs = [Path(c) / "include" for c in candidates if c]
    for site in sys.path:
        for sub in ("nvidia/cuda_runtime/include", "nvidia/cu13/include", "nvidia/cu12/include"):
            dirs.append(Path(site) / sub)
    for d in dirs:
        if (d / "cuda_runtime_api.h").exists():
            return str(d)
    try:
        from torch.utils import cpp_extension
        if cpp_extension.CUDA_HOME and (Path(cpp_extension.CUDA_HOME) / "include" / "cuda_runtime_api.h").exists():
            return str(Path(cpp_extension.CUDA_HOME) / "include")
    except Exception:  # an old or trimmed torch: nothing more to try
        pass
    return None


def _cuda_flags():
    """-isystem/-l flags of the CUDA extension; raises ExtensionUnavailable saying what is missing."""
    if torch.version.cuda is None:
        raise ExtensionUnavailable(f"torch {torch.__version__} is built without CUDA")
    base = _torch_include_base()
    if base is None or not (base / _CUDA_HEADER).exists():
        where = base or Path(torch.__file__).resolve().parent / "include"
        raise ExtensionUnavailable(
            f"torch {torch.__version__} has no C++ header {_CUDA_HEADER} under {where} "
            "(torch 2.x ships it with its C++ headers)")
    cuda_inc = cuda_include_dir()
    if cuda_inc is None:
        raise ExtensionUnavailable(
            "the CUDA runtime's headers (cuda_runtime_api.h) were not found: set CUDA_HOME to "
            "the CUDA Toolkit")
    return ["-isystem", cuda_inc], ["-lc10_cuda", "-ltorch_cuda"]


def loaded_libstdcxx():
    """The path of the C++ runtime (libstdc++) this process runs with, torch's, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


# Note [One C++ runtime]
# ~~~~~~~~~~~~~~~~~~~~~~
# Some toolchains link libstdc++ statically into every shared object they build (a compiler
# installed beside the system's, configured with -static-libstdc++, so that what it builds
# runs where its newer libstdc++ does not). An extension built so carries a second C++
# runtime into a process that already has torch's: locales, streams and exception types
# from the two mix, and the first message formatted with a number (c10::str, inside
# TORCH_CHECK) crashed the process on a GPU machine, at vramswap's first out-of-memory.
# So the link names the libstdc++ that the process runs with, before the compiler's own
# (whose archive then contributes nothing), and a built extension that still defines the
# runtime's symbols is refused.
_RUNTIME_SYMBOL = "_ZNSt6locale7classicEv"  # std::locale::classic(), defined by libstdc++


def _own_runtime(path):
    """Whether the shared object at `path` defines libstdc++'s symbols itself (None when
    nm cannot tell)."""
    try:
        res = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True)
    except OSError:
        return None
    if res.returncode != 0:
        return None
    return any(line.split()[-1:] == [_RUNTIME_SYMBOL] for line in res.stdout.splitlines())


def cxx_standard(version=None):
    """The -std flag for compiling against torch `version` (default: the imported torch's):
    C++17 (what torch 2.x's headers need) up to torch 2.11; C++20 from torch 2.12, whose
    headers refuse anything older."""
    return "-std=c++20" if _torch_version(version) >= (2, 12) else "-std=c++17"


# The oldest torch whose C++ interface the extensions are written against (c10::Allocator as
# torch 2.3 changed it, the pluggable allocator's graph-pool hooks).
OLDEST_TORCH = (2, 3)


def _torch_version(version=None):
    m = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def build(out_dir=None, kind="cpu"):
    """Compiles the extension (if not cached) and returns its path. `kind`: "cpu"
    (csrc/cpu_sim.cpp) or "cuda" (csrc/cuda_alloc.cpp). Raises ExtensionUnavailable when this
    torch cannot build it (older than OLDEST_TORCH; for "cuda", no CUDA or no headers)."""
    if _torch_version() < OLDEST_TORCH:
        raise ExtensionUnavailable(
            f"torch {torch.__version__} is too old for vramswap's extensions: they need torch "
            f"{OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} or newer")
    if kind == "cpu":
        source, prefix, extra_inc, extra_libs, salt = _SOURCE, "libvramswap_torch_", [], [], b""
    elif kind == "cuda":
        extra_inc, extra_libs = _cuda_flags()
        source, prefix = _CUDA_SOURCE, "libvramswap_torch_cuda_"
        salt = str(torch.version.cuda).encode()
    else:
        raise ValueError(f"unknown extension kind {kind!r} (accepted: cpu, cuda)")
    src = source.read_bytes()
    runtime = loaded_libstdcxx()
    # Keyed by what the build depends on; the runtime's path also retires extensions built
    # before Note [One C++ runtime].
    key = hashlib.sha256(src + torch.__version__.encode() + str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()
                         + salt + str(runtime).encode()).hexdigest()[:16]
    cache = Path(out_dir or os.environ.get("VRAMSWAP_CACHE_DIR")
                 or Path.home() / ".cache" / "vramswap")
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(cache)
    out = cache / f"{prefix}{key}.so"
    if out.exists():
        if _trusted(out):
            return out
        out.unlink()  # not this user's own build: built again below
    # The compiler writes into a directory of this process's own (mkdtemp: a random name,
    # mode 0700), never at a name another user could have prepared.
    build_dir = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    try:
        tmp = build_dir / out.name
        cmd = [os.environ.get("CXX", "g++"), cxx_standard(), "-O2", "-fPIC", "-shared",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
        # torch's and CUDA's headers are system headers: their own warnings are not the
        # extension's (the suite compiles it with -Wall -Wextra -Werror).
        for d in _include_dirs():
            cmd += ["-isystem", d]
        cmd += extra_inc
        cmd += [str(source), "-o", str(tmp)]
        for d in _lib_dirs():
            cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
        cmd += ([runtime] if runtime else []) + ["-lc10", "-ltorch_cpu"] + extra_libs
        try:
            res = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # no compiler
            raise RuntimeError(f"building vramswap's torch extension failed: {cmd[0]}: {e}") from e
        if res.returncode != 0:
            raise ExtensionBuildError("building vramswap's torch extension failed:\n"
                                      + " ".join(cmd) + "\n" + res.stderr[-4000:], res.stderr)
        if _own_runtime(tmp):
            raise RuntimeError(
                f"building vramswap's torch extension failed: {cmd[0]} linked a copy of the C++ runtime "
                "(libstdc++) into it, which would run beside torch's and crash the process (Note [One C++ "
                "runtime] in vramswap/_ext.py); set CXX to a compiler that links libstdc++ as a shared "
                "library")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return out


def _check_private(cache):
    """Makes sure only this user (or root) can write `cache`, since vramswap loads the
    compiled code it finds there: a directory of this user's own that others may write (as
    an older vramswap created it under a umask of 002) loses group and other write
    permission; one another user owns is refused with RuntimeError."""
    st = cache.stat()
    if st.st_uid not in (os.geteuid(), 0) or (st.st_uid != os.geteuid() and st.st_mode & 0o022):
        raise RuntimeError(
            f"vramswap's extension cache {cache} can be written by another user (owner uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): vramswap loads compiled code from "
            "there, so it must be a directory only you can write. Set VRAMSWAP_CACHE_DIR to one "
            "of your own (it is created with mode 700)")
    if st.st_mode & 0o022:
        os.chmod(cache, stat.S_IMODE(st.st_mode) & ~0o022)


def _trusted(path):
    """Whether the built extension at `path` may be loaded: a regular file this user or root
    owns that nobody else can write (a file another user left there is built again)."""
    st = os.lstat(path)
    return stat.S_ISREG(st.st_mode) and st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022


def load():
    """Loads the CPU extension into torch (torch.ops.vramswap.*)."""
    global _loaded
    with _lock:
        if not _loaded:
            path = os.environ.get("VRAMSWAP_TORCH_EXT") or str(build())
            torch.ops.load_library(path)
            _loaded = True
    return torch.ops.vramswap


def load_cuda():
    """Loads the CUDA extension into torch (torch.ops.vramswap_cuda.*), building it first;
    raises ExtensionUnavailable or RuntimeError (a failed build) when it cannot."""
    global _cuda_loaded
    with _lock:
        if not _cuda_loaded:
            torch.ops.load_library(str(build(kind="cuda")))
            _cuda_loaded = True
    return torch.ops.vramswap_cuda
