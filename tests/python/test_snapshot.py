#!/usr/bin/python3
"""Memory snapshots in torch's format, after training under offload, in the CPU-emulation
mode: one training step of models.build()'s transformer (forward under vramswap.offload(),
backward) with VRAMSWAP_LIMIT at half the run's peak without offload, memory history
recorded from the start (vramswap.record_memory_history()).

Checks (beside harness.py's: bit-identical losses and gradients, evictions, prefetches, the
limit, every handle released):
  * vramswap.dump_snapshot() writes torch's snapshot layout (a dict of "segments" and
    "device_traces"); every segment's blocks add up to its total_size (torch's tools assert
    it) and the trace holds the step's allocations and completed frees, and the evictions
    and fetches as "segment_unmap"/"segment_map" events marked "evict"/"fetch";
  * `python3 -m vramswap replay` reads the dump and replays it;
  * torch's own `python3 -m torch.cuda._memory_viz stats` reads the dump, and a pickle of
    vramswap.memory_snapshot() (torch.cuda.memory_snapshot()'s list of segments), whose
    report gives the list's segment count, their total size as reserved, and the live
    blocks' requested bytes as allocated (its segment summary, segsum()).

Usage: python3 tests/python/test_snapshot.py   (exit status 0: every check held)
"""
import atexit
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

HORIZON = 2
LIMIT_PERCENT = {"step": 50}
OUT = "SNAPSHOT_TEST_OUT"  # where the offload child writes its dumps


def instrument(vramswap, torch, model, result):
    """In the offload child: history from the start; memory_snapshot() between forward and
    backward (saved tensors live, some evicted); the dump when the child exits (after the
    step, its statistics written)."""
    vramswap.record_memory_history(max_entries=1_000_000)
    path = os.environ[OUT]
    atexit.register(lambda: vramswap.dump_snapshot(path))

    def between():
        with open(path + ".segments", "wb") as f:
            pickle.dump(vramswap.memory_snapshot(), f)
        result["evicted_between"] = len(vramswap.snapshot()["vramswap"]["evicted"])
    return between


def extra_checks(check, runs):
    path = os.environ[OUT]
    with open(path, "rb") as f:
        data = pickle.load(f)
    check(isinstance(data, dict) and isinstance(data.get("segments"), list)
          and isinstance(data.get("device_traces"), list), "the dump is torch's layout: segments, device_traces")
    bad = [s["address"] for s in data["segments"] if sum(b["size"] for b in s["blocks"]) != s["total_size"]]
    check(data["segments"] and not bad, f"{len(data['segments'])} segments, each tiled by its blocks"
          + (f" (not: {bad})" if bad else ""))
    # What torch 2.1+'s _memory_viz reads of each block and segment (its segment summary takes
    # an active block's requested_size as allocated, the rest of its size as internal free).
    odd = [(s["address"], b.get("address")) for s in data["segments"] for b in s["blocks"]
           if not isinstance(b.get("frames"), list) or "stream" not in s
           or not 0 < b.get("requested_size", -1) <= b["size"]]
    check(not odd, "every block has frames and 0 < requested_size <= size; every segment a stream"
          + (f" (not: {odd[:4]})" if odd else ""))
    trace = data["device_traces"][0] if data["device_traces"] else []
    actions = [e["action"] for e in trace]
    stats = runs["step"][3]["stats"]
    evicted = [e for e in trace if e.get("vramswap") == "evict"]
    fetched = [e for e in trace if e.get("vramswap") == "fetch"]
    print(f"     trace: {len(trace)} events: " + ", ".join(f"{a} {actions.count(a)}" for a in sorted(set(actions)))
          + f"; evict {len(evicted)}, fetch {len(fetched)}")
    check(actions.count("alloc") > 0 and actions.count("free_completed") > 0, "the trace has allocs and frees")
    check(all(e["action"] == "segment_unmap" for e in evicted) and len(evicted) > 0,
          f"evictions are in the trace as segment_unmap marked evict ({len(evicted)}; "
          f"{stats['num_evictions']} evictions counted)")
    check(any(e["action"] == "segment_map" for e in fetched),
          f"fetches are in the trace as segment_map marked fetch ({len(fetched)})")
    check(all(a["time_us"] <= b["time_us"] for a, b in zip(trace, trace[1:])), "the trace is in time order")

    env = dict(os.environ, PYTHONPATH=str(harness.REPO / "plugin" / "python"))
    replay = subprocess.run([sys.executable, "-m", "vramswap", "replay", "--json", "--policy", "none",
                             "--warmup", "0", path], env=env, capture_output=True, text=True, timeout=300)
    check(replay.returncode == 0 and '"status": "ok"' in replay.stdout,
          f"vramswap replay reads the dump (status {replay.returncode}"
          + (f": {replay.stderr.strip()[-400:]}" if replay.returncode else "") + ")")

    def memory_viz_stats(file):
        return subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", file],
                              capture_output=True, text=True, timeout=120)

    viz = memory_viz_stats(path)
    check(viz.returncode == 0 and f"segments: {len(data['segments'])}" in viz.stdout.splitlines(),
          f"torch.cuda._memory_viz stats reads the dump (status {viz.returncode}"
          f"{': ' + viz.stderr.strip()[-400:] if viz.returncode else ''})")
    viz = memory_viz_stats(path + ".segments")
    check(viz.returncode == 0, f"torch.cuda._memory_viz stats reads memory_snapshot()'s pickle (status "
          f"{viz.returncode}{': ' + viz.stderr.strip()[-400:] if viz.returncode else ''})")
    print("     " + viz.stdout.strip().replace("\n", "\n     "))
    with open(path + ".segments", "rb") as f:
        listed = pickle.load(f)
    total = sum(s["total_size"] for s in listed)
    live = sum(b["requested_size"] for s in listed for b in s["blocks"] if b["state"] == "active_allocated")
    from torch.cuda._memory_viz import Bytes  # the tool's own rendering of a byte count
    want = [f"segments: {len(listed)}", f"total_reserved: {Bytes(total)}", f"total_allocated: {Bytes(live)}"]
    missing = [w for w in want if w not in viz.stdout.splitlines()]
    check(not missing, f"its report counts the {len(listed)} segments and the live blocks ({live} "
          f"requested bytes of {total})" + (f" (no line {'; '.join(missing)})" if missing else ""))
    info = runs["step"][3]
    check(info.get("evicted_between", 0) > 0,
          f"between forward and backward, snapshot() lists evicted blocks ({info.get('evicted_between')})")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault(OUT, os.path.join(tmp, "snapshot.pickle"))
        sys.exit(harness.main(__file__, sys.argv[1:], LIMIT_PERCENT, HORIZON, instrument=instrument,
                              extra_checks=extra_checks))
