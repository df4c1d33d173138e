#!/usr/bin/python3
"""The torch layer with tensors on two devices in one process, in the CPU-emulation mode
(CUDASIM_DEVICE_COUNT=2): two transformers (models.build(), seeds 0 and 1), the first on
device 0 and the second on device 1 (vramswap.sim.device(1), which emulates
torch.cuda.device(1)), trained three SGD steps in turn with their forwards under
vramswap.offload(). Each device has its own pool, limit and engine: at the same
VRAMSWAP_LIMIT, 60% of one model's no-offload peak, both devices evict and fetch back, each
stays within the limit, and both models' losses and gradients are bit-identical to runs
without vramswap. memory_stats(0) and memory_stats(1) each report their own device, and
vramswap.sim.device() refuses a device cudasim does not have, or no ordinal, saying why.

Children (`--child MODE OUT LIMIT`): ref (no vramswap), peak (vramswap, two devices, no
limit), offload (the limit). Needs VRAMSWAP_LIBRARY / VRAMSWAP_CUDASIM_DIR as the other
Python tests.

Usage: python3 tests/python/test_two_devices.py   (exit status 0: every check held)
"""
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import models  # noqa: E402

STEPS = 3
MIB = 1 << 20


def child(mode, out, limit):
    import torch
    torch.set_num_threads(1)
    vramswap = None
    device = lambda d: contextlib.nullcontext()  # noqa: E731
    if mode != "ref":
        import vramswap
        config = {"horizon": 2}
        if limit:
            config["limit"] = str(limit)
        vramswap.sim.install_cpu(**config)
        device = vramswap.sim.device
    if vramswap is not None:
        refusals = {}
        for bad in (2, -1, "1"):
            try:
                with device(bad):
                    pass
                refusals[str(bad)] = "accepted"
            except ValueError as e:
                refusals[str(bad)] = str(e)
    runs = []
    for d in (0, 1):
        with device(d):
            model, data = models.build(torch, seed=d)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        runs.append((d, model, data[0], opt))
    if vramswap is not None:
        vramswap.reset_peak_stats()
    losses = {0: [], 1: []}
    scope = vramswap.offload if mode == "offload" else contextlib.nullcontext
    for _ in range(STEPS):
        for d, model, (tokens, targets), opt in runs:  # the two models' steps interleave
            with device(d):
                opt.zero_grad(set_to_none=True)
                with scope():
                    loss = model(tokens, targets)
                loss.backward()
                opt.step()
                losses[d].append(loss.item())
    result = {"losses": losses}
    if vramswap is not None:
        result["stats"] = {d: vramswap.memory_stats(d) for d in (0, 1)}
        result["refusals"] = refusals
    torch.save({d: models.gradients(model) for d, model, _, _ in runs}, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(result, f)


def run(mode, tmp, limit=0):
    out = os.path.join(tmp, mode)
    env = dict(os.environ, CUDASIM_DEVICE_COUNT="2")
    env.setdefault("VRAMSWAP_LOG", "warn")
    proc = subprocess.run([sys.executable, __file__, "--child", mode, out, str(limit)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit status {proc.returncode}\n{proc.stderr[-4000:]}")
    import torch
    with open(out + ".json") as f:
        return json.load(f), torch.load(out + ".pt")


def main(argv):
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], int(argv[3]))
        return 0
    import torch
    check = harness.Checks()
    with tempfile.TemporaryDirectory() as tmp:
        ref, ref_grads = run("ref", tmp)
        peak, _ = run("peak", tmp)
        peaks = {d: peak["stats"][str(d)]["reserved_bytes.all.peak"] for d in (0, 1)}
        check(all(p > 0 for p in peaks.values()),
              f"without a limit each device holds its model ({peaks[0] / MIB:.1f} and {peaks[1] / MIB:.1f} MiB)")
        limit = max(peaks.values()) * 60 // 100 // MIB * MIB
        got, got_grads = run("offload", tmp, limit)
        check(got["losses"] == ref["losses"], f"losses of both models bit-identical at a limit of "
              f"{limit / MIB:.0f} MiB a device ({got['losses']})")
        for d in (0, 1):
            a, b = ref_grads[d], got_grads[d]
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            check(same, f"device {d}: gradients after {STEPS} steps bit-identical")
            s = got["stats"][str(d)]
            check(s["num_evictions"] > 0 and s["num_prefetches"] + s["num_faults"] > 0,
                  f"device {d}: evicted {s['num_evictions']} blocks and fetched them back "
                  f"({s['num_prefetches']} prefetches, {s['num_faults']} faults)")
            check(s["reserved_bytes.all.peak"] <= limit,
                  f"device {d}: peak reserved {s['reserved_bytes.all.peak'] / MIB:.1f} MiB <= {limit / MIB:.0f} MiB")
            check(s["device"] == d, f"memory_stats({d}) reports device {s['device']}")
        refusals = got["refusals"]
        check("does not exist" in refusals["2"] and "CUDASIM_DEVICE_COUNT" in refusals["2"],
              f"vramswap.sim.device(2) with two devices is refused, saying why ({refusals['2']})")
        check(all("not a device ordinal" in refusals[k] for k in ("-1", "1")),
              f"a negative or non-int device is refused ({refusals['-1']}; {refusals['1']})")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
