"""The "vramswap" policy of a benchmark run (interpreter.py): what vramswap.offload() does.

Each forward phase runs inside vramswap_scope_push/pop (allocations of at least
VRAMSWAP_MIN_OFFLOAD_BYTES made there are tagged) and starts with vramswap_graph_begin;
save -> vramswap_pack (handle 0: an untagged block, whose later ops are ignored), cold ->
vramswap_mark_cold, use -> vramswap_unpack, release -> vramswap_release, all on the compute
stream. Kept tensors (what vramswap.offload_frozen and offload_optimizer do): allocated in a
tagged block (the torch layer moves them into one; one too small to be tagged is left
alone, as there), keep -> vramswap_keep, kuse ->
vramswap_use (VRAMSWAP_USE_FORWARD in a forward phase, VRAMSWAP_USE_AFTER_BACKWARD in the
others), kdone -> vramswap_mark_cold. VRAMSWAP_LIMIT, _HORIZON and _SOFT_LIMIT come from the
run's parameters.

Thread safety: one per interpreter, used from its thread.
"""
from .measure import RunError
from .policy_none import NonePolicy


class VramswapPolicy(NonePolicy):
    """The tracker protocol over vramswap's C ABI."""

    handles_saved = True
    handles_kept = True

    def __init__(self, interp):
        super().__init__(interp)
        self.handle = {}  # tid -> vramswap handle
        self.kept_handle = {}  # kept tid -> its handle
        self.to_keep = {op[1] for op in interp.ops if op[0] == "keep"}
        self.in_forward = False

    def malloc(self, n, tid=None):
        """A tensor the workload keeps is allocated in a tagged block (a scope of its own
        when no forward's is open)."""
        vs = self.it.vs
        if tid not in self.to_keep or self.in_forward:
            return super().malloc(n, tid)
        vs.vramswap_scope_push()
        try:
            return super().malloc(n, tid)
        finally:
            vs.vramswap_scope_pop()

    def kept(self, i, op):
        """One kept-tensor op; False when the run ended (out of memory)."""
        it = self.it
        vs, s = it.vs, it.compute
        kind, tid = op[0], op[1]
        from .. import _lib
        if kind == "keep":
            # 0: its block is not tagged (below VRAMSWAP_MIN_OFFLOAD_BYTES): it stays as it is,
            # as the torch layer leaves it (kept.py's _keep)
            h = vs.vramswap_keep(it.ptr[tid], int(op[2]))
            if h:
                self.kept_handle[tid] = h
            return True
        h = self.kept_handle.get(tid)
        if not h:
            return True
        if kind == "kuse":
            rc = vs.vramswap_use(h, s, 0 if self.in_forward else 1)  # VRAMSWAP_USE_FORWARD, _AFTER_BACKWARD
            if rc == -2:
                it.oom(i, f"use of kept tensor {tid}")
                return False
        else:
            rc = vs.vramswap_mark_cold(h, s)
        if rc != 0:
            raise RunError(f"op {i}: {kind} of kept tensor {tid}: {_lib.last_error()}")
        return True

    def phase(self, name):
        vs = self.it.vs
        if name == "forward":
            if not self.in_forward:
                vs.vramswap_scope_push()
                self.in_forward = True
            vs.vramswap_graph_begin()
        elif self.in_forward:
            vs.vramswap_scope_pop()
            self.in_forward = False

    def saved(self, i, kind, tid):
        """One saved-tensor op; False when the run ended (out of memory)."""
        it = self.it
        vs, s = it.vs, it.compute
        if kind == "save":
            h = vs.vramswap_pack(it.ptr[tid], s)
            if h:
                self.handle[tid] = h
                it.counts["packs"] += 1
            else:
                it.counts["untagged_saves"] += 1
            return True
        h = self.handle.get(tid)
        if not h:
            return True
        if kind == "cold":
            rc = vs.vramswap_mark_cold(h, s)
        elif kind == "use":
            rc = vs.vramswap_unpack(h, s)
            if rc != 0:
                it.oom(i, f"unpack of tensor {tid}")
                return False
        else:
            rc = vs.vramswap_release(h)
            del self.handle[tid]
            if rc != 0:
                it.oom(i, f"release of tensor {tid}")
                return False
        if rc != 0:
            from .. import _lib
            raise RunError(f"op {i}: {kind} of tensor {tid}: {_lib.last_error()}")
        return True

    def finish(self):
        if self.in_forward:
            self.it.vs.vramswap_scope_pop()

    def peak_host_bytes(self, stats):
        return stats.get("peak_host_bytes", 0)
