#!/usr/bin/python3
"""Peak memory of a training step whose backward runs on a thread of its own, as autograd's
device thread runs it on a GPU, in the CPU-emulation mode (no GPU): the pool's thread caches
on (the default) against off.

On a GPU autograd runs each backward on a long-lived thread per device, so the thread that
allocates the forward's activations is not the one that frees them, and the backward's
tensors come from a thread of their own. In the CPU-emulation mode torch 1.13 runs a CPU
backward on the calling thread, so the tests never show that pattern; here each backward is
handed to one long-lived worker thread. The model is tests/gpu/suite.py's GPT-style one
(explicit attention, fp32), no limit, no offload. "off" turns the caches off the way the
pool does once it records its history (vramswap.record_memory_history(max_entries=1) right
after installing: Note [Thread caches] in src/pool/thread_caches.cpp).

Usage: python3 bench/autograd_threads.py [--layers N] [--d-model N] [--seq N] [--batch N]
                                         [--steps N]
Needs VRAMSWAP_LIBRARY and VRAMSWAP_CUDASIM_DIR as the Python tests set them (README, "Tests").
Prints one line per mode and the ratio of the peaks reserved.
"""
import argparse
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args):
    sys.path.insert(0, str(REPO / "plugin" / "python"))
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import vramswap
    vramswap.sim.install_cpu()
    if args.child == "off":
        vramswap.record_memory_history(max_entries=1)
    import torch
    import suite
    torch.set_num_threads(1)
    cfg = dict(suite.SIZES["tiny"])
    cfg.update(layers=args.layers, d_model=args.d_model, seq=args.seq, batch=args.batch,
               attention="explicit", seed=0)
    device = torch.device("cpu")
    torch.manual_seed(cfg["seed"])
    model = suite.build_model(torch, cfg, device, torch.float32)
    idx, targets = suite.make_batch(torch, cfg, device)
    work, done = queue.Queue(), queue.Queue()

    def backward_thread():
        while (loss := work.get()) is not None:
            loss.backward()
            done.put(None)

    worker = threading.Thread(target=backward_thread)
    worker.start()
    losses = []
    for _ in range(args.steps):
        for p in model.parameters():
            p.grad = None
        loss = model(idx, targets)
        work.put(loss)
        done.get()
        losses.append(loss.item())
        del loss
    work.put(None)
    worker.join()
    s = vramswap.memory_stats()
    print(json.dumps({"peak_reserved_bytes": s["reserved_bytes.all.peak"],
                      "peak_allocated_bytes": s["allocated_bytes.all.peak"], "losses": losses}))


def main(argv):
    p = argparse.ArgumentParser(prog="bench/autograd_threads.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    results = {}
    for mode in ("on", "off"):
        cmd = [sys.executable, __file__, "--child", mode] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "child"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, VRAMSWAP_TORCH_DEVICE="cpu-sim"))
        if proc.returncode != 0:
            print(f"caches {mode}: exit status {proc.returncode}\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[mode]
        print(f"caches {mode:3}: peak reserved {r['peak_reserved_bytes'] / 2**20:8.1f} MiB, "
              f"peak allocated {r['peak_allocated_bytes'] / 2**20:8.1f} MiB")
    same = results["on"]["losses"] == results["off"]["losses"]
    print(f"reserved on/off: {results['on']['peak_reserved_bytes'] / results['off']['peak_reserved_bytes']:.3f}; "
          f"losses {'identical' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
