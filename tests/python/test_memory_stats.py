#!/usr/bin/python3
"""vramswap.memory_stats() carries torch.cuda.memory_stats()'s key names beside vramswap's,
they move with allocations, and vramswap.reset_peak_stats() resets both spellings. torch's
functions exist under torch's names (memory_allocated, max_memory_allocated,
memory_reserved, max_memory_reserved, reset_peak_memory_stats, memory_summary) and answer
from the same numbers. enable_peer_access refuses a device out of range.

Runs in the CPU-emulation mode (no GPU): torch's CPU tensors come from vramswap on cudasim.
Usage: python3 tests/python/test_memory_stats.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR (as test_cpu_emulation.py).
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

TORCH_KEYS = {  # torch's name -> vramswap's
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "peak_allocated_bytes",
    "active_bytes.all.current": "allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "reserved_bytes.all.peak": "peak_reserved_bytes",
    "num_ooms": "num_ooms",
}
MIB = 1 << 20


def main():
    import torch
    import vramswap
    vramswap.sim.install_cpu()
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    def consistent(s, where):
        bad = [k for k, v in TORCH_KEYS.items() if k not in s or s[k] != s[v]]
        check(not bad, f"{where}: torch keys present and equal to vramswap's" + (f" (bad: {bad})" if bad else ""))

    s0 = vramswap.memory_stats()
    consistent(s0, "initial")
    check("num_alloc_retries" not in s0, "num_alloc_retries is not reported (no equivalent)")
    for key in ("num_evictions", "num_prefetches", "resident_bytes", "devices", "peak_resident_bytes"):
        check(key in s0, f"vramswap key {key} kept")

    big = torch.empty(16 * MIB // 4)  # 16 MiB of float32
    s1 = vramswap.memory_stats()
    consistent(s1, "after a 16 MiB tensor")
    check(len(s1["devices"]) >= 1 and all(k in s1["devices"][0] for k in TORCH_KEYS),
          "per-device entries carry the torch keys")
    check(vramswap.memory_stats(0)["allocated_bytes.all.current"] == s1["devices"][0]["allocated_bytes"],
          "memory_stats(0) is device 0's entry")
    grew = s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"]
    check(grew >= 16 * MIB, f"allocated_bytes.all.current grew by the tensor ({grew} bytes)")
    check(s1["reserved_bytes.all.current"] >= s1["allocated_bytes.all.current"], "reserved >= allocated")
    check(s1["allocated_bytes.all.peak"] >= s1["allocated_bytes.all.current"], "peak >= current")
    check(s1["active_bytes.all.current"] == s1["allocated_bytes.all.current"], "active = allocated")

    # torch's functions, by torch's names: the same numbers, for the process or one device.
    for fn, key in (("memory_allocated", "allocated_bytes"), ("max_memory_allocated", "peak_allocated_bytes"),
                    ("memory_reserved", "reserved_bytes"), ("max_memory_reserved", "peak_reserved_bytes")):
        f = getattr(vramswap, fn, None)
        check(f is not None and f() == vramswap.memory_stats()[key] and f(0) == vramswap.memory_stats(0)[key]
              and f(torch.device("cpu", 0)) == f(0),
              f"vramswap.{fn}() is memory_stats()['{key}'], for the process and for device 0")

    # memory_summary(): torch's table layout, vramswap's numbers.
    summary = vramswap.memory_summary()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in summary.splitlines() if line.startswith("| ") and line.count("|") == 6}
    now = vramswap.memory_stats()
    for label in ("Allocated memory", "GPU reserved memory", "Resident (mapped)", "Offloadable (tagged)",
                  "Evicted to host", "In flight", "Host tier (pinned)", "Allocations", "Evictions",
                  "Fetches (prefetched)", "Faults (waited)", "Planned steps"):
        check(label in rows, f"memory_summary() has a '{label}' row")
    check(rows.get("Allocated memory", [""])[0] == vramswap._format_size(now["allocated_bytes"]).strip()
          and rows.get("GPU reserved memory", ["", ""])[1] == vramswap._format_size(now["peak_reserved_bytes"]).strip(),
          f"memory_summary()'s allocated and peak reserved cells are memory_stats()'s ({rows.get('Allocated memory')})")
    check(rows.get("Allocations", ["", "", ""])[2] == str(now["num_allocs"]),
          "memory_summary()'s allocations are num_allocs")
    check("device ID 0" in vramswap.memory_summary(0) and "all devices" in summary,
          "memory_summary(0) is device 0's, memory_summary() every device's")

    del big
    s2 = vramswap.memory_stats()
    consistent(s2, "after freeing it")
    check(s2["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"],
          "allocated_bytes.all.current back down after the free")
    check(s2["allocated_bytes.all.peak"] == s1["allocated_bytes.all.peak"], "allocated peak kept after the free")

    vramswap.empty_cache()  # so that the reserve drops too and the reserved peak can
    check(getattr(vramswap, "reset_peak_memory_stats", None) is not None, "torch's name reset_peak_memory_stats exists")
    vramswap.reset_peak_memory_stats()
    s3 = vramswap.memory_stats()
    consistent(s3, "after reset_peak_stats")
    check(s3["allocated_bytes.all.peak"] == s3["allocated_bytes.all.current"] < s1["allocated_bytes.all.peak"],
          f"reset_peak_memory_stats resets allocated_bytes.all.peak ({s1['allocated_bytes.all.peak']} -> "
          f"{s3['allocated_bytes.all.peak']})")
    check(s3["reserved_bytes.all.peak"] == s3["reserved_bytes.all.current"] < s1["reserved_bytes.all.peak"],
          f"reset_peak_stats resets reserved_bytes.all.peak to the current reserve "
          f"({s1['reserved_bytes.all.peak']} -> {s3['reserved_bytes.all.peak']})")
    check(s3["peak_allocated_bytes"] == s3["allocated_bytes"] and s3["peak_reserved_bytes"] == s3["reserved_bytes"],
          "reset_peak_stats resets vramswap's own peak keys")

    # enable_peer_access: device 0 with itself is nothing to do; a device out of range is
    # refused with the C ABI's message (two devices: tests/plugin's peer tests).
    vramswap.enable_peer_access(0, 0)
    try:
        vramswap.enable_peer_access(0, 64)
        check(False, "enable_peer_access(0, 64) raises")
    except vramswap.VramswapError as e:
        check("expected devices 0 to 63" in str(e), f"enable_peer_access(0, 64) raises, saying what is accepted ({e})")

    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
