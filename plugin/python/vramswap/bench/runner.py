"""Runs a Workload against one allocator policy on cudasim in virtual time.

Note [One child process per run]
--------------------------------
libvramswap.so and cudasim load once per process, and vramswap's limit, horizon and soft
limit are fixed when its first allocation creates the device pool; cudasim reads its
CUDASIM_* settings once too. So every run (one workload under one policy and one
configuration) executes in a fresh `python3` child process whose environment carries the
whole configuration. The parent pickles the workload's ops to a file once, starts the
children (run_many keeps `workers` of them busy), and reads each child's result back as
JSON. The parent never loads either library, so it can run any number of configurations.

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
                copy streams of their own (see Note [offload_all] below).

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

Note [What is measured]
-----------------------
  peak_device_bytes   cudasim's peak_physical_bytes (device memory the pool mapped), reset
                      after setup: what the card would have to hold. vramswap's own
                      peak_reserved_bytes is reported beside it.
  peak_live_bytes /   the sums of requested sizes of live tensors, highest and at the end,
  final_live_bytes    counted from the workload's start as a trace's own figures are: the
                      tensors a snapshot carries in from before recording began
                      (meta["carried_in"], snapshot.py's Note [Carried-in tensors]) are the
                      base, live_base_bytes, subtracted from both. For generated workloads
                      the base is 0 and these are Workload.live_bytes().
  bytes_d2h/_h2d      cudasim's copy counters
  step_time_ns        virtual time, cudasim_now_ns() after cudaDeviceSynchronize minus at
                      the start
  stall_ns            the sum of the kernels' stall_ns in cudasim's timeline: time a kernel
                      that was ready in stream order waited for an event (a prefetch or a
                      fetch that was not done)
  ideal_ns            per phase (the ops between two "phase" ops, as the compute engine runs
                      them: a phase starts when the last kernel of the one before ends), the
                      larger of the phase's compute time and its copies' time at the PCIe rate
                      (each direction's engine time, the larger of the two with a full-duplex
                      link, their sum when shared), summed over phases. A copy counts in each
                      phase by the part of its engine time that falls inside the phase (a copy
                      that starts in forward and ends in backward counts in both): with a copy
                      charged wholly to the phase it starts in, the sum is not a bound (copies
                      that run on past a boundary made it exceed the step). Every phase lasts
                      at least its compute and its copy engines' busy time, so ideal <= step,
                      with equality when in every phase the compute engine or a copy engine
                      is busy throughout: step/ideal is the time lost to neither.
                      (phases[].bytes_d2h/_h2d: the bytes of the copies that start in it.)
  series              after each alloc, free and saved-tensor op: (time, live bytes, mapped
                      bytes, physical bytes): the time is the compute stream's position (the
                      end of the last kernel queued before the op), in virtual ns from the
                      start; mapped: device memory mapped under the pool's addresses now
                      (tensors and the pool's cache; an evicted block's pages are unmapped);
                      physical: device memory the pool holds (mapped and spare pages)
  timeline            cudasim's timeline entries (kernels and copies) of the run
  warmup, warmup_steps the warm-up steps asked for and run (Note [Warm-up steps]);
  first_step          the first step's figures, from the same run; warmup_note, when the
                      workload could not be repeated as a step, says why
  error_step          the step (1: the first) in which the run ran out of memory; the
                      figures are then that step's, up to the op that failed
  bound_ns, ...       the policy-independent lower bound and its ratios (Note [The bound
                      beside every run])
  num_planned_steps,  the planned-eviction engine's counters (0 where its stats lack them):
  num_plan_divergences, num_plan_backoffs, planned_bytes_d2h   steps run on a plan (a
                      total), plans abandoned, planned steps slower than the reactive
                      policy's (totals) and bytes the plans copied out (over the measured step)

Thread safety: run() and run_many() may be called from any thread; each child is a process
of its own.
"""
import bisect
import ctypes
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICIES = ("none", "vramswap", "offload_all")
# The warm-up steps `vramswap bench` and `vramswap replay` run before the measured step
# (Note [Warm-up steps]); run() and run_many() measure the first step unless told.
DEFAULT_WARMUP = 2
DUPLEX = ("full", "shared")
GiB = 1 << 30

# Copy kinds of cudasim_timeline_entry.kind.
KIND_NAMES = {0: "kernel", 1: "h2d", 2: "d2h", 3: "d2d", 4: "memset", 5: "other"}

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # plugin/python


class RunError(RuntimeError):
    """A run could not be carried out (a missing library, a child that crashed): not a
    result. An out-of-memory is a result (status "oom"), never this."""


# ---- the parent side ---------------------------------------------------------------------

def _spec(policy, card_bytes, pcie_gbps, limit_bytes=None, horizon=4, soft_limit=None,
          duplex="full", hbm_gbps=None, min_offload_bytes=None, host_limit_bytes=None,
          record=True, label=None, warmup=0):
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if duplex not in DUPLEX:
        raise ValueError(f"duplex must be one of {', '.join(DUPLEX)}, not {duplex!r}")
    if int(card_bytes) < (64 << 20):
        raise ValueError(f"card_bytes {card_bytes} is below cudasim's smallest card (64 MiB)")
    if not pcie_gbps or float(pcie_gbps) <= 0:
        raise ValueError(f"pcie_gbps must be positive, not {pcie_gbps!r}")
    if horizon is None or int(horizon) < 0:
        raise ValueError(f"horizon must be a non-negative integer, not {horizon!r}")
    if limit_bytes is not None and int(limit_bytes) <= 0:
        raise ValueError(f"limit_bytes must be positive, not {limit_bytes!r}")
    if warmup is None or int(warmup) < 0:
        raise ValueError(f"warmup must be a non-negative integer, not {warmup!r}")
    return {
        "policy": policy, "card_bytes": int(card_bytes), "pcie_gbps": float(pcie_gbps),
        "limit_bytes": None if limit_bytes is None else int(limit_bytes),
        "horizon": int(horizon), "soft_limit": soft_limit, "duplex": duplex,
        "hbm_gbps": hbm_gbps, "min_offload_bytes": min_offload_bytes,
        # Unbacked pinned memory costs nothing; the tier must never be what stops a run.
        "host_limit_bytes": int(host_limit_bytes or max(4 * int(card_bytes), 64 * GiB)),
        "record": bool(record), "label": label, "warmup": int(warmup),
    }


def _child_env(spec):
    env = dict(os.environ)
    # A parent with the CPU-emulation mode switched on must not make the child import torch.
    env.pop("VRAMSWAP_TORCH_DEVICE", None)
    for key in [k for k in env if k.startswith("CUDASIM_") or k.startswith("VRAMSWAP_")]:
        if key not in ("VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR"):
            del env[key]
    env["PYTHONPATH"] = str(_PACKAGE_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({
        "CUDASIM_TIME": "virtual",
        "CUDASIM_UNBACKED": "1",
        "CUDASIM_DEVICE_MEMORY": str(spec["card_bytes"]),
        "CUDASIM_PCIE_GBPS": repr(spec["pcie_gbps"]),
        "CUDASIM_PCIE_DUPLEX": spec["duplex"],
        "VRAMSWAP_HOST_LIMIT": str(spec["host_limit_bytes"]),
        "VRAMSWAP_HORIZON": str(spec["horizon"]),
        "VRAMSWAP_LOG": "error",
    })
    if spec["hbm_gbps"]:
        env["CUDASIM_HBM_GBPS"] = repr(float(spec["hbm_gbps"]))
    if spec["limit_bytes"]:
        env["VRAMSWAP_LIMIT"] = str(spec["limit_bytes"])
    if spec["soft_limit"] is not None:
        env["VRAMSWAP_SOFT_LIMIT"] = str(spec["soft_limit"])
    if spec["min_offload_bytes"] is not None:
        env["VRAMSWAP_MIN_OFFLOAD_BYTES"] = str(spec["min_offload_bytes"])
    return env


class _Job:
    """One child process: start() launches it, poll() says whether it ended (killing it
    past its time limit), finish() reads its result."""

    def __init__(self, ops_path, spec, workdir, index, timeout_s):
        self.spec = spec
        self.spec_path = Path(workdir) / f"spec{index}.json"
        self.out_path = Path(workdir) / f"result{index}.json"
        self.err_path = Path(workdir) / f"stderr{index}.txt"
        self.timeout_s = timeout_s
        self.timed_out = False
        self.spec_path.write_text(json.dumps({"ops_path": str(ops_path), **spec}))
        self.proc = self.err = None

    def start(self):
        code = ("import sys; from vramswap.bench.runner import _child_main; "
                "sys.exit(_child_main(sys.argv[1], sys.argv[2]))")
        self.err = open(self.err_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.spec_path), str(self.out_path)],
                                     env=_child_env(self.spec), stdin=subprocess.DEVNULL,
                                     stdout=self.err, stderr=self.err)
        self.started = time.monotonic()

    def poll(self):
        if self.proc.poll() is not None:
            return True
        if time.monotonic() - self.started > self.timeout_s:
            self.timed_out = True
            self.stop()
            return True
        return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()

    def finish(self):
        self.err.close()
        stderr = self.err_path.read_text(errors="replace")
        if self.proc.returncode == 0 and self.out_path.exists():
            result = json.loads(self.out_path.read_text())
            result["wall_s"] = round(time.monotonic() - self.started, 3)
            if stderr.strip():
                result["stderr_tail"] = stderr[-2000:]
            return result
        what = (f"timed out after {self.timeout_s} s" if self.timed_out
                else f"exited with status {self.proc.returncode}")
        raise RunError(f"the {self.spec['policy']} run (limit {self.spec['limit_bytes']}, horizon "
                       f"{self.spec['horizon']}) {what}; its output ends:\n{stderr[-3000:]}")


def live_base_bytes(workload):
    """The bytes of the tensors a snapshot workload carries in (allocated before its trace
    began, at the head of the workload); 0 for other workloads."""
    carried = set((workload.meta or {}).get("carried_in", {}).get("tids", ()))
    return sum(op[2] for op in workload.ops if op[0] == "alloc" and op[1] in carried)


def _dump_ops(workload, workdir):
    path = Path(workdir) / "ops.pickle"
    with open(path, "wb") as f:
        pickle.dump({"name": workload.name, "ops": workload.ops, "live_base_bytes": live_base_bytes(workload)},
                    f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def run_many(workload, specs, workers=2, timeout_s=600, on_result=None):
    """Runs `workload` once per entry of `specs` (dicts of run()'s keyword arguments, with
    "policy", "card_bytes" and "pcie_gbps"), `workers` child processes at a time, and returns
    the results in the order of `specs`. on_result(index, result) is called as each one
    ends. Raises RunError when a child fails (not for an out-of-memory, which is a result)."""
    specs = [_spec(**s) for s in specs]
    results = [None] * len(specs)
    bounds = {}  # the runs' lower bounds, computed once per limit and link
    with tempfile.TemporaryDirectory(prefix="vramswap-bench-") as workdir:
        ops_path = _dump_ops(workload, workdir)
        queue = [(i, _Job(ops_path, s, workdir, i, timeout_s)) for i, s in enumerate(specs)]
        running = []
        try:
            while queue or running:
                while queue and len(running) < max(1, workers):
                    i, job = queue.pop(0)
                    job.start()
                    running.append((i, job))
                for i, job in [(i, j) for i, j in running if j.poll()]:
                    running.remove((i, job))
                    result = job.finish()
                    result["workload"] = workload.name
                    add_bound(result, workload, bounds)
                    results[i] = result
                    if on_result:
                        on_result(i, result)
                if running:
                    time.sleep(0.005)
        finally:
            for _, job in running:
                job.stop()
    return results


# Note [The bound beside every run]
# ---------------------------------
# Every result carries the policy-independent lower bound on its step time (bound.py, Note
# [The fluid relaxation]), computed in the parent from the workload, the run's limit (its
# limit_bytes, or the card when it has none), PCIe rate and duplex, with no allocator
# overhead (perfect packing), over the step the run measured (with warm-up steps: the
# repeated step, its setup live but not timed; otherwise the whole workload):
#   bound_ns           the bound, None when no policy can fit the limit (bound_note says
#                      where the working set exceeds it)
#   must_leave_bytes   the most bytes that must be off the device at one moment (max X),
#   must_leave_at_ns   and when (the step's compute clock)
#   bound_d2h_stall_ns / bound_h2d_stall_ns / bound_both_stall_ns   its parts
#   step/bound         step_time_ns / bound_ns (a completed run with a bound)
#   d2h/must_leave     bytes_d2h / must_leave_bytes (a completed run; None when nothing must
#                      leave)
# result["first_step"] gets its own bound_ns and step/bound (the whole workload from the
# start: the first step's setup is part of its time).
# Where the run measured the first step although warm-up steps were asked for, warmup_note
# says why the workload cannot be repeated as a step.

def _bound(workload, cache, limit, pcie, duplex, first_op):
    from . import bound
    key = (limit, pcie, duplex, first_op)
    if key not in cache:
        cache[key] = bound.lower_bound(workload, limit, pcie, duplex=duplex, first_op=first_op)
    return cache[key]


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def add_bound(result, workload, cache=None):
    """Adds the bound's keys (Note [The bound beside every run]) to `result`, a run of
    `workload`; `cache` (a dict) shares the bounds between runs of one workload."""
    cache = {} if cache is None else cache
    limit = result.get("limit_bytes") or result["card_bytes"]
    pcie, duplex = result["pcie_gbps"], result.get("duplex", "full")
    step, why = step_start(workload.ops)
    start = step if result.get("warmup_steps") else 0
    b = _bound(workload, cache, limit, pcie, duplex, start or 0)
    ok = result.get("status") == "ok"
    result.update({
        "bound_ns": b.bound_ns, "must_leave_bytes": b.must_leave_bytes, "must_leave_at_ns": b.must_leave_at_ns,
        "bound_d2h_stall_ns": b.d2h_stall_ns, "bound_h2d_stall_ns": b.h2d_stall_ns,
        "bound_both_stall_ns": b.both_stall_ns,
        "step/bound": _ratio(result.get("step_time_ns"), b.bound_ns) if ok else None,
        "d2h/must_leave": _ratio(result.get("bytes_d2h"), b.must_leave_bytes) if ok else None,
    })
    if b.note:
        result["bound_note"] = b.note
    first = result.get("first_step")
    if first is not None:
        fb = b if not start else _bound(workload, cache, limit, pcie, duplex, 0)
        first["bound_ns"] = fb.bound_ns
        first["step/bound"] = _ratio(first.get("step_time_ns"), fb.bound_ns) if first.get("status") == "ok" else None
    if result.get("warmup", 0) and not result.get("warmup_steps"):
        what = "snapshot" if (workload.meta or {}).get("snapshot") or (workload.meta or {}).get("carried_in") \
            else "workload"
        result["warmup_note"] = f"first step only: the {what} cannot be repeated as a step, because {why}"
    return result


def run(workload, policy, card_bytes, pcie_gbps, timeout_s=600, **options):
    """Executes `workload` under `policy` ("none", "vramswap" or "offload_all") on a cudasim
    card of `card_bytes` with a PCIe link of `pcie_gbps` GB/s per direction, in a child
    process, and returns the result dict (see Note [What is measured]). Options:
    limit_bytes (VRAMSWAP_LIMIT: the pool's cap, for every policy; vramswap evicts to stay
    under it, the others run out of memory at it), horizon (VRAMSWAP_HORIZON; offload_all's
    prefetch depth), soft_limit (VRAMSWAP_SOFT_LIMIT, a size or a percentage), duplex
    ("full" or "shared"), hbm_gbps, min_offload_bytes, host_limit_bytes, record (keep the
    timeline and the memory series), label, warmup (steps run before the measured one: see
    Note [Warm-up steps]). Raises ValueError for a bad argument, RunError
    when the child fails."""
    spec = dict(options, policy=policy, card_bytes=card_bytes, pcie_gbps=pcie_gbps)
    return run_many(workload, [spec], workers=1, timeout_s=timeout_s)[0]


# Note [Warm-up steps]
# --------------------
# A training loop runs the same step again and again, and measures a step after the first
# (the allocator's cache warm, and a policy may learn from the steps before). With warmup =
# W, the step (the ops from the first forward phase on, with the allocations of its inputs
# just before it: step_start()) runs W times first, then once more measured. Every step
# ends with the host waiting for the device (as a loop that reads its loss does); before
# the measured one cudasim's counters and timeline and vramswap's peaks are reset, and every
# figure of the result is that step's. The first step's figures (from the start of the run,
# the setup ops included, to the end of the first step) are kept as the first step ends and
# reported as result["first_step"] (first_step_figures()): one run gives both, and with
# warmup 0 they are the result's own. Only a step that frees everything it allocates, and
# frees nothing allocated before it, can be repeated; otherwise the run measures the first
# step ("warmup_steps": 0) and the result says why ("warmup_note"), as for snapshot replays
# whose carried-in tensors the step frees.

def step_start(ops):
    """-> (index of the op where the repeatable step starts, None) or (None, why the ops
    cannot be repeated as a step): Note [Warm-up steps]."""
    start = next((i for i, op in enumerate(ops) if op[0] == "phase" and op[1] == "forward"), None)
    if start is None:
        return None, "it has no forward phase"
    freed = {op[1] for op in ops[start:] if op[0] == "free"}
    while start > 0 and ops[start - 1][0] == "alloc" and ops[start - 1][1] in freed:
        start -= 1
    before = {op[1] for op in ops[:start] if op[0] == "alloc"}
    inside = {}
    for op in ops[start:]:
        if op[0] == "alloc":
            inside[op[1]] = op[2]
        elif op[0] == "free":
            if op[1] in before:
                return None, (f"the step frees tensor {op[1]!r}, which was allocated before it (a tensor "
                              "live before the step began), so a second step would free it again")
            inside.pop(op[1], None)
    if inside:
        tid = next(iter(inside))
        return None, (f"{len(inside)} tensor(s) the step allocates ({sum(inside.values()):,} B; the first is "
                      f"tensor {tid!r}) are still live at its end, so each repeat would add them again")
    return start, None


FIRST_STEP_KEYS = ("status", "step_time_ns", "compute_ns", "stall_ns", "ideal_ns", "bytes_d2h", "bytes_h2d",
                   "peak_device_bytes", "peak_live_bytes", "num_evictions", "num_prefetches", "num_faults",
                   "num_late_prefetches", "num_planned_steps", "num_plan_divergences", "num_plan_backoffs",
                   "planned_bytes_d2h")


def first_step_figures(result):
    """The figures of a result kept as its "first_step" (Note [Warm-up steps])."""
    return {k: result.get(k) for k in FIRST_STEP_KEYS}


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
        cu, vs, s = self.cu, self.vs, self.compute
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

        rate = self.spec["pcie_gbps"]  # GB/s = bytes per ns
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
