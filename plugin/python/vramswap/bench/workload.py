"""The workload format every benchmark source produces and the runner consumes.

A Workload is one training step (or a replayed trace) as a flat list of operations on
tensor ids, in host program order. Sources: snapshot.py (torch.cuda.memory._dump_snapshot
pickles), gpt.py (GPT-style steps from shapes), vgg.py (VGG-16). The runner (runner.py)
executes it against an allocator policy on cudasim in virtual time.

Operations (tuples; the first element is the kind):
  ("alloc", tid, nbytes)   a tensor is created on the device (nbytes > 0, requested size)
  ("free", tid)            the tensor's last reference is gone (its memory may be reused
                           once the compute stream has passed this point)
  ("compute", ns, label)   GPU work on the compute stream that takes ns nanoseconds (a
                           kernel or a fused group of them); label names it for traces
  ("save", tid)            autograd saved the tensor for backward (the pack hook ran)
  ("cold", tid)            only autograd's saved reference holds the tensor now (the
                           forward dropped its own); from here it may be offloaded
  ("use", tid)             backward is about to read the saved tensor (the unpack hook)
  ("release", tid)         backward is done with the saved tensor (autograd dropped it);
                           a "free" of the tensor follows, now or later
  ("phase", name)          a phase starts: "forward", "backward", "optimizer" or "other"
  ("sync",)                the host waits for the compute stream's work so far (as
                           loss.item() or a check of a value on the device does): nothing
                           it queues after can start before that work ends
  ("keep", tid, frozen)    the tensor is kept (vramswap_keep): used again in every step
                           outside backward's saves, a frozen weight (frozen True: its
                           contents never change) or optimizer state (False); it may be
                           off the device between its uses once a first "kdone" ended one
  ("kuse", tid)            a use of a kept tensor begins (vramswap_use; the optimizer's,
                           or a forward's: a frozen layer's weight cast)
  ("kdone", tid)           that use ends (vramswap_mark_cold)

Rules (validate() checks them): a tid is allocated once and freed at most once, and not
used after its free; save/cold/use/release only between its alloc and free, in the order
save < cold <= use < release (cold, use and release each optional, cold at most once; a
tensor may be saved once); tensors never freed are live at the end (final_live_bytes). A
tensor is kept at most once, between its alloc and free; its kuse and kdone alternate, from a
kuse, and it is not freed in use. A kept tensor may also be saved (autograd saving a frozen
weight): between its last kdone and its next kuse, backward's use of it goes through
save/use/release.
An "alloc" inside a "forward" phase of a tensor that is later saved is what vramswap would
tag inside an offload scope.

Thread safety: plain data; build it on one thread.
"""
from dataclasses import dataclass, field

PHASES = ("forward", "backward", "optimizer", "other")
KINDS = ("alloc", "free", "compute", "save", "cold", "use", "release", "phase", "sync", "keep", "kuse", "kdone")


class WorkloadError(ValueError):
    """A workload breaks the format's rules; the message names the op index and tid."""


@dataclass
class Workload:
    name: str
    ops: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # source facts: model shape, trace file, ...

    # -- building -------------------------------------------------------------------
    def alloc(self, tid, nbytes):
        self.ops.append(("alloc", tid, int(nbytes)))

    def free(self, tid):
        self.ops.append(("free", tid))

    def compute(self, ns, label=""):
        self.ops.append(("compute", int(ns), label))

    def save(self, tid):
        self.ops.append(("save", tid))

    def cold(self, tid):
        self.ops.append(("cold", tid))

    def use(self, tid):
        self.ops.append(("use", tid))

    def release(self, tid):
        self.ops.append(("release", tid))

    def sync(self):
        self.ops.append(("sync",))

    def keep(self, tid, frozen):
        self.ops.append(("keep", tid, bool(frozen)))

    def kuse(self, tid):
        self.ops.append(("kuse", tid))

    def kdone(self, tid):
        self.ops.append(("kdone", tid))

    def phase(self, name):
        if name not in PHASES:
            raise WorkloadError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        self.ops.append(("phase", name))

    # -- facts ----------------------------------------------------------------------
    def live_bytes(self):
        """-> (peak_live_bytes, final_live_bytes): the sum of requested sizes of tensors
        allocated and not yet freed, at its highest and at the end (what a replay of
        alloc/free events reports, before any allocator rounding)."""
        sizes = {}
        live = peak = 0
        for op in self.ops:
            if op[0] == "alloc":
                sizes[op[1]] = op[2]
                live += op[2]
                peak = max(peak, live)
            elif op[0] == "free":
                live -= sizes.pop(op[1])
        return peak, live

    def compute_ns(self, phase=None):
        """Total compute time, of one phase or of all."""
        total, current = 0, "other"
        for op in self.ops:
            if op[0] == "phase":
                current = op[1]
            elif op[0] == "compute" and (phase is None or current == phase):
                total += op[1]
        return total

    def saved_bytes(self):
        """Bytes of distinct tensors saved for backward."""
        sizes, saved = {}, set()
        for op in self.ops:
            if op[0] == "alloc":
                sizes[op[1]] = op[2]
            elif op[0] == "save":
                saved.add(op[1])
        return sum(sizes[t] for t in saved)

    def saved_bytes_by_phase(self):
        """phase -> bytes of the tensors saved for backward during it (each tensor is saved
        once, so the phases' sums add up to saved_bytes())."""
        sizes, phase = {}, "other"
        by_phase = {p: 0 for p in PHASES}
        for op in self.ops:
            if op[0] == "phase":
                phase = op[1]
            elif op[0] == "alloc":
                sizes[op[1]] = op[2]
            elif op[0] == "save":
                by_phase[phase] += sizes[op[1]]
        return by_phase

    def validate(self):
        """Raises WorkloadError at the first op that breaks the rules; returns self."""
        state = {}  # tid -> "live" | "freed"
        saved = {}  # tid -> stage reached: save, cold, use, release
        kept = {}   # tid -> in use (between kuse and kdone)
        order = {"save": 0, "cold": 1, "use": 2, "release": 3}
        for i, op in enumerate(self.ops):
            kind = op[0]
            if kind not in KINDS:
                raise WorkloadError(f"op {i}: unknown kind {kind!r}")
            if kind == "compute":
                if op[1] < 0:
                    raise WorkloadError(f"op {i}: negative compute time {op[1]}")
                continue
            if kind == "phase":
                if op[1] not in PHASES:
                    raise WorkloadError(f"op {i}: unknown phase {op[1]!r}")
                continue
            if kind == "sync":
                continue
            tid = op[1]
            if kind == "alloc":
                if tid in state:
                    raise WorkloadError(f"op {i}: tensor {tid} allocated twice")
                if op[2] <= 0:
                    raise WorkloadError(f"op {i}: tensor {tid} has size {op[2]}")
                state[tid] = "live"
                continue
            if state.get(tid) != "live":
                what = "after its free" if state.get(tid) == "freed" else "before any alloc"
                raise WorkloadError(f"op {i}: {kind} of tensor {tid} {what}")
            if kind == "free":
                if kept.get(tid):
                    raise WorkloadError(f"op {i}: free of kept tensor {tid} while in use (no kdone since its kuse)")
                state[tid] = "freed"
                continue
            if kind == "keep":
                if tid in kept:
                    raise WorkloadError(f"op {i}: tensor {tid} kept twice")
                kept[tid] = False
                continue
            if kind in ("kuse", "kdone"):
                if tid not in kept:
                    raise WorkloadError(f"op {i}: {kind} of tensor {tid}, which was never kept")
                if kept[tid] == (kind == "kuse"):
                    what = "already in use" if kind == "kuse" else "not in use"
                    raise WorkloadError(f"op {i}: {kind} of kept tensor {tid}, {what}")
                kept[tid] = kind == "kuse"
                continue
            stage = saved.get(tid)
            if kind == "save":
                if stage is not None:
                    raise WorkloadError(f"op {i}: tensor {tid} saved twice")
            elif stage is None:
                raise WorkloadError(f"op {i}: {kind} of tensor {tid}, which was never saved")
            elif order[kind] < order[stage] or (kind != "use" and order[kind] == order[stage]):
                raise WorkloadError(f"op {i}: {kind} of tensor {tid} after its {stage}")
            saved[tid] = kind
        return self
