"""Loading libvramswap.so (and, in the CPU-emulation mode, cudasim) through ctypes.

Where the libraries are found:
  VRAMSWAP_LIBRARY      the path of libvramswap.so; default: <repo>/build/lib/libvramswap.so
  VRAMSWAP_CUDASIM_DIR  the directory holding cudasim's libcudart.so.13 and libcuda.so.1;
                        default: the `sim` directory beside the library's `lib` directory
                        (the build tree's layout: build/lib, build/sim)

cudasim is loaded with RTLD_GLOBAL *before* libvramswap.so, so the loader satisfies the
library's DT_NEEDED entries (libcudart.so.13, libcuda.so.1) with cudasim's objects, which
carry those sonames: no LD_LIBRARY_PATH is needed in the CPU-emulation mode.

Thread safety: load() is idempotent and guarded by a lock; the returned objects are
immutable after loading.
"""
import ctypes
import os
import threading
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[3]
_lock = threading.Lock()
_lib = None
_cudart = None


class VramswapError(RuntimeError):
    """A vramswap C ABI call failed; the message is vramswap_last_error()."""


def library_path():
    env = os.environ.get("VRAMSWAP_LIBRARY")
    return Path(env) if env else _REPO_ROOT / "build" / "lib" / "libvramswap.so"


def cudasim_dir():
    env = os.environ.get("VRAMSWAP_CUDASIM_DIR")
    return Path(env) if env else library_path().resolve().parent.parent / "sim"


def _declare(lib):
    vp, sz, i, u64, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p
    sigs = {
        "vramswap_malloc": (vp, [sz, i, vp]),
        "vramswap_free": (None, [vp, sz, i, vp]),
        "vramswap_empty_cache": (None, []),
        "vramswap_configure": (i, [cp, cp]),
        "vramswap_last_error": (cp, []),
        "vramswap_stats_json": (sz, [ctypes.c_char_p, sz]),
        "vramswap_reset_peak_stats": (None, []),
        "vramswap_scope_push": (None, []),
        "vramswap_scope_pop": (None, []),
        "vramswap_pack": (u64, [vp, vp]),
        "vramswap_graph_begin": (None, []),
        "vramswap_mark_cold": (i, [u64, vp]),
        "vramswap_unpack": (i, [u64, vp]),
        "vramswap_release": (i, [u64]),
        "vramswap_prefetch": (i, [u64]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def load(cudasim=False):
    """Returns the ctypes handle of libvramswap.so, loading it (after cudasim when
    `cudasim` is true) on the first call. Raises VramswapError when a file is missing."""
    global _lib, _cudart
    with _lock:
        if _lib is not None:
            if cudasim and _cudart is None:
                raise VramswapError("libvramswap.so is already loaded without cudasim; "
                                    "the CPU-emulation mode must be installed first")
            return _lib
        if cudasim:
            sim = cudasim_dir()
            for name in ("libcuda.so.1", "libcudart.so.13"):
                if not (sim / name).exists():
                    raise VramswapError(f"cudasim's {name} not found in {sim} "
                                        "(set VRAMSWAP_CUDASIM_DIR or build the project)")
            ctypes.CDLL(str(sim / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
            _cudart = ctypes.CDLL(str(sim / "libcudart.so.13"), mode=ctypes.RTLD_GLOBAL)
            _cudart.cudaStreamSynchronize.restype = ctypes.c_int
            _cudart.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        path = library_path()
        if not path.exists():
            raise VramswapError(f"{path} not found (set VRAMSWAP_LIBRARY or build the project)")
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _declare(lib)
        _lib = lib
        return _lib


def lib():
    """The loaded library; raises if neither install mode has loaded it yet."""
    if _lib is None:
        raise VramswapError("vramswap is not installed: call vramswap.sim.install_cpu() first")
    return _lib


def cudart():
    """cudasim's libcudart (CPU-emulation mode only), else None."""
    return _cudart


def last_error():
    return (_lib.vramswap_last_error() or b"").decode(errors="replace")


def check(rc, what):
    if rc != 0:
        raise VramswapError(f"{what}: {last_error()}")
