#!/usr/bin/env python3
"""What CUDA's virtual memory management calls and pinned host allocation cost on this
machine: host time per call, as vramswap makes them (one 2 MiB granule of physical pages
per cuMemCreate, mapped and given access one granule at a time), batched (one
cuMemSetAccess / cuMemUnmap over many granules, one cuMemCreate of many granules), with one
handle per block by block size (does a call cost per call or per granule?), the
per-granule calls again while the device is busy with queued work, and the event calls the
pool and the engine make on every free and copy (create, record, query, destroy).

vramswap maps and unmaps granules whenever a block is evicted or fetched, so these costs
sit on the paths the copies' rate does not cover; cudasim models them from these figures.
Driver API through ctypes (libcuda.so.1): no torch, no compiler. --cpu-sim runs against
cudasim's libcuda (VRAMSWAP_CUDASIM_DIR), to exercise the script without a GPU.

Usage: python3 tests/gpu/vmm_cost.py [--granules N] [--json FILE] [--cpu-sim]
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
MIB = 1 << 20


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def load_driver(cpu_sim):
    if cpu_sim:
        sim = os.environ.get("VRAMSWAP_CUDASIM_DIR")
        if not sim:
            sys.exit("vmm_cost.py: --cpu-sim needs VRAMSWAP_CUDASIM_DIR (cudasim's build directory)")
        return ctypes.CDLL(str(Path(sim) / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL("libcuda.so.1")


class Driver:
    def __init__(self, lib):
        self.lib = lib

    def __call__(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUDA error {rc}")

    def try_call(self, name, *args):
        """True when the call exists and succeeds (cudasim implements a subset)."""
        fn = getattr(self.lib, name, None)
        return fn is not None and fn(*args) == 0


def timed(fn, n):
    """Host microseconds of each of n calls of fn(i)."""
    out = []
    for i in range(n):
        t = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t) / 1000.0)
    return out


def summary(samples):
    return {"calls": len(samples), "median_us": round(statistics.median(samples), 2),
            "mean_us": round(statistics.fmean(samples), 2), "max_us": round(max(samples), 2)}


def measure(cu, granules):
    u64 = ctypes.c_uint64
    cu("cuInit", 0)
    dev = ctypes.c_int(0)
    cu("cuDeviceGet", ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    cu("cuCtxSetCurrent", ctx)
    prop = AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                          location=Location(CU_MEM_LOCATION_TYPE_DEVICE, dev.value))
    gran = ctypes.c_size_t(0)
    cu("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    g = gran.value
    access = AccessDesc(location=Location(CU_MEM_LOCATION_TYPE_DEVICE, dev.value),
                        flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    total = g * granules
    base = u64(0)
    cu("cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(total), ctypes.c_size_t(g), u64(0), u64(0))
    handles = [u64(0) for _ in range(granules)]

    def addr(i):
        return u64(base.value + i * g)

    size = ctypes.c_size_t(g)
    res = {"granule_bytes": g, "granules": granules}
    # As vramswap does it: per granule, create, map, set access; later unmap; release.
    res["cuMemCreate"] = summary(timed(lambda i: cu("cuMemCreate", ctypes.byref(handles[i]), size,
                                                    ctypes.byref(prop), u64(0)), granules))
    res["cuMemMap"] = summary(timed(lambda i: cu("cuMemMap", addr(i), size, ctypes.c_size_t(0),
                                                 handles[i], u64(0)), granules))
    res["cuMemSetAccess"] = summary(timed(lambda i: cu("cuMemSetAccess", addr(i), size,
                                                       ctypes.byref(access), ctypes.c_size_t(1)), granules))
    res["cuMemUnmap"] = summary(timed(lambda i: cu("cuMemUnmap", addr(i), size), granules))
    # Batched: map every granule again, then one call over the whole range.
    for i in range(granules):
        cu("cuMemMap", addr(i), size, ctypes.c_size_t(0), handles[i], u64(0))
    res["cuMemSetAccess_range"] = summary(timed(lambda i: cu("cuMemSetAccess", base, ctypes.c_size_t(total),
                                                             ctypes.byref(access), ctypes.c_size_t(1)), 1))
    res["cuMemUnmap_range"] = summary(timed(lambda i: cu("cuMemUnmap", base, ctypes.c_size_t(total)), 1))
    res["cuMemRelease"] = summary(timed(lambda i: cu("cuMemRelease", handles[i]), granules))
    # One allocation of every granule's pages at once.
    big = u64(0)
    res["cuMemCreate_range"] = summary(timed(lambda i: cu("cuMemCreate", ctypes.byref(big), ctypes.c_size_t(total),
                                                          ctypes.byref(prop), u64(0)), 1))
    res["cuMemMap_range"] = summary(timed(lambda i: cu("cuMemMap", base, ctypes.c_size_t(total), ctypes.c_size_t(0),
                                                       big, u64(0)), 1))
    res["cuMemSetAccess_one_handle"] = summary(timed(lambda i: cu("cuMemSetAccess", base, ctypes.c_size_t(total),
                                                                  ctypes.byref(access), ctypes.c_size_t(1)), 1))
    res["cuMemUnmap_one_handle"] = summary(timed(lambda i: cu("cuMemUnmap", base, ctypes.c_size_t(total)), 1))
    cu("cuMemRelease", big)
    # One handle per block, by block size: does a call cost per call or per granule?
    by_size = {}
    for n in sorted({1, 4, 16, 64, granules} & set(range(1, granules + 1))):
        nbytes = ctypes.c_size_t(n * g)
        h = u64(0)
        t = {}
        t["create"] = timed(lambda i: cu("cuMemCreate", ctypes.byref(h), nbytes, ctypes.byref(prop), u64(0)), 1)[0]
        t["map"] = timed(lambda i: cu("cuMemMap", base, nbytes, ctypes.c_size_t(0), h, u64(0)), 1)[0]
        t["access"] = timed(lambda i: cu("cuMemSetAccess", base, nbytes, ctypes.byref(access), ctypes.c_size_t(1)), 1)[0]
        t["unmap"] = timed(lambda i: cu("cuMemUnmap", base, nbytes), 1)[0]
        t["release"] = timed(lambda i: cu("cuMemRelease", h), 1)[0]
        by_size[str(n)] = {k: round(v, 2) for k, v in t.items()}
    res["one_handle_by_granules"] = by_size
    # The per-granule calls again while the device is busy (a queue of memsets over a
    # scratch buffer), as during a training step.
    busy = {}
    scratch_bytes = 1 << 30
    scratch = u64(0)
    stream = ctypes.c_void_p()
    if cu.try_call("cuMemAlloc_v2", ctypes.byref(scratch), ctypes.c_size_t(scratch_bytes)) and \
            cu.try_call("cuStreamCreate", ctypes.byref(stream), 1):
        for _ in range(200):  # ~0.4 ms each at 3 TB/s: ~80 ms of device work queued
            cu("cuMemsetD8Async", scratch, ctypes.c_ubyte(1), ctypes.c_size_t(scratch_bytes), stream)
        hs = [u64(0) for _ in range(min(granules, 64))]
        n = len(hs)
        for i in range(n):
            cu("cuMemCreate", ctypes.byref(hs[i]), size, ctypes.byref(prop), u64(0))
        busy["cuMemMap"] = summary(timed(lambda i: cu("cuMemMap", addr(i), size, ctypes.c_size_t(0), hs[i], u64(0)), n))
        busy["cuMemSetAccess"] = summary(timed(lambda i: cu("cuMemSetAccess", addr(i), size, ctypes.byref(access),
                                                            ctypes.c_size_t(1)), n))
        busy["cuMemUnmap"] = summary(timed(lambda i: cu("cuMemUnmap", addr(i), size), n))
        busy["device_still_busy"] = cu.lib.cuStreamQuery(stream) != 0
        for i in range(n):
            cu("cuMemRelease", hs[i])
        cu("cuStreamSynchronize", stream)
        cu("cuStreamDestroy_v2", stream)
        cu("cuMemFree_v2", scratch)
    res["busy"] = busy
    # Events, as the pool and the engine use them on every free and copy: record on a stream,
    # query (complete and not yet), destroy. The hot path queries pending frees' events.
    events = {}
    stream = ctypes.c_void_p()
    if cu.try_call("cuStreamCreate", ctypes.byref(stream), 1):
        n = 256
        evs = [ctypes.c_void_p() for _ in range(n)]
        events["cuEventCreate"] = summary(timed(lambda i: cu("cuEventCreate", ctypes.byref(evs[i]), 2), n))
        events["cuEventRecord"] = summary(timed(lambda i: cu("cuEventRecord", evs[i], stream), n))
        cu("cuStreamSynchronize", stream)
        events["cuEventQuery_done"] = summary(timed(lambda i: cu("cuEventQuery", evs[i]), n))
        events["cuEventDestroy"] = summary(timed(lambda i: cu("cuEventDestroy_v2", evs[i]), n))
        cu("cuStreamDestroy_v2", stream)
    res["events"] = events
    cu("cuMemAddressFree", base, ctypes.c_size_t(total))
    # Pinned host memory, as the host tier takes it.
    pinned = {}
    for nbytes in (2 * MIB, 64 * MIB, total):
        p = ctypes.c_void_p()
        alloc = timed(lambda i: cu("cuMemHostAlloc", ctypes.byref(p), ctypes.c_size_t(nbytes), 0), 1)
        free = timed(lambda i: cu("cuMemFreeHost", p), 1)
        pinned[str(nbytes)] = {"alloc_us": round(alloc[0], 1), "free_us": round(free[0], 1)}
    res["pinned"] = pinned
    return res


def report(res):
    g = res["granule_bytes"]
    lines = [f"VMM, {res['granules']} granules of {g // MIB} MiB (host time per call):"]
    for key in ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"):
        s = res[key]
        lines.append(f"  {key:16s} median {s['median_us']:9.2f} us  mean {s['mean_us']:9.2f} us  max {s['max_us']:9.2f} us")
    for key in ("cuMemCreate_range", "cuMemMap_range", "cuMemSetAccess_range", "cuMemUnmap_range"):
        lines.append(f"  {key:22s} one call over all granules: {res[key]['median_us']:10.2f} us")
    for key in ("cuMemSetAccess_one_handle", "cuMemUnmap_one_handle"):
        lines.append(f"  {key:22s} one call, one handle of all granules: {res[key]['median_us']:10.2f} us")
    for n, t in res["one_handle_by_granules"].items():
        lines.append(f"  one handle of {n:>4s} granules: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items()))
    for key, st in res.get("events", {}).items():
        lines.append(f"  {key:22s} median {st['median_us']:9.2f} us  mean {st['mean_us']:9.2f} us")
    if res["busy"]:
        lines.append("  while the device is busy" + ("" if res["busy"]["device_still_busy"] else " (it was done by the end)")
                     + ": " + ", ".join(f"{k} median {res['busy'][k]['median_us']:.1f} us"
                                        for k in ("cuMemMap", "cuMemSetAccess", "cuMemUnmap")))
    for nbytes, p in res["pinned"].items():
        lines.append(f"  cuMemHostAlloc {int(nbytes) // MIB} MiB: {p['alloc_us']} us, cuMemFreeHost {p['free_us']} us")
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(prog="tests/gpu/vmm_cost.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--granules", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-sim", action="store_true")
    args = ap.parse_args(argv)
    res = measure(Driver(load_driver(args.cpu_sim)), args.granules)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
