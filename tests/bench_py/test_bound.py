#!/usr/bin/env python3
"""The policy-independent lower bound on the step time (plugin/python/vramswap/bench/bound.py),
on hand-made workloads whose optimum is known by hand. Plain python3, no torch, no library
loaded: prints one "ok - ..." or "FAIL - ..." line per check and exits 0 only when none
failed.

The link runs at 1 GB/s = 1 byte/ns, so 1,000,000 bytes take 1 ms to copy; each case says
what the best any policy can do is and why.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

from vramswap.bench import bound  # noqa: E402
from vramswap.bench.workload import Workload  # noqa: E402

MS = 1_000_000      # ns
MB = 1_000_000      # bytes: 1 ms of copy at 1 GB/s
RATE = 1.0          # GB/s = bytes per ns

from checks import check, finish  # noqa: E402


def saved(w, tid, nbytes):
    w.alloc(tid, nbytes)
    w.save(tid)


def show(b):
    return ", ".join(f"{k} {v}" for k, v in b.as_dict().items())


def test_no_pressure():
    w = Workload("no pressure")
    w.phase("forward")
    saved(w, "a", 2 * MB)
    w.compute(3 * MS)
    w.cold("a")
    w.phase("backward")
    w.use("a")
    w.compute(2 * MS)
    w.release("a")
    w.free("a")
    w.validate()
    b = bound.lower_bound(w, 4 * MB, RATE)
    check("no pressure: bound == compute", b.feasible and b.bound_ns == 5 * MS and b.stall_ns == 0, show(b))
    check("no pressure: nothing must leave", b.must_leave_bytes == 0 and b.must_leave_at_ns is None, show(b))
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("a limit equal to the peak: no pressure", b.bound_ns == 5 * MS and b.must_leave_bytes == 0, show(b))


def one_tensor(cold_to_need_ms, need_to_use_ms, held_ms=1):
    """a (2 MB) goes cold, `cold_to_need_ms` later an allocation p of 2 MB needs all of it out
    (limit 2 MB) for `held_ms`; `need_to_use_ms` after p is freed, backward uses a."""
    w = Workload("one tensor")
    w.phase("forward")
    saved(w, "a", 2 * MB)
    w.compute(1 * MS, "before cold")
    w.cold("a")
    w.compute(cold_to_need_ms * MS, "cold to need")
    w.alloc("p", 2 * MB)
    w.compute(held_ms * MS, "p held")
    w.free("p")
    w.phase("backward")
    w.compute(need_to_use_ms * MS, "need to use")
    w.use("a")
    w.compute(1 * MS, "backward")
    w.release("a")
    w.free("a")
    return w.validate()


def test_one_tensor():
    w = one_tensor(5, 5)
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("one tensor, plenty of time after its cold and before its use: no stall",
          b.bound_ns == w.compute_ns() and b.stall_ns == 0, show(b))
    check("one tensor: must_leave_bytes is what the allocation needs, at its moment",
          b.must_leave_bytes == 2 * MB and b.must_leave_at_ns == 6 * MS and b.must_leave_phase == "forward", show(b))
    b = bound.lower_bound(w, 3 * MB, RATE)
    check("one tensor, a higher limit: half of it must leave", b.must_leave_bytes == MB and b.stall_ns == 0, show(b))

    # Cold 1 ms before it must be out, 2 ms to copy: 1 ms stall, exactly.
    w = one_tensor(1, 5)
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("cold 1 ms before it must be out, a 2 ms copy: exactly 1 ms of D2H stall",
          b.bound_ns == w.compute_ns() + 1 * MS and b.d2h_stall_ns == 1 * MS and b.h2d_stall_ns == 0, show(b))
    # Cold when it must be out: the whole copy is stall.
    w = one_tensor(0, 5)
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("cold at the moment it must be out: the whole 2 ms copy is stall",
          b.bound_ns == w.compute_ns() + 2 * MS and b.d2h_stall_ns == 2 * MS, show(b))

    # The mirror: out until 0.5 ms before its use, a 2 ms fetch: 1.5 ms of H2D stall.
    w = one_tensor(5, 0.5)
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("needed 0.5 ms after it may come back, a 2 ms fetch: exactly 1.5 ms of H2D stall",
          b.bound_ns == w.compute_ns() + 1.5 * MS and b.h2d_stall_ns == 1.5 * MS and b.d2h_stall_ns == 0, show(b))
    # The fetch cannot overlap the compute during which the bytes must be out: with p held for
    # 4 ms and the use right after p's free, the whole 2 ms fetch is stall.
    w = one_tensor(5, 0, held_ms=4)
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("needed right after the pressure ends: the whole fetch is stall, none hidden under the pressure",
          b.bound_ns == w.compute_ns() + 2 * MS and b.h2d_stall_ns == 2 * MS, show(b))
    # Both sides: 1 ms before, 1.5 ms after.
    w = one_tensor(1, 0.5)
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("both sides: 1 ms of D2H stall before the peak and 1.5 ms of H2D stall after it",
          b.bound_ns == w.compute_ns() + 2.5 * MS and b.d2h_stall_ns == 1 * MS and b.h2d_stall_ns == 1.5 * MS,
          show(b))
    # A 4x faster link: no stall.
    b = bound.lower_bound(w, 2 * MB, 4 * RATE)
    check("the same step on a 4 GB/s link: no stall", b.stall_ns == 0, show(b))
    # overhead_bytes counts as live throughout: 1 MB of overhead at a 3 MB limit is the 2 MB case.
    b = bound.lower_bound(w, 3 * MB, RATE, overhead_bytes=MB)
    check("overhead_bytes adds to the live bytes",
          b.bound_ns == w.compute_ns() + 2.5 * MS and b.must_leave_bytes == 2 * MB and b.overhead_bytes == MB, show(b))


def test_only_what_is_out_when_needed():
    """An engine that copied a tensor backward uses before the pressure wasted its time: the
    bound counts only tensors still out-able at the moment. Eager copying of everything in
    cold order would copy a (3 MB, 0-3 ms), abandon it at its use (2.5 ms), copy b from 2.5
    ms and have 0.5 MB of b out at 3 ms: a 0.5 ms "stall" no policy needs (copy b first)."""
    w = Workload("wasted copy")
    w.phase("forward")
    saved(w, "a", 3 * MB)
    saved(w, "b", 1 * MB)
    w.cold("a")
    w.cold("b")
    w.compute(2.5 * MS)
    w.phase("backward")
    w.use("a")
    w.compute(0.5 * MS)
    w.alloc("c", 1 * MB)
    w.compute(1 * MS)
    w.free("c")
    w.compute(5 * MS)
    w.use("b")
    w.release("a")
    w.release("b")
    w.free("a")
    w.free("b")
    w.validate()
    b = bound.lower_bound(w, 4 * MB, RATE)
    check("only tensors out-able at the moment count: no stall when the right one is copied first",
          b.feasible and b.stall_ns == 0 and b.must_leave_bytes == MB, show(b))


def test_infeasible():
    w = Workload("too big")
    w.phase("forward")
    w.alloc("x", 2 * MB)
    w.alloc("y", 2 * MB)
    w.compute(1 * MS)
    w.free("y")
    w.free("x")
    w.validate()
    b = bound.lower_bound(w, 3 * MB, RATE)
    check("a limit below the working set: infeasible, with a reason",
          b.bound_ns is None and not b.feasible and "working set exceeds the limit" in (b.note or "")
          and b.must_leave_bytes == MB, show(b))
    check("infeasible: the reason names the op and the bytes", "op 2" in b.note and "1,000,000 B" in b.note, b.note)
    # A saved tensor that is never marked cold cannot leave.
    w = Workload("never cold")
    w.phase("forward")
    saved(w, "a", 2 * MB)
    w.compute(5 * MS)
    w.alloc("p", 2 * MB)
    w.free("p")
    w.phase("backward")
    w.use("a")
    w.release("a")
    w.free("a")
    w.validate()
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("a saved tensor never marked cold cannot leave: infeasible", b.bound_ns is None, show(b))
    # Used before the pressure: it had to come back, so nothing is out-able.
    w = one_tensor(5, 5)
    w.ops.insert(w.ops.index(("alloc", "p", 2 * MB)), ("use", "a"))
    w.validate()
    b = bound.lower_bound(w, 2 * MB, RATE)
    check("a tensor used before the pressure is not out-able then: infeasible", b.bound_ns is None, show(b))


def test_shared_duplex():
    """a must be out at j (10 ms) and back before backward uses it at 14 ms; b goes cold at
    11 ms and must be out at 14 ms. Each copy takes 2 ms and 3 ms separate the end of the
    pressure at j (11 ms) from 14 ms: with an engine per direction both fit; with one
    engine for both, 4 ms of copies need 1 ms of stall."""
    w = Workload("shared")
    w.phase("forward")
    saved(w, "a", 2 * MB)
    saved(w, "b", 2 * MB)
    w.cold("a")
    w.compute(10 * MS)
    w.alloc("p", 2 * MB)
    w.compute(1 * MS)
    w.free("p")
    w.cold("b")
    w.compute(3 * MS)
    w.phase("backward")
    w.use("a")
    w.alloc("q", 2 * MB)
    w.compute(1 * MS)
    w.free("q")
    w.compute(5 * MS)
    w.use("b")
    for t in ("a", "b"):
        w.release(t)
        w.free(t)
    w.validate()
    full = bound.lower_bound(w, 4 * MB, RATE, duplex="full")
    shared = bound.lower_bound(w, 4 * MB, RATE, duplex="shared")
    check("full duplex: the two directions overlap, no stall", full.stall_ns == 0, show(full))
    check("shared duplex: copies both ways in one 3 ms interval take 4 ms: 1 ms of stall",
          shared.bound_ns == w.compute_ns() + 1 * MS and shared.both_stall_ns == 1 * MS, show(shared))
    # With no overlap (a single peak), shared and full agree.
    w = one_tensor(1, 0.5)
    f = bound.lower_bound(w, 2 * MB, RATE, duplex="full")
    s = bound.lower_bound(w, 2 * MB, RATE, duplex="shared")
    check("shared duplex with one peak: the same bound as full duplex", f.bound_ns == s.bound_ns, f"{show(f)} / {show(s)}")


def test_first_op():
    """The ops before first_op are setup: their memory is live, their compute not timed."""
    w = Workload("setup")
    w.phase("other")
    w.alloc("param", 1 * MB)
    w.compute(7 * MS, "setup")
    w.phase("forward")
    saved(w, "a", 2 * MB)
    w.compute(1 * MS)
    w.cold("a")
    w.compute(1 * MS)
    w.alloc("p", 2 * MB)
    w.compute(1 * MS)
    w.free("p")
    w.compute(5 * MS)
    w.use("a")
    w.release("a")
    w.free("a")
    w.validate()
    start = next(i for i, op in enumerate(w.ops) if op == ("phase", "forward"))
    whole = bound.lower_bound(w, 3 * MB, RATE)
    step = bound.lower_bound(w, 3 * MB, RATE, first_op=start)
    check("first_op: the setup's compute is left out, its memory is not",
          step.compute_ns == 8 * MS and step.bound_ns == 9 * MS and step.must_leave_bytes == 2 * MB
          and whole.bound_ns == 16 * MS, f"{show(step)} / {show(whole)}")
    check("must_leave_at_ns is on the step's clock", step.must_leave_at_ns == 2 * MS, show(step))


def kept_step(frozen, in_setup):
    """A kept tensor W (4 MB) used at the start of the step and again at its end (Note [Kept
    tensors]); between its uses an allocation A of 4 MB runs 10 ms under a 6 MB limit, so 2 MB
    of W must be out throughout, and back after A is freed, right before W's next use.
    `in_setup`: W's first use ends before the step (first_op), in its setup."""
    w = Workload("kept")
    w.phase("other")
    w.alloc("W", 4 * MB)
    w.keep("W", frozen)
    if in_setup:
        w.kuse("W")
        w.kdone("W")
    first = len(w.ops)
    w.phase("optimizer")
    if not in_setup:
        w.kuse("W")
        w.compute(1 * MS)
        w.kdone("W")
    w.alloc("A", 4 * MB)
    w.compute(10 * MS)
    w.free("A")
    w.kuse("W")
    w.compute(1 * MS)
    w.kdone("W")
    return w.validate(), first


def kept_then_a(name, frozen):
    """W (4 MB) kept and last used before the step (ops 0-3: first_op 4), then A (4 MB) for
    10 ms under a 6 MB limit, in a forward."""
    w = Workload(name)
    w.alloc("W", 4 * MB)
    w.keep("W", frozen)
    w.kuse("W")
    w.kdone("W")
    w.phase("forward")
    w.alloc("A", 4 * MB)
    w.compute(10 * MS)
    w.free("A")
    return w


def test_kept():
    """Out between its uses, W comes back after A: 2 ms of H2D with no compute to hide it.
    Copying it out first takes another 2 ms while A waits, unless the host copy is valid
    already: a frozen W (its contents never change). One the step changes, last used before
    the step, is out at its start only once copied after its last use in the step before,
    which ends that step; the bound cannot tell where a step's stalls fall, and a stall after
    that use would give the copy its time: it lets the 2 ms the step must stall anyway serve
    (a real policy stalls 4 ms here)."""
    for frozen, in_setup, stall in ((False, False, 4), (True, False, 2), (False, True, 2), (True, True, 2)):
        w, first = kept_step(frozen, in_setup)
        compute = (11 if in_setup else 12) * MS
        b = bound.lower_bound(w, 6 * MB, RATE, first_op=first)
        check(f"kept {'frozen' if frozen else 'changing'}, last used {'before' if in_setup else 'in'} the step: "
              f"stall {stall} ms", b.feasible and b.bound_ns == compute + stall * MS and b.must_leave_bytes == 2 * MB,
              show(b))
    # Last used 5 ms before the step's end: its copy is done by the time the next step needs it.
    w = kept_then_a("kept, used early", False)
    w.kuse("W")
    w.kdone("W")
    w.compute(5 * MS)
    b = bound.lower_bound(w.validate(), 6 * MB, RATE, first_op=4)
    check("kept, changed 5 ms before the step's end: copied by the next step's need, then 2 ms back",
          b.feasible and b.bound_ns == 17 * MS, show(b))
    # Never used again in the step: out to its end, nothing comes back.
    w = kept_then_a("kept, not used again", True)
    b = bound.lower_bound(w.validate(), 6 * MB, RATE, first_op=4)
    check("kept, out to the end: no stall", b.feasible and b.bound_ns == 10 * MS, show(b))
    # In use, never eligible: the working set does not fit.
    w = Workload("kept, in use")
    w.alloc("W", 4 * MB)
    w.keep("W", False)
    w.phase("forward")
    w.kuse("W")
    w.alloc("A", 4 * MB)
    w.compute(10 * MS)
    w.free("A")
    w.kdone("W")
    b = bound.lower_bound(w.validate(), 6 * MB, RATE, first_op=2)
    check("kept and in use: infeasible", not b.feasible and "2,000,000 B must be off" in (b.note or ""), show(b))


def test_errors():
    w = one_tensor(5, 5)
    for kwargs, what in ((dict(duplex="half"), "duplex"), (dict(pcie_gbps=0), "pcie_gbps")):
        try:
            bound.lower_bound(w, **dict(dict(limit_bytes=2 * MB, pcie_gbps=RATE), **kwargs))
            check(f"a bad {what} is refused", False, "no error")
        except ValueError as e:
            check(f"a bad {what} is refused", what in str(e), str(e))


def test_gpt_small():
    """The figures of the planned-eviction notes, on the generated gpt-small step (scenarios.py),
    at 90% and 75% of its no-offload peak (17.355 GiB: the limits are those bench uses, in
    whole 2 MiB granules; 55 GB/s, perfect packing)."""
    from vramswap.bench import scenarios
    w = scenarios.SCENARIOS["gpt-small"].workload()
    GiB = 1 << 30
    b90 = bound.lower_bound(w, 16_770_924_544, 55.0)
    check("gpt-small at 90%: the bound is the compute time (65.95 ms), 0.44 GiB must leave",
          b90.bound_ns == w.compute_ns() and abs(w.compute_ns() - 65.95 * MS) < 0.01 * MS
          and abs(b90.must_leave_bytes / GiB - 0.443) < 0.001, show(b90))
    b75 = bound.lower_bound(w, 13_975_420_928, 55.0)
    check("gpt-small at 75%: about 124 ms (3.05 GiB out at the junction, 33.7 ms D2H stall before, 24.1 ms H2D after)",
          abs(b75.bound_ns - 123.8 * MS) < 0.1 * MS and abs(b75.must_leave_bytes / GiB - 3.047) < 0.001
          and abs(b75.d2h_stall_ns - 33.72 * MS) < 0.01 * MS and abs(b75.h2d_stall_ns - 24.14 * MS) < 0.01 * MS,
          show(b75))


def random_step(rng, layers):
    """A forward/backward step with random sizes and times: each layer saves an activation
    that goes cold a layer later and allocates a temporary; backward uses them in reverse
    with a gradient of its own."""
    w = Workload("random")
    w.phase("forward")
    w.alloc("in", rng.randint(1, 4) * MB)
    for i in range(layers):
        saved(w, f"a{i}", rng.randint(1, 8) * MB)
        w.alloc(f"t{i}", rng.randint(1, 4) * MB)
        w.compute(rng.randint(0, 3000) * 1000)
        w.free(f"t{i}")
        if i:
            w.cold(f"a{i - 1}")
    w.cold(f"a{layers - 1}")
    w.phase("backward")
    for i in reversed(range(layers)):
        w.alloc(f"g{i}", rng.randint(1, 6) * MB)
        w.use(f"a{i}")
        w.compute(rng.randint(0, 6000) * 1000)
        w.release(f"a{i}")
        w.free(f"a{i}")
        w.free(f"g{i}")
    w.free("in")
    return w.validate()


def test_properties():
    """On random steps: the bound never falls below the compute, never rises with the limit
    or the link's rate, a shared link's is never below a full-duplex one's, and a limit at
    which no policy fits stays so below it."""
    import random
    rng = random.Random(7)
    problems = []
    for n in range(60):
        w = random_step(rng, rng.randint(2, 8))
        peak = w.live_bytes()[0]
        last = None
        for share in (1.0, 0.9, 0.75, 0.6, 0.5, 0.4, 0.3):
            limit = int(share * peak)
            b = bound.lower_bound(w, limit, RATE)
            fast = bound.lower_bound(w, limit, 2 * RATE)
            shared = bound.lower_bound(w, limit, RATE, duplex="shared")
            if b.feasible != fast.feasible or b.feasible != shared.feasible:
                problems.append((n, share, "feasibility depends on the link"))
            if not b.feasible:
                last = "infeasible"
                continue
            if last == "infeasible":
                problems.append((n, share, "feasible below an infeasible limit"))
            if b.bound_ns < w.compute_ns() or fast.bound_ns > b.bound_ns or shared.bound_ns < b.bound_ns:
                problems.append((n, share, b.bound_ns, fast.bound_ns, shared.bound_ns))
            if last is not None and b.bound_ns < last:
                problems.append((n, share, "lower with a lower limit", b.bound_ns, last))
            last = b.bound_ns
    check("random steps: bound >= compute, monotone in the limit and the rate, shared >= full",
          not problems, problems[:5])


def test_disk_traffic():
    """Note [The disk's floor]: at the worst moment what the pinned tier cannot hold is on
    the disk, and each byte there crossed it once for each of a write (unless frozen) and a
    read (if used again), the cheapest bytes first."""
    def step(unused_c):
        # a (4 MB) and b or c (2 MB) saved and cold; then p (4 MB) under a 6 MB limit: 4 MB
        # must be out while p lives. c is freed unused after p; b is used in backward.
        w = Workload("disk")
        w.phase("forward")
        saved(w, "a", 4 * MB)
        other = "c" if unused_c else "b"
        saved(w, other, 2 * MB)
        w.compute(1 * MS)
        w.cold("a")
        w.cold(other)
        w.alloc("p", 4 * MB)
        w.compute(1 * MS)
        w.free("p")
        if unused_c:
            w.release("c")
            w.free("c")
        w.phase("backward")
        for t in ("a",) if unused_c else ("b", "a"):
            w.use(t)
            w.compute(1 * MS)
            w.release(t)
            w.free(t)
        return w.validate()

    w = step(unused_c=False)
    got = [bound.disk_traffic(w, 6 * MB, host * MB) for host in (0, 1, 4, 8)]
    check("disk: 4 MB out, the pinned tier holding 0/1/4/8 MB: 4/3/0/0 MB on the disk, each written and read",
          got == [8 * MB, 6 * MB, 0, 0], got)
    w = step(unused_c=True)
    got = bound.disk_traffic(w, 6 * MB, 1 * MB)
    check("disk: 3 MB on the disk, c (2 MB, freed unused) goes first and is only written: 2 + 2 x 1 MB",
          got == 4 * MB, got)
    for frozen, want in ((True, 2 * MB), (False, 4 * MB)):
        w, first = kept_step(frozen, in_setup=False)
        got = bound.disk_traffic(w, 6 * MB, 0, first_op=first)
        check(f"disk: 2 MB of kept W on the disk between its uses, {'frozen: only read' if frozen else 'changed: written and read'}",
              got == want, got)
    w = kept_then_a("disk kept, not used again", frozen=True).validate()
    check("disk: a frozen tensor not used again in the step costs the disk nothing",
          bound.disk_traffic(w, 6 * MB, 0, first_op=4) == 0)


def main():
    for test in (test_no_pressure, test_one_tensor, test_only_what_is_out_when_needed, test_infeasible,
                 test_shared_duplex, test_first_op, test_kept, test_disk_traffic, test_errors, test_gpt_small, test_properties):
        test()


if __name__ == "__main__":
    main()
    finish()
