#!/usr/bin/python3
"""The disk tier on real autograd, in the CPU-emulation mode: three training steps of
models.build()'s transformer under vramswap.offload() with VRAMSWAP_LIMIT at half the run's
peak without offload, and the pinned host tier capped at a quarter of the bytes one step
evicts (VRAMSWAP_HOST_LIMIT), with VRAMSWAP_DISK_DIR set.

Checks: losses and gradients bit-identical to the run without vramswap; blocks went to the
disk (disk_bytes_written > 0), some written ahead of need and read back ahead of use (Notes
[Writing ahead to the disk] and [Reading ahead from the disk]), and all came back
(disk_bytes 0 at the end); the peak within the limit; nothing left in the directory. The
same with the tier's I/O on streams (VRAMSWAP_DISK_IO=cufile, cudasim's libcufile), and,
where libcufile cannot be loaded (a cudasim directory without it), a warning that says so
and the run on the tier's threads, still bit-identical. Then
the same run with the directory on a full filesystem (a 1 MiB tmpfs, mounted as root or in
a namespace of the child's own): the run stops with an out-of-memory that names the
directory and why, instead of a wrong byte.

Usage: python3 tests/python/test_disk_tier.py   (exit status 0: every check held)
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

HORIZON = 2
CASE = "train3"
STEPS = 3
MIB = 1 << 20
SCRIPT = Path(__file__).resolve()


def main(argv):
    if argv and argv[0] == "--child":
        harness.child_main(argv[1:], HORIZON)
        return 0
    check = harness.Checks()
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as disk:
        ref = harness.run_child(SCRIPT, "ref", tmp, [CASE])[CASE]
        peak = harness.run_child(SCRIPT, "peak", tmp, [CASE])[CASE]
        peak_bytes = peak[1]["stats"]["peak_reserved_bytes"]
        limit = (peak_bytes // 2) // MIB * MIB
        plain = harness.run_child(SCRIPT, "offload", tmp, [CASE], limit)[CASE]
        per_step = plain[1]["stats"]["bytes_evicted_total"] // STEPS
        host_limit = max(2 * MIB, per_step // 4 // MIB * MIB)
        print(f"== {CASE}: peak without offload {peak_bytes / MIB:.1f} MiB, limit {limit / MIB:.0f} MiB, "
              f"{per_step / MIB:.1f} MiB evicted a step, host tier {host_limit / MIB:.0f} MiB")
        check(host_limit * 3 < per_step, f"the host tier ({host_limit} B) holds well under a step's evictions "
              f"({per_step} B)")

        os.environ["VRAMSWAP_HOST_LIMIT"] = str(host_limit)
        os.environ["VRAMSWAP_DISK_DIR"] = disk
        off = harness.run_child(SCRIPT, "offload", tmp, [CASE], limit)[CASE]
        s = off[1]["stats"]
        print("     stats: " + ", ".join(f"{k}={s[k]}" for k in (
            "bytes_evicted_total", "peak_host_bytes", "disk_bytes_written", "disk_bytes_read", "disk_bytes_read_ahead",
            "disk_bytes_written_ahead", "disk_bytes",
            "num_ooms")))
        harness.same_results(check, f"{CASE}: offload through the disk tier", ref[0], off[0])
        check(s["disk_bytes_written"] > 0, f"blocks went on to the disk ({s['disk_bytes_written']} B)")
        check(s["disk_bytes_read"] > 0, f"and came back ({s['disk_bytes_read']} B)")
        check(s["disk_bytes_read_ahead"] > 0, f"read back ahead of use ({s['disk_bytes_read_ahead']} B)")
        check(s["disk_bytes_written_ahead"] > 0, f"written ahead of need ({s['disk_bytes_written_ahead']} B)")
        check(s["disk_bytes"] == 0, f"nothing left on the disk at the end ({s['disk_bytes']} B)")
        check(s["peak_host_bytes"] <= host_limit, f"pinned memory within VRAMSWAP_HOST_LIMIT "
              f"({s['peak_host_bytes']} <= {host_limit})")
        check(s["peak_reserved_bytes"] <= limit, "device memory within VRAMSWAP_LIMIT")
        check(not os.listdir(disk), f"nothing left in the directory ({os.listdir(disk)})")

        # The tier's I/O on streams, through cudasim's libcufile.
        os.environ["VRAMSWAP_DISK_IO"] = "cufile"
        err = []
        cu = harness.run_child(SCRIPT, "offload", tmp, [CASE], limit, stderr=err)[CASE]
        harness.same_results(check, f"{CASE}: the disk tier's I/O on streams (cuFile)", ref[0], cu[0])
        s = cu[1]["stats"]
        check("libcufile" not in err[0], "cuFile was loaded (no warning about it)")
        check(s["disk_bytes_written"] > 0 and s["disk_bytes_read"] > 0 and s["disk_bytes"] == 0,
              f"blocks went on to the disk and all came back through cuFile ({s['disk_bytes_written']} B written, "
              f"{s['disk_bytes_read']} B read)")
        check(not os.listdir(disk), f"nothing left in the directory ({os.listdir(disk)})")

        # Where libcufile cannot be loaded (here: a cudasim directory without it), the tier
        # says so and runs on its threads.
        bare = os.path.join(tmp, "sim-without-cufile")
        os.mkdir(bare)
        sim = Path(os.environ.get("VRAMSWAP_CUDASIM_DIR") or SCRIPT.parents[2] / "build" / "sim")
        for lib in sim.iterdir():
            if not lib.name.startswith("libcufile"):
                os.symlink(lib, os.path.join(bare, lib.name))
        err = []
        saved = os.environ.get("VRAMSWAP_CUDASIM_DIR")
        os.environ["VRAMSWAP_CUDASIM_DIR"] = bare
        try:
            fallback = harness.run_child(SCRIPT, "offload", tmp, [CASE], limit, stderr=err)[CASE]
        finally:
            if saved is None:
                del os.environ["VRAMSWAP_CUDASIM_DIR"]
            else:
                os.environ["VRAMSWAP_CUDASIM_DIR"] = saved
            del os.environ["VRAMSWAP_DISK_IO"]
        harness.same_results(check, f"{CASE}: VRAMSWAP_DISK_IO=cufile without libcufile", ref[0], fallback[0])
        check("VRAMSWAP_DISK_IO=cufile: cannot load libcufile.so.0" in err[0] and "threads of its own" in err[0],
              "without libcufile: a warning names the setting and the missing library, and the tier runs on threads"
              + ("" if "threads of its own" in err[0] else f" ({err[0][-1500:]})"))
        check(fallback[1]["stats"]["disk_bytes_written"] > 0, "and blocks still went to the disk")

        # A disk that takes no more: the directory on a 1 MiB tmpfs (mounted directly as
        # root, else in a user and mount namespace of the child's own).
        full = os.path.join(tmp, "full")
        os.mkdir(full)
        env = dict(os.environ, VRAMSWAP_LOG="warn", VRAMSWAP_DISK_DIR=full)
        child = [sys.executable, str(SCRIPT), "--child", "offload", tmp, str(limit), CASE]
        mounted = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", full], capture_output=True).returncode == 0
        if not mounted:
            child = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{full}" && exec "$@"', "sh",
                     *child]
        try:
            proc = subprocess.run(child, env=env, capture_output=True, text=True, timeout=600)
        finally:
            if mounted:
                subprocess.run(["umount", full])
        err = proc.stderr
        if "mount:" in err or "unshare:" in err:
            check(False, f"a full disk: no small filesystem could be mounted here ({err[-500:]})")
        elif proc.returncode == 0:
            import torch
            out = torch.load(os.path.join(tmp, f"{CASE}.offload.pt"))
            harness.same_results(check, f"{CASE}: a full disk, the run fit anyway", ref[0], out)
        else:
            check("out of memory" in err and "the disk tier could not take more" in err and full in err
                  and "No space left on device" in err,
                  "a full disk: the run stops with an out-of-memory naming the directory and why"
                  + ("" if "No space left on device" in err else f" ({err[-2500:]})"))
            last = [line for line in err.splitlines() if "the disk tier could not take more" in line]
            if last:
                print("     " + last[-1][-400:])
    return check.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
