"""Loading libvramswap.so (and, in the CPU-emulation mode, cudasim) through ctypes.

Where the libraries are found:
  VRAMSWAP_LIBRARY      the path of libvramswap.so; default: the package's own lib/ (an
                        installed package: `pip install .` puts the libraries there), else
                        <repo>/build/lib/libvramswap.so (the package run from a checkout)
  VRAMSWAP_CUDASIM_DIR  the directory holding cudasim's libcudart.so.13 and libcuda.so.1;
                        default: the `sim` directory beside the library's `lib` directory
                        (the build tree's layout, build/lib and build/sim, and the installed
                        package's, vramswap/lib and vramswap/sim)

Note [cudasim in a namespace of its own]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In the CPU-emulation mode libvramswap.so must run on cudasim's libcudart.so.13 and
libcuda.so.1, never on NVIDIA's. A CUDA build of torch loads NVIDIA's libcudart.so.13 when
it is imported (libtorch_cuda needs it), and the loader satisfies a later DT_NEEDED entry by
soname with what is already loaded: in the process's own namespace libvramswap.so would bind
to NVIDIA's runtime, which then asks cudasim's driver for its private entry points and gives
up ("CUDA driver version is insufficient"). So the mode loads cudasim's driver, its runtime,
its libcufile.so.0 where the directory has it (the disk tier's dlopen("libcufile.so.0")
then finds it by soname) and libvramswap.so into a link-map namespace of their own
(dlmopen(LM_ID_NEWLM)), where those sonames name cudasim's objects whatever torch loaded.
Nothing crosses between the namespaces but function pointers and the memory they return
(torch's CPU extension calls vramswap_malloc and vramswap_free by address), and no
LD_LIBRARY_PATH is needed. The namespace has its own C library: its environment is a copy
of the process's taken at loading, never freed, so that a later os.environ change (which
may free the process's array) cannot leave it pointing at freed memory, and the library's
exit handlers still read it after Python has torn down; settings after loading go through
vramswap_configure.

The namespace's C library also creates the threads (cudasim's streams, the engine's), so
the process's C library would not learn that the process has threads: glibc's malloc takes
its lock-free single-thread path while __libc_single_threaded is set, and the dynamic
loader, shared by both namespaces, allocates a thread's thread-local storage with the
process's malloc. A Python with no threads of its own then corrupted its heap (a cudasim
thread's first thread-local access racing the interpreter's allocations). So loading first
starts and joins one thread through the process's C library, which leaves it in its
multi-threaded mode for good (tests/bench_py/test_namespace_threads.py).

The library is loaded once per process, for one of the two install modes: on cudasim for
the CPU-emulation mode (vramswap.sim.install_cpu), or on the real CUDA runtime and driver
for vramswap.install() (cuda.py). Once loaded for one, load() refuses the other.

Thread safety: load() is idempotent and guarded by a lock; the returned objects are
immutable after loading.
"""
import ctypes
import os
import threading
from pathlib import Path

from . import _config

_REPO_ROOT = Path(__file__).resolve().parents[3]
_lock = threading.Lock()
_lib = None
_cudart = None
_loaded_path = None   # the path libvramswap.so was loaded from
_loaded_for = None    # "cpu-sim" or "cuda": the install mode that loaded it


class VramswapError(RuntimeError):
    """A vramswap C ABI call failed; the message is vramswap_last_error()."""


_PACKAGED = Path(__file__).resolve().parent / "lib" / "libvramswap.so"


def library_path():
    env = os.environ.get("VRAMSWAP_LIBRARY")
    if env:
        return Path(env)
    return _PACKAGED if _PACKAGED.exists() else _REPO_ROOT / "build" / "lib" / "libvramswap.so"


def cudasim_dir():
    env = os.environ.get("VRAMSWAP_CUDASIM_DIR")
    return Path(env) if env else library_path().resolve().parent.parent / "sim"


def _declare(lib):
    vp, sz, i, u64, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p
    sigs = {
        "vramswap_malloc": (vp, [sz, i, vp]),
        "vramswap_free": (None, [vp, sz, i, vp]),
        "vramswap_record_stream": (None, [vp, vp]),
        "vramswap_empty_cache": (None, []),
        "vramswap_enable_peer_access": (i, [i, i]),
        "vramswap_capture_begin": (i, [i]),
        "vramswap_capture_end": (i, [i]),
        "vramswap_configure": (i, [cp, cp]),
        "vramswap_last_error": (cp, []),
        "vramswap_stats_json": (sz, [ctypes.c_char_p, sz]),
        "vramswap_snapshot_json": (sz, [ctypes.c_char_p, sz]),
        "vramswap_record_history": (None, [sz]),
        "vramswap_reset_peak_stats": (None, []),
        "vramswap_scope_push": (None, []),
        "vramswap_scope_pop": (None, []),
        "vramswap_pack": (u64, [vp, vp]),
        "vramswap_graph_begin": (None, []),
        "vramswap_mark_cold": (i, [u64, vp]),
        "vramswap_unpack": (i, [u64, vp]),
        "vramswap_release": (i, [u64]),
        "vramswap_prefetch": (i, [u64]),
        "vramswap_set_cold_probe": (None, [vp]),
        "vramswap_keep": (u64, [vp, i]),
        "vramswap_use": (i, [u64, vp, i]),
        "vramswap_unkeep": (i, [u64]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def load(cudasim=False, cuda=False):
    """Returns the ctypes handle of libvramswap.so, loading it on the first call: after
    cudasim when `cudasim` is true (the CPU-emulation mode), on the CUDA runtime and driver
    the loader finds when `cuda` is true (vramswap.install()). Raises VramswapError when a
    file is missing, or when the library is already loaded for the other mode."""
    global _lib, _cudart, _loaded_path, _loaded_for
    with _lock:
        if _lib is not None:
            if cudasim and _loaded_for == "cuda":
                raise VramswapError(
                    "vramswap.install() already made libvramswap.so torch's CUDA allocator in "
                    "this process, so the CPU-emulation mode (vramswap.sim.install_cpu()) cannot "
                    "be installed beside it: the library is loaded once per process, for one mode. "
                    "Use the CPU-emulation mode in a process of its own")
            if cudasim and _cudart is None:
                raise VramswapError("libvramswap.so is already loaded without cudasim; "
                                    "the CPU-emulation mode must be installed first")
            if cuda and _cudart is not None:
                raise VramswapError(
                    "libvramswap.so is already loaded on cudasim for the CPU-emulation mode "
                    "(vramswap.sim.install_cpu()), so vramswap.install() cannot make it torch's "
                    "CUDA allocator in this process: the library is loaded once per process, for "
                    "one mode. Use vramswap.install() in a process of its own")
            if cuda and _loaded_for is None:
                _loaded_for = "cuda"
            return _lib
        if cudasim:
            sim = cudasim_dir()
            for name in ("libcuda.so.1", "libcudart.so.13"):
                if not (sim / name).exists():
                    raise VramswapError(f"cudasim's {name} not found in {sim} "
                                        "(set VRAMSWAP_CUDASIM_DIR or build the project)")
        path = library_path()
        if not path.exists():
            raise VramswapError(f"{path} not found (set VRAMSWAP_LIBRARY or build the project)")
        try:
            if cudasim:
                lib = _load_in_namespace(sim, path)
            else:
                lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if cudasim:
                raise
            raise VramswapError(
                f"cannot load {path}: {e}. libvramswap.so needs the CUDA 13 runtime "
                "(libcudart.so.13, from the CUDA Toolkit 13) and the NVIDIA driver's libcuda.so.1 "
                "on the loader's path (LD_LIBRARY_PATH or ldconfig)") from e
        _declare(lib)
        _lib = lib
        _loaded_path = str(path)
        _loaded_for = "cpu-sim" if cudasim else ("cuda" if cuda else None)
        return _lib


_RTLD_NOW, _RTLD_NOLOAD, _LM_ID_NEWLM, _RTLD_DI_LMID = 0x2, 0x4, -1, 1


def _environment_copy(libc):
    """The address of a NULL-terminated copy of os.environ as a C `environ`, in memory from
    the process's malloc that is never freed: the namespace reads it up to the last exit
    handler (VRAMSWAP_STATS_FILE's {rank} is read at exit), after Python has freed its own
    objects."""
    entries = [f"{k}={v}".encode() + b"\0" for k, v in os.environ.items()
               if "\0" not in k + v]
    pointers = ctypes.sizeof(ctypes.c_void_p) * (len(entries) + 1)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    block = libc.malloc(pointers + sum(len(e) for e in entries))
    if not block:
        raise OSError("cannot allocate the CPU-emulation mode's copy of the environment")
    table = (ctypes.c_void_p * (len(entries) + 1)).from_address(block)
    at = block + pointers
    for i, entry in enumerate(entries):
        ctypes.memmove(at, entry, len(entry))
        table[i] = at
        at += len(entry)
    table[len(entries)] = None
    return block


def _load_in_namespace(sim, path):
    """Loads cudasim (from `sim`) and libvramswap.so (`path`) into a new link-map namespace
    (Note [cudasim in a namespace of its own]); returns libvramswap.so's ctypes handle and
    sets _cudart. Raises OSError with dlerror()'s message."""
    global _cudart
    # The process's C library must know that the process has threads (the Note).
    waker = threading.Thread(target=lambda: None, name="vramswap-multithreaded-libc")
    waker.start()
    waker.join()
    libc = ctypes.CDLL(None)
    dlmopen, dlinfo, dlsym, dlerror = libc.dlmopen, libc.dlinfo, libc.dlsym, libc.dlerror
    dlmopen.restype, dlmopen.argtypes = ctypes.c_void_p, [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
    dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    dlsym.restype, dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    dlerror.restype = ctypes.c_char_p
    namespace = ctypes.c_long(_LM_ID_NEWLM)

    def open_in_namespace(file, flags=_RTLD_NOW):
        handle = dlmopen(namespace.value, str(file).encode(), flags)
        if not handle:
            raise OSError(f"cannot load {file}: {(dlerror() or b'').decode(errors='replace')}")
        if namespace.value == _LM_ID_NEWLM and dlinfo(handle, _RTLD_DI_LMID, ctypes.byref(namespace)) != 0:
            raise OSError(f"dlinfo: {(dlerror() or b'').decode(errors='replace')}")
        return handle

    driver = open_in_namespace(sim / "libcuda.so.1")
    own_libc = open_in_namespace("libc.so.6", _RTLD_NOW | _RTLD_NOLOAD)
    ctypes.c_void_p.from_address(dlsym(own_libc, b"environ")).value = _environment_copy(libc)
    del driver
    cudart = open_in_namespace(sim / "libcudart.so.13")
    if (sim / "libcufile.so.0").exists():
        open_in_namespace(sim / "libcufile.so.0")
    handle = open_in_namespace(path)
    _cudart = ctypes.CDLL(str(sim / "libcudart.so.13"), handle=cudart)
    _cudart.cudaStreamSynchronize.restype = ctypes.c_int
    _cudart.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    return ctypes.CDLL(str(path), handle=handle)


def loaded_path():
    """The path libvramswap.so was loaded from (as given to dlopen), or None."""
    return _loaded_path


def lib():
    """The loaded library; raises if neither install mode has loaded it yet."""
    if _lib is None:
        raise VramswapError("vramswap is not installed: call vramswap.install() (CUDA) or "
                            "vramswap.sim.install_cpu() (the CPU-emulation mode) first")
    return _lib


def cudart():
    """cudasim's libcudart (CPU-emulation mode only), else None."""
    return _cudart


def last_error():
    return (_lib.vramswap_last_error() or b"").decode(errors="replace")


def check(rc, what):
    if rc != 0:
        raise VramswapError(f"{what}: {last_error()}")


def config_name(key):
    """The VRAMSWAP_* variable a configuration keyword names: `limit`, `LIMIT` and
    `vramswap_limit` all name VRAMSWAP_LIMIT."""
    return _config.name(key)


def configure(lib, config):
    """Applies `config` ({keyword: value}, keywords as config_name() reads them, values as
    _config.value_text() turns them into text; None leaves a key as it is) through
    vramswap_configure, in order. Raises ConfigError (a ValueError) at the first value
    refused, with vramswap's message (which names the variable, the value and what is
    accepted) or the package's for a value the library would misread; the keys before it
    stay applied."""
    for key, value in config.items():
        variable = _config.name(key)
        if variable in _config.PYTHON_KEYS:
            raise _config.ConfigError([
                f"{variable} is read by vramswap's Python package from the environment when it "
                "is needed; it is not a setting of libvramswap.so, so it cannot be given here"])
        text = _config.value_text(variable, value)
        if text is None:
            continue
        if lib.vramswap_configure(variable.encode(), text) != 0:
            raise _config.ConfigError([last_error()])
