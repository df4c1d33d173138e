"""The "none" policy of a benchmark run (interpreter.py): vramswap's pool with no offload
scope. Saved-tensor ops do nothing; its peak is the no-offload peak, and on a card smaller
than that peak it runs out of memory, and the run says at which op.

Thread safety: one per interpreter, used from its thread.
"""


class NonePolicy:
    """Allocations and frees straight to vramswap's pool; no saved-tensor ops."""

    handles_saved = False
    handles_kept = False  # kept-tensor ops (keep, kuse, kdone): kept() when True

    def __init__(self, interp):
        self.it = interp

    def start(self):
        """The interpreter's compute stream exists."""

    def malloc(self, n, tid=None):
        return self.it.vs.vramswap_malloc(n, 0, self.it.compute)

    def free(self, tid):
        it = self.it
        it.vs.vramswap_free(it.ptr[tid], it.size[tid], 0, it.compute)

    def phase(self, name):
        pass

    def quiesce(self):
        """Before the compute stream is synchronized at a step's end or a measurement's start."""

    def begin_measurement(self):
        pass

    def finish(self):
        pass

    def peak_host_bytes(self, stats):
        return 0

    def stream_names(self):
        return {}
