"""vramswap.OutOfMemoryError: the one exception an allocation vramswap cannot serve raises.

It is torch's own torch.cuda.OutOfMemoryError (a RuntimeError), not a class of vramswap's:
the failure is raised by C++ inside torch's allocator call, and torch turns a
c10::OutOfMemoryError into torch.cuda.OutOfMemoryError only; an `except` clause matches by
class, so a subclass of it defined here would never catch what torch raises. So
`except vramswap.OutOfMemoryError`, `except torch.cuda.OutOfMemoryError` and
`except RuntimeError` catch the same failures. Raised by:
  - the CPU-emulation mode (csrc/cpu_sim.cpp throws c10::OutOfMemoryError), on any thread
    torch allocates from (autograd's backward included);
  - vramswap.install()'s extension path (csrc/cuda_alloc.cpp, likewise).
The message starts with one "vramswap: " and carries vramswap's report (the limit, what is
resident, evictable and pinned). A torch without torch.cuda.OutOfMemoryError (older than
1.13) has no c10::OutOfMemoryError either: there the extensions raise RuntimeError, and
OutOfMemoryError is RuntimeError itself. install()'s ctypes path, the fallback where the
extension cannot be built, raises a plain RuntimeError (see vramswap.install).

Thread safety: a constant.
"""
import torch

OutOfMemoryError = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
