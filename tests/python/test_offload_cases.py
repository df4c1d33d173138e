#!/usr/bin/python3
"""The CPU-emulation mode under the autograd patterns training loops use besides a plain
step: non-reentrant activation checkpointing and two-microbatch gradient accumulation.

Cases (a residual MLP: layer norm, in-place ReLU, residual connections):
  checkpoint          blocks 2 and 3 run under torch.utils.checkpoint.checkpoint(...,
                      use_reentrant=False) (its own saved-tensor hooks nest inside
                      vramswap.offload()'s and recompute in backward); blocks 0 and 1 and the
                      final norm are offloaded as usual
  accum_interleaved   two microbatches, forward/backward twice, gradients accumulating
  accum_two_forwards  two microbatches: both forwards (two graphs alive), then both backwards
                      in forward order, gradients accumulating
Each case runs three times, each in a fresh child process, as test_cpu_emulation.py does:
  ref      no vramswap at all
  peak     vramswap's allocator on cudasim, no limit, no offload: the step's peak reserve
  offload  the forwards under vramswap.offload(), VRAMSWAP_LIMIT at LIMIT_PERCENT[case] of the peak
and checks that every loss and every gradient is bit-identical (torch.equal) to the
reference, with num_evictions > 0, evicted blocks brought back, the peak within the limit and
every handle released.

STATUS: not passing yet, so not registered in CMakeLists.txt. With these sizes and limits the
offloaded child runs out of memory in backward (checkpoint at 85% of its peak with horizon 1,
accumulation at 70%): the working set that cannot be evicted (parameters, gradients, the
prefetch window, recomputed blocks) is too close to the peak. To do: size the model so that
activations dominate (as test_cpu_emulation.py does with batch 2048) within the time budget,
or find the limit per case; then check bit-identity.

Usage: python3 tests/python/test_offload_cases.py [CASE...]   (default: all cases;
exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR (as test_cpu_emulation.py).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

BATCH, WIDTH, HIDDEN, BLOCKS = 1024, 256, 512, 4  # activations of 1 and 2 MiB, parameters small
HORIZON = {"checkpoint": 1}  # else 2; with 2 the checkpoint case ran out of memory at 90%:
# the prefetch window pulled blocks 0 and 1 back while backward recomputed blocks 3 and 2
LIMIT_PERCENT = {  # of the step's peak without offload; the checkpointed step's peak is mostly
    "checkpoint": 85,  # parameters and gradients (70% ran out of memory), with less to evict
    "accum_interleaved": 70,
    "accum_two_forwards": 70,
}
CASES = ("checkpoint", "accum_interleaved", "accum_two_forwards")
CHECKPOINTED = (2, 3)  # blocks run under checkpoint in the checkpoint case (the last ones:
# blocks 0 and 1, offloaded, stay evicted while backward recomputes 3 and 2)


def build(torch):
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
            self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

        def forward(self, x):
            h = self.fc1(self.norm(x))
            h.relu_()
            return x + self.fc2(h)

    blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
    head = torch.nn.LayerNorm(WIDTH)
    data = [(torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)) for _ in range(2)]
    return blocks, head, data


def forward(torch, blocks, head, x, target, checkpointed=()):
    from torch.utils.checkpoint import checkpoint
    for i, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if i in checkpointed else block(x)
    return torch.nn.functional.mse_loss(head(x), target)


def step(torch, case, blocks, head, data, scope):
    """Runs the case's forwards (inside `scope`) and backwards; returns the losses."""
    if case == "checkpoint":
        x, t = data[0]
        with scope():
            loss = forward(torch, blocks, head, x, t, CHECKPOINTED)
        loss.backward()
        return [loss.detach()]
    if case == "accum_interleaved":
        losses = []
        for x, t in data:
            with scope():
                loss = forward(torch, blocks, head, x, t) / len(data)
            loss.backward()
            losses.append(loss.detach())
        return losses
    if case == "accum_two_forwards":
        losses = []
        with scope():
            for x, t in data:
                losses.append(forward(torch, blocks, head, x, t) / len(data))
        for loss in losses:
            loss.backward()
        return [loss.detach() for loss in losses]
    raise ValueError(case)


def child(case, mode, out_path, limit):
    import contextlib
    import torch
    torch.set_num_threads(1)
    result = {}
    scope = contextlib.nullcontext
    if mode != "ref":
        import vramswap
        config = {"horizon": HORIZON.get(case, 2)}
        if limit:
            config["limit"] = str(limit)
        vramswap.sim.install_cpu(**config)
        if mode == "offload":
            scope = vramswap.offload
    blocks, head, data = build(torch)
    if mode != "ref":
        vramswap.reset_peak_stats()
    losses = step(torch, case, blocks, head, data, scope)
    params = list(blocks.named_parameters()) + [("head." + n, p) for n, p in head.named_parameters()]
    grads = {name: p.grad for name, p in params}  # no clone: nothing changes them after
    if mode != "ref":
        result["stats"] = vramswap.memory_stats()
        result["tracker"] = vramswap.tracker_stats()
    torch.save({"losses": losses, "grads": grads}, out_path)
    with open(out_path + ".json", "w") as f:
        json.dump(result, f)


def run_child(case, mode, tmp, limit=0):
    out = os.path.join(tmp, f"{case}.{mode}.pt")
    env = dict(os.environ)
    env.setdefault("VRAMSWAP_LOG", "warn")
    proc = subprocess.run([sys.executable, __file__, "--child", case, mode, out, str(limit)],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        print(f"child {case}/{mode} failed with status {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        sys.exit(1)
    if proc.stderr.strip():
        print(f"[{case}/{mode} stderr]\n{proc.stderr.strip()}")
    import torch
    with open(out + ".json") as f:
        return torch.load(out), json.load(f)


def main(cases):
    import torch
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    mib = 1 << 20
    for case in cases:
        print(f"== {case}")
        with tempfile.TemporaryDirectory() as tmp:
            ref, _ = run_child(case, "ref", tmp)
            peak_res, peak_info = run_child(case, "peak", tmp)
            peak = peak_info["stats"]["peak_reserved_bytes"]
            limit = (peak * LIMIT_PERCENT[case] // 100) // mib * mib
            off, info = run_child(case, "offload", tmp, limit)
        s = info["stats"]
        print(f"     peak_reserved without offload {peak / mib:.1f} MiB, limit {limit / mib:.0f} MiB, "
              f"with offload {s['peak_reserved_bytes'] / mib:.1f} MiB")
        print("     stats: " + ", ".join(f"{k}={s[k]}" for k in (
            "num_evictions", "num_prefetches", "num_faults", "num_late_prefetches",
            "bytes_evicted_total", "num_ooms", "num_tracked_blocks")))
        print(f"     tracker: {info['tracker']}")
        same = lambda a, b: len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        check(same(peak_res["losses"], ref["losses"]), f"{case}: vramswap allocator without offload: losses identical")
        check(same(off["losses"], ref["losses"]),
              f"{case}: offload: losses bit-identical ({[l.item() for l in off['losses']]})")
        bad = [n for n, g in ref["grads"].items() if n not in off["grads"] or not torch.equal(g, off["grads"][n])]
        check(not bad and ref["grads"].keys() == off["grads"].keys(),
              f"{case}: offload: all {len(ref['grads'])} gradients bit-identical" + (f" (differ: {bad})" if bad else ""))
        check(s["num_evictions"] > 0, f"{case}: offload: evictions happened ({s['num_evictions']})")
        check(s["num_prefetches"] + s["num_faults"] > 0,
              f"{case}: offload: evicted blocks came back (prefetches {s['num_prefetches']}, faults {s['num_faults']})")
        check(s["peak_reserved_bytes"] <= limit, f"{case}: offload: peak reserved within the limit")
        check(s["num_tracked_blocks"] == 0, f"{case}: offload: every handle released after backward")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        sys.exit(0)
    unknown = [c for c in sys.argv[1:] if c not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        sys.exit(2)
    sys.exit(main(sys.argv[1:] or list(CASES)))
