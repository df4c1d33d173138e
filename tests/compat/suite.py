#!/usr/bin/python3
"""The compatibility suite: the models and training loops users run, unchanged, under
`python3 -m vramswap run` at the default settings in the CPU-emulation mode, each compared
bit for bit with plain torch.

Models (zoo.py, each built from its library's config with random weights; trained by
train_model.py for 3 AdamW steps): decoder-only LMs from transformers (Llama, GPT-2, Qwen2,
Mistral), an encoder (BERT), an encoder-decoder (T5), timm's ViT and ResNet, a peft LoRA
fine-tune of Llama with its base frozen (run as it is and with `--offload-frozen`), and a
Llama whose decoder layers are each torch.compile'd. Runs, each a fresh process but the
first:
  plain     every model's train() in one process with no vramswap at all (--child-ref): the
            reference results
  peak      python3 -m vramswap run --no-offload -- train_model.py MODEL OUT: vramswap's
            allocator alone, no limit; its VRAMSWAP_STATS_FILE's peak_reserved_bytes is "the
            peak"
  none      python3 -m vramswap run [FLAGS] -- ...: no limit. Results identical to plain's,
            and offload costs no memory: the peak within 1% of the peak run's (with
            --offload-frozen, at most 1% above it: kept weights may leave)
  60        the same with VRAMSWAP_LIMIT at 60% of the peak (whole MiB): results identical,
            evictions, no out-of-memory, the peak reserve within the limit
  40        at 40%: the same, or an out-of-memory that reports itself (vramswap's report,
            "within the limit", no results written, counted in num_ooms)
Loops (train_trainer.py, train_accelerate.py, train_lightning.py: the suite's Llama trained
by transformers.Trainer, by an accelerate.Accelerator loop, by lightning.Trainer on the CPU
with one device): plain (a process each), peak and 60, checked as above.
Several processes (train_ddp.py: DistributedDataParallel; train_fsdp2.py: FSDP2's
fully_shard on every decoder layer and the model; both on gloo, RANKS ranks, the suite's
Llama, each rank on batches of its own): launched by torchrun (`python3 -m
torch.distributed.run --standalone`), each rank under vramswap as a user runs it (`torchrun
... -m vramswap run -- train_ddp.py OUT`), with VRAMSWAP_STATS_FILE=...-{rank}.stats (a file
per rank): plain, peak and 60, checked as above on every rank's results and statistics. The
limit is one for all ranks (torchrun gives them one environment): 60% of the smallest rank's
peak. The ranks' stderr goes to files (torchrun --redirects), from which a failed run's
error is read.

Each finished run under vramswap is also checked for what other offloaders broke on: no
free of memory the pool did not hand out (num_invalid_frees 0: tensors made before vramswap
was installed and freed after), and at exit no tracked handle and nothing on the host
(num_tracked_blocks, host_bytes 0: host memory not freed after backward). A third or more
of the tensors these models save are views and many are not contiguous (transposed attention
heads, rotary embeddings' halves), which the bit-identity checks cover.

KNOWN_OUT_OF_MEMORY lists the runs at 60% that may end in an out-of-memory that reports
itself, and why: a finding, shown as an out-of-memory in the table, never a wrong result.

Runs go two at a time (--jobs), each case's in order; the compiled case's runs share one
TORCHINDUCTOR_CACHE_DIR with the reference process, which compiles its C++ first.
OMP_NUM_THREADS=1 in every child: deterministic kernels, and a 2-core CI.

--table README.md replaces the block between the compat-table markers in that file with the
measured table (library and version, model, peak without vramswap, limit, peak with
vramswap, evictions, identical, seconds; a distributed run's peaks and evictions rank by
rank) and the command and date that made it. The table is written whatever the checks
found; the exit status says whether they all held.

Usage: python3 tests/compat/suite.py [CASE...] [--jobs N] [--table README.md] [--json FILE]
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as the Python tests).
"""
import argparse
import concurrent.futures
import datetime
import glob
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
sys.path.insert(0, str(HERE))

from harness import Checks  # noqa: E402
# run_child: a child's rc, seconds, error line, result and stats; one inductor cache for all.
from test_torch2_features import run_child  # noqa: E402
import zoo  # noqa: E402  (imports no library: each model's build does)

MIB = 1 << 20
PERCENTS = (None, 60, 40)  # None: no limit
STRICT_PERCENT = 60        # must fit; below it an out-of-memory that reports itself is accepted
PEAK_TOLERANCE = 0.01
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"
ENV = {"OMP_NUM_THREADS": "1"}
RANKS = 2  # processes of a distributed case


def _model(name, *extra_variants):
    library, what, _ = zoo.MODELS[name]
    return {"library": library, "model": what, "script": ["train_model.py", name], "ref": "shared",
            "variants": [("", [], PERCENTS)] + list(extra_variants)}


def _loop(library, what, script):
    return {"library": library, "model": what, "script": [script], "ref": "own",
            "variants": [("", [], (STRICT_PERCENT,))]}


def _distributed(what, script):
    return dict(_loop("torch", what, script), ranks=RANKS)


# case -> {library, model, script (under tests/compat, then its arguments), ref ("shared": its
# plain results come from the one --child-ref process; "own": a plain process of its own), variants:
# [(label, flags of `vramswap run`, percents)], each run against the case's one peak; ranks: for a
# distributed case, how many processes torchrun starts}.
CASES = {name: _model(name) for name in zoo.MODELS}
CASES["lora"] = _model("lora", ("--offload-frozen", ["--offload-frozen"], PERCENTS))
CASES.update({
    "trainer": _loop("transformers", "Trainer (LlamaForCausalLM)", "train_trainer.py"),
    "accelerate": _loop("accelerate", "Accelerator loop (LlamaForCausalLM)", "train_accelerate.py"),
    "lightning": _loop("lightning", "lightning.Trainer, CPU, 1 device (LlamaForCausalLM)", "train_lightning.py"),
    "ddp": _distributed(f"DistributedDataParallel, {RANKS} ranks, gloo, torchrun (LlamaForCausalLM)",
                        "train_ddp.py"),
    "fsdp2": _distributed(f"FSDP2 `fully_shard` per layer, {RANKS} ranks, gloo, torchrun (LlamaForCausalLM)",
                          "train_fsdp2.py"),
})
DISTRIBUTIONS = ("torch", "transformers", "peft", "timm", "accelerate", "lightning")

# (case, variant label, percent) -> why a run at STRICT_PERCENT may end in an out-of-memory that
# reports itself. Each is a finding: the table shows the out-of-memory.
KNOWN_OUT_OF_MEMORY = {
    ("resnet", "", 60): "in its second step's backward, an 8 MiB gradient (untagged) does not fit by granules: "
                        "the reserved-but-free memory lies in pieces beside blocks in use; and no placement could "
                        "fit it: there autograd holds 36.8 MiB nothing tags (parameters, gradients, AdamW's state, "
                        "the batch) and an 8 MiB saved activation it is using, 52.8 MiB with the request under a "
                        "52 MiB limit (DESIGN.md, the pool's placement: Note [Why nothing fits])",
}


# -- running ---------------------------------------------------------------------------------

def child_ref(out_dir, names):
    """--child-ref: every named zoo model's train() in this process, no vramswap; writes
    OUT_DIR/NAME-plain.json and, for the table, the training's own seconds to NAME-plain.time."""
    import train_model
    for name in names:
        start = time.monotonic()
        result = train_model.train(name)
        with open(os.path.join(out_dir, f"{name}-plain.json"), "w") as f:
            json.dump(result, f)
        with open(os.path.join(out_dir, f"{name}-plain.time"), "w") as f:
            f.write(f"{time.monotonic() - start:.3f}")


def run_ref(tmp, names):
    """The shared reference process; -> {name: record} (the process's rc and error in each)."""
    rec = run_child(tmp, "ref", [sys.executable, str(Path(__file__).resolve()), "--child-ref", tmp] + names,
                    ENV, stats=False)
    out = {}
    for name in names:
        r = dict(rec, result=None, seconds=None)
        try:
            with open(os.path.join(tmp, f"{name}-plain.json")) as f:
                r["result"] = json.load(f)
            with open(os.path.join(tmp, f"{name}-plain.time")) as f:
                r["seconds"] = float(f.read())
        except (OSError, ValueError):
            pass
        out[name] = r
    return out


def run_ranks(tmp, label, cmd, extra, stats=True):
    """run_child for a torchrun launch (cmd: what follows torchrun's own options); its record
    has "rank_stats" (each rank's VRAMSWAP_STATS_FILE, None for one not written) and, for a
    failed run, the error of the first rank that names one (torchrun's own is only that a
    rank failed)."""
    logs = os.path.join(tmp, label + ".logs")
    if stats:
        extra = dict(extra, VRAMSWAP_STATS_FILE=os.path.join(tmp, label) + "-{rank}.stats")
    rec = run_child(tmp, label, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={RANKS}", "--log-dir", logs, "--redirects", "2"] + cmd,
                    extra, stats=False)
    rec["rank_stats"] = []
    for rank in range(RANKS):
        try:
            with open(os.path.join(tmp, f"{label}-{rank}.stats")) as f:
                rec["rank_stats"].append(json.load(f))
        except (OSError, ValueError):
            rec["rank_stats"].append(None)
    if rec["rc"] != 0:
        errors = []
        for rank in range(RANKS):
            for path in glob.glob(os.path.join(logs, "*", "attempt_*", str(rank), "stderr.log")):
                with open(path, errors="replace") as f:
                    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in f]
                named = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]
                if named:
                    errors.append(f"rank {rank}: {named[-1][:400]}")
        # A rank whose peer failed first fails too, with gloo's "Connection closed by peer".
        first = [e for e in errors if not re.search(r"closed by peer|reset by peer", e)]
        if first or errors:
            rec["error"] = (first or errors)[0]
    return rec


def run_case(tmp, name):
    """The case's runs, in order (its own plain run first for a loop); -> {"runs": {label:
    record}, "peak", "seconds"}. A limited run's record has "limit", "percent" and "variant".
    A distributed case's runs are torchrun launches (run_ranks), its peak the smallest rank's."""
    case = CASES[name]
    py = sys.executable
    script = [str(HERE / case["script"][0])] + case["script"][1:] + ["{OUT}.json"]
    sim = dict(ENV, VRAMSWAP_TORCH_DEVICE="cpu-sim")
    if case.get("ranks"):
        def child(label, cmd, extra, stats=True):
            return run_ranks(tmp, label, cmd[1:] if cmd[0] == py else ["-m"] + cmd[2:], extra, stats)
    else:
        def child(label, cmd, extra, stats=True):
            return run_child(tmp, label, cmd, extra, stats)
    start = time.monotonic()
    runs = {}
    if case["ref"] == "own":
        runs["plain"] = child(f"{name}-plain", [py] + script, ENV, stats=False)
    runs["peak"] = child(f"{name}-peak", [py, "-m", "vramswap", "run", "--no-offload", "--", "python3"] + script, sim)
    if case.get("ranks"):
        peaks = [s.get("peak_reserved_bytes", 0) if s else 0 for s in runs["peak"]["rank_stats"]]
        peak = min(peaks)
    else:
        peak = (runs["peak"]["stats"] or {}).get("peak_reserved_bytes", 0)
    for variant, flags, percents in case["variants"]:
        for percent in percents:
            label = (variant + " " if variant else "") + ("none" if percent is None else str(percent))
            limit = 0 if percent is None else (peak * percent // 100) // MIB * MIB
            if percent is not None and not limit:
                continue  # no peak: the checks say so
            extra = dict(sim, VRAMSWAP_LIMIT=str(limit)) if limit else sim
            rec = child(f"{name}-{label.replace(' ', '')}", [py, "-m", "vramswap", "run"] + flags
                        + ["--", "python3"] + script, extra)
            rec.update(limit=limit, percent=percent, variant=variant, flags=flags)
            runs[label] = rec
    return {"runs": runs, "peak": peak, "seconds": time.monotonic() - start}


# -- checking --------------------------------------------------------------------------------

def same(a, b):
    return a is not None and b is not None and a == b


def stats_of(rec):
    """A run's statistics, [(who, stats or None)]: ("", the process's) or, for a distributed
    run, (", rank R", each rank's)."""
    if "rank_stats" in rec:
        return [(f", rank {r}", st) for r, st in enumerate(rec["rank_stats"])]
    return [("", rec["stats"])]


def out_of_memory(rec):
    """Whether a failed run ended in vramswap's own out-of-memory report (raised by the
    allocator: torch.OutOfMemoryError; by the tracker's unpack hook in backward: a
    RuntimeError whose message starts with OutOfMemoryError), with no results written."""
    err = rec["error"] or ""
    return (rec["rc"] != 0 and rec["result"] is None and "OutOfMemoryError: vramswap: " in err
            and "within the limit" in err and any(st and st.get("num_ooms", 0) > 0 for _, st in stats_of(rec)))


def oom_reason(err):
    """The out-of-memory report's figures that say why it did not fit, for the table."""
    parts = []
    for pattern, what in ((r"cannot allocate ([\d.]+ \w?i?B)", "{} asked"),
                          (r"([\d.]+ \w?i?B) reserved but free", "{} reserved but free"),
                          (r"([\d.]+ \w?i?B) tagged and resident", "{} tagged and resident"),
                          (r"([\d.]+ \w?i?B) evictable", "{} evictable")):
        m = re.search(pattern, err)
        if m:
            parts.append(what.format(m.group(1)))
    return "out of memory (" + (", ".join(parts) if parts else "see the run's report") + ")"


def is_limited(label):
    return label not in ("plain", "peak")


def check_case(check, name, done, plain):
    case, runs, peak = CASES[name], done["runs"], done["peak"]
    times = ", ".join(f"{k} {r['seconds']:.1f} s" for k, r in runs.items())
    print(f"== {name}: {case['library']} {case['model']}: {done['seconds']:.1f} s ({times}); "
          f"peak without offload {peak / MIB:.1f} MiB", flush=True)
    ref = plain["result"]
    check(ref is not None, f"{name}: the plain run finished" + ("" if ref else f": {plain['error']}"))
    check(runs["peak"]["rc"] == 0 and same(ref, runs["peak"]["result"]),
          f"{name}: vramswap run --no-offload: results identical to plain torch's"
          + ("" if runs["peak"]["rc"] == 0 else f" (exited {runs['peak']['rc']}: {runs['peak']['error']})"))
    if case.get("ranks") and ref is not None:
        params = {r["param_sha256"] for r in ref["ranks"]}
        check(len(ref["ranks"]) == case["ranks"] and len(params) == 1,
              f"{name}: the plain run's {len(ref['ranks'])} ranks end with the same parameters")
    peaks = [(st or {}).get("peak_reserved_bytes", 0) for _, st in stats_of(runs["peak"])]
    for label, rec in runs.items():
        if not is_limited(label):
            continue
        how = "vramswap run" + "".join(" " + f for f in rec["flags"])
        where = "no limit" if rec["limit"] == 0 else f"{rec['limit'] // MIB} MiB ({rec['percent']}%)"
        title = f"{name}, {how} at {where}"
        for who, s in stats_of(rec):
            if s:
                print(f"     {label}{who}: " + ", ".join(f"{k}={s.get(k)}" for k in (
                    "peak_reserved_bytes", "num_evictions", "num_prefetches", "num_faults", "num_ooms",
                    "num_planned_steps", "frozen_bytes_d2h", "num_invalid_frees")))
        known = KNOWN_OUT_OF_MEMORY.get((name, rec["variant"], rec["percent"]))
        if out_of_memory(rec) and (known or (rec["percent"] is not None and rec["percent"] < STRICT_PERCENT)):
            check(True, f"{title}: " + (f"KNOWN LIMIT ({known}): " if known else "")
                  + f"an out-of-memory that reports itself, no results written ({oom_reason(rec['error'])})")
            continue
        check(rec["rc"] == 0 and same(ref, rec["result"]),
              f"{title}: losses, gradient and state_dict sha256s identical to plain torch's"
              + ("" if rec["rc"] == 0 else f" (exited {rec['rc']}: {rec['error']})"))
        for (who, s), own_peak in zip(stats_of(rec), peaks):
            check_stats(check, title + who, rec, s, own_peak)


def check_stats(check, title, rec, s, peak):
    """One process's statistics at the end of a limited run: within the limit with evictions
    (or, with no limit, the peak of --no-offload's `peak`), no invalid free, nothing left."""
    if not s:
        check(False, f"{title}: no stats file")
        return
    if rec["limit"]:
        check(s["num_evictions"] > 0 and s["num_ooms"] == 0 and s["peak_reserved_bytes"] <= rec["limit"],
              f"{title}: {s['num_evictions']} evictions, {s['num_ooms']} out-of-memory, peak "
              f"{s['peak_reserved_bytes'] / MIB:.1f} MiB within the limit")
    else:
        got = s["peak_reserved_bytes"]
        low = 0 if "--offload-frozen" in rec["flags"] else peak * (1 - PEAK_TOLERANCE)
        check(low <= got <= peak * (1 + PEAK_TOLERANCE),
              f"{title}: peak reserve {got / MIB:.1f} MiB, within 1% of --no-offload's {peak / MIB:.1f} MiB"
              + (" (or below it)" if low == 0 else ""))
    check(s["num_invalid_frees"] == 0,
          f"{title}: no free of memory the pool did not hand out (num_invalid_frees {s['num_invalid_frees']})")
    if rec["rc"] == 0:
        check(s["num_tracked_blocks"] == 0 and s["host_bytes"] == 0,
              f"{title}: at exit no handle tracked ({s['num_tracked_blocks']}) and nothing on the host "
              f"({s['host_bytes']} B)")


# -- the table --------------------------------------------------------------------------------

def versions():
    from importlib import metadata
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def table_rows(names, results, plains, vers):
    rows = []
    for name in names:
        case, runs = CASES[name], results[name]["runs"]
        ref = plains[name]["result"]
        for label, rec in runs.items():
            if not is_limited(label):
                continue
            ranks = [st or {} for _, st in stats_of(rec)]
            if rec["rc"] == 0:
                identical = "yes" if same(ref, rec["result"]) else "**no**"
            elif out_of_memory(rec):
                identical = oom_reason(rec["error"])
            else:
                identical = f"**failed**: {(rec['error'] or '')[:120]}"
            model = case["model"] + "".join(f", `{f}`" for f in rec["flags"])
            peaks = [st or {} for _, st in stats_of(runs["peak"])]
            limit = "none" if not rec["limit"] else f"{rec['limit'] // MIB} MiB ({rec['percent']}%"
            if rec["limit"] and case.get("ranks"):
                limit += f" of {results[name]['peak'] / MIB:.0f} MiB"
            rows.append([f"{case['library']} {vers[case['library']]}", model, per_rank(peaks, "peak_reserved_bytes"),
                         limit + ("" if limit == "none" else ")"),
                         per_rank(ranks, "peak_reserved_bytes"), per_rank(ranks, "num_evictions"), identical,
                         f"{rec['seconds']:.1f} ({runs['peak']['seconds']:.1f})"])
    return rows


def per_rank(stats, key):
    """A figure of the table: "56 MiB" for one process, "60 / 60 MiB" rank by rank for a
    distributed run ("" where a process wrote no statistics)."""
    if key == "peak_reserved_bytes":
        figures = [f"{st[key] / MIB:.0f}" if key in st else "?" for st in stats]
        return "" if not any(stats) else " / ".join(figures) + " MiB"
    return " / ".join(str(st.get(key, "?")) for st in stats) if any(stats) else ""


def table(names, results, plains, command):
    vers = versions()
    head = ["library", "model", "peak without vramswap", "limit", "peak with vramswap", "evictions",
            "identical to plain torch", "seconds (`--no-offload`'s)"]
    lines = [f"Made by `{command}` on {datetime.date.today().isoformat()}: torch {vers['torch']}, Python "
             f"{platform.python_version()}, the CPU-emulation mode, {os.cpu_count()} cores, one thread a run. "
             "Peaks are vramswap's `peak_reserved_bytes` (the peak without vramswap: `vramswap run "
             "--no-offload`'s), rank by rank for the distributed runs (rank 0 first; torchrun gives every rank "
             "one environment, so one limit: 60% of the smaller peak); seconds are each run's wall time, the "
             "process's start and imports included (torchrun's and all its ranks' for a distributed run).",
             "",
             "| " + " | ".join(head) + " |",
             "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(names, results, plains, vers)]
    return "\n".join(lines)


def write_table(path, text):
    """Replaces what lies between BEGIN and END in `path` with `text`."""
    doc = Path(path).read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to replace")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    Path(path).write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv):
    if argv[:1] == ["--child-ref"]:
        child_ref(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"default: all ({', '.join(CASES)})")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    ap.add_argument("--table", metavar="README", help="write the table between the compat-table markers")
    ap.add_argument("--json", metavar="FILE", help="write every run's record")
    a = ap.parse_args(argv)
    names = a.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        return 2
    check = Checks()
    start = time.monotonic()
    shared = [n for n in names if CASES[n]["ref"] == "shared"]
    # The compiled model first in the reference process (its C++ compiled once, into the cache
    # its own runs then read), and its runs last in the queue.
    shared.sort(key=lambda n: n != "compiled")
    order = sorted(names, key=lambda n: n == "compiled")
    with tempfile.TemporaryDirectory() as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
            ref = pool.submit(run_ref, tmp, shared) if shared else None
            futures = {n: pool.submit(run_case, tmp, n) for n in order}
            results = {n: futures[n].result() for n in names}
            plains = ref.result() if ref else {}
    for n in names:
        if CASES[n]["ref"] == "own":
            plains[n] = results[n]["runs"]["plain"]
        check_case(check, n, results[n], plains[n])
    print(f"total {time.monotonic() - start:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "plain": plains}, f, indent=1)
    if a.table:
        rel = os.path.relpath(os.path.abspath(a.table), REPO)
        command = "python3 tests/compat/suite.py --table " + rel + "".join(" " + c for c in a.cases)
        write_table(a.table, table(names, results, plains, command))
        print(f"table written to {a.table}")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
