#!/usr/bin/python3
"""Does a host-to-device copy on a second stream wait for the copies queued before it on
another stream? The question behind a second fetch stream for vramswap (DESIGN.md, Kept
blocks): when a fetch that is needed now queues behind hundreds of megabytes of planned
fetches, the step waits for all of them. cudasim serves each direction with one engine in
the order copies were queued, whatever their stream (src/sim/core/virtual_time.h); on a
card the driver gives each direction its own copy engine, and which stream's copy that
engine takes next is not documented.

For each case, QUEUE copies of BIG bytes are queued host to device on stream A, then one
copy of SMALL bytes host to device on stream B: B of the same priority, then B of the
highest priority (cudaDeviceGetStreamPriorityRange). Events time, from just before A's
first copy, when A's last copy and when B's copy landed. `small_share` is B's landing time
over A's: near 1, B waited for the whole queue (FIFO across streams, as cudasim models it);
near 1 / QUEUE or below, the engine took B's copy at the next copy boundary or shared the
bus with it. Each case runs ROUNDS times; the median is reported.

It calls the CUDA runtime through ctypes (copy_cost.py's loader: the toolkit's or torch's
libcudart.so.13 on a GPU machine, cudasim's with --cpu-sim, where the answer is cudasim's
model, not a card's).

Usage: python3 tests/gpu/copy_order.py [--cpu-sim] [--json OUT]
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_cost import H2D, Cuda  # noqa: E402

MIB = 1 << 20
BIG, QUEUE, SMALL, ROUNDS = 64 * MIB, 10, 2 * MIB, 5
NON_BLOCKING = 1


def elapsed_ns(cuda, start, end):
    ms = ctypes.c_float()
    cuda.check(cuda.rt.cudaEventElapsedTime(ctypes.byref(ms), start, end), "cudaEventElapsedTime")
    return ms.value * 1e6


def one_round(cuda, a, b, dev_big, dev_small, host, events):
    """(A's queue landed, B's copy landed), ns from just before A's first copy."""
    rt = cuda.rt
    start, a_end, b_end = events
    cuda.check(rt.cudaEventRecord(start, a), "cudaEventRecord")
    for _ in range(QUEUE):
        cuda.check(rt.cudaMemcpyAsync(dev_big, host, BIG, H2D, a), "cudaMemcpyAsync")
    cuda.check(rt.cudaEventRecord(a_end, a), "cudaEventRecord")
    cuda.check(rt.cudaMemcpyAsync(dev_small, host, SMALL, H2D, b), "cudaMemcpyAsync")
    cuda.check(rt.cudaEventRecord(b_end, b), "cudaEventRecord")
    cuda.check(rt.cudaEventSynchronize(a_end), "cudaEventSynchronize")
    cuda.check(rt.cudaEventSynchronize(b_end), "cudaEventSynchronize")
    return elapsed_ns(cuda, start, a_end), elapsed_ns(cuda, start, b_end)


def measure(cuda):
    """{"cases": [{"case", "priority", "queue_ns", "small_ns", "small_share", "rounds"}], ...}."""
    rt = cuda.rt
    rt.cudaStreamCreateWithPriority.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    cuda.check(rt.cudaSetDevice(0), "cudaSetDevice(0)")
    least, greatest = ctypes.c_int(), ctypes.c_int()
    cuda.check(rt.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
               "cudaDeviceGetStreamPriorityRange")
    dev_big = cuda.pointer(rt.cudaMalloc, ctypes.c_size_t(BIG), what="cudaMalloc")
    dev_small = cuda.pointer(rt.cudaMalloc, ctypes.c_size_t(SMALL), what="cudaMalloc")
    host = cuda.pointer(rt.cudaMallocHost, ctypes.c_size_t(BIG), what="cudaMallocHost")
    a = cuda.pointer(rt.cudaStreamCreateWithFlags, ctypes.c_uint(NON_BLOCKING), what="cudaStreamCreateWithFlags")
    events = [cuda.pointer(rt.cudaEventCreate, what="cudaEventCreate") for _ in range(3)]
    streams, cases = [a], []
    try:
        for case, priority in (("same priority", least.value), ("highest priority", greatest.value)):
            b = cuda.pointer(rt.cudaStreamCreateWithPriority, ctypes.c_uint(NON_BLOCKING), ctypes.c_int(priority),
                             what="cudaStreamCreateWithPriority")
            streams.append(b)
            one_round(cuda, a, b, dev_big, dev_small, host, events)  # first use of buffers and streams: untimed
            rounds = [one_round(cuda, a, b, dev_big, dev_small, host, events) for _ in range(ROUNDS)]
            queue_ns = statistics.median(r[0] for r in rounds)
            small_ns = statistics.median(r[1] for r in rounds)
            cases.append({"case": case, "priority": priority, "queue_ns": queue_ns, "small_ns": small_ns,
                          "small_share": small_ns / queue_ns if queue_ns > 0 else None,
                          "rounds": [{"queue_ns": q, "small_ns": s} for q, s in rounds]})
    finally:
        for e in events:
            rt.cudaEventDestroy(e)
        for s in streams:
            rt.cudaStreamDestroy(s)
        rt.cudaFreeHost(host)
        rt.cudaFree(dev_big)
        rt.cudaFree(dev_small)
    return {"big_bytes": BIG, "queue": QUEUE, "small_bytes": SMALL, "priority_range": [least.value, greatest.value],
            "cases": cases}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-sim", action="store_true", help="cudasim's runtime (no GPU): its model, not a card")
    ap.add_argument("--json", metavar="OUT", help="write the result there")
    args = ap.parse_args(argv)
    if args.cpu_sim:
        os.environ.setdefault("CUDASIM_TIME", "virtual")  # the clock that models the copy engines
    result = measure(Cuda(args.cpu_sim))
    result["clock"] = "cudasim" if args.cpu_sim else "device"
    print(f"{QUEUE} x {BIG // MIB} MiB host to device on stream A, then {SMALL // MIB} MiB on stream B "
          f"({result['clock']}):")
    for c in result["cases"]:
        print(f"  B at {c['case']} ({c['priority']}): A's queue landed at {c['queue_ns'] / 1e6:.3f} ms, "
              f"B's copy at {c['small_ns'] / 1e6:.3f} ms: {c['small_share']:.3f} of the queue's time")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
