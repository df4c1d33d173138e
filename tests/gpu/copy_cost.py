#!/usr/bin/python3
"""What one copy between pinned host memory and the device costs, by size: the measurement
VRAMSWAP_MIN_OFFLOAD_BYTES's default is to be chosen from.

vramswap moves each tagged block with one cudaMemcpyAsync each way. A copy of s bytes takes
about t(s) = a + s / B on the device: a fixed cost a (the copy engine's setup and the
command's latency) and the bus rate B. Below s* = a * B a copy spends more time on its fixed
cost than on moving bytes, so offloading blocks smaller than s* runs the bus at less than
half its rate: s* is the size the threshold should not go below.

For each direction (device to host, host to device) and each size, COPIES copies are queued
back to back on one stream between two events: the device time per copy is the events'
elapsed time / COPIES, and the host time per copy is how long queueing one took (a host
slower than the device would make the device time the host's). Then a least-squares fit of
t(s) = a + s / B over the sizes gives a, B and s*.

It calls the CUDA runtime through ctypes (libcudart.so.13: the CUDA Toolkit's or torch's on a
GPU machine; cudasim's with --cpu-sim, where the figures are cudasim's model of a copy, not
a card's) and nothing else, so what it times is the runtime call vramswap makes.

Usage: python3 tests/gpu/copy_cost.py [--cpu-sim] [--json OUT]
       python3 tests/gpu/copy_cost.py --self-test   (the fit on made-up points; no CUDA)
tests/gpu/suite.py runs it as its "copies" step and puts the result in its report.
"""
import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

KIB = 1 << 10
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
COPIES = 64  # per size and direction; fewer for the largest (at most ~1 GiB moved per size)
D2H, H2D = 2, 1  # cudaMemcpyKind


def fit(points):
    """Least-squares t = a + s / B over (s bytes, t ns) points, each weighted by 1 / t^2 (the
    relative error counts, so the 64 MiB copies do not decide the fixed cost alone):
    {"fixed_ns": a, "bytes_per_ns": B, "breakeven_bytes": a * B}; B is None when the times do
    not grow with the size (then no s* either)."""
    if len(points) < 2:
        raise ValueError("the fit needs two sizes at least")
    w = [1.0 / (t * t) if t > 0 else 1.0 for _, t in points]
    sw = sum(w)
    ms = sum(wi * s for wi, (s, _) in zip(w, points)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, points)) / sw
    sxx = sum(wi * (s - ms) ** 2 for wi, (s, _) in zip(w, points))
    sxy = sum(wi * (s - ms) * (t - mt) for wi, (s, t) in zip(w, points))
    slope = sxy / sxx if sxx else 0.0  # ns per byte
    fixed = max(mt - slope * ms, 0.0)
    if slope * max(s for s, _ in points) <= 1e-9 * max(t for _, t in points):  # flat (or falling)
        return {"fixed_ns": fixed, "bytes_per_ns": None, "breakeven_bytes": None}
    rate = 1.0 / slope
    return {"fixed_ns": fixed, "bytes_per_ns": rate, "breakeven_bytes": fixed * rate}


class Cuda:
    """The few runtime calls the measurement makes, each checked."""

    def __init__(self, cpu_sim):
        if cpu_sim:
            sim = Path(os.environ.get("VRAMSWAP_CUDASIM_DIR")
                       or Path(__file__).resolve().parents[2] / "build" / "sim")
            ctypes.CDLL(str(sim / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
            self.rt = ctypes.CDLL(str(sim / "libcudart.so.13"), mode=ctypes.RTLD_GLOBAL)
        else:
            self.rt = self._load_runtime()
        self.rt.cudaGetErrorString.restype = ctypes.c_char_p
        self.rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p]
        self.rt.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.rt.cudaEventSynchronize.argtypes = [ctypes.c_void_p]
        self.rt.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self.rt.cudaFree.argtypes = [ctypes.c_void_p]
        self.rt.cudaFreeHost.argtypes = [ctypes.c_void_p]
        self.rt.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
        self.rt.cudaEventDestroy.argtypes = [ctypes.c_void_p]

    @staticmethod
    def _load_runtime():
        tried = []
        candidates = ["libcudart.so.13"]  # already loaded by torch, or on the loader's path
        for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if home:
                candidates.append(str(Path(home) / "lib64" / "libcudart.so.13"))
        for name in candidates:
            try:
                return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                tried.append(f"{name}: {e}")
        raise RuntimeError("no CUDA 13 runtime found (set CUDA_HOME): " + "; ".join(tried))

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: error {rc} ({self.rt.cudaGetErrorString(rc).decode()})")

    def pointer(self, fn, *args, what):
        p = ctypes.c_void_p()
        self.check(fn(ctypes.byref(p), *args), what)
        return p


def measure(cuda, sizes=SIZES, copies=COPIES):
    """[{"direction", "bytes", "copies", "device_ns_per_copy", "host_ns_per_copy"}]."""
    rt = cuda.rt
    cuda.check(rt.cudaSetDevice(0), "cudaSetDevice(0)")
    largest = max(sizes)
    dev = cuda.pointer(rt.cudaMalloc, ctypes.c_size_t(largest), what="cudaMalloc")
    host = cuda.pointer(rt.cudaMallocHost, ctypes.c_size_t(largest), what="cudaMallocHost")
    stream = cuda.pointer(rt.cudaStreamCreateWithFlags, ctypes.c_uint(1), what="cudaStreamCreateWithFlags")
    start = cuda.pointer(rt.cudaEventCreate, what="cudaEventCreate")
    stop = cuda.pointer(rt.cudaEventCreate, what="cudaEventCreate")
    rows = []
    try:
        for direction, kind in (("device_to_host", D2H), ("host_to_device", H2D)):
            dst, src = (host, dev) if kind == D2H else (dev, host)
            for size in sizes:
                n = max(4, min(copies, (1 << 30) // size))
                # One copy first: the first use of the buffers and the stream is not timed.
                cuda.check(rt.cudaMemcpyAsync(dst, src, size, kind, stream), "cudaMemcpyAsync")
                cuda.check(rt.cudaEventRecord(start, stream), "cudaEventRecord")
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    cuda.check(rt.cudaMemcpyAsync(dst, src, size, kind, stream), "cudaMemcpyAsync")
                host_ns = (time.perf_counter_ns() - t0) / n
                cuda.check(rt.cudaEventRecord(stop, stream), "cudaEventRecord")
                cuda.check(rt.cudaEventSynchronize(stop), "cudaEventSynchronize")
                ms = ctypes.c_float()
                cuda.check(rt.cudaEventElapsedTime(ctypes.byref(ms), start, stop), "cudaEventElapsedTime")
                rows.append({"direction": direction, "bytes": size, "copies": n,
                             "device_ns_per_copy": ms.value * 1e6 / n, "host_ns_per_copy": host_ns})
    finally:
        rt.cudaEventDestroy(start)
        rt.cudaEventDestroy(stop)
        rt.cudaStreamDestroy(stream)
        rt.cudaFreeHost(host)
        rt.cudaFree(dev)
    return rows


def summarize(rows):
    """Per direction: the fit, and whether the host kept ahead of the device at the smallest
    size (otherwise the fixed cost measured is the host's)."""
    out = {}
    for direction in ("device_to_host", "host_to_device"):
        mine = [r for r in rows if r["direction"] == direction]
        if len(mine) < 2:
            continue
        f = fit([(r["bytes"], r["device_ns_per_copy"]) for r in mine])
        smallest = min(mine, key=lambda r: r["bytes"])
        f["host_bound_at_smallest"] = smallest["host_ns_per_copy"] >= smallest["device_ns_per_copy"]
        out[direction] = f
    return out


def self_test():
    """The fit recovers a made-up line (a = 2000 ns, B = 50 bytes/ns: s* = 100,000 bytes)
    exactly, and says so when the times do not grow with the size."""
    points = [(s, 2000 + s / 50) for s in SIZES]
    f = fit(points)
    ok = abs(f["fixed_ns"] - 2000) < 1e-6 and abs(f["bytes_per_ns"] - 50) < 1e-9 \
        and abs(f["breakeven_bytes"] - 100000) < 1e-3
    print(("ok   " if ok else "FAIL ") + f"fit of t = 2000 ns + s / (50 B/ns): {f}")
    flat = fit([(s, 5000) for s in SIZES])
    ok2 = flat["bytes_per_ns"] is None and flat["breakeven_bytes"] is None and abs(flat["fixed_ns"] - 5000) < 1e-6
    print(("ok   " if ok2 else "FAIL ") + f"flat times have no rate and no break-even: {flat}")
    try:
        fit([(4096, 1.0)])
        ok3 = False
    except ValueError:
        ok3 = True
    print(("ok   " if ok3 else "FAIL ") + "one size is refused")
    return 0 if ok and ok2 and ok3 else 1


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-sim", action="store_true", help="cudasim's runtime (no GPU): its model, not a card")
    ap.add_argument("--json", metavar="OUT", help="write the rows and the fit there")
    ap.add_argument("--self-test", action="store_true", help="check the fit on made-up points; no CUDA")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    rows = measure(Cuda(args.cpu_sim))
    result = {"rows": rows, "fit": summarize(rows), "clock": "cudasim" if args.cpu_sim else "device"}
    for r in rows:
        print(f"{r['direction']:15s} {r['bytes']:>10d} B  device {r['device_ns_per_copy'] / 1000:9.2f} us/copy  "
              f"host {r['host_ns_per_copy'] / 1000:7.2f} us/copy")
    for direction, f in result["fit"].items():
        rate = f"{f['bytes_per_ns']:.1f} GB/s" if f["bytes_per_ns"] is not None else "n/a"
        be = f"{f['breakeven_bytes'] / KIB:.0f} KiB" if f["breakeven_bytes"] is not None else "n/a"
        print(f"{direction}: fixed {f['fixed_ns'] / 1000:.2f} us, rate {rate}, break-even {be}"
              + (" (host-bound at the smallest size)" if f["host_bound_at_smallest"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
