"""What the CPU-emulation tests share: the training cases, the child processes that run them,
and the checks that compare a run under vramswap with a run without it.

A case is a training pattern run on models.build()'s transformer:
  step                one forward and one backward
  checkpoint          blocks 2 and 3 under torch.utils.checkpoint.checkpoint(...,
                      use_reentrant=False): their own saved-tensor hooks nest inside
                      vramswap.offload()'s, and backward recomputes them
  checkpoint_reentrant  the same with use_reentrant=True (torch 1.13's default): the
                      blocks' forward runs without grad, and backward recomputes them
                      outside the offload scope, in a backward of its own
  accum_interleaved   two microbatches, forward/backward twice, gradients accumulating
  accum_two_forwards  two microbatches: both forwards (two graphs alive at once), then both
                      backwards, gradients accumulating
  nested              offload() around the whole forward and again around each odd block
                      (scopes nest; leaving the inner one keeps the outer one open)
  train3              three training steps (forward, backward, an SGD update): the second
                      and third repeat the first, so vramswap follows its plan there

Each case runs in child processes (`python3 <test> --child MODE OUT LIMIT CASE...`):
  ref      no vramswap at all (c10's default CPU allocator); all cases in one process
  peak     torch's CPU allocator is vramswap on cudasim, no limit, no offload; all cases in
           one process, the cache emptied and the peaks reset before each: each case's peak
           reserve
  offload  the forwards under vramswap.offload() with VRAMSWAP_LIMIT below that peak; one
           process per case (the limit is fixed at vramswap's first allocation)
and writes, per case, the losses and gradients (torch.save) and vramswap's statistics (JSON).

Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR (default: the build tree), as vramswap's
package reads them.
"""
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402

MIB = 1 << 20
CASES = ("step", "checkpoint", "checkpoint_reentrant", "accum_interleaved", "accum_two_forwards", "nested", "train3")
CHECKPOINTED = (2, 3)  # blocks run under checkpoint in the checkpoint case: the last ones, so
# blocks 0 and 1, offloaded, stay evicted while backward recomputes 3 and 2


def run_case(torch, case, model, data, scope, between=None):
    """Runs the case's forwards (inside `scope`) and backwards; returns the losses.
    `between()`, when given, runs after the (first) forward, before its backward."""
    if case in ("step", "checkpoint", "checkpoint_reentrant", "nested"):
        tokens, targets = data[0]
        run_block = None
        if case.startswith("checkpoint"):
            from torch.utils.checkpoint import checkpoint
            blocks = [model.blocks[i] for i in CHECKPOINTED]
            reentrant = case == "checkpoint_reentrant"

            def run_block(block, x):
                if any(block is b for b in blocks):
                    return checkpoint(block, x, use_reentrant=reentrant)
                return block(x)
        elif case == "nested":
            odd = list(model.blocks)[1::2]

            def run_block(block, x):
                if any(block is b for b in odd):
                    with scope():
                        return block(x)
                return block(x)
        with scope():
            loss = model(tokens, targets, run_block)
        if between:
            between()
        loss.backward()
        return [loss.detach()]
    if case == "accum_interleaved":
        losses = []
        for tokens, targets in data:
            with scope():
                loss = model(tokens, targets) / len(data)
            loss.backward()
            losses.append(loss.detach())
        return losses
    if case == "accum_two_forwards":
        with scope():
            losses = [model(tokens, targets) / len(data) for tokens, targets in data]
        for loss in losses:
            loss.backward()
        return [loss.detach() for loss in losses]
    if case == "train3":
        tokens, targets = data[0]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            with scope():
                loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return losses
    raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")


def microbatches(case):
    return 2 if case.startswith("accum") else 1


def child_main(argv, horizon, instrument=None):
    """The child: argv = [MODE, OUT_DIR, LIMIT, CASE...]. In the offload mode,
    instrument(vramswap, torch, model, result) may set the model's residual probe and
    returns a callable run between forward and backward (or None); what it records goes
    into `result` (the case's JSON)."""
    mode, out_dir, limit, cases = argv[0], argv[1], int(argv[2]), argv[3:]
    import torch
    torch.set_num_threads(1)
    vramswap = None
    if mode != "ref":
        import vramswap
        config = {"horizon": horizon}
        if limit:
            config["limit"] = str(limit)
        vramswap.sim.install_cpu(**config)
    for case in cases:
        result = {}
        if mode != "ref":
            # Each tensor in its own block: num_allocs counts them.
            before = vramswap.memory_stats()["num_allocs"]
            tensors = [torch.empty(1 << 18) for _ in range(3)]
            result["allocs_for_3_tensors"] = vramswap.memory_stats()["num_allocs"] - before
            del tensors
        model, data = models.build(torch, microbatches=microbatches(case))
        between = None
        if mode == "offload" and instrument is not None:
            between = instrument(vramswap, torch, model, result)
        if vramswap is not None:
            vramswap.empty_cache()
            vramswap.reset_peak_stats()
        scope = vramswap.offload if mode == "offload" else contextlib.nullcontext
        losses = run_case(torch, case, model, data, scope, between)
        model.set_probe(None)
        if vramswap is not None:
            result["stats"] = vramswap.memory_stats()
            result["tracker"] = vramswap.tracker_stats()
        out = os.path.join(out_dir, f"{case}.{mode}")
        torch.save({"losses": losses, "grads": models.gradients(model)}, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump(result, f)
        del model, data, losses


class Checks:
    def __init__(self):
        self.failures = []

    def __call__(self, cond, what):
        print(("ok   " if cond else "FAIL ") + what, flush=True)
        if not cond:
            self.failures.append(what)

    def finish(self):
        print("PASS" if not self.failures else f"{len(self.failures)} check(s) failed")
        return 0 if not self.failures else 1


def run_child(script, mode, tmp, cases, limit=0, stderr=None):
    """Runs `script --child mode tmp limit cases...`; -> {case: (tensors, info)}. stderr: a
    list the child's standard error is appended to."""
    env = dict(os.environ)
    env.setdefault("VRAMSWAP_LOG", "warn")
    proc = subprocess.run([sys.executable, str(script), "--child", mode, tmp, str(limit), *cases],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"child {mode} {' '.join(cases)} failed with status {proc.returncode}:\n"
              f"{proc.stdout}\n{proc.stderr}")
        sys.exit(1)
    if proc.stderr.strip():
        print(f"[{mode} stderr]\n{proc.stderr.strip()}")
    if stderr is not None:
        stderr.append(proc.stderr)
    import torch
    results = {}
    for case in cases:
        out = os.path.join(tmp, f"{case}.{mode}")
        with open(out + ".json") as f:
            results[case] = (torch.load(out + ".pt"), json.load(f))
    return results


def same_results(check, label, ref, got):
    """Checks that losses and every gradient are bit-identical (torch.equal)."""
    import torch
    same = len(ref["losses"]) == len(got["losses"]) and all(
        torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"]))
    check(same, f"{label}: losses bit-identical ({[round(l.item(), 6) for l in got['losses']]})")
    bad = [n for n, g in ref["grads"].items()
           if n not in got["grads"] or g is None or got["grads"][n] is None
           or not torch.equal(g, got["grads"][n])]
    check(not bad and ref["grads"].keys() == got["grads"].keys(),
          f"{label}: all {len(ref['grads'])} gradients bit-identical" + (f" (differ: {bad})" if bad else ""))


def run_cases(script, cases, limit_percent):
    """ref and peak (one process each), then offload per case at limit_percent[case] of the
    case's peak; checks bit-identity, evictions, prefetches, the limit and that every
    handle was released. Returns (checks, {case: (peak, limit, offload result, info)})."""
    check = Checks()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_child(script, "ref", tmp, cases)
        peak = run_child(script, "peak", tmp, cases)
        for case in cases:
            peak_bytes = peak[case][1]["stats"]["peak_reserved_bytes"]
            limit = (peak_bytes * limit_percent[case] // 100) // MIB * MIB
            off = run_child(script, "offload", tmp, [case], limit)[case]
            runs[case] = (peak_bytes, limit, off[0], off[1])
    for case in cases:
        peak_bytes, limit, off, info = runs[case]
        s = info["stats"]
        print(f"== {case}: peak_reserved without offload {peak_bytes / MIB:.1f} MiB, limit {limit / MIB:.0f} MiB "
              f"({limit_percent[case]}%), with offload {s['peak_reserved_bytes'] / MIB:.1f} MiB")
        print("     stats: " + ", ".join(f"{k}={s[k]}" for k in (
            "num_evictions", "num_prefetches", "num_faults", "num_late_prefetches", "num_clean_reuses",
            "bytes_evicted_total", "bytes_prefetched_total", "num_ooms", "num_tracked_blocks")))
        print(f"     tracker: {info['tracker']}")
        check(peak[case][1]["allocs_for_3_tensors"] >= 3,
              f"{case}: torch's CPU tensors come from vramswap (3 tensors: num_allocs "
              f"+{peak[case][1]['allocs_for_3_tensors']})")
        same_results(check, f"{case}: vramswap allocator without offload", ref[case][0], peak[case][0])
        same_results(check, f"{case}: offload", ref[case][0], off)
        check(s["num_evictions"] > 0, f"{case}: offload: evictions happened ({s['num_evictions']})")
        check(s["num_prefetches"] > 0, f"{case}: offload: prefetches happened ({s['num_prefetches']})")
        check(s["peak_reserved_bytes"] <= limit, f"{case}: offload: peak reserved within the limit")
        check(s["num_tracked_blocks"] == 0, f"{case}: offload: every handle released after backward")
    return check, runs


def main(script, argv, limit_percent, horizon, instrument=None, extra_checks=None):
    """The tests' entry point: the child when argv starts with --child, else the parent for
    the cases named in argv (default: all of limit_percent's)."""
    if argv and argv[0] == "--child":
        child_main(argv[1:], horizon, instrument)
        return 0
    cases = argv or list(limit_percent)
    unknown = [c for c in cases if c not in limit_percent]
    if unknown:
        print(f"unknown case(s) {unknown}; known here: {', '.join(limit_percent)}")
        return 2
    check, runs = run_cases(script, cases, limit_percent)
    if extra_checks:
        extra_checks(check, runs)
    return check.finish()
