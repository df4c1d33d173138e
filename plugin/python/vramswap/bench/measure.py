"""What a benchmark run measures, and the figures derived from its result in the parent: the
steps measured (Note [Warm-up steps]) and the lower bound beside every run (Note [The bound
beside every run]). The runs themselves: runner.py (the parent's job pool) and
interpreter.py (the child that executes a workload).

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
  bytes_d2h/_h2d      the copies the step queued (its timeline)
  bytes_disk_read/    a run with a disk tier: the disk tier's reads and writes the step
  bytes_disk_write    queued (timeline kinds 6 and 7, cudasim's disk engine), beside
                      disk_bytes_written_ahead / disk_bytes_read_ahead (the engine's counts
                      of those made ahead of need or use), host_limit_bytes and disk_gbps
  step_time_ns        virtual time, cudasim_now_ns() after the compute stream is synchronized
                      at the step's end minus at its start (Note [Warm-up steps]): copies the
                      step started for the next one may still run
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
  num_plan_divergences, num_plan_backoffs, num_plan_fetch_moves,
  num_plan_fetch_moves_undone, planned_bytes_d2h   steps run on a plan (a total), plans
                      abandoned, planned steps slower than the reactive policy's, planned
                      fetches moved earlier for landing late and moves undone (totals) and
                      bytes the plans copied out (over the measured step)
  vmm_calls           the measured step's CUDA VMM calls, {create, map, unmap, release}
                      (a map: cuMemMap with its cuMemSetAccess), and vmm_mapped_bytes, the
                      bytes they gave pages to. On a GPU each call costs tens of us whatever
                      it covers (cudasim's CUDASIM_HOST_COSTS=h100 charges them): the
                      remapping a step pays beside its copies

Thread safety: pure functions on values.
"""
import math

# The warm-up steps `vramswap bench` and `vramswap replay` run before the measured step
# (Note [Warm-up steps]); run() and run_many() measure the first step unless told.
DEFAULT_WARMUP = 2

# Copy kinds of cudasim_timeline_entry.kind.
KIND_DISK_READ, KIND_DISK_WRITE = 6, 7
KIND_NAMES = {0: "kernel", 1: "h2d", 2: "d2h", 3: "d2d", 4: "memset", 5: "other",
              KIND_DISK_READ: "disk read", KIND_DISK_WRITE: "disk write"}


class RunError(RuntimeError):
    """A run could not be carried out (a missing library, a child that crashed): not a
    result. An out-of-memory is a result (status "oom"), never this."""


def live_base_bytes(workload):
    """The bytes of the tensors a snapshot workload carries in (allocated before its trace
    began, at the head of the workload); 0 for other workloads."""
    carried = set((workload.meta or {}).get("carried_in", {}).get("tids", ()))
    return sum(op[2] for op in workload.ops if op[0] == "alloc" and op[1] in carried)


# Note [Warm-up steps]
# --------------------
# A training loop runs the same step again and again, and measures a step after the first
# (the allocator's cache warm, and a policy may learn from the steps before). With warmup =
# W, the step (the ops from the first forward phase on, with the allocations of its inputs
# just before it: step_start()) runs W times first, then once more measured. Every step
# ends with the host waiting for the compute stream, as a loop that reads its loss does
# (loss.item() waits for the stream that computed it, not for other streams): copies a step
# started for the next one (a kept tensor's copy out after its last use) run on into it, and
# the next step waits for them only where it needs them. Waiting for the whole device
# instead charged them to the step that started them, and gave the next one an idle copy
# engine no loop has: the AdamW-state step at 90% of its peak measured 35.9 ms with its
# state's copies out started at their last use, 13 ms of them after its last kernel. Before
# the measured step cudasim's counters and timeline and vramswap's peaks are reset, and every
# figure of the result is that step's (copies queued before it are not in its timeline). The first step's figures (from the start of the run,
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
                   "planned_bytes_d2h", "vmm_calls", "vmm_mapped_bytes")


def first_step_figures(result):
    """The figures of a result kept as its "first_step" (Note [Warm-up steps])."""
    return {k: result.get(k) for k in FIRST_STEP_KEYS}


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
#   bound_disk_ns      a run with a disk tier (disk_gbps, behind a pinned tier of
#                      host_limit_bytes): the disk's floor, the least bytes the disk must
#                      move in the step (bound.disk_traffic, Note [The disk's floor]) at
#                      disk_gbps. The bound is the larger of the link's bound and this floor
#                      (the disk's time may overlap compute and copies, so it does not add to
#                      them).
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


def _disk_traffic(workload, cache, limit, host, first_op):
    from . import bound
    key = ("disk", limit, host, first_op)
    if key not in cache:
        cache[key] = bound.disk_traffic(workload, limit, host, first_op=first_op)
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

    def with_disk(b, first_op):
        """b's bound, raised to the disk's floor for a run with a disk tier; and the floor."""
        if not result.get("disk_gbps") or b.bound_ns is None:
            return b.bound_ns, None
        traffic = _disk_traffic(workload, cache, limit, int(result["host_limit_bytes"]), first_op)
        floor = math.ceil(traffic / float(result["disk_gbps"]))
        return max(b.bound_ns, floor), floor

    bound_ns, disk_floor = with_disk(b, start or 0)
    if disk_floor is not None:
        result["bound_disk_ns"] = disk_floor
    result.update({
        "bound_ns": bound_ns, "must_leave_bytes": b.must_leave_bytes, "must_leave_at_ns": b.must_leave_at_ns,
        "bound_d2h_stall_ns": b.d2h_stall_ns, "bound_h2d_stall_ns": b.h2d_stall_ns,
        "bound_both_stall_ns": b.both_stall_ns,
        "step/bound": _ratio(result.get("step_time_ns"), bound_ns) if ok else None,
        "d2h/must_leave": _ratio(result.get("bytes_d2h"), b.must_leave_bytes) if ok else None,
    })
    if b.note:
        result["bound_note"] = b.note
    first = result.get("first_step")
    if first is not None:
        fb = b if not start else _bound(workload, cache, limit, pcie, duplex, 0)
        first["bound_ns"] = with_disk(fb, 0)[0]
        first["step/bound"] = _ratio(first.get("step_time_ns"), first["bound_ns"]) if first.get("status") == "ok" else None
    if result.get("warmup", 0) and not result.get("warmup_steps"):
        what = "snapshot" if (workload.meta or {}).get("snapshot") or (workload.meta or {}).get("carried_in") \
            else "workload"
        result["warmup_note"] = f"first step only: the {what} cannot be repeated as a step, because {why}"
    return result
