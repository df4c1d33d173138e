"""`python3 -m vramswap bench` and `python3 -m vramswap replay`: the memory-pressure benchmark
on cudasim in virtual time (no GPU, no torch).

  bench [SCENARIO...|SNAPSHOT.pickle...|all] [--out DIR | --results] [--json] [--quick]
        [--workers N] [--warmup N] [--disk GBPS] [--list]
      runs the named scenarios (default: scenarios.DEFAULT) under every policy and prints
      one table per scenario. A name that is an existing *.pickle file is a torch memory
      snapshot, and one that is an existing *.log file an operator log of the DTR
      prototype (dtr.py), replayed as `replay` replays it, at the standard limits on the
      H100 card.
      Files (results.json, table.txt/.md, memory.svg, timeline.svg, trace.json) go to
      DIR/<scenario>/ with --out, to bench/results/<scenario>/ with --results (which also
      rewrites bench/results/README.md), otherwise to vramswap-bench/<scenario>/ in the
      current directory (DEFAULT_OUT; rewritten by the next run); the folder is printed.
      --json prints one JSON object instead of the tables and writes files only with --out.
      --quick runs vramswap at one limit per scenario, the lowest of its limits that the
      step's working set fits (scenarios.quick_share()), horizon 4. --disk GBPS sets the
      disk's rate in the scenarios with a disk tier (gpt-small-disk: the pinned tier holds a
      quarter of what must leave, the rest goes to the disk; runner.py's Note [A disk in
      the benchmark]).
  replay SNAPSHOT [--limit SIZE|PCT] [--horizon N] [--card SIZE] [--pcie GBPS]
         [--duplex full|shared] [--soft-limit SIZE|PCT] [--warmup N]
         [--policy none|offload_all|vramswap] [--until PHASE] [--out DIR] [--json]
      replays a torch memory snapshot (torch.cuda.memory._dump_snapshot), or an operator
      log of the DTR prototype (JSON lines; dtr.py), under vramswap at
      --limit (a size, or a percentage of the no-offload peak; default: the whole card) and,
      for context, under no offload and offload_all, and prints the table (--policy: that
      policy alone; a percentage limit still runs no offload for its peak, unshown).
      --until PHASE replays the snapshot only up to the start of its first PHASE phase
      (e.g. optimizer): the ops from there on are left out, nothing more is freed, and the
      output says so. With --json it prints one JSON object for the vramswap run (or the
      --policy run): peak_live_bytes and final_live_bytes (the trace's own figures: bytes
      allocated since recording began and still live, so the tensors allocated before it,
      live_base_bytes, are not counted), peak_device_bytes, bytes_d2h, bytes_h2d,
      step_time_s, ideal_time_s, bound_time_s, step/bound, must_leave_bytes,
      d2h/must_leave, stall_time_s, idle_time_s, first_step, ... Exit status: 0 when the
      replay completed, 1 when it ran out of memory (the object says where), 2 for a bad
      argument.

Both measure the step after --warmup warm-up steps (default 2; 0: the first step), and
report the first step of the same run beside it (measure.py's Note [Warm-up steps]); a
workload that cannot be repeated as a step (most snapshots: the step frees tensors
allocated before it) is measured at its first step, and the output says why. Every run
shows the policy-independent lower bound on its step time at its limit (bound.py) beside
the per-phase ideal: "bound" and "step/bound" (measure.py's Note [The bound beside every
run]).

Sizes are written as vramswap's configuration writes them (1024-based: 512MiB, 12GiB, 12G,
1.5GiB or a plain number of bytes).

Thread safety: main() is for the command line (it prints and exits).
"""
import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from .._files import write_file
from . import report, runner, scenarios
from .workload import PHASES

_UNITS = {"": 0, "b": 0, "k": 10, "kb": 10, "kib": 10, "m": 20, "mb": 20, "mib": 20,
          "g": 30, "gb": 30, "gib": 30, "t": 40, "tb": 40, "tib": 40}
RESULTS_DIR = scenarios._REPO_ROOT / "bench" / "results"
# Where bench writes its plots, traces and JSON when neither --out nor --results is given:
# relative to the current directory, one folder per scenario, rewritten by the next run.
DEFAULT_OUT = "vramswap-bench"


def parse_size(text):
    """Bytes from '12GiB', '512 MiB', '1.5G', '12550078464' (1024-based units, as
    VRAMSWAP_LIMIT). Raises ValueError."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?) ?([a-zA-Z]*)", text.strip())
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 12GiB, 512MiB, 12550078464)")
    whole, _, frac = m.group(1).partition(".")
    shift = _UNITS[m.group(2).lower()]
    n = (int(whole) << shift) + (int(frac) << shift) // 10 ** len(frac) if frac else int(whole) << shift
    return n


def _size_arg(text):
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return n


def _size_or_percent(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", text.strip())
    if m:
        pct = float(m.group(1))
        if not 0 < pct <= 1000:
            raise argparse.ArgumentTypeError(f"{text!r}: a percentage from 0 (excluded) to 1000%")
        return ("percent", pct)
    return ("bytes", _size_arg(text))


def _positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return v


def _int_in(low, high):
    """An argparse type: an integer from low to high."""
    def parse(text):
        if not re.fullmatch(r"\d+", text) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer from {low} to {high}")
        return int(text)
    return parse


_horizon = _int_in(0, 1024)
_workers = _int_in(1, 64)


def _progress(quiet):
    def say(msg):
        if not quiet:
            print(f"  {msg}", file=sys.stderr, flush=True)
    return say


def _header(sc, sr):
    f = sr.workload_facts
    return (f"== {sc.name}: {sc.description}\n"
            f"   card: {sc.card_name or report.fmt_bytes(sc.card_bytes)} ({report.fmt_bytes(sc.card_bytes)}, "
            f"PCIe {sc.pcie_gbps:g} GB/s each way, {sc.duplex} duplex); cudasim virtual time, no GPU\n"
            f"   workload: {f['ops']} ops, compute {report.fmt_ns(f['compute_ns'])}, peak live "
            f"{report.fmt_bytes(f['peak_live_bytes'])}, saved for backward {report.fmt_bytes(f['saved_bytes'])}; "
            f"no-offload peak device memory {report.fmt_bytes(sr.reference_peak)}")


# ---- bench -------------------------------------------------------------------------------

def bench_parser():
    p = argparse.ArgumentParser(
        prog="python3 -m vramswap bench",
        description="Runs memory-pressure scenarios on cudasim in virtual time (no GPU): no offload, "
                    "offload_all and vramswap at several limits and horizons, side by side.")
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help=f"scenario names (default: {scenarios.DEFAULT}; 'all' for every one; --list shows them), "
                        "or paths of traces to replay at the standard limits (torch memory snapshots, *.pickle; DTR "
                        "operator logs, *.log)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--out", metavar="DIR", type=Path,
                     help=f"write plots, trace and JSON to DIR/<scenario>/ (default: {DEFAULT_OUT}/ in the current "
                          "directory; with --json, none unless --out is given)")
    out.add_argument("--results", action="store_true",
                     help="write them to bench/results/<scenario>/ and rewrite bench/results/README.md")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--quick", action="store_true",
                   help="vramswap only at the lowest of the scenario's limits that its working set fits (50%% of "
                        "the peak for the GPT steps, 75%% for VGG-16), horizon 4, and above the peak")
    p.add_argument("--workers", type=_workers, default=2, help="child processes run at once (default 2)")
    p.add_argument("--disk", type=_positive_float, metavar="GBPS",
                   help="the disk's rate in the scenarios with a disk tier behind a small pinned one "
                        "(gpt-small-disk; default: the scenario's, 6 GB/s)")
    _warmup_arg(p)
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    return p


def _warmup_arg(p):
    p.add_argument("--warmup", type=_int_in(0, 16), default=runner.DEFAULT_WARMUP, metavar="N",
                   help=f"steps run before the measured one (default {runner.DEFAULT_WARMUP}; 0: the first step "
                        "is measured); the first step is reported beside it either way")


def bench(argv):
    p = bench_parser()
    args = p.parse_args(argv)
    if args.list:
        for name, sc in scenarios.SCENARIOS.items():
            why = sc.unavailable()
            print(f"{name:12} {sc.description}; {sc.card_name}" + (f" [unavailable: {why}]" if why else ""))
        return 0
    names = args.scenarios or [scenarios.DEFAULT]
    if "all" in names:
        names = list(scenarios.SCENARIOS)
        explicit = False
    else:
        explicit = True
    chosen = {}
    for n in names:
        if n in scenarios.SCENARIOS:
            chosen[n] = scenarios.SCENARIOS[n]
        elif scenarios.is_trace_path(n):
            sc = scenarios.trace_scenario(n)
            try:
                sc.workload()
            except Exception as e:  # noqa: BLE001 - the reader's errors name the file; no traceback
                print(f"vramswap bench: cannot replay {n}: {e}", file=sys.stderr)
                return 2
            chosen[sc.name] = sc
        else:
            p.error(f"argument SCENARIO: unknown scenario {n!r} (known: {', '.join(scenarios.SCENARIOS)}, all; "
                    "or the path of a trace: a snapshot, *.pickle, or a DTR operator log, *.log)")
    names = list(chosen)
    if args.results and args.quick:
        p.error("argument --results: bench/results holds full runs; leave out --quick")
    base = RESULTS_DIR if args.results else args.out
    if base is None and not args.json:
        base = Path(DEFAULT_OUT)
    say = _progress(args.json)
    done, skipped, out_json = [], {}, {}
    for n in names:
        sc = chosen[n]
        why = sc.unavailable()
        if why:
            if explicit:
                print(f"vramswap bench: scenario {n} cannot run: {why}", file=sys.stderr)
                return 2
            skipped[n] = why
            say(f"{n}: skipped: {why}")
            continue
        say(f"{n}: running ({sc.description})")
        try:
            sr = scenarios.run_scenario(sc, quick=args.quick, workers=args.workers, record=base is not None,
                                        progress=say, warmup=args.warmup, disk_gbps=args.disk)
        except runner.RunError as e:
            print(f"vramswap bench: {n}: {e}", file=sys.stderr)
            return 1
        done.append(sr)
        out_json[n] = {"description": sc.description, "card_bytes": sc.card_bytes, "card": sc.card_name,
                       "pcie_gbps": sc.pcie_gbps, "duplex": sc.duplex, "workload": sr.workload_facts,
                       "reference_peak_bytes": sr.reference_peak, "warmup": args.warmup,
                       "notes": report.notes(sr.results),
                       "runs": [report.summary(r) for r in sr.results]}
        if not args.json:
            print(_header(sc, sr))
            print(report.table(sr.results, sr.reference_peak))
            print()
        if base is not None:
            report.write(Path(base) / n, n, sr.results, card_bytes=sc.card_bytes, title=n)
    if args.json:
        print(json.dumps({"clock": "cudasim virtual time", "scenarios": out_json, "skipped": skipped}, indent=1))
    if base is not None:
        if args.results:
            _write_results_readme(done, skipped, argv, args.warmup)
        print(f"plots, traces and JSON: {base}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _write_results_readme(done, skipped, argv, warmup=runner.DEFAULT_WARMUP):
    """bench/results/README.md: the command, the date, the tables and links to the plots."""
    lines = [
        "# vramswap memory-pressure benchmark: results",
        "",
        f"Generated {datetime.date.today().isoformat()} by",
        "",
        "```sh",
        "PYTHONPATH=plugin/python python3 -m vramswap bench " + " ".join(argv),
        "```",
        "",
        "**Clock: cudasim virtual time, no GPU.** Every number below comes from running the real "
        "`libvramswap.so` (and, for the other policies, the same pool) on cudasim with "
        "`CUDASIM_TIME=virtual` and `CUDASIM_UNBACKED=1`: kernels take the time the workload gives "
        "them, copies take bytes / PCIe rate on one copy engine per direction, and the host clock "
        "moves only when the host waits. No real GPU ran any of it; the times are a model of the "
        "card named in each section, not a measurement of one.",
        "",
        ("Each run measures the first training step (the allocator's cache cold, nothing learned "
         "from an earlier step, `--warmup 0`); by default the step after 2 warm-up steps is measured."
         if not warmup else f"Each run measures the step after {warmup} warm-up step(s) (`--warmup {warmup}`), "
         "and the first step of the same run is shown beside it (\"first step\"); a workload that cannot "
         "be repeated as a step is measured at its first step, and the lines under its table say why."),
        "",
        "Policies: **none** (vramswap's pool with no offload), **offload_all** (every saved tensor "
        "copied to pinned host memory at save and back at use on copy streams of its own, as "
        "torch's `save_on_cpu` and hook-based offloaders do; horizon 0 copies back when backward "
        "asks, horizon 4 prefetches the next 4), **vramswap** (the offload scope and tracker "
        "protocol at `VRAMSWAP_LIMIT` = a share of the no-offload peak, `VRAMSWAP_HORIZON` as "
        "shown, the default soft limit of 90%). Columns: peak device = cudasim's peak physical "
        "memory; d2h / h2d = bytes copied; stall = time kernels waited on copies (event waits); "
        "idle = step time minus compute time (the compute engine idle for any reason); ideal = "
        "the sum over phases (forward, backward, optimizer) of the larger of the phase's compute "
        "time and its copies' time at the PCIe rate; bound = the lower bound on the step time at the "
        "run's limit that holds for every policy (compute plus the least stall the copies force: "
        "`plugin/python/vramswap/bench/bound.py`), and step/bound how far the run is from it. See "
        "`plugin/python/vramswap/bench/measure.py` for the exact definitions.",
        "",
    ]
    lines += _must_show(done)
    for sr in done:
        sc = sr.scenario
        f = sr.workload_facts
        lines += [
            f"## {sc.name}",
            "",
            f"{sc.description}. Card: {sc.card_name}. Workload: {f['ops']} ops, compute "
            f"{report.fmt_ns(f['compute_ns'])}, peak live {report.fmt_bytes(f['peak_live_bytes'])} "
            f"({f['peak_live_bytes']:,} B), saved for backward {report.fmt_bytes(f['saved_bytes'])}. "
            f"No-offload peak device memory {report.fmt_bytes(sr.reference_peak)} ({sr.reference_peak:,} B).",
            "",
            report.markdown_table(sr.results, sr.reference_peak),
            "",
        ] + ([sc.notes, ""] if sc.notes else []) + [
            f"Plots: [memory over time]({sc.name}/memory.svg), [copy timeline of the featured run]"
            f"({sc.name}/timeline.svg); Chrome trace (open in ui.perfetto.dev): [{sc.name}/trace.json]"
            f"({sc.name}/trace.json); all numbers: [{sc.name}/results.json]({sc.name}/results.json).",
            "",
            f"![memory]({sc.name}/memory.svg)",
            "",
        ]
    for n, why in skipped.items():
        lines += [f"## {n}", "", f"Not run: {why}.", ""]
    write_file(RESULTS_DIR / "README.md", "\n".join(lines))


def _must_show(done):
    """The issue's "must show" items, checked against these runs: lines for the README."""
    by_name = {sr.name: sr for sr in done}
    out = ["## What the issue asks to show, checked against these runs", ""]

    def mark(ok):
        return "**holds**" if ok else "**does not hold**"

    sr = by_name.get("magma27")
    if sr:
        none = next((r for r in sr.results if r["policy"] == "none" and r["status"] == "ok"), None)
        if none:
            out.append(f"- Replaying MAGMA27 reproduces the trace's peak live bytes, 12,550,078,464 B: "
                       f"{mark(none['peak_live_bytes'] == 12_550_078_464)} ({none['peak_live_bytes']:,} B).")
    kept_names = {n for n, sc in scenarios.SCENARIOS.items() if sc.kept}
    for sr in sorted(done, key=lambda sr: sr.name in kept_names):
        if sr.name == "magma27":
            continue
        if sr.name in kept_names and not any(l.startswith("### Kept") for l in out):
            out += ["", "### Kept tensors (the LoRA and AdamW-state scenarios)", "",
                    "Kept tensors are in the plan as blocks cold from the step's start; a victim's copy out for "
                    "the next step starts at its last use (DESIGN.md, \"Kept blocks\"). These rows are issue 16's, "
                    "listed against the planned-eviction bars above for comparison.", ""]
        for label in ("vramswap 90%", "vramswap 75%", "vramswap 50%"):
            r = next((r for r in sr.results if r["policy"] == "vramswap" and r.get("label") == label
                      and r.get("horizon") == 4), None)
            if not r:
                continue
            where = f"- {sr.name} at {label.split()[-1]} of its no-offload peak (horizon 4)"
            if r.get("bound_ns") is None:
                out.append(f"{where}: no bound ({r.get('bound_note') or 'the working set does not fit'}); "
                           f"run {r['status']}.")
                continue
            if r["status"] != "ok":
                out.append(f"{where}: steady step <= 1.05 x the bound: {mark(False)} (the run ended {r['status']}).")
                continue
            ratio = r["step_time_ns"] / r["bound_ns"]
            must = r.get("must_leave_bytes") or 0
            moved = r["bytes_d2h"] / must if must else None
            steps = f"step {report.fmt_ns(r['step_time_ns'])}, bound {report.fmt_ns(r['bound_ns'])}"
            out.append(f"{where}: steady step <= 1.05 x the bound: {mark(ratio <= 1.05)} ({ratio:.3f}; {steps}"
                       + "); D2H bytes <= 1.25 x the bytes that must leave: "
                       + (f"{mark(moved <= 1.25)} ({report.fmt_bytes(r['bytes_d2h'])} for "
                          f"{report.fmt_bytes(must)}, {moved:.2f}x)." if moved is not None else "nothing must leave."))
        for r in sr.results:
            if r["policy"] == "vramswap" and r["status"] == "ok" and r["limit_bytes"] > sr.reference_peak:
                none = next((n for n in sr.results if n["policy"] == "none" and n["status"] == "ok"), None)
                if none is None:
                    continue
                moved = r["bytes_d2h"] + r["bytes_h2d"]
                peak, none_peak = r.get("peak_reserved_bytes") or 0, none.get("peak_reserved_bytes") or 0
                out.append(f"- {sr.name} at a limit above the peak ({r['label'].split()[-1]}): 0 bytes moved: "
                           f"{mark(moved == 0)} ({report.fmt_bytes(moved)}); step time equal to no offload: "
                           f"{mark(r['step_time_ns'] == none['step_time_ns'])}; peak reserved <= no offload's: "
                           f"{mark(peak <= none_peak)} ({report.fmt_bytes(peak)} against "
                           f"{report.fmt_bytes(none_peak)}"
                           + (f": {report.fmt_bytes(peak - none_peak)} more)." if peak > none_peak else ")."))
    heading = next((i for i, line in enumerate(out) if line.startswith("### Kept")), len(out))
    text, kept_text = "\n".join(out[:heading]), "\n".join(out[heading:])
    why = []
    if "0 bytes moved: **does not hold**" in text:
        why.append(
            "- Bytes move above the peak when the pool maps new memory instead of reusing freed blocks. "
            "A tagged block the program frees is reusable at once by the stream that freed it and by other "
            "streams once the event recorded at the free completes (DevicePool::deallocate_to_any); "
            "cudasim's host clock moves only when the host waits, so other streams see that late.")
    if "peak reserved <= no offload's: **does not hold**" in text:
        why.append(
            "- Under a limit below the card the pool places for eviction (DESIGN.md, \"The pool\"): a tagged "
            "block of half a granule or more takes whole granules of its own, so that its eviction frees what "
            "it unmaps, and ordinary blocks keep off granules with live tagged blocks; a limit above the peak "
            "can then reserve more than the run without offload (`tagged_waste_bytes` in results.json is the "
            "rounding part). After a step with no eviction and no refused mapping it places densely again, but "
            "what was placed before stays: kept blocks (frozen weights, optimizer state) in whole granules, "
            "and the granules the first step mapped.")
    if "1.05 x the bound: **does not hold**" in text:
        why.append(
            "- Under heavy pressure the plan is still short of the bound by a few percent: the copies it "
            "plans move whole blocks where the bound moves bytes as a fluid, a copy back starts only at an "
            "engine call after the memory it needs is free, and the plan places fetches by memory, not by "
            "time (DESIGN.md, \"Planned eviction\").")
    if "the bytes that must leave: **does not hold**" in text:
        why.append(
            "- The bytes that must leave are counted from the step's live bytes (perfect packing); the plan "
            "works from what the pool must own, its rounding and cached blocks included, and evicts whole "
            "blocks, so at mild pressure one large block can be most of the excess.")
    if "**does not hold**" in kept_text:
        why.append(
            "- AdamW's state changes in every step, so whatever of it must be out during the forward is "
            "copied out between its use in the optimizer and the forward's end, at the PCIe rate: where that "
            "takes longer than the optimizer and the forward, the forward waits for it. The bound moves bytes "
            "as a fluid and may take any state or activation (DESIGN.md, \"Kept blocks\").")
    if "the bytes that must leave: **does not hold**" in kept_text:
        why.append(
            "- A kept tensor leaves whole: the plan takes the state of the tensors needed last in the "
            "optimizer, whatever their size (an embedding's AdamW moments are among them), where the bytes "
            "that must leave are counted from the live bytes.")
    out += [""] + (["Why an item does not hold:", ""] + why if why else []) + [""]
    return out


# ---- replay ------------------------------------------------------------------------------

def replay_parser():
    p = argparse.ArgumentParser(
        prog="python3 -m vramswap replay",
        description="Replays a torch memory snapshot (torch.cuda.memory._dump_snapshot pickle), or an operator "
                    "log of the DTR prototype (JSON lines), on cudasim in virtual time under vramswap, beside no "
                    "offload and offload_all.")
    p.add_argument("snapshot", metavar="SNAPSHOT", type=Path,
                   help="the snapshot pickle, or the operator log (its first line a DTR instruction)")
    p.add_argument("--limit", type=_size_or_percent, metavar="SIZE|PCT",
                   help="vramswap's limit: a size (12GiB) or a percentage of the no-offload peak (50%%); "
                        "default: the whole card")
    p.add_argument("--horizon", type=_horizon, default=4, help="VRAMSWAP_HORIZON (default 4)")
    p.add_argument("--card", type=_size_arg, default=80 * scenarios.GiB, metavar="SIZE",
                   help="the card's memory (default 80GiB)")
    p.add_argument("--pcie", type=_positive_float, default=55.0, metavar="GBPS",
                   help="PCIe rate per direction in GB/s (default 55)")
    p.add_argument("--duplex", choices=runner.DUPLEX, default="full", help="PCIe duplex (default full)")
    p.add_argument("--soft-limit", type=_size_or_percent, metavar="SIZE|PCT",
                   help="VRAMSWAP_SOFT_LIMIT (a size, or a percentage of the limit; default 90%%)")
    _warmup_arg(p)
    p.add_argument("--policy", choices=("none", "offload_all", "vramswap"),
                   help="run only this policy (default: all three; a percentage --limit still runs no offload "
                        "for its peak, without showing it)")
    p.add_argument("--until", choices=PHASES, metavar="PHASE",
                   help="replay only up to the start of the snapshot's first PHASE phase "
                        f"({', '.join(PHASES)}), e.g. optimizer: the ops from there on are left out and "
                        "nothing more is freed")
    p.add_argument("--out", metavar="DIR", type=Path, help="write plots, trace and JSON to DIR")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object for the vramswap run, or the --policy run (no context runs)")
    return p


def _json_object(r, facts):
    s = 1e-9
    ok = r["status"] == "ok"
    bound = r.get("bound_ns")
    return {
        "snapshot": facts.get("snapshot"),
        "policy": r["policy"], "status": r["status"], "error": r["error"],
        "limit_bytes": r["limit_bytes"], "horizon": r["horizon"], "card_bytes": r["card_bytes"],
        "pcie_gbps": r["pcie_gbps"], "duplex": r["duplex"],
        "peak_live_bytes": r["peak_live_bytes"], "final_live_bytes": r["final_live_bytes"],
        "peak_device_bytes": r["peak_device_bytes"], "peak_reserved_bytes": r["peak_reserved_bytes"],
        "bytes_d2h": r["bytes_d2h"], "bytes_h2d": r["bytes_h2d"],
        "step_time_s": r["step_time_ns"] * s if ok else None,
        "ideal_time_s": r["ideal_ns"] * s if ok else None,
        "bound_time_s": bound * s if bound is not None else None,
        "step/bound": r.get("step/bound"),
        "must_leave_bytes": r.get("must_leave_bytes"),
        "d2h/must_leave": r.get("d2h/must_leave"),
        "bound_note": r.get("bound_note"),
        "compute_time_s": r["compute_ns"] * s, "stall_time_s": r["stall_ns"] * s if ok else None,
        "num_evictions": r["num_evictions"], "num_prefetches": r["num_prefetches"],
        "num_faults": r["num_faults"], "num_late_prefetches": r["num_late_prefetches"],
        "num_planned_steps": r.get("num_planned_steps", 0), "num_plan_divergences": r.get("num_plan_divergences", 0),
        "planned_bytes_d2h": r.get("planned_bytes_d2h", 0),
        "vmm_calls": r.get("vmm_calls"), "vmm_mapped_bytes": r.get("vmm_mapped_bytes"),
        "live_base_bytes": r["live_base_bytes"],
        "idle_time_s": (r["step_time_ns"] - r["compute_ns"]) * s if ok else None,
        "warmup": r.get("warmup", 0), "warmup_steps": r.get("warmup_steps", 0),
        "warmup_note": r.get("warmup_note"),
        "first_step": r.get("first_step"),
        "until": facts.get("until"),
        "clock": "cudasim virtual time",
    }


def replay(argv):
    p = replay_parser()
    args = p.parse_args(argv)
    if not args.snapshot.is_file():
        p.error(f"argument SNAPSHOT: {str(args.snapshot)!r} is not a file")
    if args.card < (64 << 20) or args.card > (1 << 40):
        p.error("argument --card: the card must be from 64MiB to 1TiB (cudasim's range)")
    try:
        from . import dtr, snapshot
    except ImportError as e:
        print(f"vramswap replay: the trace readers are not available: {e}", file=sys.stderr)
        return 1
    try:
        w = scenarios.load_trace(args.snapshot).validate()
    except (snapshot.SnapshotError, dtr.DtrLogError, OSError) as e:  # these name the file, where and what is wrong
        print(f"vramswap replay: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a snapshot check() let through: still no traceback
        print(f"vramswap replay: cannot read {args.snapshot}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    facts = {"snapshot": str(args.snapshot)}
    if args.until:
        try:
            w = scenarios.truncate(w, args.until)
        except ValueError as e:
            p.error(f"argument --until: the snapshot cannot be cut at {args.until}: {e}")
        facts["until"] = w.meta["until"]
    base = dict(card_bytes=args.card, pcie_gbps=args.pcie, duplex=args.duplex, record=args.out is not None,
                warmup=args.warmup)
    soft = None
    if args.soft_limit:
        soft = f"{args.soft_limit[1]:g}%" if args.soft_limit[0] == "percent" else str(args.soft_limit[1])
    percent = bool(args.limit and args.limit[0] == "percent")
    shown = [args.policy] if args.policy else (["vramswap"] if args.json else ["none", "offload_all", "vramswap"])
    main_policy = args.policy or "vramswap"
    try:
        context = []
        if "none" in shown or (percent and "vramswap" in shown):
            context.append(dict(base, policy="none", label="none"))
        if "offload_all" in shown:
            context.append(dict(base, policy="offload_all", label="offload_all", horizon=0))
        context = runner.run_many(w, context) if context else []
        none = next((r for r in context if r["policy"] == "none"), None)
        reference = none["peak_device_bytes"] if none and none["status"] == "ok" else None
        runs = context
        if "vramswap" in shown:
            limit = None
            if percent:
                if reference is None:
                    print("vramswap replay: --limit as a percentage needs the no-offload peak, but the no-offload "
                          f"run did not complete on this card: {none['error']}", file=sys.stderr)
                    return 1
                limit = max(scenarios.GRANULE,
                            int(reference * args.limit[1] / 100) // scenarios.GRANULE * scenarios.GRANULE)
            elif args.limit:
                limit = args.limit[1]
            if limit is not None and limit > args.card:
                p.error(f"argument --limit: {limit} bytes is more than the card ({args.card} bytes)")
            label = "vramswap" + (f" {args.limit[1]:g}%" if percent else "")
            runs = context + runner.run_many(w, [dict(base, policy="vramswap", label=label, limit_bytes=limit,
                                                      horizon=args.horizon, soft_limit=soft)])
    except runner.RunError as e:
        print(f"vramswap replay: {e}", file=sys.stderr)
        return 1
    results = [r for r in runs if r["policy"] in shown]
    r = next(x for x in results if x["policy"] == main_policy)
    cut = ""
    if args.until:
        u = facts["until"]
        cut = (f"   replayed up to the start of the {u['phase']} phase: ops 0 to {u['op'] - 1} of {u['ops_total']}; "
               "the rest is left out and nothing more is freed (tensors live there stay live at the end)\n")
    if args.json:
        print(json.dumps(_json_object(r, facts), indent=1))
    else:
        base_live = r["live_base_bytes"]
        print(f"== replay of {args.snapshot.name}: {len(w.ops)} ops, compute {report.fmt_ns(w.compute_ns())}; "
              f"live bytes from the trace's start: peak {r['peak_live_bytes']:,} B, final {r['final_live_bytes']:,} B"
              + (f" (besides {base_live:,} B allocated before it)" if base_live else "") + "\n" + cut +
              f"   card {report.fmt_bytes(args.card)}, PCIe {args.pcie:g} GB/s each way ({args.duplex} duplex); "
              "cudasim virtual time, no GPU")
        print(report.table(results, reference))
    if args.out is not None:
        report.write(args.out, args.snapshot.stem, results, card_bytes=args.card, title=args.snapshot.stem)
        print(f"plots, trace and JSON: {args.out}", file=sys.stderr if args.json else sys.stdout)
    return 0 if r["status"] == "ok" else 1
