"""The child side of a benchmark run: executes a Workload's ops against one allocator policy
on cudasim in virtual time, in a process of its own (runner.py's Note [One child process per
run]), and writes the result (measure.py's Note [What is measured]).

The child sets CUDASIM_TIME=virtual (copy engines at CUDASIM_PCIE_GBPS per direction, one
compute engine), CUDASIM_UNBACKED=1 (device and pinned memory reserve no RAM and copies move
no data: a 12 GB replay runs on a laptop), CUDASIM_DEVICE_MEMORY (the card) and the
VRAMSWAP_* settings, loads cudasim and libvramswap.so through ctypes (vramswap._lib), creates
one compute stream and interprets the ops in order:

  alloc    vramswap_malloc(size, 0, compute): NULL ends the run as "oom" at that op, with
           vramswap_last_error()
  free     vramswap_free(ptr, size, 0, compute)
  compute  cudasim_kernel(compute, ns, label): a timed op on the compute engine
  phase    a boundary recorded for the per-phase ideal bound (below)

and, per policy, the saved-tensor ops:

  "none"        nothing: vramswap's pool with no offload scope. Its peak is the no-offload
                peak; on a card smaller than that peak it runs out of memory, and the run
                says at which op.
  "vramswap"    what vramswap.offload() does: each forward phase runs inside
                vramswap_scope_push/pop (allocations of at least VRAMSWAP_MIN_OFFLOAD_BYTES
                made there are tagged) and starts with vramswap_graph_begin; save ->
                vramswap_pack (handle 0: an untagged block, whose later ops are ignored),
                cold -> vramswap_mark_cold, use -> vramswap_unpack, release ->
                vramswap_release, all on the compute stream. VRAMSWAP_LIMIT, _HORIZON and
                _SOFT_LIMIT come from the run's parameters.
  "offload_all" what torch.autograd.graph.save_on_cpu and hook-based offloaders do, given
                copy streams of their own (see

Note [offload_all] below).

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
With `horizon` > 0 the restores of the next `horizon` saved tensors in the predicted order
of use (the order vramswap predicts: oldest forward first, last saved first) are started at
each use, as layer-prefetching offloaders (Megatron-style CPU offload) do, as far as memory
allows (a prefetch that finds no memory is left to the use, never an error); horizon 0 is
save_on_cpu's behaviour: each tensor is copied back when backward asks for it. Device
memory comes from vramswap's pool with no offload scope, so the peaks of the three policies
are measured by one allocator.

Thread safety: one interpreter per process, used from one thread.
"""
import bisect
import ctypes
import json
import os
import pickle
import sys
from pathlib import Path

from .measure import KIND_NAMES, RunError, first_step_figures, step_start

# ---- the child side ----------------------------------------------------------------------

# ctypes mirrors of cudasim.h's structs, field for field: cudasim writes the whole struct,
# so a mirror that lacks a field is written past (tests/bench_py/test_runner.py checks them
# against the header).
class _TimelineEntry(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint32), ("device", ctypes.c_int32), ("stream", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64), ("enqueue_ns", ctypes.c_uint64), ("start_ns", ctypes.c_uint64),
                ("end_ns", ctypes.c_uint64), ("stall_ns", ctypes.c_uint64), ("label", ctypes.c_char * 48)]


class _Counters(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "bytes_h2d", "bytes_d2h", "bytes_d2d", "bytes_h2h", "bytes_memset", "ops_executed",
        "physical_bytes", "peak_physical_bytes", "mapped_bytes", "capacity_bytes",
        "pinned_bytes", "registered_bytes")]


class _Cuda:
    """The runtime and cudasim calls the interpreter makes, checked."""

    def __init__(self):
        from .. import _lib
        self.vs = _lib.load(cudasim=True)
        self.rt = _lib.cudart()
        self.drv = ctypes.CDLL(str(_lib.cudasim_dir() / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
        vp, i, sz, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
        for name, res, args in (
                ("cudaStreamCreateWithFlags", i, [ctypes.POINTER(vp), ctypes.c_uint]),
                ("cudaEventCreateWithFlags", i, [ctypes.POINTER(vp), ctypes.c_uint]),
                ("cudaEventRecord", i, [vp, vp]),
                ("cudaStreamWaitEvent", i, [vp, vp, ctypes.c_uint]),
                ("cudaMemcpyAsync", i, [vp, vp, sz, i, vp]),
                ("cudaHostAlloc", i, [ctypes.POINTER(vp), sz, ctypes.c_uint]),
                ("cudaDeviceSynchronize", i, []),
                ("cudaSetDevice", i, [i])):
            fn = getattr(self.rt, name)
            fn.restype, fn.argtypes = res, args
        for name, res, args in (
                ("cudasim_get_counters", i, [i, ctypes.POINTER(_Counters)]),
                ("cudasim_reset_counters", i, [i])):
            fn = getattr(self.drv, name)
            fn.restype, fn.argtypes = res, args
        # cudasim's virtual time (src/sim/include/cudasim.h); an older cudasim lacks it.
        self.virtual = hasattr(self.drv, "cudasim_virtual_time")
        if self.virtual:
            for name, res, args in (
                    ("cudasim_virtual_time", i, []),
                    ("cudasim_now_ns", u64, []),
                    ("cudasim_kernel", i, [vp, u64, ctypes.c_char_p]),
                    ("cudasim_timeline", sz, [ctypes.POINTER(_TimelineEntry), sz]),
                    ("cudasim_timeline_clear", None, [])):
                fn = getattr(self.drv, name)
                fn.restype, fn.argtypes = res, args
            self.virtual = self.drv.cudasim_virtual_time() == 1

    def check(self, rc, what):
        if rc != 0:
            raise RunError(f"{what} failed with CUDA error {rc}")

    def stream(self):
        s = ctypes.c_void_p()
        self.check(self.rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreateWithFlags")  # non-blocking
        return s.value

    def event(self):
        e = ctypes.c_void_p()
        self.check(self.rt.cudaEventCreateWithFlags(ctypes.byref(e), 2), "cudaEventCreateWithFlags")  # no timing
        return e.value

    def counters(self):
        c = _Counters()
        self.check(self.drv.cudasim_get_counters(0, ctypes.byref(c)), "cudasim_get_counters")
        return c

    def now(self):
        return self.drv.cudasim_now_ns()

    def drain_timeline(self):
        """The timeline entries recorded since the last call, which cudasim then forgets (so
        that reading as the run goes costs O(new entries), and the run never reaches
        cudasim's cap). Each: (kind, stream, bytes, enqueue_ns, start_ns, end_ns, stall_ns,
        label). Entries are complete when queued in virtual time."""
        n = self.drv.cudasim_timeline(None, 0)
        if n == 0:
            return []
        buf = (_TimelineEntry * n)()
        got = min(self.drv.cudasim_timeline(buf, n), n)
        self.drv.cudasim_timeline_clear()
        return [(e.kind, e.stream, e.bytes, e.enqueue_ns, e.start_ns, e.end_ns, e.stall_ns,
                 e.label.decode(errors="replace")) for e in buf[:got]]


def _stats_json(vs):
    n = vs.vramswap_stats_json(None, 0)
    buf = ctypes.create_string_buffer(n + 65536)
    got = vs.vramswap_stats_json(buf, len(buf))
    return json.loads(buf.value.decode()) if got else {}


class _Interpreter:
    """Executes the ops of one workload under one policy (Note [One child process per run])."""

    def __init__(self, cuda, spec, ops, live_base=0):
        self.cu = cuda
        self.vs = cuda.vs
        self.spec = spec
        self.policy = spec["policy"]
        self.ops = ops
        self.live_base = live_base
        self.record = spec["record"]
        self.ptr = {}        # tid -> device pointer
        self.size = {}       # tid -> requested bytes
        self.live = 0
        self.peak_live = 0
        self.kernels = 0     # compute ops queued so far
        self.phases = []     # (name, kernels queued before the phase's first op)
        self.series = []     # (kernels queued, live bytes, mapped bytes, physical bytes)
        self.status = "ok"
        self.error = None
        self.error_op = None
        self.counts = {"packs": 0, "untagged_saves": 0}
        # vramswap
        self.handle = {}
        self.in_forward = False
        # offload_all
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
        # The timeline as drained so far, and the compute stream's position in it.
        self.entries = []
        self.tail_ns = 0

    # -- the loop -------------------------------------------------------------------
    def execute(self):
        cu, vs = self.cu, self.vs
        self.compute = cu.stream()
        if self.policy == "offload_all":
            self.d2h = cu.stream()
            self.h2d = cu.stream()
        kernel = cu.drv.cudasim_kernel
        malloc, free = vs.vramswap_malloc, vs.vramswap_free
        saved_ops = {"save", "cold", "use", "release"}
        offload_all = self.policy == "offload_all"
        track = self.record
        segments, measured = self._segments()
        self.first_step = None
        self.error_step = None
        self._begin_measurement()  # the first step is measured from the start
        for n, (first, last) in enumerate(segments):
            if n >= 2:  # a repeat of the step: measured afresh (the last one is the result)
                self._begin_measurement()
            if not self._run_segment(first, last, kernel, malloc, free, saved_ops, offload_all, track):
                self.error_step = max(1, n)
                break
            if n > 0 and n < len(segments) - 1:
                self._end_step(n)
        if self.in_forward:
            vs.vramswap_scope_pop()
        if offload_all and self.status == "ok":
            self._reap_originals(everything=True)
        cu.check(cu.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        self.end_ns = cu.now()

    def _end_step(self, n):
        """A warm-up step ended: the host waits for the device (a training loop that reads
        its loss does), and after the first step its figures are kept (Note [Warm-up steps])."""
        cu = self.cu
        if self.policy == "offload_all":
            self._reap_originals(everything=True)
        cu.check(cu.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        if n == 1:
            self.end_ns = cu.now()
            self.first_step = first_step_figures(self.result())

    def _segments(self):
        """-> ([(first, last)], index of the measured segment): Note [Warm-up steps]."""
        whole = [(0, len(self.ops))]
        warmup = int(self.spec.get("warmup") or 0)
        self.warmup_steps = 0
        if warmup == 0:
            return whole, 0
        start, _ = step_start(self.ops)
        if start is None:
            return whole, 0
        self.warmup_steps = warmup
        step = (start, len(self.ops))
        return [(0, start)] + [step] * (warmup + 1), warmup + 1

    def _begin_measurement(self):
        """Starts measuring here: the device idle, cudasim's counters and timeline and
        vramswap's peaks reset, its counters noted (the result reports their deltas)."""
        cu = self.cu
        if self.policy == "offload_all":
            self._reap_originals(everything=True)
        cu.check(cu.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        self._drain()
        cu.check(cu.drv.cudasim_reset_counters(0), "cudasim_reset_counters")
        cu.drv.cudasim_timeline_clear()
        self.vs.vramswap_reset_peak_stats()
        self.stats0 = _stats_json(self.vs)
        self.start_ns = cu.now()
        self.kernels = 0
        self.phases = []
        self.series = []
        self.entries = []
        self.tail_ns = 0
        self.peak_live = self.live
        self.peak_host = self.host_live
        self.counts = {"packs": 0, "untagged_saves": 0}

    def _run_segment(self, first, last, kernel, malloc, free, saved_ops, offload_all, track):
        """Runs ops[first:last]; False when the run ended (out of memory)."""
        cu, s = self.cu, self.compute
        for i in range(first, last):
            op = self.ops[i]
            kind = op[0]
            if kind == "compute":
                rc = kernel(s, op[1], op[2].encode()[:47])
                if rc != 0:
                    raise RunError(f"op {i}: cudasim_kernel failed with CUDA error {rc}")
                self.kernels += 1
                continue
            if kind == "alloc":
                tid, n = op[1], op[2]
                p = malloc(n, 0, s) if not offload_all else self._malloc(n)
                if not p:
                    self._oom(i, f"alloc of tensor {tid} ({n} bytes)")
                    return False
                self.ptr[tid] = p
                self.size[tid] = n
                self.live += n
                if self.live > self.peak_live:
                    self.peak_live = self.live
            elif kind == "free":
                tid = op[1]
                n = self.size[tid]
                self.live -= n
                if offload_all and tid in self.out_event:
                    self._free_restored(tid)  # freed without a release op: the copy goes too
                    if tid in self.pending_free:
                        self.pending_free.remove(tid)
                    if tid not in self.original_freed:
                        self._free_original(tid)
                    self.original_freed.discard(tid)
                    del self.out_event[tid]
                else:
                    free(self.ptr[tid], n, 0, s)
                del self.size[tid]
                del self.ptr[tid]
            elif kind == "phase":
                self._phase(op[1])
                continue
            elif kind in saved_ops:
                if self.policy == "vramswap":
                    ok = self._vramswap_op(i, kind, op[1])
                elif self.policy == "offload_all":
                    ok = self._offload_all_op(i, kind, op[1])
                else:
                    continue
                if not ok:
                    return False
            else:
                raise RunError(f"op {i}: unknown kind {kind!r}")
            if track:
                c = cu.counters()
                self.series.append((self.kernels, self.live, c.mapped_bytes, c.physical_bytes))
        return True

    def _oom(self, i, what):
        self.status = "oom"
        self.error_op = i
        from .. import _lib
        self.error = f"op {i}: {what}: {_lib.last_error() or 'refused'}"

    def _phase(self, name):
        self.phases.append((name, self.kernels))
        if self.policy != "vramswap":
            if name == "forward":
                self.graph += 1
                self.seq = 0
            return
        if name == "forward":
            if not self.in_forward:
                self.vs.vramswap_scope_push()
                self.in_forward = True
            self.vs.vramswap_graph_begin()
        elif self.in_forward:
            self.vs.vramswap_scope_pop()
            self.in_forward = False

    # -- "vramswap": the tracker protocol -------------------------------------------
    def _vramswap_op(self, i, kind, tid):
        vs, s = self.vs, self.compute
        if kind == "save":
            h = vs.vramswap_pack(self.ptr[tid], s)
            if h:
                self.handle[tid] = h
                self.counts["packs"] += 1
            else:
                self.counts["untagged_saves"] += 1
            return True
        h = self.handle.get(tid)
        if not h:
            return True
        if kind == "cold":
            rc = vs.vramswap_mark_cold(h, s)
        elif kind == "use":
            rc = vs.vramswap_unpack(h, s)
            if rc != 0:
                self._oom(i, f"unpack of tensor {tid}")
                return False
        else:
            rc = vs.vramswap_release(h)
            del self.handle[tid]
            if rc != 0:
                self._oom(i, f"release of tensor {tid}")
                return False
        if rc != 0:
            from .. import _lib
            raise RunError(f"op {i}: {kind} of tensor {tid}: {_lib.last_error()}")
        return True

    # -- "offload_all": Note [offload_all] ------------------------------------------
    def _offload_all_op(self, i, kind, tid):
        cu, s = self.cu, self.compute
        n = self.size[tid]
        if kind == "save":
            host = ctypes.c_void_p()
            cu.check(cu.rt.cudaHostAlloc(ctypes.byref(host), n, 0), "cudaHostAlloc")
            ready = cu.event()
            cu.check(cu.rt.cudaEventRecord(ready, s), "cudaEventRecord")
            cu.check(cu.rt.cudaStreamWaitEvent(self.d2h, ready, 0), "cudaStreamWaitEvent")
            cu.check(cu.rt.cudaMemcpyAsync(host, self.ptr[tid], n, 2, self.d2h), "cudaMemcpyAsync D2H")
            out = cu.event()
            cu.check(cu.rt.cudaEventRecord(out, self.d2h), "cudaEventRecord")
            self._drain()
            self.copy_end[tid] = self.last_copy_end
            self.host[tid] = host.value
            self.out_event[tid] = out
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
            for key in self.order[:self.spec["horizon"]]:  # the next ones after this
                if key[2] not in self.restored and not self._restore(i, key[2], prefetch=True):
                    break  # no memory for it now: it is restored when used
            return True
        # release: backward is done with the restored copy and the host copy.
        self._free_restored(tid)
        self._forget(tid)
        self.host_live -= n
        return True

    def _drain(self):
        new = self.cu.drain_timeline()
        for e in new:
            if e[0] == 0 and e[1] == self.compute:
                self.tail_ns = max(self.tail_ns, e[5])
            elif e[0] == 2:
                self.last_copy_end = e[5]
        self.entries.extend(new)

    def _reap_originals(self, everything=False):
        """Frees the originals of cold saved tensors whose D2H copy has ended by the compute
        stream's position (the end of its last kernel), so that the compute stream's wait
        for the copy costs nothing: record_stream's behaviour with a host that sees events
        complete as the GPU gets there. `everything`: all of them, waiting if need be (an
        allocator out of memory synchronizes before it gives up)."""
        if not self.pending_free:
            return
        self._drain()
        keep = []
        for tid in self.pending_free:
            if everything or self.copy_end[tid] <= self.tail_ns:
                if tid in self.ptr and tid not in self.original_freed:
                    self._free_original(tid)
            else:
                keep.append(tid)
        self.pending_free = keep

    def _free_original(self, tid):
        """Frees the saved tensor's own device memory in stream order after its D2H copy."""
        cu = self.cu
        if tid in self.out_event:
            cu.check(cu.rt.cudaStreamWaitEvent(self.compute, self.out_event[tid], 0), "cudaStreamWaitEvent")
        self.vs.vramswap_free(self.ptr[tid], self.size[tid], 0, self.compute)
        self.original_freed.add(tid)

    def _free_restored(self, tid):
        """Frees the restored copy (a prefetched one nobody used: after its copy)."""
        if tid not in self.restored:
            return
        p, done = self.restored.pop(tid)
        if tid not in self.used:
            self.cu.check(self.cu.rt.cudaStreamWaitEvent(self.compute, done, 0), "cudaStreamWaitEvent")
        self.used.discard(tid)
        self.vs.vramswap_free(p, self.size[tid], 0, self.compute)

    def _forget(self, tid):
        key = self.order_key.pop(tid, None)
        if key is not None:
            del self.order[bisect.bisect_left(self.order, key)]

    def _malloc(self, n):
        """offload_all's allocation: originals whose copies are done are freed first; out
        of memory, all the others are (waiting for their copies), then it tries again."""
        self._reap_originals()
        p = self.vs.vramswap_malloc(n, 0, self.compute)
        if not p and self.pending_free:
            self._reap_originals(everything=True)
            p = self.vs.vramswap_malloc(n, 0, self.compute)
        return p

    def _restore(self, i, tid, prefetch=False):
        """Starts the H2D copy of a saved tensor into a new device block. False when there is
        no memory for it: an out-of-memory for a use, a prefetch left for later."""
        cu, s = self.cu, self.compute
        n = self.size[tid]
        p = self.vs.vramswap_malloc(n, 0, s) if prefetch else self._malloc(n)
        if not p:
            if not prefetch:
                self._oom(i, f"restore of tensor {tid} ({n} bytes)")
            return False
        ready = cu.event()
        cu.check(cu.rt.cudaEventRecord(ready, s), "cudaEventRecord")
        cu.check(cu.rt.cudaStreamWaitEvent(self.h2d, ready, 0), "cudaStreamWaitEvent")
        cu.check(cu.rt.cudaStreamWaitEvent(self.h2d, self.out_event[tid], 0), "cudaStreamWaitEvent")
        cu.check(cu.rt.cudaMemcpyAsync(p, self.host[tid], n, 1, self.h2d), "cudaMemcpyAsync H2D")
        done = cu.event()
        cu.check(cu.rt.cudaEventRecord(done, self.h2d), "cudaEventRecord")
        # No record_stream: the compute stream waits for `done` before the copy is freed.
        self.restored[tid] = (p, done)
        return True

    # -- the result -----------------------------------------------------------------
    def result(self):
        cu = self.cu
        c = cu.counters()
        stats = _stats_json(self.vs)
        self._drain()
        timeline = self.entries
        start = self.start_ns
        compute_stream = self.compute
        kernels = sorted((e for e in timeline if e[0] == 0), key=lambda e: (e[4], e[3]))
        copies = [e for e in timeline if e[0] in (1, 2)]
        step_ns = self.end_ns - start
        # The compute stream's position after k kernels: the end of the k-th (virtual, from start).
        ends = [0] + [e[5] - start for e in kernels]

        def at(k):
            return ends[min(k, len(ends) - 1)]

        bounds = [(name, k) for name, k in self.phases]
        if not bounds or bounds[0][1] > 0:
            bounds.insert(0, ("other", 0))
        phases = []
        for j, (name, k) in enumerate(bounds):
            k_next = bounds[j + 1][1] if j + 1 < len(bounds) else len(kernels)
            t0 = at(k) if j > 0 else 0
            t1 = at(k_next) if j + 1 < len(bounds) else max(step_ns, at(k_next))
            phases.append({"name": name, "start_ns": t0, "end_ns": t1,
                           "compute_ns": sum(e[5] - e[4] for e in kernels[k:k_next]),
                           "bytes_d2h": 0, "bytes_h2d": 0})
        starts = [p["start_ns"] for p in phases]
        for p in phases:
            p["d2h_busy_ns"] = p["h2d_busy_ns"] = 0
        for e in copies:
            direction = "d2h" if e[0] == 2 else "h2d"
            c0, c1 = e[4] - start, e[5] - start
            j = max(0, bisect.bisect_right(starts, c0) - 1)
            phases[j]["bytes_" + direction] += e[2]  # bytes by the phase the copy starts in
            # Engine time by overlap with each phase's interval (the last phase is open-ended).
            for p in phases[j:]:
                lo, hi = max(c0, p["start_ns"]), min(c1, p["end_ns"]) if p is not phases[-1] else c1
                if p["start_ns"] >= c1:
                    break
                if hi > lo:
                    p[direction + "_busy_ns"] += hi - lo
        ideal = 0
        for p in phases:
            if self.spec["duplex"] == "full":
                transfer = max(p["d2h_busy_ns"], p["h2d_busy_ns"])
            else:
                transfer = p["d2h_busy_ns"] + p["h2d_busy_ns"]
            p["transfer_ns"] = transfer
            p["ideal_ns"] = max(p["compute_ns"], transfer)
            ideal += p["ideal_ns"]
        phases = [p for p in phases if p["end_ns"] > p["start_ns"] or p["compute_ns"] or p["bytes_d2h"] or p["bytes_h2d"]]
        devices = stats.get("devices") or [{}]
        dev = devices[0]
        result = {
            "policy": self.policy,
            "label": self.spec.get("label"),
            "card_bytes": self.spec["card_bytes"],
            "pcie_gbps": self.spec["pcie_gbps"],
            "duplex": self.spec["duplex"],
            "limit_bytes": self.spec["limit_bytes"],
            "horizon": self.spec["horizon"] if self.policy != "none" else None,
            "soft_limit": self.spec["soft_limit"],
            "virtual_time": cu.virtual,
            "status": self.status,
            "error": self.error,
            "error_op": self.error_op,
            "ops_total": len(self.ops),
            "peak_live_bytes": self.peak_live - self.live_base,
            "final_live_bytes": self.live - self.live_base,
            "live_base_bytes": self.live_base,
            "peak_device_bytes": c.peak_physical_bytes,
            "final_device_bytes": c.physical_bytes,
            "peak_reserved_bytes": dev.get("peak_reserved_bytes", stats.get("peak_reserved_bytes")),
            "bytes_d2h": c.bytes_d2h,
            "bytes_h2d": c.bytes_h2d,
            "step_time_ns": step_ns,
            "compute_ns": sum(e[5] - e[4] for e in kernels),
            "stall_ns": sum(e[6] for e in kernels),
            "ideal_ns": ideal,
            "phases": phases,
            "num_evictions": stats.get("num_evictions", 0) - self.stats0.get("num_evictions", 0),
            "num_prefetches": stats.get("num_prefetches", 0) - self.stats0.get("num_prefetches", 0),
            "num_faults": stats.get("num_faults", 0) - self.stats0.get("num_faults", 0),
            "num_late_prefetches": stats.get("num_late_prefetches", 0) - self.stats0.get("num_late_prefetches", 0),
            "num_clean_reuses": stats.get("num_clean_reuses", 0) - self.stats0.get("num_clean_reuses", 0),
            # The planned-eviction engine's counters (0 where the engine has none): the number
            # of steps it ran on a plan (a total), and over the measured step the plans it
            # abandoned and the bytes its plans copied out.
            "num_planned_steps": stats.get("num_planned_steps", 0),
            "num_plan_divergences": stats.get("num_plan_divergences", 0) - self.stats0.get("num_plan_divergences", 0),
            "num_plan_backoffs": stats.get("num_plan_backoffs", 0),
            "planned_bytes_d2h": stats.get("planned_bytes_d2h", 0) - self.stats0.get("planned_bytes_d2h", 0),
            "warmup": int(self.spec.get("warmup") or 0),
            "warmup_steps": self.warmup_steps,
            "error_step": getattr(self, "error_step", None),
            "tagged_waste_bytes": stats.get("tagged_waste_bytes", 0),
            "peak_host_bytes": (stats.get("peak_host_bytes", 0) if self.policy == "vramswap" else self.peak_host),
            "packs": self.counts["packs"],
            "untagged_saves": self.counts["untagged_saves"],
        }
        if self.record:
            stream_names = {compute_stream: "compute"}
            if self.policy == "offload_all":
                stream_names.update({self.d2h: "offload_all D2H", self.h2d: "offload_all H2D"})
            # The other streams are vramswap's engine's: one per direction.
            engine = {1: "vramswap H2D", 2: "vramswap D2H"}
            result["timeline"] = [
                {"kind": KIND_NAMES.get(e[0], "other"),
                 "stream": stream_names.get(e[1]) or engine.get(e[0]) or f"stream {e[1]:#x}",
                 "bytes": e[2], "enqueue_ns": e[3] - start if e[3] >= start else 0,
                 "start_ns": e[4] - start, "end_ns": e[5] - start, "stall_ns": e[6], "label": e[7]}
                for e in timeline if e[4] >= start]
            result["series"] = [(at(k), live - self.live_base, mapped, phys) for k, live, mapped, phys in self.series]
        return result


def _child_main(spec_path, out_path):
    spec = json.loads(Path(spec_path).read_text())
    with open(spec["ops_path"], "rb") as f:
        data = pickle.load(f)
    cuda = _Cuda()
    if not cuda.virtual:
        print("vramswap bench: cudasim has no virtual time (cudasim_virtual_time is missing or "
              "CUDASIM_TIME=virtual was refused); rebuild src/sim", file=sys.stderr)
        return 3
    cuda.check(cuda.rt.cudaSetDevice(0), "cudaSetDevice")
    interp = _Interpreter(cuda, spec, data["ops"], data.get("live_base_bytes", 0))
    interp.execute()
    result = interp.result()
    result["first_step"] = interp.first_step or first_step_figures(result)
    tmp = Path(out_path + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out_path)
    # Skip the libraries' exit handlers (stats file, pool teardown): nothing more to learn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
