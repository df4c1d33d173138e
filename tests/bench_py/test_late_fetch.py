#!/usr/bin/env python3
"""Planned eviction's feedback from fetches that landed late on the device (Note [Late
fetches] in src/policy/step_recorder.h), through the benchmark's runner on cudasim in virtual
time. Plain python3, no torch: prints one "ok - ..." or "FAIL - ..." line per check and exits
0 only when no check failed.

The step (a 2 GiB limit, PCIe 55 GB/s): the forward saves A (1 GiB, cold at once), then B and
E (512 MiB each, cold 30 ms later), allocates a 448 MiB buffer J and saves C (64 MiB). 512 MiB
must leave there, and only A's copy has landed by then: the plan takes A. Backward computes
10 ms, then the host waits for the device (a value read on the host: the workload's "sync"),
uses C, frees C and J, uses B, then A 18 ms after the sync, then E. Memory lets A come back
only once C and J are gone, 11 ms before its use, and its copy takes 19.5 ms: it lands 8.5 ms
late after the copy stream idled since the forward. E's copy has landed by the sync, so E can
take A's place out from there: the next plan brings A back after C's first point, and the
step is that much faster.

What it holds them to:
  * the planned step with the late fetch (2 warm-up steps) is the slow one; from the next
    step on the fetch is moved (num_plan_fetch_moves 1), the step is faster and within
    1.05x the bound, and the move stays;
  * the same step with the sync first thing in backward, or with none (the host ahead of
    the device, so that as far as the host knows E's copy has not landed when A could come
    back): A's fetch is late as before and moved, the move gains nothing, it is undone the
    step after (num_plan_fetch_moves_undone 1), and the steps after are the step before the
    move, moving as many bytes.
A few seconds on 2 cores.

Environment: VRAMSWAP_LIBRARY / VRAMSWAP_CUDASIM_DIR as for the package (default: build/).
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

from vramswap.bench import runner  # noqa: E402
from vramswap.bench.workload import Workload  # noqa: E402

from checks import check, finish  # noqa: E402

GiB, MiB, MS = 1 << 30, 1 << 20, 1_000_000
CARD, PCIE, LIMIT = 8 * GiB, 55.0, 2 * GiB


def step(sync="after_compute"):
    """The step above; `sync`: "after_compute" (10 ms into backward), "first" (before
    backward computes anything) or None."""
    w = Workload(f"late-fetch-{sync}")
    w.phase("forward")
    w.alloc("A", GiB), w.save("A"), w.cold("A"), w.compute(30 * MS)
    w.alloc("B", GiB // 2), w.save("B"), w.cold("B")
    w.alloc("E", GiB // 2), w.save("E"), w.cold("E")
    w.alloc("J", 448 * MiB)
    w.alloc("C", 64 * MiB), w.save("C"), w.cold("C"), w.compute(1 * MS)
    w.phase("backward")
    if sync == "first":
        w.sync()
    w.compute(10 * MS)
    if sync == "after_compute":
        w.sync()
    w.use("C"), w.compute(10 * MS), w.release("C"), w.free("C"), w.free("J"), w.compute(1 * MS)
    w.use("B"), w.compute(5 * MS), w.release("B"), w.free("B")
    w.compute(2 * MS), w.use("A"), w.compute(25 * MS), w.release("A"), w.free("A")
    w.use("E"), w.compute(5 * MS), w.release("E"), w.free("E")
    return w.validate()


def runs(w, warmups):
    specs = [dict(policy="vramswap", card_bytes=CARD, pcie_gbps=PCIE, limit_bytes=LIMIT, warmup=k, record=False)
             for k in warmups]
    return dict(zip(warmups, runner.run_many(w, specs)))


def figures(r):
    return (f"{r['status']}, step {r['step_time_ns'] / MS:.2f} ms, bound {(r.get('bound_ns') or 0) / MS:.2f} ms, "
            f"{r['bytes_d2h'] / GiB:.2f} GiB out, moves {r.get('num_plan_fetch_moves')}, "
            f"undone {r.get('num_plan_fetch_moves_undone')}, planned steps {r.get('num_planned_steps')}")


def test_a_late_fetch_moves_earlier():
    r = runs(step(), (2, 3, 5))
    late, moved, later = r[2], r[3], r[5]
    for k, x in r.items():
        print(f"# warm-up {k}: {figures(x)}")
    check("the runs complete, each step after the first on the plan",
          all(x["status"] == "ok" and x["num_planned_steps"] == k - 1 for k, x in r.items()),
          "; ".join(figures(x) for x in r.values()))
    check("the first planned step waits for the late fetch (over 1.05x the bound)",
          late["step_time_ns"] > 1.05 * late["bound_ns"] and late["num_plan_fetch_moves"] == 0, figures(late))
    check("the next step moves the fetch and is faster, within 1.05x the bound",
          moved["num_plan_fetch_moves"] == 1 and moved["num_plan_fetch_moves_undone"] == 0
          and moved["step_time_ns"] < late["step_time_ns"] - 5 * MS
          and moved["step_time_ns"] <= 1.05 * moved["bound_ns"], figures(moved))
    check("the move stays", later["num_plan_fetch_moves"] == 1 and later["num_plan_fetch_moves_undone"] == 0
          and later["step_time_ns"] == moved["step_time_ns"], figures(later))


def test_a_move_that_gains_nothing_is_undone():
    for sync, how in (("first", "sync first"), (None, "no sync")):
        r = runs(step(sync), (2, 3, 4, 5))
        for k, x in r.items():
            print(f"# {how}, warm-up {k}: {figures(x)}")
        late, moved, back, later = r[2], r[3], r[4], r[5]
        check(f"{how}: the fetch is late on the device and moved", moved["num_plan_fetch_moves"] == 1, figures(moved))
        check(f"{how}: the move gains nothing and moves more bytes out",
              moved["step_time_ns"] >= late["step_time_ns"] and moved["bytes_d2h"] > late["bytes_d2h"],
              figures(moved))
        check(f"{how}: the step after undoes it, and the steps after are the step before the move",
              back["num_plan_fetch_moves_undone"] == 1 and later["num_plan_fetch_moves"] == 1
              and later["step_time_ns"] == late["step_time_ns"] and later["bytes_d2h"] == late["bytes_d2h"],
              f"{figures(back)}; {figures(later)}")


def main():
    try:
        test_a_late_fetch_moves_earlier()
        test_a_move_that_gains_nothing_is_undone()
    except runner.RunError as e:
        check("the runs complete", False, str(e))


if __name__ == "__main__":
    main()
    finish()
