#!/usr/bin/python3
"""End-to-end proof of the CPU-emulation mode and the autograd tracker, with no GPU.

Runs one training step of a small residual MLP (layer norm, residual connections, an
in-place ReLU) three times, each in a fresh child process (the pool's limit is fixed at its
first allocation, and the reference must not load vramswap at all):
  ref      no vramswap: c10's default CPU allocator
  peak     torch's CPU allocator is vramswap on cudasim, no limit, no offload: measures the
           step's peak device memory
  offload  the same under vramswap.offload() with VRAMSWAP_LIMIT at LIMIT_PERCENT (70%) of that peak
and checks that
  1. torch's CPU tensors come from vramswap (num_allocs grows with each new tensor),
  2. between forward and backward, evicted saved blocks are really unmapped (a read in a
     forked child dies of SIGSEGV),
  3. the offloaded step completes with loss and every gradient bit-identical (torch.equal)
     to the reference, with num_evictions > 0 and prefetches or faults having brought the
     evicted blocks back.

Usage: python3 tests/python/test_cpu_emulation.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY (libvramswap.so; default <repo>/build/lib/libvramswap.so) and
VRAMSWAP_CUDASIM_DIR (default: the sim/ directory beside it).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

BATCH, WIDTH, HIDDEN, BLOCKS = 2048, 512, 1024, 4  # activations of 4 and 8 MiB
HORIZON = 2
LIMIT_PERCENT = 70  # of the step's peak without offload


def build_model_and_data(torch):
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
            self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

        def forward(self, x):
            h = self.fc1(self.norm(x))
            h.relu_()  # in place: saves its result, the same storage fc2 saves
            return x + self.fc2(h)  # residual: x is saved by norm and still referenced

    model = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)], torch.nn.LayerNorm(WIDTH))
    x = torch.randn(BATCH, WIDTH)
    target = torch.randn(BATCH, WIDTH)
    return model, x, target


def faults_on_read(ptr):
    """True when reading one byte at ptr kills a forked child with SIGSEGV (unmapped)."""
    import ctypes
    import signal
    pid = os.fork()
    if pid == 0:
        ctypes.string_at(ptr, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV


def count_unmapped_saved():
    """Between forward and backward: how many saved blocks the tracker holds are unmapped
    (evicted), proven by a read faulting in a forked child."""
    from vramswap import tracker
    ptrs = {next(iter(saved)).tensor.data_ptr()
            for saved in list(tracker._tracker._saved.values()) if len(saved)}
    return sum(faults_on_read(p) for p in ptrs), len(ptrs)


def train_step(torch, model, x, target, offload=None, result=None):
    if offload is None:
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
    else:
        with offload():
            out = model(x)
            loss = torch.nn.functional.mse_loss(out, target)
        result["unmapped_saved_blocks"] = count_unmapped_saved()
    del out
    loss.backward()
    return loss.detach().clone()


def child(mode, out_path, limit):
    import torch
    torch.set_num_threads(1)
    result = {}
    if mode != "ref":
        import vramswap
        config = {"horizon": HORIZON}
        if limit:
            config["limit"] = str(limit)
        vramswap.sim.install_cpu(**config)
        before = vramswap.memory_stats()["num_allocs"]
        probe = [torch.empty(1 << 20) for _ in range(3)]
        result["allocs_for_3_tensors"] = vramswap.memory_stats()["num_allocs"] - before
        result["probe_in_vramswap"] = torch.ops.vramswap.cpu_allocator_installed()
        del probe
    model, x, target = build_model_and_data(torch)
    if mode != "ref":
        vramswap.reset_peak_stats()
    loss = train_step(torch, model, x, target,
                      offload=vramswap.offload if mode == "offload" else None, result=result)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if mode != "ref":
        result["stats"] = vramswap.memory_stats()
        result["tracker"] = vramswap.tracker_stats()
    torch.save({"loss": loss, "grads": grads}, out_path)
    with open(out_path + ".json", "w") as f:
        json.dump(result, f)


def run_child(mode, tmp, limit=0):
    out = os.path.join(tmp, mode + ".pt")
    env = dict(os.environ)
    env.setdefault("VRAMSWAP_LOG", "warn")
    proc = subprocess.run([sys.executable, __file__, "--child", mode, out, str(limit)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"child {mode} failed with status {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        sys.exit(1)
    if proc.stderr.strip():
        print(f"[{mode} stderr]\n{proc.stderr.strip()}")
    import torch
    with open(out + ".json") as f:
        return torch.load(out), json.load(f)


def main():
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        ref, _ = run_child("ref", tmp)
        peak_res, peak_info = run_child("peak", tmp)
        peak = peak_info["stats"]["peak_reserved_bytes"]
        mib = 1 << 20
        limit = (peak * LIMIT_PERCENT // 100) // mib * mib
        off_res, off_info = run_child("offload", tmp, limit)

    import torch
    check(peak_info["allocs_for_3_tensors"] >= 3 and peak_info["probe_in_vramswap"],
          f"torch CPU tensors come from vramswap (3 tensors: num_allocs +{peak_info['allocs_for_3_tensors']})")
    check(torch.equal(peak_res["loss"], ref["loss"]), "vramswap allocator without offload: loss identical")
    s = off_info["stats"]
    print(f"     peak_reserved without offload {peak / mib:.1f} MiB, limit {limit / mib:.0f} MiB, "
          f"peak_reserved with offload {s['peak_reserved_bytes'] / mib:.1f} MiB")
    print("     stats: " + ", ".join(f"{k}={s[k]}" for k in (
        "num_evictions", "num_prefetches", "num_faults", "num_late_prefetches",
        "bytes_evicted_total", "bytes_prefetched_total", "num_ooms", "num_tracked_blocks")))
    print(f"     tracker: {off_info['tracker']}")
    check(torch.equal(off_res["loss"], ref["loss"]), f"offload: loss bit-identical ({off_res['loss'].item()})")
    bad = [n for n, g in ref["grads"].items() if not torch.equal(g, off_res["grads"][n])]
    check(not bad and ref["grads"].keys() == off_res["grads"].keys(),
          f"offload: all {len(ref['grads'])} gradients bit-identical" + (f" (differ: {bad})" if bad else ""))
    check(s["num_evictions"] > 0, f"offload: evictions happened ({s['num_evictions']})")
    unmapped, tracked = off_info["unmapped_saved_blocks"]
    check(unmapped > 0, f"offload: {unmapped} of {tracked} saved blocks were unmapped before backward "
          "(a read faults with SIGSEGV)")
    check(s["num_prefetches"] + s["num_faults"] > 0,
          f"offload: evicted blocks came back (prefetches {s['num_prefetches']}, faults {s['num_faults']})")
    check(s["peak_reserved_bytes"] <= limit, "offload: peak reserved within the limit")
    check(s["num_tracked_blocks"] == 0, "offload: every handle released after backward")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main())
