"""A lower bound on a workload's step time under a memory limit that holds for every
offload policy: no policy, however clever, can run the step faster on this card.

    lower_bound(workload, limit_bytes, pcie_gbps, duplex="full", overhead_bytes=0,
                first_op=0)  -> Bound
    disk_traffic(workload, limit_bytes, host_bytes, overhead_bytes=0, first_op=0)
                -> bytes a disk tier behind `host_bytes` of pinned memory must move

Pure Python, from the Workload alone (workload.py): nothing is run and no library is
loaded. The runner reports it beside every run (measure.py's "bound_ns"); a policy is
judged by step / bound, and its D2H traffic by bytes_d2h / must_leave_bytes.

Note [The fluid relaxation]
---------------------------
The step is read on the compute clock: t is the sum of the "compute" ops before an op (from
`first_op` on; the ops before it are setup whose memory is live but whose time is not part
of the measured step). live(t) is the sum of the requested sizes of the tensors allocated
and not freed, plus a constant `overhead_bytes` (the allocator's rounding and cache: 0 is
the perfect-packing bound). After every op,

    X = max(0, live + overhead - M)

bytes must be off the device (M: the limit). Only saved tensors that went cold may be off
it: a tensor b is *eligible* after op k when its "cold" op is at or before k and its first
"use" (or its free, if it is never used) is after k. A tensor that is never marked cold can
never leave; after its first use it stays (the tracker protocol: an unpacked block is in
use until its release). Bytes are fluid: any part of an eligible tensor may be out.

Copies run at R bytes/ns (pcie_gbps: 1 GB/s = 1 byte/ns) on one engine per direction. A
stall is time the compute clock stops while copies go on; the bound is

    compute + the least total stall any policy needs.

**D2H side (forward walk).** At op k the bytes that can be out are at most what one engine,
copying only tensors eligible at k, can have moved by the moment of k. With release
times w_b (the wall time of b's cold op) this is the classic single-machine fluid bound

    out_max(k) = min( S_k,  min over b in E_k of ( A_k(<b) + R * (W_k - w_b) ) )

(E_k: the eligible tensors; S_k: their total size; A_k(<b): the bytes of those that went
cold before b; W_k: the wall time of k). Copying in cold order from each tensor's cold
time, skipping any tensor that comes back before k, reaches it. Restricting to E_k
matters: an engine that spent its time on a tensor used again before k moved nothing
that helps at k, so a single eager schedule over all cold tensors "minus what came back"
could understate out_max and the bound would not be one. The walk goes forward; where
X(k) > out_max(k) the step must stall until the engine has moved the difference at rate
R: the stall (X - out_max) / R is added to the wall clock (every later W grows by it)
and the walk goes on. Each stall is the least that makes k feasible given the stalls
before it, and a later stall can only shift later releases (w_b) along with W, so by
induction the walk's stall up to each op is at most any policy's stall up to that op
(pointwise minimal). Where X(k) > S_k no amount of waiting helps: the bytes that must be
out exceed every byte that is cold and not yet needed, the working set does not fit the
limit, and the bound is infeasible (bound_ns None, note says where).

**H2D side (backward walk).** The mirror image, walking from the step's end to its start:
a tensor out after op k must be back before its first use u_b, so fetching it is copying
in reverse time released at u_b; the bytes that can be out after k are those of eligible
tensors never used again (freed without a use, or live at the end: they need no fetch)
plus what one H2D engine, walking backward from the uses, can have fetched between k and
them. Where X exceeds that, the stall goes after op k (between k and the uses).

The state after op k lasts through the compute that follows it, until the next op that is
not compute. The D2H side checks it at its start (what the engine has moved only grows
with time), the H2D side at its end (bytes that must be out during that compute can start
coming in only when it ends): a fetch that overlapped the compute would put back bytes
the memory has no room for.

**Combining them.** The D2H walk's stalls up to op k lie before k (an allocation waits
for the copies before it), the H2D walk's stalls from k on lie after it, so for every
split k both are forced at once and disjointly: stall >= d2h(<= k) + h2d(>= k). The
bound takes the best split (the live peak is one of the candidates; for a step with one
peak it is usually the best). With a full-duplex link the two directions are independent
engines and this is the bound.

**Shared duplex** (one engine for both directions): the split's two parts use the engine
on opposite sides of the split, so they never overlap. Where they do overlap is between
two moments j < k at which bytes must be out: the bytes out at j that backward uses
before k must come in between j and k, and the bytes out at k that went cold after j
must go out between them, and with one engine the two take the sum of their times:

    H = max(0, X(j) - I - F),  D = max(0, X(k) - I),  I = bytes eligible at both j and k,
    F = bytes eligible at j freed unused before k;
    stall between j and k >= (H + D) / R - (compute from the end of j's state to k)

(the tensors eligible at both may stay out throughout, at no cost; any other choice of
what is out costs at least as much). The bound then takes the best of
d2h(<= j) + that + h2d(>= k) over pairs of candidate moments (the local maxima of X, the
highest 160 of them), beside the single splits. With full duplex the same pair argument
gives max(H, D) / R, which the walks already account for, so it adds nothing there.

Note [Kept tensors]
-------------------
A kept tensor (a frozen weight, optimizer state: "keep", then "kuse"/"kdone" around each
use) is eligible between a kdone and its next kuse (or its free, or the end): each such
interval counts as a tensor of its own, that must come back when a kuse ends it. Its D2H
copy is needed only where the contents changed and no copy of them is on the host: never
for a frozen tensor (its host copy, once made, stays valid: counted as made, which can only
lower the bound; the first step's real first copy is not charged), and not for an interval
that began before `first_op` when the step does not change it. One the step changes (used
in it: optimizer state) is out at the step's start only once copied after its last use in
the step before: its copy is released at that use's time less the step's compute and less
the stalls after that use in the step before, on the engine as any other. Those stalls are
at most the step's total stall S, and S must cover the stall the walks need with S of
extra time for those copies (more time only lowers it): the bound is the least such S,
found by bisection between the stall with those copies free (the least possible) and the
stall they need given that much time.
A kept tensor's saved uses (backward's pack and unpack of a frozen weight) do not end an
interval here: eligible for longer, the bound can only be lower.

Note [The disk's floor]
-----------------------
With a disk tier behind a pinned tier of H bytes, at least max(0, X(k) - H) bytes are on
the disk after op k. Each byte there crossed the disk once per step at least: written, if
its contents are the step's (every tensor but a frozen kept one, whose copy on the disk
stays valid), and read back, if it is used again (its interval ends in a use). A policy
choosing what goes to the disk at k takes the eligible bytes that cost least first (free:
a frozen tensor never used again; one crossing: a frozen one used again, or a tensor of the
step freed unused; two: a tensor of the step used again), so the least traffic the step
needs is the largest, over the moments k, of that cheapest filling of X(k) - H bytes. One
disk engine carries reads and writes at the disk's rate, and its work can overlap compute
and copies, so the floor on the step is that traffic / rate, beside (not added to) the
link's bound (measure.py's Note [The bound beside every run]).

The relaxation ignores placement (fragmentation; give overhead_bytes), the copies' real
granularity (a tensor moves whole), the engine's other duties, and the host side; so the
bound can be far below what a policy reaches, never above it.

Thread safety: pure functions of their arguments.
"""
from dataclasses import dataclass, asdict

kMaxPairCandidates = 160  # moments of high X tried as pairs for a shared-duplex link


@dataclass
class Bound:
    """The bound for one workload, limit and link (all times on the compute clock, ns)."""
    bound_ns: object              # int, or None when no policy can fit (see note)
    compute_ns: int               # the compute time of the ops from first_op on
    stall_ns: int                 # bound_ns - compute_ns (None when infeasible)
    d2h_stall_ns: int             # the D2H walk's stall before the split
    h2d_stall_ns: int             # the H2D walk's stall after the split
    both_stall_ns: int            # shared duplex: the stall of copies both ways between two moments
    split_ns: object              # where the split falls (compute clock), None without pressure
    must_leave_bytes: int         # max X: the bytes that must be out at the worst moment
    must_leave_at_ns: object      # when (compute clock), None without pressure
    must_leave_phase: object      # the phase at that moment
    limit_bytes: int
    overhead_bytes: int
    pcie_gbps: float
    duplex: str
    note: object = None           # why it is infeasible (None when feasible)

    @property
    def feasible(self):
        return self.bound_ns is not None

    def as_dict(self):
        return asdict(self)


class _Tensor:
    __slots__ = ("size", "cold", "end", "used", "d2h", "released", "wrap")

    def __init__(self, size, d2h=True):
        self.size = size
        self.cold = None   # op index of its cold op
        self.end = None    # op index of its first use, or of its free when never used
        self.used = False  # `end` is a use (it must come back)
        self.d2h = d2h     # being out needs a copy to the host (Note [Kept tensors])
        self.released = None  # compute time its copy out may start, when not its cold op's
        self.wrap = None      # a kept tensor's first interval, changed by the step: its last
                              # use's time less the step's compute (Note [Kept tensors])


def _scan(ops, first_op, overhead, limit):
    """One pass over the ops -> (tensors that went cold {tid: _Tensor}, per-op time t_k
    (compute before op k, from first_op), the constraint ops [(k, X_k, phase)] with X > 0,
    total compute, max X, where)."""
    sizes, tensors = {}, {}
    kept = {}  # kept tid -> [frozen, intervals so far, the open interval or None]
    last_kdone = {}  # kept tid that changes -> its last kdone in the step
    live = 0
    t = 0
    times = [0] * (len(ops) + 1)
    constraints = []
    phase = "other"
    worst = (0, None, None, None)  # (X, t, phase, op)
    for k, op in enumerate(ops):
        times[k] = t
        kind = op[0]
        if kind == "compute":
            if k >= first_op:
                t += op[1]
            continue
        if kind == "phase":
            phase = op[1]
            continue
        if kind == "sync":
            continue  # the host's wait moves no byte and adds no device time
        tid = op[1]
        if kind == "alloc":
            sizes[tid] = op[2]
            live += op[2]
        elif kind == "free":
            live -= sizes.pop(tid)
            tb = tensors.get(tid)
            if tb is not None and tb.end is None:
                tb.end = k
            tb = kept.pop(tid, (None, None, None))[2]
            if tb is not None:
                tb.end = k
        elif kind == "cold":
            tensors[tid] = _Tensor(sizes[tid])
            tensors[tid].cold = k
        elif kind == "use":
            tb = tensors.get(tid)
            if tb is not None and tb.end is None:
                tb.end, tb.used = k, True
        elif kind == "keep":
            kept[tid] = [bool(op[2]), 0, None]  # frozen, intervals so far, the open one
        elif kind == "kdone":
            frozen, count, _ = kept[tid]
            tb = _Tensor(sizes[tid], d2h=not frozen and k >= first_op)
            tb.cold = k
            tensors[(tid, count)] = tb
            kept[tid] = [frozen, count + 1, tb]
            if k >= first_op and not frozen:
                last_kdone[tid] = k
        elif kind == "kuse":
            tb = kept[tid][2]
            if tb is not None:
                tb.end, tb.used = k, True
                kept[tid][2] = None
        if k < first_op:
            continue
        x = live + overhead - limit
        if x > 0:
            constraints.append((k, x, phase))
            if x > worst[0]:
                worst = (x, t, phase, k)
    times[len(ops)] = t
    n = len(ops)
    for tb in tensors.values():
        if tb.end is None:
            tb.end = n  # live at the end, never used: out at the end needs no fetch
    # A kept tensor the step changes is out at its start only once copied after its last use
    # in the step before: released that long before the step (Note [Kept tensors]).
    for (tid, count), tb in ((key, tb) for key, tb in tensors.items() if isinstance(key, tuple)):
        if tb.cold < first_op and tid in last_kdone:
            tb.wrap = times[last_kdone[tid]] - t
    return tensors, times, constraints, t, worst


class _Engine:
    """One copy engine serving the eligible tensors released so far, in release order:
    what it can have moved by a wall time (Note [The fluid relaxation]); plus bytes that
    count as out with no copy at all (free)."""

    def __init__(self, rate):
        self.rate = rate
        self.jobs = {}   # tid -> (size, release wall time), in release order
        self.total = 0
        self.free = 0    # bytes that may be out without a copy (the H2D side's unused)

    def add(self, tid, size, wall, needs_copy=True):
        if needs_copy:
            self.jobs[tid] = (size, wall)
            self.total += size
        else:
            self.jobs[tid] = (size, None)
            self.free += size

    def remove(self, tid):
        size, wall = self.jobs.pop(tid)
        if wall is None:
            self.free -= size
        else:
            self.total -= size

    def capacity(self, now):
        best = self.total
        before = 0
        for size, wall in self.jobs.values():
            if wall is None:
                continue
            v = before + self.rate * (now - wall)
            if v < best:
                best = v
            before += size
        return self.free + max(0.0, best)

    def most(self):
        return self.free + self.total


def _infeasible_note(k, x, have, phase, t, limit, overhead):
    return (f"no policy fits: after op {k} ({phase}, {t / 1e6:.3f} ms into the step's compute) {x:,} B must be "
            f"off the device (the live bytes, plus {overhead:,} B of overhead, above the limit of {limit:,} B), but "
            f"only {have:,} B are cold and not needed before then: the step's working set exceeds the limit")


def lower_bound(workload, limit_bytes, pcie_gbps, duplex="full", overhead_bytes=0, first_op=0):
    """The policy-independent lower bound on the step time of `workload` (the ops from
    `first_op` on; the ones before are setup, live but not timed) under a device limit of
    `limit_bytes`, copies at `pcie_gbps` GB/s per direction ("full" duplex) or shared by
    both directions ("shared"), with `overhead_bytes` added to the live bytes throughout.
    See Note [The fluid relaxation]. Returns a Bound; bound_ns is None (and note says why)
    when the working set cannot fit."""
    if duplex not in ("full", "shared"):
        raise ValueError(f"duplex must be full or shared, not {duplex!r}")
    if not pcie_gbps or pcie_gbps <= 0:
        raise ValueError(f"pcie_gbps must be positive, not {pcie_gbps!r}")
    ops = workload.ops if hasattr(workload, "ops") else workload
    limit, overhead, rate = int(limit_bytes), int(overhead_bytes), float(pcie_gbps)
    tensors, times, constraints, compute, worst = _scan(ops, first_op, overhead, limit)
    base = dict(compute_ns=compute, must_leave_bytes=worst[0], must_leave_at_ns=worst[1],
                must_leave_phase=worst[2], limit_bytes=limit, overhead_bytes=overhead,
                pcie_gbps=rate, duplex=duplex)
    wrap = [tb for tb in tensors.values() if tb.wrap is not None]

    def walk(lead):
        """The bound with the copies of the kept tensors the step changes released `lead`
        ns before (None: free, as if made long before)."""
        for tb in wrap:
            tb.d2h = lead is not None
            tb.released = None if lead is None else tb.wrap - lead
        return _walk(ops, tensors, times, constraints, worst, base, rate, duplex, limit, overhead)

    b = walk(None)
    if not wrap or not b.feasible:
        return b
    # Note [Kept tensors]: the least stall S with S >= the stall the walk needs given S more
    # lead for those copies (the walk's stall only falls as the lead grows).
    lo, hi = b.stall_ns, walk(b.stall_ns).stall_ns
    if hi <= lo:
        return b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if walk(mid).stall_ns <= mid:
            hi = mid
        else:
            lo = mid
    b = walk(hi)
    return Bound(**{**b.as_dict(), "bound_ns": compute + hi, "stall_ns": hi})


def _walk(ops, tensors, times, constraints, worst, base, rate, duplex, limit, overhead):
    """The two walks and the best split (Note [The fluid relaxation]) -> Bound."""
    compute = base["compute_ns"]
    if not constraints:
        return Bound(bound_ns=compute, stall_ns=0, d2h_stall_ns=0, h2d_stall_ns=0, both_stall_ns=0,
                     split_ns=None, **base)
    is_constraint = {k: x for k, x, _ in constraints}

    # D2H: forward. d2h[k] = the least stall before op k (inclusive of the wait at k).
    colds, ends = {}, {}
    for tid, tb in tensors.items():
        colds.setdefault(tb.cold, []).append(tid)
        ends.setdefault(tb.end, []).append(tid)
    eng = _Engine(rate)
    stall = 0.0
    d2h = {}
    phase_at = {k: p for k, _, p in constraints}
    for k in range(len(ops)):
        for tid in ends.get(k, ()):
            if tid in eng.jobs:
                eng.remove(tid)
        for tid in colds.get(k, ()):
            tb = tensors[tid]
            if tb.end > k:
                eng.add(tid, tb.size, times[k] + stall if tb.released is None else tb.released, needs_copy=tb.d2h)
        x = is_constraint.get(k)
        if x is None:
            continue
        if x > eng.most():
            note = _infeasible_note(k, x, eng.most(), phase_at[k], times[k], limit, overhead)
            return Bound(bound_ns=None, stall_ns=None, d2h_stall_ns=None, h2d_stall_ns=None, both_stall_ns=None,
                         split_ns=None, note=note, **base)
        have = eng.capacity(times[k] + stall)
        if x > have:
            stall += (x - have) / rate
        d2h[k] = stall

    # H2D: backward, on the reverse clock T - t. The state after op k lasts until the next
    # op that is not compute (`until[k]`): bytes out then must stay out through that
    # compute, so a fetch can start only at its end. h2d[k] = the least stall after it.
    total = times[len(ops)]
    n = len(ops)
    until = _interval_ends(ops, times)
    eng = _Engine(rate)
    stall = 0.0
    h2d = {}
    for tid in ends.get(n, ()):
        eng.add(tid, tensors[tid].size, None, needs_copy=False)
    for k in range(n - 1, -1, -1):
        # State after op k: cold <= k < end. Tensors whose end is op k+1 join (released at
        # k+1's reverse time); tensors whose cold op is k+1 leave.
        for tid in ends.get(k + 1, ()) if k + 1 < n else ():
            tb = tensors[tid]
            if tb.cold <= k:
                eng.add(tid, tb.size, total - times[k + 1] + stall, needs_copy=tb.used)
        for tid in colds.get(k + 1, ()):
            if tid in eng.jobs:
                eng.remove(tid)
        x = is_constraint.get(k)
        if x is None:
            continue
        have = eng.capacity(total - until[k] + stall)
        if x > have:
            stall += (x - have) / rate
        h2d[k] = stall

    # The best split, and for a shared link the best pair of moments.
    best = (0.0, worst[3], 0.0, 0.0, 0.0)  # (stall, split op, d2h part, h2d part, both part)
    for k, _, _ in constraints:
        s = d2h[k] + h2d[k]
        if s > best[0]:
            best = (s, k, d2h[k], h2d[k], 0.0)
    if duplex == "shared":
        best = max(best, _best_pair(tensors, times, until, constraints, d2h, h2d, rate), key=lambda b: b[0])
    s, k, sd, sh, sb = best
    stall_ns = int(round(sd)) + int(round(sh)) + int(round(sb))
    return Bound(bound_ns=compute + stall_ns, stall_ns=stall_ns, d2h_stall_ns=int(round(sd)),
                 h2d_stall_ns=int(round(sh)), both_stall_ns=int(round(sb)), split_ns=times[k], **base)


def _interval_ends(ops, times):
    """op index -> the compute time at which the state after it ends (the time of the next
    op that is not compute, or the end)."""
    until = [0] * len(ops)
    end = times[len(ops)]
    for k in range(len(ops) - 1, -1, -1):
        until[k] = end
        if ops[k][0] != "compute":
            end = times[k]
    return until


def _best_pair(tensors, times, until, constraints, d2h, h2d, rate):
    """Shared duplex: max over candidate moments j < k of d2h[j] + (stall between them
    forced by copies both ways on one engine) + h2d[k] (Note [The fluid relaxation])."""
    xs = [x for _, x, _ in constraints]
    cand = [i for i in range(len(constraints))
            if (i == 0 or xs[i] >= xs[i - 1]) and (i + 1 == len(xs) or xs[i] >= xs[i + 1])]
    if len(cand) > kMaxPairCandidates:
        cand = sorted(sorted(cand, key=lambda i: -xs[i])[:kMaxPairCandidates])
    pts = [constraints[i] for i in cand]
    best = (-1.0, None, 0.0, 0.0, 0.0)
    items = list(tensors.values())
    for a, (j, xj, _) in enumerate(pts):
        elig = sorted((tb.end, tb.size, tb.used) for tb in items if tb.cold <= j < tb.end)
        remaining = sum(e[1] for e in elig)
        freed = 0
        p = 0
        for k, xk, _ in pts[a + 1:]:
            while p < len(elig) and elig[p][0] <= k:
                remaining -= elig[p][1]
                if not elig[p][2]:
                    freed += elig[p][1]
                p += 1
            work = max(0, xj - remaining - freed) + max(0, xk - remaining)
            between = max(0.0, work / rate - (times[k] - until[j]))
            s = d2h[j] + between + h2d[k]
            if s > best[0]:
                best = (s, j, d2h[j], h2d[k], between)
    return best


def disk_traffic(workload, limit_bytes, host_bytes, overhead_bytes=0, first_op=0):
    """The least bytes a disk tier behind `host_bytes` of pinned memory must move (written
    plus read) in the step of `workload` (its ops from `first_op` on) under a device limit
    of `limit_bytes`: Note [The disk's floor]. 0 where the pinned tier holds what must
    leave."""
    ops = workload.ops if hasattr(workload, "ops") else workload
    limit, host = int(limit_bytes), int(host_bytes)
    tensors, _, constraints, _, _ = _scan(ops, first_op, int(overhead_bytes), limit)
    # Each tensor's crossings: a write unless frozen (a kept interval the step does not
    # change), a read if it is used again.
    costs = [(tb.cold, tb.end, (1 if tb.d2h or tb.wrap is not None else 0) + (1 if tb.used else 0), tb.size)
             for tb in tensors.values()]
    best = 0
    for k, x, _ in constraints:
        need = x - host
        if need <= 0:
            continue
        eligible = sorted((cost, size) for cold, end, cost, size in costs if cold <= k < end)
        moved = 0
        for cost, size in eligible:
            take = min(size, need)
            moved += cost * take
            need -= take
            if need == 0:
                break
        best = max(best, moved)
    return best
