#!/usr/bin/python3
"""A saved tensor that goes cold between two of the tracker's hooks is marked cold when an
allocation needs its memory (vramswap's cold probe, Note [Pending blocks] in
vramswap/csrc/cpu_sim.cpp), not at the tracker's next hook.

In the CPU-emulation mode under VRAMSWAP_LIMIT=LIMIT, with the tracker's hooks run by real
autograd:

    a = randn(N)                      outside any scope: 8 MiB, untagged
    with vramswap.offload():
        y = a.exp()                   8 MiB, tagged; exp saves its result: packed, and in use
        s = y.sum()                   (y is the program's: not cold at any hook)
    del y                             now only autograd's saved slot holds it: cold, but no
                                      hook runs, so the tracker has not seen it
    big = empty(BIG)                  a, y and big exceed the limit; a and big do not

Without the probe `big` is an out-of-memory (the reclaim finds nothing cold); with it, y is
marked cold and evicted, `big` is allocated, and the backward that follows brings y back:
a.grad is exactly exp(a), computed again without vramswap. The probe's mark is counted in
tracker_stats()["cold"] and the pending set is empty afterwards.

Usage: python3 tests/python/test_cold_probe.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_cpu_emulation.py).
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

MIB = 1 << 20
LIMIT = 32 * MIB
N = 2 * MIB  # floats: 8 MiB
BIG = 18 * MIB  # bytes: with a and y, 34 MiB of a 32 MiB limit; without y, 26 MiB

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def main():
    import torch
    import vramswap
    from vramswap import tracker
    torch.set_num_threads(1)
    vramswap.sim.install_cpu(limit=str(LIMIT), horizon=0)
    torch.manual_seed(0)
    a = torch.randn(N, requires_grad=True)
    before = vramswap.memory_stats()
    cold_before = vramswap.tracker_stats()["cold"]
    with vramswap.offload():
        y = a.exp()
        s = y.sum()
    handle = next(iter(tracker._tracker._live))
    check(tracker._tracker.is_pending(handle), "y is packed and not cold while the program holds it")
    del y
    check(tracker._tracker.is_pending(handle), "after `del y` no hook ran: the tracker has not marked it")
    try:
        big = torch.empty(BIG, dtype=torch.uint8)
    except torch.cuda.OutOfMemoryError as e:
        check(False, f"an allocation that needs y's memory succeeds (it raised: {e})")
        return 1
    big.fill_(1)
    after = vramswap.memory_stats()
    check(after["num_ooms"] == before["num_ooms"], "no out-of-memory was counted")
    check(after["num_evictions"] > before["num_evictions"],
          f"y was evicted to make room ({after['num_evictions'] - before['num_evictions']} eviction(s))")
    check(vramswap.tracker_stats()["cold"] > cold_before, "the probe's cold mark is counted")
    check(not tracker._tracker.is_pending(handle), "y left the pending set")
    del big
    s.backward()
    del s
    check(torch.equal(a.grad, torch.exp(a.detach())), "backward brought y back: a.grad is exactly exp(a)")
    check(vramswap.memory_stats()["num_tracked_blocks"] == 0, "every handle was released")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
