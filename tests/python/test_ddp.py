#!/usr/bin/python3
"""Two-rank DDP (gloo) under `python3 -m vramswap run`, in the CPU-emulation mode.

tests/python/scripts/train_ddp.py (plain torch: DistributedDataParallel, gloo, AdamW, 3
steps, each rank on its own batch) is launched as torchrun would launch it, one process
per rank with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (Debian's
torchrun fails on Python 3.11 with torch 1.13 in its elastic redirect parsing), three times:
  plain     python3 train_ddp.py OUT-r
  peak      python3 -m vramswap run --no-offload -- python3 train_ddp.py OUT-r, with
            VRAMSWAP_STATS_FILE=peak-{rank}.json: each rank's peak reserve, no limit
  offload   python3 -m vramswap run -- python3 train_ddp.py OUT-r, each rank with
            VRAMSWAP_LIMIT at LIMIT_PERCENT of its own peak and VRAMSWAP_STATS_FILE=
            offload-{rank}.json ({rank} is RANK: one file per rank)
and checks that each rank's results (losses and parameters after the last step) are
byte-identical to the plain run's, that the parameters agree across ranks, and that each
rank's stats file shows evictions and a peak within its limit.

First, `vramswap run` wrapped around the launcher (`vramswap run -- python3 -m
torch.distributed.run ... train_ddp.py`, and `-- torchrun ...`) must refuse with exit status
2 and say where it goes (`torchrun ... -m vramswap run -- ...`), before any rank starts: the
launcher starts every rank in a process of its own, where vramswap would not be installed.

Usage: python3 tests/python/test_ddp.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_vramswap_run.py).
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from environment import child_environment

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "python" / "scripts" / "train_ddp.py"
LIMIT_PERCENT = 60
WORLD = 2
MIB = 1 << 20

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(prefix, tmp, tag, per_rank_env):
    """Starts WORLD ranks of `prefix + [SCRIPT, OUT]` as torchrun would; returns
    [(returncode, stdout, stderr, results or None)] by rank."""
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        env = child_environment()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        env.update(per_rank_env(rank))
        out = Path(tmp) / f"{tag}-{rank}.json"
        procs.append((subprocess.Popen(prefix + [str(SCRIPT), str(out)], env=env, cwd=tmp, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True), out))
    results = []
    for proc, out in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        results.append((proc.returncode, stdout, stderr, json.loads(out.read_text()) if out.exists() else None))
    return results


def check_wrapped_launcher_refused(tmp):
    """`vramswap run` around torchrun would install vramswap in the launcher alone."""
    py = sys.executable
    out = Path(tmp) / "wrapped.json"
    for launcher in (["python3", "-m", "torch.distributed.run"], ["torchrun"]):
        proc = subprocess.run([py, "-m", "vramswap", "run", "--"] + launcher
                              + ["--standalone", "--nproc-per-node", str(WORLD), str(SCRIPT), str(out)],
                              env=child_environment({"VRAMSWAP_TORCH_DEVICE": "cpu-sim"}), cwd=tmp,
                              capture_output=True, text=True, timeout=300)
        check(proc.returncode == 2 and "-m vramswap run --" in proc.stderr and not out.exists(),
              f"vramswap run -- {' '.join(launcher)} ...: refused with status 2 ({proc.returncode}), no rank "
              f"started, and says to put vramswap run after the launcher: {proc.stderr.strip()[-400:]}")


def main():
    py = sys.executable
    run = [py, "-m", "vramswap", "run"]
    with tempfile.TemporaryDirectory(prefix="vramswap-ddp-") as tmp:
        check_wrapped_launcher_refused(tmp)
        plain = launch([py], tmp, "plain", lambda rank: {})
        for rank, (rc, _, err, res) in enumerate(plain):
            check(rc == 0 and res is not None, f"plain DDP, rank {rank} trained (status {rc}) {err[-600:]}")
        if failures:
            return 1
        check(plain[0][3]["params"] == plain[1][3]["params"], "plain DDP: the ranks' parameters agree")

        cpu_sim = {"VRAMSWAP_TORCH_DEVICE": "cpu-sim"}
        peak = launch(run + ["--no-offload", "--", "python3"], tmp, "peak",
                      lambda rank: dict(cpu_sim, VRAMSWAP_STATS_FILE=str(Path(tmp) / "peak-{rank}.stats")))
        limits = []
        for rank, (rc, _, err, res) in enumerate(peak):
            stats_path = Path(tmp) / f"peak-{rank}.stats"
            check(rc == 0 and res == plain[rank][3] and stats_path.exists(),
                  f"--no-offload, rank {rank}: trained, identical, and wrote peak-{rank}.stats ({rc}) {err[-600:]}")
            reserve = json.loads(stats_path.read_text())["peak_reserved_bytes"] if stats_path.exists() else 0
            limits.append(reserve * LIMIT_PERCENT // 100 // MIB * MIB)
        if failures:
            return 1

        off = launch(run + ["--", "python3"], tmp, "offload",
                     lambda rank: dict(cpu_sim, VRAMSWAP_LIMIT=str(limits[rank]),
                                       VRAMSWAP_STATS_FILE=str(Path(tmp) / "offload-{rank}.stats")))
        for rank, (rc, out, err, res) in enumerate(off):
            check(rc == 0 and res == plain[rank][3],
                  f"under vramswap run at {LIMIT_PERCENT}% ({limits[rank] // MIB} MiB), rank {rank}: losses and "
                  f"parameters identical to plain DDP's (status {rc}) {err[-800:]}")
            stats_path = Path(tmp) / f"offload-{rank}.stats"
            st = json.loads(stats_path.read_text()) if stats_path.exists() else {}
            check(st.get("num_evictions", 0) > 0 and st.get("num_ooms", 1) == 0
                  and st.get("peak_reserved_bytes", limits[rank] + 1) <= limits[rank],
                  f"rank {rank}: its own stats file, evictions ({st.get('num_evictions')}), no out-of-memory, peak "
                  f"{st.get('peak_reserved_bytes', 0) / MIB:.1f} MiB within {limits[rank] // MIB} MiB")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
