"""vramswap.install(): libvramswap.so as torch's CUDA allocator.

torch lets a process replace its CUDA caching allocator with a "pluggable" one, once, before
its first CUDA allocation: afterwards torch refuses ("Can't swap an already initialized
allocator"), because memory its own allocator handed out would be freed to the wrong one.
install() does the swap, by one of two paths:

  extension  csrc/cuda_alloc.cpp, a small LibTorch extension built on first use (_ext.py),
             creates a torch::cuda::CUDAPluggableAllocator over vramswap_malloc/vramswap_free
             with its hooks set: an allocation vramswap cannot serve raises
             torch.cuda.OutOfMemoryError carrying vramswap's report, torch.cuda.empty_cache()
             calls vramswap_empty_cache, Tensor.record_stream calls vramswap_record_stream.
             Needs a torch 2.x with CUDA, its C++ headers, the CUDA runtime's headers and a
             C++ compiler.
  ctypes     torch.cuda.memory.CUDAPluggableAllocator(libvramswap.so,
             "vramswap_torch_malloc", "vramswap_free") and
             torch.cuda.memory.change_current_allocator(); the reset (empty_cache) and
             record_stream hooks are set through the allocator object's set_reset_fn /
             set_record_stream_fn where this torch's Python binding has them. An allocation
             vramswap cannot serve raises RuntimeError (not torch.cuda.OutOfMemoryError)
             carrying vramswap's report: see install().

VRAMSWAP_TORCH_EXT_CUDA (or the keyword torch_ext_cuda=) chooses: unset or `auto`, the
extension when it can be built and loaded, else the ctypes path with a warning; `1` (on,
true, yes) the extension or an error; `0` (off, false, no) the ctypes path.

libvramswap.so is loaded once per process, for one mode: after install() the CPU-emulation
mode (vramswap.sim.install_cpu()) is refused, and install() is refused after it.

Thread safety: install() holds a lock; after it returns, torch calls the allocator from any
thread (vramswap is thread-safe).
"""
import ctypes
import os
import threading
import warnings

from . import _config, _lib, sim
from ._lib import VramswapError

EXT_KEY = "VRAMSWAP_TORCH_EXT_CUDA"

_lock = threading.Lock()
_installed = False
_backend = None          # "extension" or "ctypes" once installed
_fallback_reason = None  # why "auto" did not use the extension
_allocator = None        # the ctypes path's torch allocator object (torch keeps one too)


def _addr(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def _split_config(config):
    """-> (choice, config without the extension key); choice is "auto", "extension" or
    "ctypes". Raises ConfigError (a ValueError) naming the key for a value it does not
    accept."""
    rest = {}
    value = None
    for key, v in config.items():
        if _lib.config_name(key) == EXT_KEY:
            value = v
        else:
            rest[key] = v
    if value is None:
        value = os.environ.get(EXT_KEY, "")
    text = _config.value_text(EXT_KEY, value).decode()
    error = _config.python_key_error(EXT_KEY, text)
    if error is not None:
        raise _config.ConfigError([error])
    return _config.EXT_CUDA_WORDS[text.strip().lower()], rest


def _refuse_unless_swappable(torch):
    """Raises VramswapError, saying why and what to do, unless torch's CUDA allocator can be
    replaced now. Touches nothing (torch.cuda.is_available() does not initialize CUDA)."""
    if sim.installed() or _lib.cudart() is not None:
        raise VramswapError(
            "vramswap.install(): the CPU-emulation mode (vramswap.sim.install_cpu(), which "
            "VRAMSWAP_TORCH_DEVICE=cpu-sim makes `import vramswap` install) is already installed "
            "in this process, with libvramswap.so loaded on cudasim; the library is loaded once "
            "per process, for one mode, so it cannot also become torch's CUDA allocator. Use "
            "vramswap.install() in a process of its own, without VRAMSWAP_TORCH_DEVICE=cpu-sim")
    cpu_mode = ("On a machine without a usable GPU, use vramswap's CPU-emulation mode instead: "
                "vramswap.sim.install_cpu(**config), or set VRAMSWAP_TORCH_DEVICE=cpu-sim (then "
                "`import vramswap` installs it, and `python3 -m vramswap run` runs scripts in it)")
    if torch.version.cuda is None:
        raise VramswapError(f"vramswap.install(): this torch ({torch.__version__}) is built "
                            f"without CUDA, so it has no CUDA allocator to replace. {cpu_mode}")
    if not torch.cuda.is_available():
        raise VramswapError(
            f"vramswap.install(): this torch ({torch.__version__}, CUDA {torch.version.cuda}) sees "
            "no CUDA device (torch.cuda.is_available() is False: no GPU, no driver, or "
            f"CUDA_VISIBLE_DEVICES hides them). {cpu_mode}")
    if torch.cuda.is_initialized():
        raise VramswapError(
            "vramswap.install(): torch has already initialized CUDA in this process: its own "
            "caching allocator has been set up, the CUDA context created, and it may already "
            "have served device memory (a CUDA tensor was made, or a torch.cuda call such as "
            "current_device(), synchronize() or set_device() ran). torch's allocator can only "
            "be swapped before its first CUDA allocation, so vramswap cannot take over now. "
            "Call vramswap.install() before any CUDA tensor or torch.cuda call (right after "
            "`import vramswap`), or run the script unchanged with "
            "`python3 -m vramswap run -- script.py`, which installs vramswap before the "
            "script starts")


def _install_extension(ops, lib):
    """Makes vramswap torch's CUDA allocator through the loaded extension; an error here is
    torch refusing the swap or an unsupported torch, not a missing extension."""
    ops.install_cuda_allocator(_addr(lib.vramswap_malloc), _addr(lib.vramswap_free),
                               _addr(lib.vramswap_record_stream), _addr(lib.vramswap_empty_cache),
                               _addr(lib.vramswap_last_error), _addr(lib.vramswap_capture_begin),
                               _addr(lib.vramswap_capture_end))


def _install_ctypes(torch, lib):
    """torch's own Python path; returns its allocator object. The alloc function is
    vramswap_torch_malloc, not vramswap_malloc: torch's CUDAPluggableAllocator does not check
    for NULL, so it gets the entry point that throws (a C++ std::runtime_error with
    vramswap's report, which torch raises as RuntimeError) instead of returning NULL. It is
    only ever called by torch's C++, never through ctypes here: an exception cannot unwind
    through a ctypes call."""
    memory = torch.cuda.memory
    # The same path the library was loaded from, so torch's dlopen finds the loaded copy.
    allocator = memory.CUDAPluggableAllocator(_lib.loaded_path(), "vramswap_torch_malloc", "vramswap_free")
    raw = allocator.allocator()
    for setter, fn in (("set_reset_fn", lib.vramswap_empty_cache),
                       ("set_record_stream_fn", lib.vramswap_record_stream)):
        set_hook = getattr(raw, setter, None)
        if set_hook is not None:
            set_hook(_addr(fn))
    memory.change_current_allocator(allocator)
    return allocator


def _warn_fallback(reason, config):
    level = os.environ.get("VRAMSWAP_LOG", "warn")
    for key, value in config.items():
        if _lib.config_name(key) == "VRAMSWAP_LOG":
            level = value
    if str(level).strip().lower() in ("off", "error"):
        return
    first_line = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
    warnings.warn(
        f"vramswap.install(): vramswap's CUDA extension cannot be used ({first_line}); using "
        "torch's ctypes path instead, where an allocation vramswap cannot serve raises "
        "RuntimeError carrying vramswap's report (only the extension raises "
        "torch.cuda.OutOfMemoryError; see vramswap.install's documentation). "
        f"{EXT_KEY}=0 chooses the ctypes path without this warning; "
        "vramswap.cuda.fallback_reason() has the whole reason", RuntimeWarning, stacklevel=3)


def install(**config):
    """Makes libvramswap.so torch's CUDA allocator, for the rest of the process.

    `config`: VRAMSWAP_* keys with or without the prefix, any case (limit="16GiB",
    horizon=2, VRAMSWAP_LOG="info"), applied through vramswap_configure before the swap; the
    VRAMSWAP_* environment is read by the library itself when it loads, and every VRAMSWAP_*
    variable of it is checked then, before `config`, as sim.install_cpu() does. Settings of
    the pool (VRAMSWAP_LIMIT, ...) only take effect before vramswap's first allocation. A
    value refused (in the environment or in `config`) raises ConfigError, a ValueError,
    naming the variable, the value and what is accepted; nothing is swapped then.
    torch_ext_cuda= (VRAMSWAP_TORCH_EXT_CUDA) chooses the path: auto (default), 1 or 0.
    Calling install() again only applies `config`. Returns the path used: "extension" or
    "ctypes".

    Must run before torch initializes CUDA (before any CUDA tensor or torch.cuda call that
    creates the context); raises VramswapError otherwise, and when torch has no CUDA or sees
    no device (the CPU-emulation mode, vramswap.sim.install_cpu(), is the way to run without
    a GPU), and when the CPU-emulation mode is installed in this process.

    What the ctypes path (torch.cuda.memory.CUDAPluggableAllocator) loses against the
    extension: torch does not check what the allocation function returns (a NULL would
    become a tensor at address 0 whose first kernel fails with a CUDA error that leaves the
    context unusable), so that path is given vramswap_torch_malloc, which throws a C++
    std::runtime_error when vramswap cannot serve an allocation (past VRAMSWAP_LIMIT with
    nothing left to evict, the host tier full, an invalid device, a bad configuration).
    torch passes it on and raises it as a plain RuntimeError whose message is vramswap's
    report ("vramswap: CUDA out of memory allocating N bytes on device D: ...", or
    "vramswap: allocating N bytes on device D failed: ..." when the cause is not a lack of
    memory), where the extension raises torch.cuda.OutOfMemoryError (a RuntimeError
    subclass) with the same report: `except RuntimeError` catches both,
    `except torch.cuda.OutOfMemoryError` only the extension's. Where torch itself recovers
    from an out-of-memory by catching its own C++ type (cuDNN convolution falling back to an
    algorithm with a smaller workspace), the ctypes path's exception is not caught and fails
    the operation instead. The report is also in vramswap's log (VRAMSWAP_LOG=warn, the
    default, prints it) and counted in memory_stats()["num_ooms"].
    empty_cache and record_stream reach vramswap on both paths where torch's Python binding
    has set_reset_fn / set_record_stream_fn (torch 2.x); with a torch that lacks them,
    torch.cuda.empty_cache() does nothing (vramswap.empty_cache() still works) and
    Tensor.record_stream is not seen by vramswap, so a block used on a second stream can be
    reused before that stream's work ends. On both paths torch.cuda.memory_stats(),
    memory_allocated(), memory_snapshot() and torch.cuda.set_per_process_memory_fraction()
    are not served by a pluggable allocator (torch raises, or ignores the fraction): use
    vramswap.memory_stats() and VRAMSWAP_LIMIT.
    """
    global _installed, _backend, _fallback_reason, _allocator
    choice, config = _split_config(config)
    with _lock:
        if _installed:
            _lib.configure(_lib.lib(), config)
            return _backend
        import torch
        _refuse_unless_swappable(torch)
        lib = _lib.load(cuda=True)
        _config.check_environment(lib)
        _lib.configure(lib, config)
        reason = None
        ops = None
        if choice != "ctypes":
            from . import _ext
            try:
                ops = _ext.load_cuda()
            except Exception as e:  # noqa: BLE001 - any build or load failure: "unavailable"
                if choice == "extension":
                    raise VramswapError(f"vramswap.install(): {EXT_KEY}=1 asks for vramswap's CUDA "
                                        f"extension, which cannot be used: {e}") from e
                reason = str(e)
        if ops is not None:
            _install_extension(ops, lib)
            _backend = "extension"
        else:
            _allocator = _install_ctypes(torch, lib)
            _backend = "ctypes"
            _fallback_reason = reason
            if reason is not None:
                _warn_fallback(reason, config)
        _installed = True
        return _backend


def installed():
    """Whether install() made vramswap torch's CUDA allocator in this process."""
    return _installed


def backend():
    """The path install() took: "extension", "ctypes", or None before install()."""
    return _backend


def fallback_reason():
    """Why install() (VRAMSWAP_TORCH_EXT_CUDA unset or auto) used the ctypes path instead of
    the extension, in full; None when it did not fall back."""
    return _fallback_reason
