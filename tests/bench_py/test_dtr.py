"""Tests of vramswap.bench.dtr: the DTR prototype's operator logs as workloads.

A small log written here gives an exact workload (every op checked); malformed logs are
refused naming the file, the line and what is wrong; the shipped logs (bench/traces/dtr, or
$VRAMSWAP_TRACES_DIR/dtr) load as valid, repeatable steps whose allocations and compute
time match what the raw log says, counted here without the reader; and `vramswap replay`
replays one under a limit on cudasim.

Needs no torch and no GPU: `python3 tests/bench_py/test_dtr.py`; exit status 0 when every
check passed. The replay needs libvramswap.so and cudasim (VRAMSWAP_LIBRARY,
VRAMSWAP_CUDASIM_DIR), and is skipped with a message without them.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vramswap.bench import dtr, measure, scenarios  # noqa: E402

import checks  # noqa: E402  (tests/bench_py/checks.py: the benchmark tests' reporting)


def check(cond, what):
    checks.check(what, cond)


def raises(fn, *fragments):
    try:
        fn()
    except dtr.DtrLogError as e:
        if all(f in str(e) for f in fragments):
            return True
        print(f"     message: {e}")
        return False
    except Exception as e:  # noqa: BLE001 - the wrong kind is a failure, not a crash
        print(f"     raised {type(e).__name__}: {e}")
        return False
    return False


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def const(name, size):
    return [{"INSTRUCTION": "CONSTANT", "NAME": name}, {"INSTRUCTION": "MEMORY", "NAME": name, "MEMORY": str(size)}]


def call(name, args, results, time, aliases=None):
    out = [{"INSTRUCTION": "CALL", "NAME": name, "ARGS": args, "RESULT": [r for r, _ in results], "TIME": str(time)}]
    for k, (r, size) in enumerate(results):
        out.append({"INSTRUCTION": "MEMORY", "NAME": r, "MEMORY": str(size)})
        out.append({"INSTRUCTION": "ALIAS", "NAME": r, "ALIAS": str((aliases or {}).get(k, -1))})
    return out


def release(*names):
    return [{"INSTRUCTION": "RELEASE", "NAME": n} for n in names]


ANNOTATE = {"INSTRUCTION": "ANNOTATE"}


def small_log():
    """A forward of three operators and a backward of two. w: a weight (kept), x: an input
    (freed by the step). a = conv(x, w) is saved: relu reads it last in the forward (through
    v, a view of it), relu_backward first in backward (through c, a copy of its name); its
    storage lives until a, v and c are all released. b = relu(v) is saved too (relu_backward
    reads it, as autograd's relu keeps its result); g, a gradient, is live at the end."""
    return ([dict(ANNOTATE, ANNOTATION="START")] + const("w", 4096) + const("x", 8192) +
            call("conv", ["x", "w"], [("a", 65536)], 1000) +
            call("view", ["a"], [("v", 0)], 10, aliases={0: 0}) +
            [{"INSTRUCTION": "COPY", "DST": "c", "SRC": "a"}] +
            call("relu", ["v"], [("b", 65536)], 500) + release("x") +
            [dict(ANNOTATE, ANNOTATION="BACKWARD")] +
            call("relu_backward", ["b", "c"], [("g", 2048)], 700) + release("b", "v") +
            call("conv_backward", ["a", "w"], [("h", 1024)], 900) + release("a", "c", "h"))


def test_small(tmp):
    w = dtr.load(write(tmp / "small.log", small_log()), name="small").validate()
    # Storages are numbered as made: w 0, x 1, a 2, b 3, g 4, h 5.
    expected = [
        ("phase", "other"), ("alloc", 0, 4096), ("alloc", 1, 8192),
        ("phase", "forward"), ("alloc", 2, 65536), ("save", 2), ("compute", 1000, "conv"),
        ("compute", 10, "view"),
        ("alloc", 3, 65536), ("save", 3), ("compute", 500, "relu"), ("cold", 2), ("cold", 3), ("free", 1),
        ("phase", "backward"), ("alloc", 4, 2048), ("use", 2), ("use", 3), ("compute", 700, "relu_backward"),
        ("release", 3), ("free", 3),
        ("alloc", 5, 1024), ("compute", 900, "conv_backward"), ("release", 2), ("free", 2), ("free", 5),
        ("phase", "other"), ("free", 4),
    ]
    check(w.ops == expected, "a small log: the exact workload (views and copies are names of one storage; "
          "the saved tensor is cold after the forward's last read and used before backward's first)"
          + ("" if w.ops == expected else f"\n     got {w.ops}"))
    check(w.meta["saved"] == 2 and w.meta["saved_bytes"] == 2 * 65536 and w.meta["constant_bytes"] == 4096 + 8192,
          f"the small log's facts: two saved tensors of 64 KiB, 12 KiB of constants ({w.meta})")
    check(w.meta["freed_at_end_bytes"] == 2048, "what the step still holds at its end (the gradient) is freed there")
    start, why = measure.step_start(w.ops)
    check(start == 2 and why is None, f"the step repeats from the input's alloc on ({start}, {why})")
    check(scenarios.load_trace(tmp / "small.log").ops == w.ops, "load_trace() reads a .log as an operator log")


def test_malformed(tmp):
    p = write(tmp / "no_backward.log", [r for r in small_log() if r.get("ANNOTATION") != "BACKWARD"])
    check(raises(lambda: dtr.load(p), str(p), "no BACKWARD annotation"), "a log without a BACKWARD annotation is refused")
    recs = small_log()
    backward_first = write(tmp / "backward_first.log", [recs[0], dict(ANNOTATE, ANNOTATION="BACKWARD")] + [
        r for r in recs[1:] if r.get("ANNOTATION") != "BACKWARD"])
    check(raises(lambda: dtr.load(backward_first), "no operator before the BACKWARD annotation"),
          "a log whose backward starts before any operator is refused (it has no forward)")
    bad = tmp / "bad_json.log"
    bad.write_text(json.dumps(small_log()[0]) + "\n{not json\n")
    check(raises(lambda: dtr.load(bad), str(bad), "line 2", "not JSON"), "a line that is not JSON: file and line")
    unknown = write(tmp / "unknown.log", small_log()[:3] + [{"INSTRUCTION": "TELEPORT", "NAME": "w"}] + small_log()[3:])
    check(raises(lambda: dtr.load(unknown), "line 4", "unknown instruction 'TELEPORT'"), "an unknown instruction")
    recs = small_log()
    i = next(k for k, r in enumerate(recs) if r.get("NAME") == "conv")
    missing = write(tmp / "missing.log", recs[:i + 1] + recs[i + 3:])  # conv's MEMORY and ALIAS lines gone
    check(raises(lambda: dtr.load(missing), "CALL conv", "'a' is not followed by its MEMORY and ALIAS"),
          "a CALL result without its MEMORY and ALIAS lines")
    undefined = write(tmp / "undefined.log", recs[:i] + call("conv", ["x", "nope"], [("a", 65536)], 1) + recs[i + 5:])
    check(raises(lambda: dtr.load(undefined), "reads 'nope'"), "an operator reading a name nothing made")


def shipped_dir():
    d = Path(os.environ.get("VRAMSWAP_TRACES_DIR", REPO / "bench" / "traces")) / "dtr"
    return d if d.is_dir() and any(d.glob("*.log")) else None


def raw_figures(path):
    """What the raw log says, counted without the reader: the bytes of storages made after
    START (constants and CALL results with ALIAS -1), and the GPU time of its operators."""
    made = compute = 0
    started = False
    pending = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("ANNOTATION") == "START":
                started = True
                continue
            if not started:
                continue
            kind = r["INSTRUCTION"]
            if kind in ("CALL", "MUTATE"):
                compute += int(r["TIME"])
            if kind == "MEMORY":
                pending[r["NAME"]] = int(r["MEMORY"])
            elif kind == "ALIAS" and r["ALIAS"] == "-1":
                made += pending.pop(r["NAME"])
    return made, compute


def constant_bytes(path):
    total, constants, started = 0, set(), False
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            started = started or r.get("ANNOTATION") == "START"
            if started and r["INSTRUCTION"] == "CONSTANT":
                constants.add(r["NAME"])
            elif started and r["INSTRUCTION"] == "MEMORY" and r["NAME"] in constants:
                total += int(r["MEMORY"])
                constants.discard(r["NAME"])
    return total


def test_shipped(d):
    for path in sorted(d.glob("*.log")):
        label = path.name.split("-")[0]
        if "unroll_gan" in path.name:
            check(raises(lambda: dtr.load(path), "no BACKWARD annotation"),
                  f"{label}: refused (several backward passes, no BACKWARD annotation)")
            continue
        try:
            w = dtr.load(path).validate()
        except Exception as e:  # noqa: BLE001
            check(False, f"{label}: loads ({type(e).__name__}: {e})")
            continue
        allocated = sum(op[2] for op in w.ops if op[0] == "alloc")
        results, compute = raw_figures(path)
        constants = constant_bytes(path)
        check(allocated == results + constants,
              f"{label}: every storage the log makes is allocated once ({allocated:,} B = "
              f"{results:,} B of results + {constants:,} B of constants)")
        check(w.compute_ns() == compute, f"{label}: compute is the operators' GPU time ({compute / 1e6:.1f} ms)")
        start, why = measure.step_start(w.ops)
        check(start is not None, f"{label}: a repeatable step ({why})")
        saves = [op[1] for op in w.ops if op[0] == "save"]
        check(len(saves) > 0 and w.meta["saved_bytes"] > w.live_bytes()[0] // 2,
              f"{label}: {len(saves)} saved tensors, {w.meta['saved_bytes'] / 2**30:.2f} GiB, more than half "
              f"its peak of {w.live_bytes()[0] / 2**30:.2f} GiB")


def test_replay(d):
    from vramswap import _lib
    if not _lib.library_path().is_file():
        checks.skip("the replay", f"no {_lib.library_path()}")
        return
    path = next(d.glob("resnet32-*.log"))
    env = dict(os.environ, PYTHONPATH=str(REPO / "plugin" / "python"))
    r = subprocess.run([sys.executable, "-m", "vramswap", "replay", str(path), "--limit", "50%", "--policy",
                        "vramswap", "--json"], env=env, capture_output=True, text=True, timeout=300)
    try:
        out = json.loads(r.stdout)
    except ValueError:
        check(False, f"replay of {path.name} prints JSON (status {r.returncode}: {r.stderr.strip()[-400:]!r})")
        return
    check(r.returncode == 0 and out["status"] == "ok", f"replay of ResNet-32's log at 50% of its peak completes "
          f"({out['status']}: {out.get('error')})")
    check(out["num_evictions"] > 0 and out["bytes_d2h"] >= out["must_leave_bytes"] > 0,
          f"it evicts at least what must leave ({out['bytes_d2h']:,} >= {out['must_leave_bytes']:,} B)")
    check(out["warmup_steps"] == 2 and out["num_planned_steps"] >= 1,
          f"the step repeats: measured after 2 warm-ups, following its plan ({out['warmup_steps']}, "
          f"{out['num_planned_steps']})")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        test_small(Path(tmp))
        test_malformed(Path(tmp))
    d = shipped_dir()
    if d is None:
        checks.skip("the shipped logs", "no bench/traces/dtr/*.log")
    else:
        test_shipped(d)
        test_replay(d)
    checks.finish()


if __name__ == "__main__":
    main()
