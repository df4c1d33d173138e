#!/usr/bin/python3
"""End-to-end proof of the CPU-emulation mode and the autograd tracker, with no GPU.

One training step of models.build()'s transformer (4 layers, causal attention, layer norm,
residual connections, an in-place ReLU) runs three times, each in a fresh child process
(harness.py: ref without vramswap, peak with vramswap's allocator and no offload, offload
under vramswap.offload() with VRAMSWAP_LIMIT at LIMIT_PERCENT of that peak), and the test
checks that
  1. torch's CPU tensors come from vramswap (num_allocs grows with each new tensor),
  2. the offloaded step's loss and every gradient are bit-identical (torch.equal) to the
     reference, with evictions and prefetches, the peak within the limit, every handle
     released,
  3. a tensor saved for backward that the forward still references is never evicted while
     referenced: at each residual add (models.py's probe) the residual input is one of the
     tracker's saved blocks, not marked cold, and readable (a read in a forked child does
     not fault) — while other saved blocks have already been evicted,
  4. between forward and backward, evicted saved blocks are really unmapped (a read in a
     forked child dies of SIGSEGV).

Usage: python3 tests/python/test_cpu_emulation.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY (libvramswap.so; default <repo>/build/lib/libvramswap.so) and
VRAMSWAP_CUDASIM_DIR (default: the sim/ directory beside it).
"""
import gc
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

HORIZON = 2
LIMIT_PERCENT = {"step": 50}  # of the step's peak without offload


def faults_on_read(ptr):
    """True when reading one byte at ptr kills a forked child with SIGSEGV (unmapped)."""
    import ctypes
    pid = os.fork()
    if pid == 0:
        ctypes.string_at(ptr, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV


def saved_blocks():
    """The tracker's live saved blocks: {data_ptr: handle}."""
    from vramswap import tracker
    return {o.tensor.data_ptr(): o.handle for o in gc.get_objects()
            if isinstance(o, tracker._Saved) and o.tensor is not None}


def instrument(vramswap, torch, model, result):
    from vramswap import tracker
    probes = result.setdefault("probes", [])

    def probe(name, x):
        handle = saved_blocks().get(x.data_ptr())
        probes.append({
            "name": name,
            "saved": handle is not None,
            "not_cold": handle is not None and tracker._tracker.is_pending(handle),
            "readable": not faults_on_read(x.data_ptr()),
            "evictions_before": vramswap.memory_stats()["num_evictions"],
        })

    def between():
        ptrs = list(saved_blocks())
        result["unmapped_saved_blocks"] = [sum(faults_on_read(p) for p in ptrs), len(ptrs)]

    model.set_probe(probe)
    return between


def extra_checks(check, runs):
    _, _, _, info = runs["step"]
    probes = info["probes"]
    check(len(probes) == 8, f"residual probes ran ({len(probes)} of 8: 2 per layer)")
    check(all(p["saved"] for p in probes),
          "every residual input was a saved block the tracker holds when the forward used it")
    check(all(p["not_cold"] and p["readable"] for p in probes),
          "no residual input was marked cold or evicted while the forward still referenced it "
          + str([(p["name"], p["not_cold"], p["readable"]) for p in probes if not (p["not_cold"] and p["readable"])]))
    under_pressure = sum(p["evictions_before"] > 0 for p in probes)
    check(under_pressure > 0, f"{under_pressure} of those residuals were used after evictions had begun")
    unmapped, tracked = info["unmapped_saved_blocks"]
    check(unmapped > 0, f"{unmapped} of {tracked} saved blocks were unmapped between forward and backward "
          "(a read faults with SIGSEGV)")


if __name__ == "__main__":
    sys.exit(harness.main(__file__, sys.argv[1:], LIMIT_PERCENT, HORIZON, instrument, extra_checks))
