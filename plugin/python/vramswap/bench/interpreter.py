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

and the saved-tensor ops (save, cold, use, release) as the run's policy does them, one
module each: "none" (policy_none.py: vramswap's pool with no offload scope, the no-offload
peak), "vramswap" (policy_vramswap.py: what vramswap.offload() does, the tracker protocol)
and "offload_all" (policy_offload_all.py, Note [offload_all]: what save_on_cpu and
hook-based offloaders do, given copy streams of their own). Device memory comes from
vramswap's pool under every policy, so the peaks of the three are measured by one
allocator.

Thread safety: one interpreter per process, used from one thread.
"""
import bisect
import ctypes
import json
import os
import pickle
import sys
from pathlib import Path

from .measure import KIND_DISK_READ, KIND_DISK_WRITE, KIND_NAMES, RunError, first_step_figures, step_start
from .policy_none import NonePolicy
from .policy_offload_all import OffloadAllPolicy
from .policy_vramswap import VramswapPolicy

POLICIES = {"none": NonePolicy, "vramswap": VramswapPolicy, "offload_all": OffloadAllPolicy}

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
        # cudasim's own calls (counters, virtual time, timeline) are its libcuda.so.1's, in the
        # link-map namespace _lib loaded cudasim into (_lib's Note [cudasim in a namespace of
        # its own]). Loading the file again here would map a second cudasim, one that no
        # allocation or copy of the run goes through, whose calls fail or count nothing. The
        # runtime needs that driver (DT_NEEDED), and dlsym through a handle searches the
        # object and then its dependencies: the names resolve in the driver the runs use.
        self.drv = ctypes.CDLL(str(_lib.cudasim_dir() / "libcuda.so.1"), handle=self.rt._handle)
        vp, i, sz, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
        for name, res, args in (
                ("cudaStreamCreateWithFlags", i, [ctypes.POINTER(vp), ctypes.c_uint]),
                ("cudaEventCreateWithFlags", i, [ctypes.POINTER(vp), ctypes.c_uint]),
                ("cudaEventRecord", i, [vp, vp]),
                ("cudaStreamWaitEvent", i, [vp, vp, ctypes.c_uint]),
                ("cudaMemcpyAsync", i, [vp, vp, sz, i, vp]),
                ("cudaHostAlloc", i, [ctypes.POINTER(vp), sz, ctypes.c_uint]),
                ("cudaDeviceSynchronize", i, []),
                ("cudaStreamSynchronize", i, [vp]),
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
        self.pol = POLICIES[self.policy](self)
        # The timeline as drained so far, and the compute stream's position in it.
        self.entries = []
        self.tail_ns = 0
        self.last_copy_end = 0

    # -- the loop -------------------------------------------------------------------
    def execute(self):
        cu = self.cu
        self.compute = cu.stream()
        self.pol.start()
        track = self.record
        segments, measured = self._segments()
        self.first_step = None
        self.error_step = None
        self._begin_measurement()  # the first step is measured from the start
        for n, (first, last) in enumerate(segments):
            if n >= 2:  # a repeat of the step: measured afresh (the last one is the result)
                self._begin_measurement()
            if not self._run_segment(first, last, track):
                self.error_step = max(1, n)
                break
            if n > 0 and n < len(segments) - 1:
                self._end_step(n)
        cu.check(cu.rt.cudaStreamSynchronize(self.compute), "cudaStreamSynchronize")
        self.end_ns = cu.now()
        # Copies still running are the next step's (Note [Warm-up steps]); the run waits for
        # them only to end cleanly.
        self.pol.finish()
        cu.check(cu.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def _end_step(self, n):
        """A warm-up step ended: the host waits for the compute stream (a training loop that
        reads its loss does), and after the first step its figures are kept (Note [Warm-up
        steps])."""
        cu = self.cu
        self.pol.quiesce()
        cu.check(cu.rt.cudaStreamSynchronize(self.compute), "cudaStreamSynchronize")
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
        """Starts measuring here: the compute stream idle (copies the step before started may
        still run, as in a training loop), cudasim's counters and timeline and vramswap's
        peaks reset, its counters noted (the result reports their deltas)."""
        cu = self.cu
        self.pol.quiesce()
        cu.check(cu.rt.cudaStreamSynchronize(self.compute), "cudaStreamSynchronize")
        self.drain()
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
        self.pol.begin_measurement()
        self.counts = {"packs": 0, "untagged_saves": 0}

    def _run_segment(self, first, last, track):
        """Runs ops[first:last]; False when the run ended (out of memory)."""
        cu, s, pol = self.cu, self.compute, self.pol
        kernel = cu.drv.cudasim_kernel
        saved_ops = ("save", "cold", "use", "release") if pol.handles_saved else ()
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
                p = pol.malloc(n, tid)
                if not p:
                    self.oom(i, f"alloc of tensor {tid} ({n} bytes)")
                    return False
                self.ptr[tid] = p
                self.size[tid] = n
                self.live += n
                if self.live > self.peak_live:
                    self.peak_live = self.live
            elif kind == "free":
                tid = op[1]
                self.live -= self.size[tid]
                pol.free(tid)
                del self.size[tid]
                del self.ptr[tid]
            elif kind == "phase":
                self._phase(op[1])
                continue
            elif kind == "sync":
                cu.check(cu.rt.cudaStreamSynchronize(s), "cudaStreamSynchronize")
                continue
            elif kind in ("keep", "kuse", "kdone"):
                if pol.handles_kept and not pol.kept(i, op):
                    return False
            elif kind in saved_ops:
                if not pol.saved(i, kind, op[1]):
                    return False
            elif kind in ("save", "cold", "use", "release"):
                continue  # a policy with no saved-tensor ops
            else:
                raise RunError(f"op {i}: unknown kind {kind!r}")
            if track:
                c = cu.counters()
                self.series.append((self.kernels, self.live, c.mapped_bytes, c.physical_bytes))
        return True

    def oom(self, i, what):
        """The run ends out of memory at op `i`."""
        self.status = "oom"
        self.error_op = i
        from .. import _lib
        self.error = f"op {i}: {what}: {_lib.last_error() or 'refused'}"

    def _phase(self, name):
        self.phases.append((name, self.kernels))
        self.pol.phase(name)

    def drain(self):
        """Reads the timeline cudasim recorded since the last call: the compute stream's
        position (tail_ns) and the end of the last copy queued (last_copy_end)."""
        new = self.cu.drain_timeline()
        for e in new:
            if e[0] == 0 and e[1] == self.compute:
                self.tail_ns = max(self.tail_ns, e[5])
            elif e[0] == 2:
                self.last_copy_end = e[5]
        self.entries.extend(new)

    # -- the result -----------------------------------------------------------------
    def result(self):
        cu = self.cu
        c = cu.counters()
        stats = _stats_json(self.vs)
        self.drain()
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
                lo, hi = max(c0, p["start_ns"]), min(c1, p["end_ns"])
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

        def delta(key):  # a counter's growth over the measured step
            return stats.get(key, 0) - self.stats0.get(key, 0)

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
            # The copies the step queued (its timeline), not cudasim's counters: those count a
            # copy when a worker runs it, and the step before may leave copies running.
            "bytes_d2h": sum(e[2] for e in copies if e[0] == 2),
            "bytes_h2d": sum(e[2] for e in copies if e[0] == 1),
            # The disk tier's reads and writes the step queued (cudasim's disk engine).
            "bytes_disk_read": sum(e[2] for e in timeline if e[0] == KIND_DISK_READ),
            "bytes_disk_write": sum(e[2] for e in timeline if e[0] == KIND_DISK_WRITE),
            # The engine's counts of the same (the step's): how much went ahead of need or use.
            "disk_bytes_written_ahead": delta("disk_bytes_written_ahead"),
            "disk_bytes_read_ahead": delta("disk_bytes_read_ahead"),
            "host_limit_bytes": self.spec["host_limit_bytes"],
            "disk_gbps": self.spec.get("disk_gbps"),
            "step_time_ns": step_ns,
            "compute_ns": sum(e[5] - e[4] for e in kernels),
            "stall_ns": sum(e[6] for e in kernels),
            "ideal_ns": ideal,
            "phases": phases,
            "num_evictions": delta("num_evictions"),
            "num_prefetches": delta("num_prefetches"),
            "num_faults": delta("num_faults"),
            "num_late_prefetches": delta("num_late_prefetches"),
            "num_clean_reuses": delta("num_clean_reuses"),
            # The planned-eviction engine's counters (0 where the engine has none): the number
            # of steps it ran on a plan (a total), and over the measured step the plans it
            # abandoned and the bytes its plans copied out.
            "num_planned_steps": stats.get("num_planned_steps", 0),
            "num_plan_divergences": delta("num_plan_divergences"),
            "num_plan_backoffs": stats.get("num_plan_backoffs", 0),
            "num_plan_fetch_moves": stats.get("num_plan_fetch_moves", 0),
            "num_plan_fetch_moves_undone": stats.get("num_plan_fetch_moves_undone", 0),
            "planned_bytes_d2h": delta("planned_bytes_d2h"),
            # The VMM calls the measured step made (each costs the same on a GPU whatever it
            # covers: CUDASIM_HOST_COSTS=h100 charges them), and the bytes they gave pages to.
            "vmm_calls": {k: delta(f"host_vmm_{k}_calls") for k in ("create", "map", "unmap", "release")},
            "vmm_mapped_bytes": delta("host_vmm_mapped_bytes"),
            "warmup": int(self.spec.get("warmup") or 0),
            "warmup_steps": self.warmup_steps,
            "error_step": getattr(self, "error_step", None),
            "tagged_waste_bytes": stats.get("tagged_waste_bytes", 0),
            # The most bytes tagged blocks held beyond their sizes in the measured step (their
            # rounding to whole granules while placing for eviction): memory the bound does
            # not count, which the plan must move out instead (DESIGN.md, after Note [Disk time]).
            "peak_tagged_waste_bytes": stats.get("peak_tagged_waste_bytes", 0),
            "peak_host_bytes": self.pol.peak_host_bytes(stats),
            "packs": self.counts["packs"],
            "untagged_saves": self.counts["untagged_saves"],
        }
        if self.record:
            stream_names = {compute_stream: "compute", **self.pol.stream_names()}
            # The other streams are vramswap's engine's: one per direction, and the disk
            # tier's (reads, writes).
            engine = {1: "vramswap H2D", 2: "vramswap D2H", KIND_DISK_READ: "vramswap disk reads",
                      KIND_DISK_WRITE: "vramswap disk writes"}
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
