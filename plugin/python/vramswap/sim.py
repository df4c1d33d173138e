"""The CPU-emulation mode: torch's CPU tensors allocated by vramswap on cudasim.

On a machine with no GPU, `vramswap.sim.install_cpu(**config)` loads cudasim's
libcuda.so.1 and libcudart.so.13, then libvramswap.so on top of them, and replaces c10's
CPU allocator (c10::SetCPUAllocator at the highest priority) with one that calls
vramswap_malloc/vramswap_free on device 0 and the legacy stream. cudasim's device memory is
host memory, so torch's CPU kernels run on it directly; an evicted block's pages are really
unmapped, so a wrong eviction faults (SIGSEGV) instead of passing silently. Any torch
script can then be run under `vramswap.offload()`.

torch's CPU ops are not stream-ordered: the tracker synchronizes the legacy stream after
each vramswap_unpack in this mode (cudaStreamSynchronize(0)), so a restored block's copy has
landed before a CPU kernel reads it.

Tensors allocated before install_cpu() keep c10's default allocator (their DataPtrs carry
their own deleter); only later allocations go through vramswap.

Thread safety: install_cpu() may be called from one thread at a time; afterwards
allocations from any thread are served by vramswap (thread-safe).
"""
import contextlib
import ctypes

from . import _config, _ext, _lib

_installed = False


def install_cpu(**config):
    """Makes vramswap (on cudasim) torch's CPU allocator. `config`: VRAMSWAP_* keys, with or
    without the prefix, any case (limit="48MiB", horizon=2), values as the environment takes
    them or ints (see vramswap._config for what else is accepted). Settings of the pool
    (VRAMSWAP_LIMIT, ...) only take effect before vramswap's first allocation. Calling it
    again only applies `config`.

    Before anything is installed, every VRAMSWAP_* variable of the environment is checked
    (the library's keys by the library, with the messages LD_PRELOAD prints), then
    `config`: a refused value raises ConfigError (a ValueError) naming the variable, the
    value and what is accepted, and nothing is installed. A bad environment value is refused
    even when `config` sets the same key."""
    global _installed
    lib = _lib.load(cudasim=True)
    if not _installed:
        _config.check_environment(lib)
    _lib.configure(lib, config)
    if _installed:
        return
    ops = _ext.load()

    def addr(fn):
        return ctypes.cast(fn, ctypes.c_void_p).value

    ops.install_cpu_allocator(addr(lib.vramswap_malloc), addr(lib.vramswap_free),
                              addr(lib.vramswap_last_error))
    _installed = True


def uninstall_cpu():
    """Puts c10's default CPU allocator back; tensors vramswap allocated stay valid."""
    global _installed
    if _installed:
        _ext.load().uninstall_cpu_allocator()
        _installed = False


def installed():
    return _installed


@contextlib.contextmanager
def device(index):
    """Inside it, the calling thread's CPU tensors are allocated on cudasim's device `index`
    (CUDASIM_DEVICE_COUNT devices; 0 outside), which is also the thread's current CUDA device
    (cudaSetDevice), so that the legacy stream the mode uses is that device's. Emulates
    `torch.cuda.device(index)` for the torch layer with blocks on several devices in one
    process; a tensor keeps its device's block wherever it is used later."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"vramswap.sim.device: {index!r} is not a device ordinal")
    if not _installed:
        raise RuntimeError("vramswap.sim.device: the CPU-emulation mode is not installed (install_cpu())")
    cudart = _lib.cudart()
    count = ctypes.c_int(0)
    rc = cudart.cudaGetDeviceCount(ctypes.byref(count))
    if rc != 0 or index >= count.value:
        raise ValueError(f"vramswap.sim.device: device {index} does not exist (cudasim has {count.value}: "
                         "CUDASIM_DEVICE_COUNT sets how many)")
    previous = ctypes.c_int(0)
    _check(cudart.cudaGetDevice(ctypes.byref(previous)), "cudaGetDevice")
    ops = _ext.load()
    _check(cudart.cudaSetDevice(index), f"cudaSetDevice({index})")
    before = ops.set_device(index)
    try:
        yield
    finally:
        ops.set_device(before)
        _check(cudart.cudaSetDevice(previous.value), f"cudaSetDevice({previous.value})")


def _check(rc, what):
    if rc != 0:
        raise _lib.VramswapError(f"{what} failed with CUDA error {rc}")


def synchronize():
    """Waits for the legacy stream (cudaStreamSynchronize(0)) in the CPU-emulation mode."""
    cudart = _lib.cudart()
    if cudart is not None:
        _check(cudart.cudaStreamSynchronize(None), "cudaStreamSynchronize(0)")
