"""The "offload_all" policy of a benchmark run (interpreter.py): what
torch.autograd.graph.save_on_cpu and hook-based offloaders do, given copy streams of their
own.

Note [offload_all]
------------------
torch's save_on_cpu pack hook copies *every* saved tensor (activations, but also weights
and residuals that the forward still holds) into a pinned CPU tensor, and autograd keeps
only that copy: the device tensor is freed as soon as the forward drops it. Its unpack hook
copies the tensor back to a new device tensor, which backward frees when it is done. The
model here runs those copies on streams of their own, as hook-based offloaders with streams
do (save_on_cpu itself copies on the compute stream):
  save     a pinned host buffer (cudaHostAlloc, never freed during the run: a caching host
           allocator would reuse it; with CUDASIM_UNBACKED it costs no RAM); an event on the
           compute stream; the D2H stream waits for it, copies, records the "out" event
  cold     the forward dropped the tensor: its device memory returns to the pool as soon as
           the D2H copy has read it, with no compute stall: once the compute stream's
           position (the end of its last kernel queued) has passed the copy's virtual end
           (both read from cudasim's timeline as the run goes), the compute stream waits for
           the "out" event (already complete, so free) and the block is freed on it. That is
           record_stream's behaviour for a host that sees events complete as the GPU gets
           there. (record_stream itself would hold the block until the *host* sees the event
           complete, and cudasim's host clock moves only when the host waits, so the pool
           would grow instead, past no offload's peak.) An allocation that finds no memory
           first frees every pending original, waiting for their copies, and tries again.
  use      if its restore has not started: a new device block (vramswap_malloc on the
           compute stream), an event on the compute stream, the H2D stream waits for it and
           for the "out" event, copies, records the "in" event; then the compute stream
           waits for the "in" event
  release  the restored device copy is freed on the compute stream (which waited for its
           copy); the host copy is dropped
  free     the original device memory is freed (after its copy), unless it was already
Kept tensors (frozen weights, optimizer state) are moved as axolotl's layer offloading and
ZeRO-Offload's state move them, swapping the tensor's storage:
  kdone    the use ended: its device memory returns to the pool once a D2H copy has read
           it (as "cold" above); a frozen tensor is copied only the first time (its host
           copy stays valid), later its memory is freed at once (in stream order)
  kuse     if it is out: a new device block, the H2D stream waits for it and the host copy,
           copies; the compute stream waits for the copy. With `horizon` > 0 it then starts
           the restores of the next `horizon` kept tensors used after it in the step, as
           memory allows (axolotl prefetches the next layer on a stream of its own).
With `horizon` > 0 the restores of the next `horizon` saved tensors in the predicted order
of use (the order vramswap predicts: oldest forward first, last saved first) are started at
each use, as layer-prefetching offloaders (Megatron-style CPU offload) do, as far as memory
allows (a prefetch that finds no memory is left to the use, never an error); horizon 0 is
save_on_cpu's behaviour: each tensor is copied back when backward asks for it. Device
memory comes from vramswap's pool with no offload scope, so the peaks of the three policies
are measured by one allocator.

Thread safety: one per interpreter, used from its thread.
"""
import bisect
import ctypes

from .policy_none import NonePolicy


class OffloadAllPolicy(NonePolicy):
    """Note [offload_all]."""

    handles_saved = True
    handles_kept = True

    def __init__(self, interp):
        super().__init__(interp)
        # Kept tensors: tid -> {"frozen", "out" (its device memory is gone), "host", "out_event",
        # "in_event" (its restore in flight)}; the kuse ops in order (prefetch), and the kept
        # memory waiting for its D2H copy: (tid's device pointer, bytes, copy end, event).
        self.kept_state = {}
        self.kuses = [(i, op[1]) for i, op in enumerate(interp.ops) if op[0] == "kuse"]
        self.kept_pending = []
        self.host = {}            # tid -> pinned buffer
        self.out_event = {}       # tid -> event after its D2H copy
        self.original_freed = set()
        self.restored = {}        # tid -> (device pointer of the restored copy, "in" event)
        self.used = set()         # restored tids the compute stream waited for (a use)
        self.order = []           # (graph, -seq, tid): saved, not yet used, in predicted order of use
        self.order_key = {}
        self.graph = 0
        self.seq = 0
        self.host_live = 0
        self.peak_host = 0
        self.copy_end = {}        # tid -> virtual end of its D2H copy
        self.pending_free = []    # cold tids whose original waits for its copy to end

    def start(self):
        self.d2h = self.it.cu.stream()
        self.h2d = self.it.cu.stream()

    def malloc(self, n, tid=None):
        """An allocation: originals whose copies are done are freed first; out of memory,
        all the others are (waiting for their copies), then it tries again."""
        it = self.it
        self._reap_originals()
        p = it.vs.vramswap_malloc(n, 0, it.compute)
        if not p and (self.pending_free or self.kept_pending):
            self._reap_originals(everything=True)
            p = it.vs.vramswap_malloc(n, 0, it.compute)
        return p

    def free(self, tid):
        k = self.kept_state.pop(tid, None)
        if k is not None and k["out"]:
            return  # its device memory is gone already (or goes after its copy)
        if tid not in self.out_event:
            super().free(tid)
            return
        self._free_restored(tid)  # freed without a release op: the copy goes too
        if tid in self.pending_free:
            self.pending_free.remove(tid)
        if tid not in self.original_freed:
            self._free_original(tid)
        self.original_freed.discard(tid)
        del self.out_event[tid]

    def phase(self, name):
        if name == "forward":
            self.graph += 1
            self.seq = 0

    def saved(self, i, kind, tid):
        """One saved-tensor op; False when the run ended (out of memory)."""
        it = self.it
        cu, s = it.cu, it.compute
        n = it.size[tid]
        if kind == "save":
            host = ctypes.c_void_p()
            cu.check(cu.rt.cudaHostAlloc(ctypes.byref(host), n, 0), "cudaHostAlloc")
            self.out_event[tid], self.copy_end[tid] = self._copy_out(it.ptr[tid], host.value, n)
            self.host[tid] = host.value
            self.host_live += n
            self.peak_host = max(self.peak_host, self.host_live)
            self.seq += 1
            key = (self.graph, -self.seq, tid)
            self.order_key[tid] = key
            bisect.insort(self.order, key)
            return True
        if kind == "cold":
            # The forward dropped it: only the host copy is kept, and the device memory
            # returns when the copy is done (_reap_originals).
            self.pending_free.append(tid)
            self._reap_originals()
            return True
        if kind == "use":
            if tid not in self.restored and not self._restore(i, tid):
                return False
            cu.check(cu.rt.cudaStreamWaitEvent(s, self.restored[tid][1], 0), "cudaStreamWaitEvent")
            self.used.add(tid)
            self._forget(tid)
            for key in self.order[:it.spec["horizon"]]:  # the next ones after this
                if key[2] not in self.restored and not self._restore(i, key[2], prefetch=True):
                    break  # no memory for it now: it is restored when used
            return True
        # release: backward is done with the restored copy and the host copy.
        self._free_restored(tid)
        self._forget(tid)
        self.host_live -= n
        return True

    def kept(self, i, op):
        """One kept-tensor op (Note [offload_all]); False when the run ended (out of memory)."""
        it = self.it
        cu, s = it.cu, it.compute
        kind, tid = op[0], op[1]
        if kind == "keep":
            self.kept_state[tid] = {"frozen": bool(op[2]), "out": False, "host": None, "out_event": None,
                                    "in_event": None}
            return True
        k = self.kept_state[tid]
        n = it.size[tid]
        if kind == "kdone":
            if k["frozen"] and k["host"] is not None:
                it.vs.vramswap_free(it.ptr[tid], n, 0, s)  # its host copy is still valid
            else:
                if k["host"] is None:
                    host = ctypes.c_void_p()
                    cu.check(cu.rt.cudaHostAlloc(ctypes.byref(host), n, 0), "cudaHostAlloc")
                    k["host"] = host.value
                    self.host_live += n
                    self.peak_host = max(self.peak_host, self.host_live)
                out, end = self._copy_out(it.ptr[tid], k["host"], n)
                k["out_event"] = out
                self.kept_pending.append((it.ptr[tid], n, end, out))
                self._reap_originals()
            k["out"] = True
            return True
        # kuse
        if k["out"] and k["in_event"] is None and not self._kept_restore(i, tid):
            return False
        if k["in_event"] is not None:
            cu.check(cu.rt.cudaStreamWaitEvent(s, k["in_event"], 0), "cudaStreamWaitEvent")
            k["in_event"] = None
        horizon = it.spec["horizon"]
        if horizon:
            at = next(j for j, (op_i, _) in enumerate(self.kuses) if op_i == i)
            for _, nxt in self.kuses[at + 1:at + 1 + horizon]:
                m = self.kept_state.get(nxt)  # (not kept yet: the setup's uses)
                if m and m["out"] and m["in_event"] is None and not self._kept_restore(i, nxt, prefetch=True):
                    break  # no memory for it now: it is restored when used
        return True

    def _kept_restore(self, i, tid, prefetch=False):
        """Starts the H2D copy of a kept tensor into a new device block (it is on the device
        again from here: its `out` goes). False when there is no memory for it."""
        it = self.it
        k = self.kept_state[tid]
        copied = self._copy_in(i, f"kept tensor {tid}", it.size[tid], k["host"], k["out_event"], prefetch)
        if copied is None:
            return False
        it.ptr[tid], k["in_event"] = copied
        k["out"] = False
        return True

    def _copy_in(self, i, what, n, host, out_event, prefetch):
        """A new device block of `n` bytes and the H2D copy of `host` into it, after the copy
        out that made `host` (`out_event`, None: none) -> (pointer, its "in" event), or None
        when there is no memory for it: an out-of-memory for a use, a prefetch left for later."""
        it = self.it
        cu, s = it.cu, it.compute
        p = it.vs.vramswap_malloc(n, 0, s) if prefetch else self.malloc(n)
        if not p:
            if not prefetch:
                it.oom(i, f"restore of {what} ({n} bytes)")
            return None
        ready = cu.event()
        cu.check(cu.rt.cudaEventRecord(ready, s), "cudaEventRecord")
        cu.check(cu.rt.cudaStreamWaitEvent(self.h2d, ready, 0), "cudaStreamWaitEvent")
        if out_event is not None:
            cu.check(cu.rt.cudaStreamWaitEvent(self.h2d, out_event, 0), "cudaStreamWaitEvent")
        cu.check(cu.rt.cudaMemcpyAsync(p, host, n, 1, self.h2d), "cudaMemcpyAsync H2D")
        done = cu.event()
        cu.check(cu.rt.cudaEventRecord(done, self.h2d), "cudaEventRecord")
        return p, done

    def _copy_out(self, src, host, n):
        """The D2H copy of `n` bytes at `src` into `host`, after the compute stream's work so
        far -> (its "out" event, the copy's virtual end)."""
        it = self.it
        cu = it.cu
        ready = cu.event()
        cu.check(cu.rt.cudaEventRecord(ready, it.compute), "cudaEventRecord")
        cu.check(cu.rt.cudaStreamWaitEvent(self.d2h, ready, 0), "cudaStreamWaitEvent")
        cu.check(cu.rt.cudaMemcpyAsync(host, src, n, 2, self.d2h), "cudaMemcpyAsync D2H")
        out = cu.event()
        cu.check(cu.rt.cudaEventRecord(out, self.d2h), "cudaEventRecord")
        it.drain()
        return out, it.last_copy_end

    def quiesce(self):
        # The copies still under way are the next step's: their originals go when they land
        # (a step ends with the compute stream, Note [Warm-up steps] in measure.py).
        self._reap_originals()

    def begin_measurement(self):
        self.peak_host = self.host_live

    def finish(self):
        if self.it.status == "ok":
            self._reap_originals(everything=True)

    def peak_host_bytes(self, stats):
        return self.peak_host

    def stream_names(self):
        return {self.d2h: "offload_all D2H", self.h2d: "offload_all H2D"}

    def _reap_originals(self, everything=False):
        """Frees the originals of cold saved tensors whose D2H copy has ended by the compute
        stream's position (the end of its last kernel), so that the compute stream's wait
        for the copy costs nothing: record_stream's behaviour with a host that sees events
        complete as the GPU gets there. `everything`: all of them, waiting if need be (an
        allocator out of memory synchronizes before it gives up)."""
        if self.kept_pending:
            self._reap_kept(everything)
        if not self.pending_free:
            return
        it = self.it
        it.drain()
        keep = []
        for tid in self.pending_free:
            if everything or self.copy_end[tid] <= it.tail_ns:
                if tid in it.ptr and tid not in self.original_freed:
                    self._free_original(tid)
            else:
                keep.append(tid)
        self.pending_free = keep

    def _reap_kept(self, everything):
        """_reap_originals for kept tensors' memory whose D2H copy was started at a kdone."""
        it = self.it
        cu = it.cu
        it.drain()
        keep = []
        for p, n, end, out in self.kept_pending:
            if everything or end <= it.tail_ns:
                cu.check(cu.rt.cudaStreamWaitEvent(it.compute, out, 0), "cudaStreamWaitEvent")
                it.vs.vramswap_free(p, n, 0, it.compute)
            else:
                keep.append((p, n, end, out))
        self.kept_pending = keep

    def _free_original(self, tid):
        """Frees the saved tensor's own device memory in stream order after its D2H copy."""
        it = self.it
        cu = it.cu
        if tid in self.out_event:
            cu.check(cu.rt.cudaStreamWaitEvent(it.compute, self.out_event[tid], 0), "cudaStreamWaitEvent")
        it.vs.vramswap_free(it.ptr[tid], it.size[tid], 0, it.compute)
        self.original_freed.add(tid)

    def _free_restored(self, tid):
        """Frees the restored copy (a prefetched one nobody used: after its copy)."""
        if tid not in self.restored:
            return
        it = self.it
        p, done = self.restored.pop(tid)
        if tid not in self.used:
            it.cu.check(it.cu.rt.cudaStreamWaitEvent(it.compute, done, 0), "cudaStreamWaitEvent")
        self.used.discard(tid)
        it.vs.vramswap_free(p, it.size[tid], 0, it.compute)

    def _forget(self, tid):
        key = self.order_key.pop(tid, None)
        if key is not None:
            del self.order[bisect.bisect_left(self.order, key)]

    def _restore(self, i, tid, prefetch=False):
        """Starts the H2D copy of a saved tensor into a new device block. False when there is
        no memory for it: an out-of-memory for a use, a prefetch left for later."""
        copied = self._copy_in(i, f"tensor {tid}", self.it.size[tid], self.host[tid], self.out_event[tid], prefetch)
        if copied is None:
            return False
        # No record_stream: the compute stream waits for its "in" event before the copy is freed.
        self.restored[tid] = copied
        return True
