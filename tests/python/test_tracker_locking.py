#!/usr/bin/python3
"""The tracker (vramswap/tracker.py) never deadlocks on its own lock, and updates its
counters under it, as its docstring promises.

Runs in the CPU-emulation mode (no GPU), calling the tracker's hooks directly on tensors
allocated inside its scope, with the tracker's lock replaced by ProbeLock, an instrument
that knows which thread holds it.

  destructor_under_lock
      A saved tensor's record (_Saved) dies while the thread that kills it holds the
      tracker's lock: its last reference is a garbage cycle, and cyclic GC runs while the
      lock is held (ProbeLock(collect=True) runs gc.collect() each time it is taken: a
      collection can start at any allocation inside the locked region). _Saved.__del__
      must not take the lock then: the test runs in a thread and fails (instead of hanging)
      when the thread has not finished after a timeout. Afterwards the handle is released
      and forgotten, and the release counted.
  counters_under_lock
      Every counter of tracker_stats() (packs, untagged, cold, unpacks, releases) is
      written while the writing thread holds the tracker's lock (a dict that checks
      ProbeLock's owner on each write).

Usage: python3 tests/python/test_tracker_locking.py [CASE...]   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_cpu_emulation.py).
"""
import gc
import os
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

TIMEOUT_S = 20
TAGGED_FLOATS = 1 << 16  # 256 KiB: at least min_offload_bytes below, so tagged in a scope

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


class ProbeLock:
    """A non-reentrant lock that records its holder; with collect=True, it runs a cyclic
    garbage collection each time it is taken (as an allocation inside the locked region can)."""

    def __init__(self, collect=False):
        self._lock = threading.Lock()
        self.owner = None
        self.collect = collect

    def acquire(self, blocking=True, timeout=-1):
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
            if self.collect:
                gc.collect()
        return got

    def release(self):
        self.owner = None
        self._lock.release()

    def locked(self):
        return self._lock.locked()

    def held_here(self):
        return self.owner == threading.get_ident()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


class GuardedCounters(dict):
    """The tracker's counters, refusing (recording) a write made without the lock."""

    def __init__(self, counters, lock):
        super().__init__(counters)
        self.lock = lock
        self.unguarded = set()

    def __setitem__(self, key, value):
        if not self.lock.held_here():
            self.unguarded.add(key)
        super().__setitem__(key, value)


def in_thread(fn, what):
    """Runs fn() in a daemon thread; False (and a FAIL) when it has not returned in
    TIMEOUT_S, so a deadlock fails the test instead of hanging it."""
    errors = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported as a failed check
            errors.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(TIMEOUT_S)
    if t.is_alive():
        check(False, f"{what}: returned within {TIMEOUT_S} s (it deadlocked: the thread is "
                     "blocked on the tracker's lock)")
        return False
    check(not errors, f"{what}: returned" + (f", but raised {errors[0]!r}" if errors else ""))
    return not errors


def destructor_under_lock(torch, vramswap, tracker):
    T = tracker._tracker
    lib = vramswap._lib.lib()
    T._lock = ProbeLock(collect=True)
    before = vramswap.tracker_stats()
    tracked_before = vramswap.memory_stats()["num_tracked_blocks"]
    gc.disable()  # the cycle below is collected where the test says, not before
    try:
        T.enter()
        t = torch.ones(TAGGED_FLOATS)
        saved = T.pack(t)
        check(isinstance(saved, tracker._Saved), "a tensor allocated in the scope is packed (a _Saved)")
        handle = saved.handle
        cycle = [saved]
        cycle.append(cycle)
        del saved, cycle  # garbage now, freed only by cyclic GC
        other = torch.ones(TAGGED_FLOATS)  # packing it takes the lock: GC runs while it is held
        kept = []
        if not in_thread(lambda: kept.append(T.pack(other)),
                         "pack() while cyclic GC kills a _Saved under the tracker's lock"):
            return False
        T.exit()
    finally:
        gc.enable()
    T.poll_cold()  # any later tracker call settles what the destructor left
    stats = vramswap.tracker_stats()
    check(handle not in T._live and not T.is_pending(handle),
          "the dead _Saved's handle is forgotten by the tracker")
    check(stats["releases"] == before["releases"] + 1,
          f"its release is counted ({before['releases']} -> {stats['releases']})")
    check(lib.vramswap_release(handle) != 0, "vramswap released the handle (releasing it again is refused)")
    del t, other, kept
    gc.collect()
    T.poll_cold()
    check(vramswap.memory_stats()["num_tracked_blocks"] == tracked_before,
          "every handle the case made is released")
    return True


def counters_under_lock(torch, vramswap, tracker):
    T = tracker._tracker
    lock = ProbeLock()
    T._lock = lock
    counters = GuardedCounters(T.stats, lock)
    T.stats = counters
    with vramswap.offload():
        x = torch.ones(TAGGED_FLOATS, requires_grad=True)
        small = torch.ones(4, requires_grad=True)
        y = (x * 2).exp()       # exp saves its result: packed, cold when y is dropped below
        z = (small * 3).exp()   # too small to be tagged: untagged
    loss = y.sum() + z.sum()
    del y, z
    T.poll_cold()
    loss.backward()             # unpack, then release when autograd drops the saved tensors
    del loss
    T.poll_cold()
    stats = vramswap.tracker_stats()
    for key in ("packs", "untagged", "cold", "unpacks", "releases"):
        check(stats[key] > 0, f"the case moves the counter {key} ({stats[key]})")
    check(not counters.unguarded,
          "every counter is written under the tracker's lock"
          + (f" (written without it: {sorted(counters.unguarded)})" if counters.unguarded else ""))
    return True


CASES = {"destructor_under_lock": destructor_under_lock, "counters_under_lock": counters_under_lock}


def main(argv):
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        return 2
    import torch
    import vramswap
    torch.set_num_threads(1)
    vramswap.sim.install_cpu(min_offload_bytes="64KiB")
    from vramswap import tracker
    for name in names:
        print(f"== {name}", flush=True)
        if not CASES[name](torch, vramswap, tracker):
            # A deadlocked thread holds the tracker's lock for good: stop here.
            print(f"{len(failures)} check(s) failed")
            sys.stdout.flush()
            os._exit(1)
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
