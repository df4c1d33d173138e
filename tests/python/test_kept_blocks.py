#!/usr/bin/python3
"""Kept blocks on real autograd, in the CPU-emulation mode: frozen-layer streaming
(vramswap.offload_frozen) and optimizer state off the device (vramswap.offload_optimizer).

lora   A LoRA-style model: a frozen embedding, six frozen 1024x1024 layers each with a
       trainable rank-16 adapter, a frozen head; three SGD steps on the adapters, the
       forwards under vramswap.offload(). With VRAMSWAP_LIMIT at half the peak of the run
       without offload (below the frozen weights alone) and offload_frozen(model): losses and
       adapters bit-identical to the run without vramswap; each weight copied to the host at
       most once (frozen_bytes_d2h <= the kept bytes) and dropped again with no copy in every
       later step (frozen_bytes_dropped grows in steps 2 and 3).
       lora_checkpoint: the same with layers 2 and 3 under torch.utils.checkpoint;
       lora_accum: two forwards before one backward (each weight saved twice: it must be cold
       between its two uses in backward, else the whole base is held at once);
       lora_no_scope: offload_frozen with no offload scope (autograd holds the weights it
       saves until backward), at 90%.
adamw  A four-layer 1024-wide MLP trained with AdamW for three steps, whose peak without
       offload is in the first optimizer step (the state created there). At 75% of that
       peak the run stops with an out-of-memory; with offload_optimizer(optimizer) it
       completes, with losses and parameters bit-identical to the run without vramswap.

Each run is a child process (`--child MODE CASE OUT LIMIT`): ref (no vramswap), peak
(vramswap, no limit, no offload), offload (the limit and the feature), plain (the limit
without the feature). Then tests/gpu/kept.py's checks of `vramswap run --offload-frozen` and
`--offload-optimizer` in the CPU-emulation mode.

Usage: python3 tests/python/test_kept_blocks.py   (exit status 0: every check held)
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import harness  # noqa: E402

MIB = 1 << 20
STEPS = 3
SCRIPT = Path(__file__).resolve()


MODEL = {"lora": "lora", "lora_checkpoint": "lora_checkpoint", "lora_accum": "lora_accum", "lora_no_scope": "lora",
         "adamw": "mlp"}


def child(mode, case, out, limit):
    import torch
    import train_kept
    torch.set_num_threads(1)
    vramswap = None
    lora = case.startswith("lora")
    result = {"steps": []}
    if mode != "ref":
        import vramswap
        config = {"horizon": 2}
        if limit:
            config["limit"] = str(limit)
        if lora and mode == "offload":
            # A model larger than the limit: built first (in ordinary memory), then its frozen
            # weights move into vramswap's blocks one by one as offload_frozen keeps them.
            model, data, opt, loss_fn = train_kept.build(MODEL[case])
            vramswap.sim.install_cpu(**config)
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.clone()  # into vramswap's memory
        else:
            vramswap.sim.install_cpu(**config)
            model, data, opt, loss_fn = train_kept.build(MODEL[case])
    else:
        model, data, opt, loss_fn = train_kept.build(MODEL[case])
    trainable = [p for p in model.parameters() if p.requires_grad]
    if mode == "offload":
        if lora:
            frozen = vramswap.offload_frozen(model)
            result["kept_params"] = len(frozen)
            result["kept_weight_bytes"] = frozen.kept_bytes()
        else:
            vramswap.offload_optimizer(opt)
    if vramswap is not None:
        vramswap.reset_peak_stats()
    scope = vramswap.offload if (vramswap is not None and mode != "peak" and lora and case != "lora_no_scope") \
        else None
    losses = []
    try:
        for step in range(STEPS):
            if scope:
                with scope():
                    loss = loss_fn()
            else:
                loss = loss_fn()
            loss.backward()
            if vramswap is not None and step == 0:
                result["peak_before_first_step"] = vramswap.memory_stats()["peak_reserved_bytes"]
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if vramswap is not None:
                result["steps"].append(vramswap.memory_stats())
    except Exception as e:  # the plain mode's expected out-of-memory, reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
    if vramswap is not None:
        result["stats"] = vramswap.memory_stats()
    # The trainable parameters (the frozen weights are read only inside their forwards: all
    # of them at once would not fit under the limit).
    if "error" in result:  # out of memory: no room to copy the parameters out either
        trainable = []
    torch.save({"losses": losses, "params": [p.detach().clone() for p in trainable]},
               os.path.join(out, f"{case}.{mode}.pt"))
    with open(os.path.join(out, f"{case}.{mode}.json"), "w") as f:
        json.dump(result, f)


def run(mode, case, tmp, limit=0):
    env = dict(os.environ)
    env.setdefault("VRAMSWAP_LOG", "warn")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--child", mode, case, tmp, str(limit)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"child {mode} {case} failed with status {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        sys.exit(1)
    import torch
    with open(os.path.join(tmp, f"{case}.{mode}.json")) as f:
        info = json.load(f)
    return torch.load(os.path.join(tmp, f"{case}.{mode}.pt")), info


def same(check, label, ref, got):
    import torch
    check(len(ref["losses"]) == len(got["losses"]) == STEPS and
          all(torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"])),
          f"{label}: losses bit-identical ({[round(l.item(), 6) for l in got['losses']]})")
    check(len(ref["params"]) == len(got["params"]) and
          all(torch.equal(a, b) for a, b in zip(ref["params"], got["params"])),
          f"{label}: all {len(ref['params'])} trained parameters bit-identical after {STEPS} steps")


def main(argv):
    if argv and argv[0] == "--child":
        child(argv[1], argv[2], argv[3], int(argv[4]))
        return 0
    cases = argv or ["lora", "lora_checkpoint", "lora_accum", "lora_no_scope", "adamw"]
    check = harness.Checks()
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            ref, _ = run("ref", case, tmp)
            _, peak = run("peak", case, tmp)
            peak_bytes = peak["stats"]["peak_reserved_bytes"]
            percent = {"adamw": 75, "lora_no_scope": 90}.get(case, 50)
            limit = peak_bytes * percent // 100 // MIB * MIB
            off, info = run("offload", case, tmp, limit)
            s = info["stats"]
            print(f"== {case}: peak without offload {peak_bytes / MIB:.1f} MiB, limit {limit / MIB:.0f} MiB "
                  f"({percent}%), with the feature {s['peak_reserved_bytes'] / MIB:.1f} MiB")
            print("     per step: " + "; ".join(", ".join(f"{k}={st[k]}" for k in (
                "frozen_bytes_d2h", "frozen_bytes_dropped", "bytes_evicted_total", "num_faults", "kept_bytes"))
                for st in info["steps"]))
            check("error" not in info, f"{case}: the run completed ({info.get('error', '')})")
            same(check, f"{case}: under the limit", ref, off)
            check(s["peak_reserved_bytes"] <= limit, f"{case}: peak reserved within the limit "
                  f"({s['peak_reserved_bytes']} <= {limit})")
            if case == "lora_no_scope":
                d2h = info["steps"][-1]["frozen_bytes_d2h"] if info["steps"] else 0
                check(d2h > 0, f"{case}: weights that autograd did not save left the device ({d2h} B)")
            elif case.startswith("lora"):
                kept = info["kept_weight_bytes"]
                check(kept > limit, f"{case}: the frozen weights ({kept} B, {info['kept_params']} parameters kept) "
                      f"exceed the limit ({limit} B)")
                d2h = [st["frozen_bytes_d2h"] for st in info["steps"]]
                dropped = [st["frozen_bytes_dropped"] for st in info["steps"]]
                check(0 < d2h[-1] <= kept, f"{case}: each weight copied out at most once ({d2h[-1]} <= {kept})")
                check(all(dropped[i] > dropped[i - 1] for i in range(1, STEPS)),
                      f"{case}: weights dropped with no copy in every later step ({dropped})")
                check(d2h[-1] == d2h[-2], f"{case}: no weight copied out in the last step ({d2h})")
            else:
                before = peak["peak_before_first_step"]
                check(before < peak_bytes, f"adamw: without offload the peak is in the optimizer "
                      f"({before} B before the first step, {peak_bytes} B after)")
                _, plain = run("plain", case, tmp, limit)
                check("OutOfMemoryError" in plain.get("error", "") or "out of memory" in plain.get("error", ""),
                      f"adamw: at the same limit without offload_optimizer the run runs out of memory "
                      f"({plain.get('error', 'it completed')[:120]})")
                check(s["kept_bytes"] > 0, f"adamw: the optimizer's state is kept ({s['kept_bytes']} B)")
        if not argv:
            run_options(check, tmp)
    return check.finish()


def run_options(check, tmp):
    """`vramswap run --offload-frozen` and `--offload-optimizer` on the unmodified script
    (tests/gpu/kept.py, which a GPU runs the same way)."""
    sys.path.insert(0, str(SCRIPT.parents[1] / "gpu"))
    import kept
    kept.run_options(tmp, True, check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
