"""vramswap for PyTorch: saved activations evicted to host memory under pressure.

What exists so far (see DESIGN.md, "Who uses it and how"):
  vramswap.sim.install_cpu(**config)  the CPU-emulation mode: torch's CPU tensors are
                                      allocated by libvramswap.so on cudasim (no GPU needed)
  vramswap.offload()                  the autograd tracker (saved-tensor hooks)
  vramswap.memory_stats()             vramswap_stats_json as a dict
  vramswap.reset_peak_stats()
Not yet: vramswap.install() for CUDA (CUDAPluggableAllocator) and `vramswap run`.
Setting VRAMSWAP_TORCH_DEVICE=cpu-sim makes `import vramswap` install the CPU-emulation
mode at once (with the VRAMSWAP_* environment).
"""
import ctypes
import json
import os

from . import sim
from ._lib import VramswapError
from .tracker import offload, tracker_stats

__all__ = ["sim", "offload", "memory_stats", "reset_peak_stats", "tracker_stats",
           "VramswapError"]


def memory_stats():
    """vramswap's statistics (vramswap_stats_json) as a dict."""
    from . import _lib
    lib = _lib.lib()
    for _ in range(4):
        n = lib.vramswap_stats_json(None, 0)
        buf = ctypes.create_string_buffer(n + 4096)
        got = lib.vramswap_stats_json(buf, len(buf))
        if 0 < got < len(buf):
            return json.loads(buf.value.decode())
    raise VramswapError("vramswap_stats_json: " + _lib.last_error())


def reset_peak_stats():
    from . import _lib
    _lib.lib().vramswap_reset_peak_stats()


if os.environ.get("VRAMSWAP_TORCH_DEVICE") == "cpu-sim":
    sim.install_cpu()
