#!/usr/bin/env python3
"""What breaks for other pluggable allocators, checked for vramswap as torch's allocator:
each case in a child process of its own (the swap is once per process).

  empty_cache      vramswap.install(); 256 MiB of tensors made and dropped; then
                   torch.cuda.empty_cache() must give vramswap's cached memory back to the
                   device: vramswap's reserved bytes fall to what live tensors hold, and the
                   device's free memory (cudaMemGetInfo) rises by at least what vramswap gave
                   back (pytorch #145168: a pluggable allocator's memory stayed reserved).
  expandable       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment, then
                   vramswap.install() and a training step's worth of allocations: they must
                   go through vramswap (its counters move) or install() must refuse, naming
                   the variable (pytorch #147851: expandable segments with a pluggable
                   allocator); never a silent fall-back to torch's allocator.
  host_vmm         whether the driver can create host memory of the VMM API
                   (CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED): where it
                   can, an evicted kept block stays addressable (Note [Kept blocks stay
                   addressable] in src/residency/engine_copies.cpp). A fact to record, never a
                   failure.

--cpu-sim runs what the CPU-emulation mode can (no GPU: vramswap.sim.install_cpu(), and
vramswap.empty_cache() in place of torch.cuda.empty_cache(); the expandable case needs CUDA
and is skipped), so that CTest keeps the script from rotting.

Output: --json FILE, {"cases": {name: {"status": "ok"|"failed"|"skipped", ...}}}; exit status
0 when no case failed.

Usage: python3 tests/gpu/allocator_hooks.py [--cpu-sim] [--json FILE]
       (run by tests/gpu/suite.py; --child CASE OUT runs one case)
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))
MIB = 1 << 20
CASES = ("empty_cache", "expandable", "host_vmm")
CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 141  # cuda.h


def mem_free(torch, cpu_sim):
    """The device's free bytes (cudaMemGetInfo), or None in the CPU-emulation mode."""
    return None if cpu_sim else torch.cuda.mem_get_info()[0]


def case_empty_cache(cpu_sim):
    import torch
    import vramswap
    if cpu_sim:
        vramswap.sim.install_cpu()
        device = "cpu"
    else:
        vramswap.install()
        device = "cuda"
    keep = torch.ones(1 << 20, device=device)  # 4 MiB that stays live
    tensors = [torch.ones(16 * MIB // 4, device=device) for _ in range(16)]  # 256 MiB
    del tensors
    if not cpu_sim:
        torch.cuda.synchronize()
    before = vramswap.memory_stats()
    free_before = mem_free(torch, cpu_sim)
    if cpu_sim:
        vramswap.empty_cache()
    else:
        torch.cuda.empty_cache()
    after = vramswap.memory_stats()
    free_after = mem_free(torch, cpu_sim)
    given_back = before["reserved_bytes.all.current"] - after["reserved_bytes.all.current"]
    live = after["allocated_bytes.all.current"]
    ok = given_back >= 256 * MIB and after["reserved_bytes.all.current"] <= live + 64 * MIB
    if free_before is not None:
        ok = ok and free_after - free_before >= given_back - 64 * MIB
    del keep
    return {"status": "ok" if ok else "failed", "reserved_before": before["reserved_bytes.all.current"],
            "reserved_after": after["reserved_bytes.all.current"], "live": live, "given_back": given_back,
            "device_free_before": free_before, "device_free_after": free_after,
            "how": "vramswap.empty_cache()" if cpu_sim else "torch.cuda.empty_cache()"}


def case_expandable(cpu_sim):
    if cpu_sim:
        return {"status": "skipped", "message": "needs CUDA (PYTORCH_CUDA_ALLOC_CONF is torch's CUDA allocator's)"}
    import torch
    import vramswap
    try:
        vramswap.install()
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        named = "PYTORCH_CUDA_ALLOC_CONF" in str(e) or "expandable" in str(e)
        return {"status": "ok" if named else "failed", "outcome": "refused", "message": str(e)[:600]}
    x = torch.randn(64, 1 << 20, device="cuda")
    y = (x * 2).sum()
    torch.cuda.synchronize()
    after = vramswap.memory_stats()
    went_through = after["allocated_bytes.all.peak"] >= 256 * MIB
    return {"status": "ok" if went_through else "failed", "outcome": "installed", "sum": float(y),
            "vramswap_peak_allocated": after["allocated_bytes.all.peak"],
            "torch_reports_allocated": torch.cuda.memory_allocated(),
            "message": "" if went_through else "the allocations did not reach vramswap"}


def case_host_vmm(cpu_sim):
    if cpu_sim:
        sim = os.environ.get("VRAMSWAP_CUDASIM_DIR")
        if not sim:
            return {"status": "skipped", "message": "VRAMSWAP_CUDASIM_DIR is not set"}
        cuda = ctypes.CDLL(os.path.join(sim, "libcuda.so.1"))
    else:
        cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        return {"status": "failed", "message": "cuInit failed"}
    value = ctypes.c_int(0)
    rc = cuda.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                   0)
    if rc != 0:
        return {"status": "ok", "supported": None, "message": f"the driver does not know the attribute ({rc})"}
    return {"status": "ok", "supported": bool(value.value)}


def child(case, out, cpu_sim):
    try:
        result = globals()["case_" + case](cpu_sim)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        result = {"status": "failed", "message": f"{type(e).__name__}: {e}"[:600]}
    Path(out).write_text(json.dumps(result))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-sim", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "OUT"))
    a = ap.parse_args(argv)
    if a.cpu_sim:
        os.environ["VRAMSWAP_TORCH_DEVICE"] = "cpu-sim"
    if a.child:
        child(a.child[0], a.child[1], a.cpu_sim)
        return 0
    cases = {}
    with tempfile.TemporaryDirectory(prefix="vramswap-hooks-") as tmp:
        for case in CASES:
            out = Path(tmp) / f"{case}.json"
            env = dict(os.environ)
            if case == "expandable":
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case, str(out)]
            proc = subprocess.run(cmd + (["--cpu-sim"] if a.cpu_sim else []), env=env, capture_output=True,
                                  text=True, timeout=300)
            if out.exists():
                cases[case] = json.loads(out.read_text())
            else:
                cases[case] = {"status": "failed", "message": f"the child died ({proc.returncode}): "
                                                              f"{(proc.stderr or proc.stdout)[-600:]}"}
            print(f"{case:12s} {cases[case]['status']}: "
                  + json.dumps({k: v for k, v in cases[case].items() if k != "status"})[:400])
    if a.json:
        Path(a.json).write_text(json.dumps({"cases": cases}, indent=1) + "\n")
    return 1 if any(c["status"] == "failed" for c in cases.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
