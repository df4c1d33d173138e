#!/usr/bin/python3
"""torch 2.x features under vramswap in the CPU-emulation mode, each trained for a few
AdamW steps and compared bit for bit with plain torch.

tests/python/scripts/train_gpt2.py (plain torch: a GPT-2-style model, causal attention by
F.scaled_dot_product_attention, GELU MLPs, a tied head; fixed seed, one thread) trains with
one feature per case:
  compile      every block compiled (block.compile(): inductor, compiling C++ on the CPU), as
               torchtitan compiles a transformer
  sdpa         the model eager (its attention is F.scaled_dot_product_attention)
  checkpoint   its last two blocks under torch.utils.checkpoint.checkpoint(...,
               use_reentrant=False)
  sac          the same blocks under selective activation checkpointing (context_fn=
               create_selective_checkpoint_contexts with a policy that saves the matmuls)
  autocast     the forward under torch.autocast("cpu", dtype=torch.bfloat16)
  save_on_cpu  its last block under torch.autograd.graph.save_on_cpu(), inside
               `with vramswap.offload():`: a second user of saved_tensors_hooks nested in
               vramswap's scope

Each case runs fresh child processes (vramswap's allocator is installed once per process):
  plain     python3 train_gpt2.py OUT --feature F: no vramswap at all
  peak      python3 -m vramswap run --no-offload -- ...: vramswap's allocator, no offload,
            no limit; VRAMSWAP_STATS_FILE's peak_reserved_bytes is the case's peak
  run       python3 -m vramswap run -- ... (the script unchanged), VRAMSWAP_LIMIT at
            LIMIT_PERCENT of that peak in whole MiB (test_vramswap_run.py's limit_of)
  inproc    this file's --child: vramswap.sim.install_cpu() and the forward inside
            `with vramswap.offload():` (train_gpt2.train's forward_scope), at the same limit
(the cases' `modes` say which of run and inproc each gets), and checks that the limited
runs' losses, gradient sha256s (each step) and parameter sha256 are those of the plain run,
that blocks were evicted, that nothing ran out of memory and that the peak reserve stayed
within the limit. Why 60%: the saved activations are most of the peak, so at 60% the run
only fits by evicting them.

save_on_cpu also checks that nothing is moved twice (Note [Nested saved-tensor hooks]): an
unnested in-process run at the same limit (the plain model) gives the tracker's count of
pack calls to compare with, and the nested run looks up the blocks save_on_cpu holds in
vramswap.snapshot() after each forward and at each of their unpacks.

The children run two at a time (compile, the slow one, beside the others); the inductor
cache (TORCHINDUCTOR_CACHE_DIR) is a temporary directory the compile children share, so
only the first compiles C++. Each case's time is printed.

Usage: python3 tests/python/test_torch2_features.py [CASE...]   (default: all; exit status 0:
every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_cpu_emulation.py).

Note [Nested saved-tensor hooks]
--------------------------------
saved_tensors_hooks form a stack and autograd calls only the innermost pair: a tensor saved
inside save_on_cpu() within vramswap.offload() is packed by save_on_cpu alone, and
vramswap's tracker never sees it (no vramswap_pack, no handle, never marked cold, never
evicted). Its block is still tagged when it was allocated in the scope (tagging is where an
allocation is placed, decided when it is made, before anyone saves it), which only costs
page rounding. On the CPU save_on_cpu keeps the tensor itself (tensor.cpu() is the tensor),
so its block stays in use until backward unpacks it; were the same storage also saved
outside save_on_cpu, the tracker's pack would find its use count above the tracker's own
aliases and never mark it cold. So the rule: every save goes to exactly one hook, and
vramswap evicts only what its own hook packed. The counter that shows it: the tracker's
pack calls (tracker_stats() packs + untagged) in the nested run plus save_on_cpu's packs
equal the unnested run's.
"""
import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from environment import child_environment

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "scripts" / "train_gpt2.py"
LIMIT_PERCENT = 60  # of each case's --no-offload peak
MIB = 1 << 20
CHILD_TIMEOUT = 300
RESULT_KEYS = ("loss", "grad_sha256", "param_sha256")

# name -> (train_gpt2.py's --feature, what it is, limited runs: "run" and/or "inproc")
CASES = {
    "compile": ("compile", "torch.compile (inductor on the CPU) of every block", ("run", "inproc")),
    "sdpa": ("eager", "F.scaled_dot_product_attention, eager", ("run",)),
    "checkpoint": ("checkpoint", "non-reentrant activation checkpointing of blocks 2 and 3", ("run", "inproc")),
    "sac": ("sac", "selective activation checkpointing (matmuls saved) of blocks 2 and 3", ("run", "inproc")),
    "autocast": ("autocast", "bf16 autocast on the CPU", ("run",)),
    "save_on_cpu": ("save_on_cpu", "save_on_cpu() around block 3 inside vramswap.offload()", ("inproc",)),
}


# -- the in-process child -------------------------------------------------------------------

def child_main(spec):
    """Trains spec["feature"] with the forward inside vramswap.offload() (VRAMSWAP_LIMIT and
    VRAMSWAP_STATS_FILE from the environment); writes the results to spec["out"] and what it
    observed (tracker_stats, and for save_on_cpu what save_on_cpu held) to spec["info"]."""
    sys.path.insert(0, str(HERE / "scripts"))
    import torch
    import train_gpt2
    import vramswap
    vramswap.sim.install_cpu()
    a = train_gpt2.parser().parse_args([spec["out"], "--feature", spec["feature"]])
    info = {}
    scope = vramswap.offload
    save_on_cpu = torch.autograd.graph.save_on_cpu
    if spec["feature"] == "save_on_cpu":
        scope, save_on_cpu = _watched_save_on_cpu(torch, vramswap, info)
    try:
        result = train_gpt2.train(a, forward_scope=scope, save_on_cpu=save_on_cpu)
    except BaseException as e:  # what the tracker had seen when it failed, for the report
        info.update(failed=f"{type(e).__name__}", tracker=vramswap.tracker_stats())
        with open(spec["info"], "w") as f:
            json.dump(info, f)
        raise
    info["tracker"] = vramswap.tracker_stats()
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    with open(spec["info"], "w") as f:
        json.dump(info, f)


def _block_states(vramswap):
    """The live blocks in vramswap.snapshot(): [(address, size, tagged, evicted)]. A block
    whose pages are all unmapped is listed under "vramswap"/"evicted" only."""
    snap = vramswap.snapshot()
    blocks = [(b["address"], b["size"], b["vramswap"]["tagged"], b["vramswap"]["evicted"])
              for seg in snap["segments"] for b in seg["blocks"] if "vramswap" in b]
    blocks += [(b["address"], b["size"], True, True) for b in snap["vramswap"]["evicted"]]
    return blocks


def _watched_save_on_cpu(torch, vramswap, info):
    """-> (forward scope, save_on_cpu class) for the nested case: save_on_cpu whose hooks
    note what it packs and check at each unpack that the block was not evicted; the scope
    is vramswap.offload() that, once the forward returned, looks up every block save_on_cpu
    holds (all still held: backward has not run)."""
    held = []  # (address, bytes) of what save_on_cpu packed in the current forward
    info.update(soc_packs=0, soc_bytes=0, held_tagged=0, held_evicted_after_forward=0, held_seen=0,
                others_evicted_after_forward=0, evicted_at_unpack=0, unpacks=0)

    def evicted_among(ranges, blocks):
        hit = [any(a <= p < a + s and ev for a, s, _, ev in blocks) for p, _ in ranges]
        return sum(hit)

    class WatchedSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self):
            super().__init__()
            pack, unpack = self.pack_hook, self.unpack_hook

            def pack_hook(t):
                info["soc_packs"] += 1
                info["soc_bytes"] += t.untyped_storage().nbytes()
                held.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
                return pack(t)

            def unpack_hook(packed):
                _, t = packed
                info["unpacks"] += 1
                info["evicted_at_unpack"] += evicted_among([(t.untyped_storage().data_ptr(), 0)],
                                                           _block_states(vramswap))
                return unpack(packed)

            self.pack_hook, self.unpack_hook = pack_hook, unpack_hook

    @contextlib.contextmanager
    def scope():
        held.clear()
        with vramswap.offload():
            yield
        blocks = _block_states(vramswap)
        info["held_seen"] += len(held)
        info["held_tagged"] += sum(any(a <= p < a + s and tag for a, s, tag, _ in blocks) for p, _ in held)
        info["held_evicted_after_forward"] += evicted_among(held, blocks)
        info["others_evicted_after_forward"] += sum(ev for *_, ev in blocks)

    return scope, WatchedSaveOnCpu


# -- the parent -------------------------------------------------------------------------------

def child_env(tmp, extra):
    env = child_environment()
    # One inductor cache for every child: the C++ the first compile built is reused.
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers on 2 cores
    env.update(extra)
    return env


def run_child(tmp, label, cmd, extra, stats=True):
    """Runs one child ({OUT} in cmd: tmp/label); -> {"rc", "seconds", "error" (on failure,
    the exception's line of its stderr), "result", "stats", "info"} (None for a file it did
    not write). stats: vramswap's statistics to OUT.stats (VRAMSWAP_STATS_FILE)."""
    out = os.path.join(tmp, label)
    if stats:
        extra = dict(extra, VRAMSWAP_STATS_FILE=out + ".stats")
    start = time.monotonic()
    try:
        proc = subprocess.run([a.replace("{OUT}", out) for a in cmd], env=child_env(tmp, extra), cwd=tmp,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        rc, stderr = "timeout", f"ran past {CHILD_TIMEOUT} s"
    rec = {"rc": rc, "seconds": time.monotonic() - start, "error": None}
    if rc != 0:  # the exception's line (the last that names one), else the last line
        lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
        named = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]
        rec["error"] = (named or lines or ["(no stderr)"])[-1][:400]
    for key, suffix in (("result", ".json"), ("stats", ".stats"), ("info", ".info")):
        try:
            with open(out + suffix) as f:
                rec[key] = json.load(f)
        except (OSError, ValueError):
            rec[key] = None
    return rec


def limit_of(peak_rec):
    """LIMIT_PERCENT of a run's peak reserve, in whole MiB (0 when it has no stats)."""
    if not peak_rec["stats"]:
        return 0
    return (peak_rec["stats"]["peak_reserved_bytes"] * LIMIT_PERCENT // 100) // MIB * MIB


def run_case(tmp, name):
    """The case's children, in order; -> {label: record} and "limit", "seconds"."""
    feature, _, modes = CASES[name]
    py = sys.executable
    script = [str(SCRIPT), "{OUT}.json", "--feature", feature]
    sim = {"VRAMSWAP_TORCH_DEVICE": "cpu-sim"}
    start = time.monotonic()
    recs = {"plain": run_child(tmp, f"{name}-plain", [py] + script, {}, stats=False)}
    recs["peak"] = run_child(tmp, f"{name}-peak", [py, "-m", "vramswap", "run", "--no-offload", "--", "python3"]
                             + script, sim)
    limit = limit_of(recs["peak"])
    limited = dict(sim, VRAMSWAP_LIMIT=str(limit))
    if limit:
        if "run" in modes:
            recs["run"] = run_child(tmp, f"{name}-run", [py, "-m", "vramswap", "run", "--", "python3"] + script,
                                    limited)
        if "inproc" in modes:
            recs["inproc"] = run_inproc(tmp, f"{name}-inproc", feature, limited)
        if name == "save_on_cpu":  # the same model unnested, for the tracker's pack count
            recs["unnested"] = run_inproc(tmp, f"{name}-unnested", "eager", limited)
    return {"recs": recs, "limit": limit, "seconds": time.monotonic() - start}


def run_inproc(tmp, label, feature, extra):
    out = os.path.join(tmp, label)
    spec = json.dumps({"feature": feature, "out": out + ".json", "info": out + ".info"})
    return run_child(tmp, label, [sys.executable, str(Path(__file__).resolve()), "--child", spec], extra)


def same(a, b):
    return a is not None and b is not None and all(a.get(k) == b.get(k) for k in RESULT_KEYS)


def report(check, name, run):
    feature, what, modes = CASES[name]
    recs, limit = run["recs"], run["limit"]
    times = ", ".join(f"{k} {r['seconds']:.1f} s" for k, r in recs.items())
    peak = recs["peak"]["stats"]["peak_reserved_bytes"] if recs["peak"]["stats"] else 0
    print(f"== {name}: {what}: {run['seconds']:.1f} s ({times}); peak without offload {peak / MIB:.1f} MiB, "
          f"limit {limit // MIB} MiB ({LIMIT_PERCENT}%)", flush=True)
    plain = recs["plain"]
    for label, rec in recs.items():
        if rec["rc"] != 0:
            check(False, f"{name}, {label}: child exited {rec['rc']}: {rec['error']}")
    if plain["result"] is None:
        return
    r = plain["result"]
    print(f"     plain: losses {[round(x, 6) for x in r['loss']]}"
          + (f", {r['compiled_graphs']} compiled graph(s)" if "compiled_graphs" in r else ""))
    check(same(plain["result"], recs["peak"]["result"]),
          f"{name}: vramswap run --no-offload: results identical to plain torch's")
    for mode in modes:
        rec = recs.get(mode)
        how = "vramswap run" if mode == "run" else "in-process vramswap.offload()"
        if rec is None:
            check(False, f"{name}, {how}: not run (no peak to set the limit from)")
            continue
        s = rec["stats"]
        if rec["info"] and rec["info"].get("failed"):
            print(f"     {mode}: the tracker when it raised {rec['info']['failed']}: {rec['info']['tracker']}")
        if s:
            print(f"     {mode}: " + ", ".join(f"{k}={s[k]}" for k in (
                "peak_reserved_bytes", "num_evictions", "num_prefetches", "num_faults", "bytes_evicted_total",
                "num_ooms", "num_tracked_blocks"))
                + (f"; {rec['result']['compiled_graphs']} compiled graph(s)"
                   if rec["result"] and "compiled_graphs" in rec["result"] else ""))
        check(same(r, rec["result"]),
              f"{name}, {how} at {limit // MIB} MiB: losses, gradient and parameter sha256s identical to "
              "plain torch's" + ("" if rec["result"] else " (no results: the run failed)"))
        check(bool(s) and s["num_evictions"] > 0 and s["num_ooms"] == 0 and s["peak_reserved_bytes"] <= limit,
              f"{name}, {how}: " + (f"{s['num_evictions']} evictions, {s['num_ooms']} out-of-memory, peak "
                                    f"{s['peak_reserved_bytes'] / MIB:.0f} MiB within the limit"
                                    if s else "no stats file"))
    if name == "save_on_cpu":
        nested_checks(check, recs)


def nested_checks(check, recs):
    """Note [Nested saved-tensor hooks]."""
    nested, unnested = recs.get("inproc"), recs.get("unnested")
    if not nested or not unnested or not nested["info"] or not unnested["info"]:
        check(False, "save_on_cpu: the nested and unnested in-process runs both finished")
        return
    i, t, u = nested["info"], nested["info"]["tracker"], unnested["info"]["tracker"]
    print(f"     save_on_cpu packed {i['soc_packs']} tensors ({i['soc_bytes'] / MIB:.1f} MiB); tracker nested {t}, "
          f"unnested {u}")
    print(f"     after each forward: {i['held_seen']} held blocks looked up, {i['held_tagged']} tagged, "
          f"{i['held_evicted_after_forward']} evicted; {i['others_evicted_after_forward']} other blocks evicted")
    check(i["soc_packs"] > 0 and i["unpacks"] == i["soc_packs"],
          f"save_on_cpu: packed {i['soc_packs']} saved tensors, unpacked {i['unpacks']}")
    check(t["packs"] + t["untagged"] + i["soc_packs"] == u["packs"] + u["untagged"],
          f"save_on_cpu: the tracker's pack calls, nested ({t['packs']} + {t['untagged']} untagged) plus "
          f"save_on_cpu's ({i['soc_packs']}), equal the unnested run's ({u['packs']} + {u['untagged']}): every "
          "save went to exactly one hook")
    check(i["held_seen"] == i["soc_packs"] and i["held_evicted_after_forward"] == 0
          and i["others_evicted_after_forward"] > 0,
          f"save_on_cpu: after each forward none of the blocks it holds was evicted "
          f"({i['held_evicted_after_forward']} of {i['held_seen']}), while "
          f"{i['others_evicted_after_forward']} others were")
    check(i["evicted_at_unpack"] == 0, f"save_on_cpu: none of its blocks was evicted when backward unpacked it "
                                       f"({i['evicted_at_unpack']} of {i['unpacks']})")


def main(argv):
    if argv[:1] == ["--child"]:
        child_main(json.loads(argv[1]))
        return 0
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        return 2
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what, flush=True)
        if not cond:
            failures.append(what)

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        # Two at a time, compile (the longest) first.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = {n: pool.submit(run_case, tmp, n) for n in names}
            runs = {n: f.result() for n, f in futures.items()}
    for n in names:
        report(check, n, runs[n])
    print(f"total {time.monotonic() - start:.1f} s")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
