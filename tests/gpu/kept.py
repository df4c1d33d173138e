#!/usr/bin/python3
"""Kept blocks under `vramswap run` on an unmodified script: frozen-layer streaming
(--offload-frozen) and optimizer state off the device (--offload-optimizer), on a GPU or, with
--cpu-sim, in the CPU-emulation mode (what tests/python/test_kept_blocks.py runs).

tests/python/scripts/train_kept.py trains each model three steps:
  ref     plainly (torch's own allocator)
  peak    python3 -m vramswap run --no-offload: vramswap's allocator, no limit; its stats file
          gives the peak reserve
  kept    python3 -m vramswap run --offload-frozen (the LoRA-style model; its forwards
          offloaded too) or --no-offload --offload-optimizer (the AdamW MLP), with
          VRAMSWAP_LIMIT at that peak less most of the bytes the feature can keep: 18 of the
          28 MiB of frozen weights, 16 of AdamW's 32 MiB of state. A share of the peak would
          not do: on a GPU most of these small models' peak is torch's cuBLAS workspaces (64
          of the LoRA model's 101 MiB, H200, 2026-11-27), which no feature can move
and checks that the kept run's results file equals the plain run's (losses and a sha256 of
the trained parameters), its peak is within the limit, the feature moved bytes
(frozen_bytes_d2h, bytes_evicted_total) and nothing ran out of memory.

In the CPU-emulation mode the scripts emulate those workspaces (train_kept.py --workspace 32),
so that the limits there press on the model as they do on a GPU.

Usage: python3 tests/gpu/kept.py [--cpu-sim] [--out FILE]   (exit status 0: every check held)
On a GPU, run it after scripts/gpu (it uses build-gpu's library: VRAMSWAP_LIBRARY and
VRAMSWAP_CACHE_DIR as scripts/gpu exports them); --out writes the checks and the stats (JSON).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "python" / "scripts" / "train_kept.py"
MIB = 1 << 20
# (model, option, bytes below the no-offload peak the limit is, the stat that shows it moved them)
CASES = (("lora", "--offload-frozen", 18 * MIB, "frozen_bytes_d2h"),
         ("mlp", "--offload-optimizer", 16 * MIB, "bytes_evicted_total"))
WORKSPACE_MIB = 32  # per cuBLAS workspace, as torch allocates them on a Hopper card


def run_options(tmp, cpu_sim, check, python=sys.executable):
    """Runs every case of CASES in `tmp`; check(cond, what) records each check. Returns
    {model: stats of the kept run}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSWAP_") or k in (
        "VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR", "VRAMSWAP_CACHE_DIR", "VRAMSWAP_TORCH_EXT",
        "VRAMSWAP_TORCH_EXT_CUDA")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python")] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if cpu_sim:
        env["VRAMSWAP_TORCH_DEVICE"] = "cpu-sim"
    device = ["--device", "cpu", "--workspace", str(WORKSPACE_MIB)] if cpu_sim else ["--device", "cuda"]

    def launch(name, run_args, model, extra_env=None):
        out = os.path.join(tmp, name)
        cmd = [python] + (["-m", "vramswap", "run"] + run_args + ["--", "python3"] if run_args is not None else [])
        proc = subprocess.run(cmd + [str(SCRIPT), out + ".json", "--model", model] + device, cwd=tmp,
                              capture_output=True, text=True, timeout=600,
                              env=dict(env, VRAMSWAP_STATS_FILE=out + ".stats", **(extra_env or {})))
        if proc.returncode != 0:
            check(False, f"{' '.join(cmd)} {model}: exit status {proc.returncode}: {proc.stderr[-2000:]}")
            return None, None
        with open(out + ".json") as f:
            results = json.load(f)
        stats = None
        if run_args is not None:
            with open(out + ".stats") as f:
                stats = json.load(f)
        return results, stats

    kept_stats = {}
    for model, flag, below, key in CASES:
        ref, _ = launch(f"{model}-ref", None, model)
        _, peak = launch(f"{model}-peak", ["--no-offload"], model)
        if ref is None or peak is None:
            continue
        limit = (peak["peak_reserved_bytes"] - below) // MIB * MIB
        run_args = [flag] + (["--no-offload"] if model == "mlp" else [])
        got, st = launch(f"{model}-kept", run_args, model, {"VRAMSWAP_LIMIT": str(limit)})
        if got is None:
            continue
        kept_stats[model] = st
        check(got == ref and st["peak_reserved_bytes"] <= limit and st[key] > 0 and st["num_ooms"] == 0,
              f"vramswap run {flag} ({model} at its peak less {below // MIB} MiB): the plain run's results "
              f"({got == ref}), peak {st['peak_reserved_bytes'] / MIB:.1f} <= {limit / MIB:.0f} MiB, "
              f"{key}={st[key]}, {st['num_ooms']} out-of-memory")
    return kept_stats


def main(argv):
    p = argparse.ArgumentParser(prog="tests/gpu/kept.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-sim", action="store_true", help="the CPU-emulation mode (no GPU)")
    p.add_argument("--out", default=None, help="write the checks and the kept runs' stats here (JSON)")
    args = p.parse_args(argv)
    checks = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what, flush=True)
        checks.append({"ok": bool(cond), "what": what})

    with tempfile.TemporaryDirectory() as tmp:
        stats = run_options(tmp, args.cpu_sim, check)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"checks": checks, "stats": stats}, f, indent=1)
    failed = [c for c in checks if not c["ok"]]
    print("PASS" if checks and not failed else f"{len(failed)} check(s) failed")
    return 0 if checks and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
