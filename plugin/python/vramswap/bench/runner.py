"""Runs a Workload against one allocator policy on cudasim in virtual time.

Note [One child process per run]
--------------------------------
libvramswap.so and cudasim load once per process, and vramswap's limit, horizon and soft
limit are fixed when its first allocation creates the device pool; cudasim reads its
CUDASIM_* settings once too. So every run (one workload under one policy and one
configuration) executes in a fresh `python3` child process whose environment carries the
whole configuration. The parent pickles the workload's ops to a file once, starts the
children (run_many keeps `workers` of them busy), and reads each child's result back as
JSON. The parent never loads either library, so it can run any number of configurations.

What the child does is interpreter.py (the ops) and policy_*.py (one module per policy;
Note [offload_all] in policy_offload_all.py); what a run measures, the warm-up steps and
the bound beside every result are measure.py's Notes.

Note [A disk in the benchmark]
------------------------------
A run with disk_gbps has a disk tier (VRAMSWAP_DISK_DIR, a directory of its own in the
runs' temporary directory, gone with it) behind a pinned tier of host_limit_bytes, with
its I/O on streams (VRAMSWAP_DISK_IO=cufile): cudasim's libcufile queues each read and
write on the disk engine at CUDASIM_DISK_GBPS, one engine for reads and writes, so a step
that waits for the disk is charged for it on the virtual clock. With CUDASIM_UNBACKED the
I/O moves no bytes (as the copies move none), so the file holds only its reserved space.

Thread safety: run() and run_many() may be called from any thread; each child is a process
of its own.
"""
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .interpreter import _Counters, _TimelineEntry  # noqa: F401  (the layout tests check them here)
from .measure import (DEFAULT_WARMUP, FIRST_STEP_KEYS, KIND_NAMES, RunError, add_bound,  # noqa: F401
                      first_step_figures, live_base_bytes, step_start)

POLICIES = ("none", "vramswap", "offload_all")
DUPLEX = ("full", "shared")
GiB = 1 << 30

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # plugin/python


# ---- the parent side ---------------------------------------------------------------------

def _spec(policy, card_bytes, pcie_gbps, limit_bytes=None, horizon=4, soft_limit=None,
          duplex="full", hbm_gbps=None, min_offload_bytes=None, host_limit_bytes=None,
          record=True, label=None, warmup=0, disk_gbps=None):
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if duplex not in DUPLEX:
        raise ValueError(f"duplex must be one of {', '.join(DUPLEX)}, not {duplex!r}")
    if int(card_bytes) < (64 << 20):
        raise ValueError(f"card_bytes {card_bytes} is below cudasim's smallest card (64 MiB)")
    if not pcie_gbps or float(pcie_gbps) <= 0:
        raise ValueError(f"pcie_gbps must be positive, not {pcie_gbps!r}")
    if horizon is None or int(horizon) < 0:
        raise ValueError(f"horizon must be a non-negative integer, not {horizon!r}")
    if limit_bytes is not None and int(limit_bytes) <= 0:
        raise ValueError(f"limit_bytes must be positive, not {limit_bytes!r}")
    if warmup is None or int(warmup) < 0:
        raise ValueError(f"warmup must be a non-negative integer, not {warmup!r}")
    if disk_gbps is not None and not float(disk_gbps) > 0:
        raise ValueError(f"disk_gbps must be positive, not {disk_gbps!r}")
    return {
        "policy": policy, "card_bytes": int(card_bytes), "pcie_gbps": float(pcie_gbps),
        "limit_bytes": None if limit_bytes is None else int(limit_bytes),
        "horizon": int(horizon), "soft_limit": soft_limit, "duplex": duplex,
        "hbm_gbps": hbm_gbps, "min_offload_bytes": min_offload_bytes,
        # Unbacked pinned memory costs nothing; the tier must never be what stops a run.
        "host_limit_bytes": int(host_limit_bytes or max(4 * int(card_bytes), 64 * GiB)),
        "record": bool(record), "label": label, "warmup": int(warmup),
        "disk_gbps": None if disk_gbps is None else float(disk_gbps),
    }


def _child_env(spec):
    env = dict(os.environ)
    # A parent with the CPU-emulation mode switched on must not make the child import torch.
    env.pop("VRAMSWAP_TORCH_DEVICE", None)
    # CUDASIM_HOST_COSTS and CUDASIM_HOST_VMM pass: what the host's slow calls cost, and
    # whether the driver can map host memory (kept blocks stay addressable), are the caller's
    # questions.
    for key in [k for k in env if k.startswith("CUDASIM_") or k.startswith("VRAMSWAP_")]:
        if key not in ("VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR", "CUDASIM_HOST_COSTS", "CUDASIM_HOST_VMM"):
            del env[key]
    env["PYTHONPATH"] = str(_PACKAGE_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({
        "CUDASIM_TIME": "virtual",
        "CUDASIM_UNBACKED": "1",
        "CUDASIM_DEVICE_MEMORY": str(spec["card_bytes"]),
        "CUDASIM_PCIE_GBPS": repr(spec["pcie_gbps"]),
        "CUDASIM_PCIE_DUPLEX": spec["duplex"],
        "VRAMSWAP_HOST_LIMIT": str(spec["host_limit_bytes"]),
        "VRAMSWAP_HORIZON": str(spec["horizon"]),
        "VRAMSWAP_LOG": "error",
    })
    if spec["hbm_gbps"]:
        env["CUDASIM_HBM_GBPS"] = repr(float(spec["hbm_gbps"]))
    if spec["limit_bytes"]:
        env["VRAMSWAP_LIMIT"] = str(spec["limit_bytes"])
    if spec["soft_limit"] is not None:
        env["VRAMSWAP_SOFT_LIMIT"] = str(spec["soft_limit"])
    if spec["min_offload_bytes"] is not None:
        env["VRAMSWAP_MIN_OFFLOAD_BYTES"] = str(spec["min_offload_bytes"])
    if spec.get("disk_gbps"):
        # Note [A disk in the benchmark]: the tier's I/O on streams, which cudasim times.
        env.update({"VRAMSWAP_DISK_DIR": spec["disk_dir"], "VRAMSWAP_DISK_IO": "cufile",
                    "CUDASIM_DISK_GBPS": repr(spec["disk_gbps"])})
    return env


class _Job:
    """One child process: start() launches it, poll() says whether it ended (killing it
    past its time limit), finish() reads its result."""

    def __init__(self, ops_path, spec, workdir, index, timeout_s):
        self.spec = spec
        self.spec_path = Path(workdir) / f"spec{index}.json"
        self.out_path = Path(workdir) / f"result{index}.json"
        self.err_path = Path(workdir) / f"stderr{index}.txt"
        self.timeout_s = timeout_s
        self.timed_out = False
        if spec.get("disk_gbps"):
            disk_dir = Path(workdir) / f"disk{index}"
            disk_dir.mkdir(mode=0o700)
            spec = self.spec = dict(spec, disk_dir=str(disk_dir))
        self.spec_path.write_text(json.dumps({"ops_path": str(ops_path), **spec}))
        self.proc = self.err = None

    def start(self):
        code = ("import sys; from vramswap.bench.interpreter import _child_main; "
                "sys.exit(_child_main(sys.argv[1], sys.argv[2]))")
        self.err = open(self.err_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.spec_path), str(self.out_path)],
                                     env=_child_env(self.spec), stdin=subprocess.DEVNULL,
                                     stdout=self.err, stderr=self.err)
        self.started = time.monotonic()

    def poll(self):
        if self.proc.poll() is not None:
            return True
        if time.monotonic() - self.started > self.timeout_s:
            self.timed_out = True
            self.stop()
            return True
        return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()

    def finish(self):
        self.err.close()
        stderr = self.err_path.read_text(errors="replace")
        if self.proc.returncode == 0 and self.out_path.exists():
            result = json.loads(self.out_path.read_text())
            result["wall_s"] = round(time.monotonic() - self.started, 3)
            if stderr.strip():
                result["stderr_tail"] = stderr[-2000:]
            return result
        what = (f"timed out after {self.timeout_s} s" if self.timed_out
                else f"exited with status {self.proc.returncode}")
        raise RunError(f"the {self.spec['policy']} run (limit {self.spec['limit_bytes']}, horizon "
                       f"{self.spec['horizon']}) {what}; its output ends:\n{stderr[-3000:]}")


def _dump_ops(workload, workdir):
    path = Path(workdir) / "ops.pickle"
    with open(path, "wb") as f:
        pickle.dump({"name": workload.name, "ops": workload.ops, "live_base_bytes": live_base_bytes(workload)},
                    f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def run_many(workload, specs, workers=2, timeout_s=600, on_result=None):
    """Runs `workload` once per entry of `specs` (dicts of run()'s keyword arguments, with
    "policy", "card_bytes" and "pcie_gbps"), `workers` child processes at a time, and returns
    the results in the order of `specs`. on_result(index, result) is called as each one
    ends. Raises RunError when a child fails (not for an out-of-memory, which is a result)."""
    specs = [_spec(**s) for s in specs]
    results = [None] * len(specs)
    bounds = {}  # the runs' lower bounds, computed once per limit and link
    with tempfile.TemporaryDirectory(prefix="vramswap-bench-") as workdir:
        ops_path = _dump_ops(workload, workdir)
        queue = [(i, _Job(ops_path, s, workdir, i, timeout_s)) for i, s in enumerate(specs)]
        running = []
        try:
            while queue or running:
                while queue and len(running) < max(1, workers):
                    i, job = queue.pop(0)
                    job.start()
                    running.append((i, job))
                for i, job in [(i, j) for i, j in running if j.poll()]:
                    running.remove((i, job))
                    result = job.finish()
                    result["workload"] = workload.name
                    add_bound(result, workload, bounds)
                    results[i] = result
                    if on_result:
                        on_result(i, result)
                if running:
                    time.sleep(0.005)
        finally:
            for _, job in running:
                job.stop()
    return results


def run(workload, policy, card_bytes, pcie_gbps, timeout_s=600, **options):
    """Executes `workload` under `policy` ("none", "vramswap" or "offload_all") on a cudasim
    card of `card_bytes` with a PCIe link of `pcie_gbps` GB/s per direction, in a child
    process, and returns the result dict (see Note [What is measured]). Options:
    limit_bytes (VRAMSWAP_LIMIT: the pool's cap, for every policy; vramswap evicts to stay
    under it, the others run out of memory at it), horizon (VRAMSWAP_HORIZON; offload_all's
    prefetch depth), soft_limit (VRAMSWAP_SOFT_LIMIT, a size or a percentage), duplex
    ("full" or "shared"), hbm_gbps, min_offload_bytes, host_limit_bytes, record (keep the
    timeline and the memory series), label, warmup (steps run before the measured one: see
    Note [Warm-up steps]), disk_gbps (a disk tier behind the pinned one, at that rate: Note
    [A disk in the benchmark]). Raises ValueError for a bad argument, RunError
    when the child fails."""
    spec = dict(options, policy=policy, card_bytes=card_bytes, pcie_gbps=pcie_gbps)
    return run_many(workload, [spec], workers=1, timeout_s=timeout_s)[0]
