"""Tests of vramswap.bench.snapshot: the unpickler that refuses classes, the replay rules on
small synthetic snapshots, and the figures of the shipped traces' README reproduced from the
real PyTorch memory snapshots.

Needs no torch and no GPU: `python3 tests/bench_py/test_snapshot.py`; exit status 0 when
every check passed. The real snapshots are looked for in $VRAMSWAP_TRACES_DIR (default
<repo>/bench/traces), directly or in its torch_snapshots/ folder; without them those checks
are skipped with a message, and the synthetic ones still run.
"""
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

from vramswap.bench import snapshot  # noqa: E402
from vramswap.bench.workload import Workload  # noqa: E402

MAGMA = "MAGMA27_cs336small_b32_s256_fp32_fwdbwd.pickle"
WEDSONLIN = "Wedsonlin_cs336medium_b4_s{}_bf16ac_trainstep.pickle"
# The README's training-step peak increments of the Wedsonlin runs, in GB (1e9 B), 3 decimals.
WEDSONLIN_GB = {128: 1.918, 256: 4.008, 512: 7.331, 1024: 19.111}
MAGMA_PEAK_INCREMENT = 12_550_078_464
MAGMA_LIVE_AT_CROSS_ENTROPY = 11_894_554_624
MAGMA_UNIT = 4 * 256 * 32 * 768  # 4*s*b*h bytes: one fp32 activation of the residual stream

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def raises(fn, kind, *fragments):
    try:
        fn()
    except kind as e:
        return all(f in str(e) for f in fragments)
    except Exception as e:  # noqa: BLE001 - the wrong kind is a failure, not a crash
        print(f"     raised {type(e).__name__}: {e}")
        return False
    return False


class Payload:
    """A class whose instances a snapshot must never hold."""
    def __init__(self):
        self.x = 1


# ---- the refusing unpickler ---------------------------------------------------------------

def test_refusal(tmp):
    holding_class = tmp / "class.pickle"
    holding_class.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Payload()]]}))
    check(raises(lambda: snapshot.read(holding_class), snapshot.SnapshotError,
                 str(holding_class), "refusing to load class __main__.Payload",
                 "snapshots hold only builtin types"),
          "read() refuses a pickle holding a class instance, naming the file and the class")
    with open(holding_class, "rb") as f:
        check(raises(lambda: snapshot.RefusingUnpickler(f).load(), pickle.UnpicklingError,
                     "refusing to load class __main__.Payload"),
              "RefusingUnpickler raises UnpicklingError for the class")
    callable_ = tmp / "callable.pickle"
    callable_.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "f": len}))
    check(raises(lambda: snapshot.read(callable_), snapshot.SnapshotError,
                 "refusing to load class builtins.len"),
          "read() refuses even a builtin function (any find_class)")
    missing = tmp / "missing.pickle"
    check(raises(lambda: snapshot.read(missing), FileNotFoundError, str(missing),
                 "_dump_snapshot() pickle"),
          "a missing file is a FileNotFoundError naming the file and what was expected")
    not_dict = tmp / "list.pickle"
    not_dict.write_bytes(pickle.dumps([1, 2, 3]))
    check(raises(lambda: snapshot.read(not_dict), snapshot.SnapshotError, str(not_dict),
                 "'segments' and 'device_traces'"),
          "a pickle of something else names what a snapshot holds")
    garbage = tmp / "garbage.pickle"
    garbage.write_bytes(b"this is not a pickle at all")
    check(raises(lambda: snapshot.read(garbage), snapshot.SnapshotError, str(garbage)),
          "bytes that are not a pickle are a SnapshotError naming the file")


# ---- malformed snapshots ------------------------------------------------------------------

def malformed_cases():
    """(name, snapshot, words its SnapshotError must hold): hand-built snapshots that are
    pickles of the right outer shape with something wrong inside."""
    good = ev("alloc", 0xA0, 100, FWD)

    def trace(*events):
        return {"segments": [], "device_traces": [list(events)]}

    no_addr = dict(good)
    del no_addr["addr"]
    return [
        ("missing addr", trace(good, no_addr), ["device_traces[0][1] (alloc)", "no 'addr'", "address"]),
        ("negative size", trace(ev("alloc", 0xA0, -5), ev("free_completed", 0xA0, -5)),
         ["device_traces[0][0] (alloc)", "'size' is an int (-5)", "positive integer"]),
        ("size zero", trace(ev("alloc", 0xA0, 0)), ["device_traces[0][0]", "'size' is an int (0)"]),
        ("size as text", trace(ev("free_completed", 0xA0, "100")),
         ["device_traces[0][0] (free_completed)", "'size' is a str ('100')"]),
        ("size as bool", trace(ev("alloc", 0xA0, True)), ["'size' is a bool (True)"]),
        ("address negative", trace(ev("alloc", -16, 100)), ["'addr' is an int (-16)", "non-negative"]),
        ("trace not a list", {"segments": [], "device_traces": [5]},
         ["device_traces[0]", "is an int (5)", "a list of events"]),
        ("event not a dict", trace(good, [1, 2]), ["device_traces[0][1]", "is a list", "an event"]),
        ("no action", trace({"addr": 1, "size": 2}), ["device_traces[0][0]", "no 'action'"]),
        ("action not text", trace(dict(good, action=7)), ["device_traces[0][0]", "'action' is an int (7)"]),
        ("frames not a list", trace(dict(good, frames="model.py")),
         ["device_traces[0][0] (alloc)", "'frames' is a str", "a list of frames"]),
        ("frame without a name", trace(dict(good, frames=[{"filename": "model.py", "line": 1}])),
         ["device_traces[0][0] (alloc), frames[0]", "no 'name'"]),
        ("frame line as text", trace(dict(good, frames=[py("forward", line="12")])),
         ["frames[0]", "'line' is a str ('12')", "an integer"]),
        ("time as text", trace(dict(good, time_us="noon")), ["device_traces[0][0]", "'time_us' is a str"]),
        ("segments not a list", {"segments": 5, "device_traces": [[good]]},
         ["'segments' is an int (5)", "'segments' and 'device_traces' lists"]),
        ("no device_traces", {"segments": []}, ["no 'device_traces'"]),
        ("segment not a dict", {"segments": [5], "device_traces": [[good]]},
         ["segments[0]", "is an int (5)", "a segment"]),
        ("blocks not a list", {"segments": [{"device": 0, "blocks": 3}], "device_traces": [[good]]},
         ["segments[0]", "'blocks' is an int (3)"]),
        ("block size negative",
         {"segments": [{"device": 0, "blocks": [{"size": -1, "state": "active_allocated"}]}],
          "device_traces": [[good]]},
         ["segments[0].blocks[0]", "'size' is an int (-1)"]),
        ("annotation time as text",
         {"segments": [], "device_traces": [[good]],
          "external_annotations": [{"name": "Optimizer.step#SGD.step", "stage": "START", "time_us": "x"}]},
         ["external_annotations[0]", "'time_us' is a str"]),
    ]


def test_malformed(tmp):
    """read() and load() refuse a snapshot whose inside load() cannot use with a
    SnapshotError naming the file, the place and what was expected (not a KeyError or a
    TypeError, and not a -5-byte allocation replayed as 16 EiB)."""
    for name, data, words in malformed_cases():
        path = tmp / (name.replace(" ", "_") + ".pickle")
        path.write_bytes(pickle.dumps(data))
        check(raises(lambda: snapshot.read(path), snapshot.SnapshotError, str(path), *words),
              f"read() refuses a snapshot with {name}, saying where and what ({', '.join(words)})")
        check(raises(lambda: snapshot.load("given.pickle", snapshot=data), snapshot.SnapshotError,
                     "given.pickle", *words),
              f"load(snapshot=...) refuses it too ({name})")


def test_replay_cli(tmp):
    """`python3 -m vramswap replay` on a malformed snapshot: status 2 and the reader's
    message, no traceback; on a snapshot no run can complete (every policy out of memory):
    status 1, with and without --json."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "plugin" / "python"))

    def replay(*args):
        return subprocess.run([sys.executable, "-m", "vramswap", "replay", *map(str, args)],
                              env=env, capture_output=True, text=True, timeout=300)

    for name, data, words in malformed_cases()[:3]:
        path = tmp / ("cli_" + name.replace(" ", "_") + ".pickle")
        path.write_bytes(pickle.dumps(data))
        r = replay(path)
        check(r.returncode == 2 and all(w in r.stderr for w in words) and "Traceback" not in r.stderr
              and "out of memory" not in r.stdout + r.stderr,
              f"replay of a snapshot with {name}: status 2 ({r.returncode}), says where and what "
              f"({r.stderr.strip()[-400:]!r})")
    from vramswap import _lib
    if not _lib.library_path().is_file():
        print(f"skipped: replay's exit status when nothing completes (no {_lib.library_path()})")
        return
    huge = tmp / "huge.pickle"
    huge.write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        ev("alloc", 0xA0, 100 << 30, FWD), ev("free_completed", 0xA0, 100 << 30, FWD)]]}))
    for extra in ((), ("--json",)):
        r = replay(huge, "--card", "1GiB", *extra)
        check(r.returncode == 1 and "oom" in r.stdout,
              f"replay {' '.join(extra)} where every run is out of memory: status 1 ({r.returncode}; "
              f"{(r.stdout + r.stderr).strip()[-300:]!r})")


# ---- synthetic snapshots ------------------------------------------------------------------

def py(name, filename="model.py", line=1):
    return {"name": name, "filename": filename, "line": line}


FWD = [py("forward"), py("_call_impl", "torch/nn/modules/module.py"), py("<module>", "train.py")]
CE = [py("cross_entropy", "nn_utils.py"), py("<module>", "train.py")]
TOP = [py("<module>", "train.py")]
BWD = [py("_make_grads", "torch/autograd/__init__.py"), py("backward", "torch/_tensor.py")]
ENGINE = {"name": "torch::autograd::Engine::thread_main(std::shared_ptr<...>)",
          "filename": "??", "line": 0}


def apply_of(node):
    return {"name": f"torch::autograd::generated::{node}::apply(std::vector<at::Tensor>&&)",
            "filename": "??", "line": 0}


def release_of(node):
    return {"name": f"torch::autograd::generated::{node}::release_variables()",
            "filename": "??", "line": 0}


def ev(action, addr, size, frames=(), t=0):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "frames": list(frames)}


def synthetic(named_nodes):
    """Forward (a temporary, a saved tensor at a reused address), a carried-in free at
    module level, cross-entropy, backward. With named_nodes the backward events carry the
    C++ frames of a Linux build; without, none (a Python-frames-only build)."""
    add = [ENGINE, apply_of("AddBackward0")] if named_nodes else []
    mul = [ENGINE, apply_of("MulBackward0")] if named_nodes else []
    rel = [release_of("MulBackward0"), ENGINE] if named_nodes else []
    events = [
        ev("segment_alloc", 0x1000, 1 << 20),
        ev("alloc", 0xA0, 100, FWD),                 # tid 1, saved
        ev("alloc", 0xB0, 10, FWD),                  # tid 2, a forward temporary
        ev("free_requested", 0xB0, 10, FWD),
        ev("free_completed", 0xB0, 10, FWD),
        ev("alloc", 0xB0, 20, FWD),                  # tid 3: the address reused; saved
        ev("free_requested", 0xF0, 7, TOP),
        ev("free_completed", 0xF0, 7, TOP),          # carried in: tid 0
        ev("alloc", 0xC0, 4, CE),                    # tid 4, the loss: outlives backward
        ev("alloc", 0xD0, 8, BWD),                   # tid 5
        ev("alloc", 0xE0, 30, add),                  # tid 6
        ev("alloc", 0xE8, 6, mul),                   # tid 7
        ev("free_completed", 0xB0, 20, rel),         # saved tid 3 released by MulBackward0
        ev("free_completed", 0xA0, 100, rel),        # saved tid 1 released by MulBackward0
        ev("free_completed", 0xE0, 30, add),
        ev("free_completed", 0xE8, 6, add),
        ev("oom", 0, 1 << 40),
    ]
    return {"segments": [], "device_traces": [events], "allocator_settings": {},
            "external_annotations": []}


def test_synthetic():
    for named in (False, True):
        what = "named nodes" if named else "no C++ frames"
        w = snapshot.load("synthetic.pickle", compute="none", snapshot=synthetic(named))
        w.validate()
        # Without node names the uses go at the start of the backward work since the last
        # release; with them, before the work of the node that releases the tensors.
        uses_then = ([("use", 3), ("use", 1), ("alloc", 5, 8), ("alloc", 6, 30),
                      ("alloc", 7, 6)] if not named else
                     [("alloc", 5, 8), ("alloc", 6, 30), ("use", 3), ("use", 1),
                      ("alloc", 7, 6)])
        expected = [
            ("phase", "other"), ("alloc", 0, 7),
            ("phase", "forward"), ("alloc", 1, 100), ("save", 1), ("alloc", 2, 10),
            ("free", 2), ("alloc", 3, 20), ("save", 3), ("free", 0), ("alloc", 4, 4),
            ("cold", 1), ("cold", 3),
            ("phase", "backward"), *uses_then,
            ("release", 3), ("free", 3), ("release", 1), ("free", 1), ("free", 6), ("free", 7),
        ]
        check(w.ops == expected, f"synthetic ({what}): ops as the rules say")
        if w.ops != expected:
            print("     got", w.ops)
        m = w.meta
        check(m["saved"] == {"tensors": 2, "bytes": 120} and w.saved_bytes() == 120,
              f"synthetic ({what}): 2 saved tensors, 120 B")
        check(m["carried_in"]["tensors"] == 1 and m["carried_in"]["bytes"] == 7,
              f"synthetic ({what}): the free of an untraced address is a carried-in tensor")
        check(m["phases"] == ["other", "forward", "backward"],
              f"synthetic ({what}): module-level glue inside forward joins the forward")
        check(m["ooms"] == 1 and m["actions"]["segment_alloc"] == 1,
              f"synthetic ({what}): oom and ignored actions counted")
        loss = m["marks"]["loss"]
        check(w.ops[loss] == ("alloc", 4, 4) and snapshot.live_bytes_at(w, loss) == 120
              and snapshot.live_bytes_at(w, loss, carried_in=True) == 120,
              f"synthetic ({what}): live at the loss start is 120 B")
        # Alloc minus free_completed sizes: 100 110 100 120 113 117 125 155 161 141 41 11 5.
        check(snapshot.peak_increment(w) == (161, w.ops.index(("alloc", 7, 6))),
              f"synthetic ({what}): peak increment 161 B at the last alloc")
        check(w.live_bytes() == (168, 12),
              f"synthetic ({what}): Workload.live_bytes() counts the carried-in 7 B too")
    w = snapshot.load("synthetic.pickle", compute="none", carried_in=False,
                      snapshot=synthetic(False)).validate()
    check(("alloc", 0, 7) not in w.ops and w.meta["carried_in"]["tensors"] == 0
          and w.live_bytes() == (168, 12),
          "carried_in=False drops the untraced free")
    w = snapshot.load("synthetic.pickle", compute=lambda e, nxt: e["size"] * 10,
                      snapshot=synthetic(True)).validate()
    computes = [op for op in w.ops if op[0] == "compute"]
    check(len(computes) == 13 and computes[0] == ("compute", 1000, "forward")
          and ("compute", 60, "MulBackward0") in computes,
          "a callable compute model: one compute op after each event, labelled")
    w = snapshot.load("synthetic.pickle", snapshot=synthetic(True)).validate()
    check(w.compute_ns() == 7 * snapshot.MIN_KERNEL_NS,
          "bytes model: tiny allocations cost the minimum kernel time")
    two = synthetic(False)
    two["device_traces"] = [[], []]
    check(raises(lambda: snapshot.load("two.pickle", snapshot=two, device=1),
                 snapshot.SnapshotError, "two.pickle", "device 1 has no trace events"),
          "a device without events is an error naming the file")


MOD = "torch/nn/modules/module.py"


def in_block(line, model_line=10):
    """Frames of an allocation at `line` of Block.forward, called from `model_line` of
    Model.forward (the layer loop), each module call inside _call_impl."""
    return [py("forward", "model.py", line), py("_call_impl", MOD),
            py("forward", "model.py", model_line), py("_call_impl", MOD),
            py("<module>", "train.py")]


def blocks_snapshot():
    """Two layers of one Block class called from the same line (a loop), then a head module
    from another line, a tensor of the model's own code, and a module-level loss."""
    head = [py("forward", "model.py", 30), py("_call_impl", MOD),
            py("forward", "model.py", 11), py("_call_impl", MOD), py("<module>", "train.py")]
    model_own = [py("forward", "model.py", 12), py("_call_impl", MOD), py("<module>", "train.py")]
    events = [
        ev("alloc", 0x100, 10, in_block(20)),   # tid 0: layer 0, inside
        ev("alloc", 0x200, 10, in_block(21)),   # tid 1: layer 0, its last line: the output
        ev("alloc", 0x300, 10, in_block(20)),   # tid 2: layer 1 (line falls back to 20)
        ev("alloc", 0x400, 10, in_block(21)),   # tid 3: layer 1's output
        ev("alloc", 0x500, 10, head),           # tid 4: the head, the last call (its output)
        ev("alloc", 0x600, 10, model_own),      # tid 5: the model's own code: in no call
        ev("alloc", 0x700, 4, CE),              # tid 6: the loss, outlives backward
    ] + [ev("free_completed", a, 10, BWD) for a in (0x600, 0x500, 0x400, 0x300, 0x200, 0x100)]
    return {"segments": [], "device_traces": [events], "allocator_settings": {},
            "external_annotations": []}


def forward_part(w):
    return w.ops[:w.ops.index(("phase", "backward"))]


def test_cold_points():
    data = blocks_snapshot()
    w = snapshot.load("blocks.pickle", compute="none", snapshot=data).validate()
    expected = [
        ("phase", "forward"),
        ("alloc", 0, 10), ("save", 0), ("alloc", 1, 10), ("save", 1),
        ("cold", 0),                                  # layer 0 returned; its output held
        ("alloc", 2, 10), ("save", 2), ("alloc", 3, 10), ("save", 3),
        ("cold", 1), ("cold", 2),                     # layer 1 returned: layer 0's output too
        ("alloc", 4, 10), ("save", 4),
        ("cold", 3),                                  # the head returned: layer 1's output
        ("alloc", 5, 10), ("save", 5), ("alloc", 6, 4),
        ("cold", 4), ("cold", 5),                     # no call after the head; model code
    ]
    check(forward_part(w) == expected,
          "block_exit: cold at the block call's exit, the block's output one call later, "
          "the last call's output and the model's own tensors at the end of forward")
    if forward_part(w) != expected:
        print("     got", forward_part(w))
    c = w.meta["cold"]
    check(c["mode"] == "block_exit" and c["block_depth"] == 1 and c["block_calls"] == 3
          and c["before_end_of_forward"] == 4 and c["bytes_before_end_of_forward"] == 40,
          f"block_exit meta: depth 1, 3 calls, 4 tensors cold early ({c})")
    w2 = snapshot.load("blocks.pickle", compute="none", snapshot=data,
                       cold="next_block_exit").validate()
    check(forward_part(w2)[:11] == expected[:5] + expected[6:10] + [("cold", 0), ("cold", 1)]
          and w2.meta["cold"]["before_end_of_forward"] == 4,
          "next_block_exit: every tensor of a layer held until the next call returns")
    old = snapshot.load("blocks.pickle", compute="none", snapshot=data,
                        cold="end_of_forward").validate()
    fwd = forward_part(old)
    check(fwd[-6:] == [("cold", t) for t in range(6)] and old.meta["cold"]["block_depth"] is None,
          "end_of_forward: every saved tensor cold at the end of forward, as before")
    check([op for op in old.ops if op[0] != "cold"] == [op for op in w.ops if op[0] != "cold"],
          "the cold rule moves only cold ops")
    check(raises(lambda: snapshot.load("blocks.pickle", snapshot=data, cold="early"),
                 ValueError, "early", "block_exit"),
          "an unknown cold rule is a ValueError naming the known ones")
    # One module call only (no blocks to tell apart): the end of forward, as before.
    w3 = snapshot.load("synthetic.pickle", compute="none", snapshot=synthetic(False))
    check(w3.meta["cold"]["block_depth"] is None
          and w3.meta["cold"]["before_end_of_forward"] == 0,
          "a forward of one module call has no blocks: cold at the end of forward")


# ---- the shipped traces -------------------------------------------------------------------

def traces_dir():
    root = Path(os.environ.get("VRAMSWAP_TRACES_DIR") or REPO / "bench" / "traces")
    for d in (root / "torch_snapshots", root):
        if (d / MAGMA).is_file():
            return d
    return None


def check_cold(name, w, old, min_share):
    """The block_exit cold points of a shipped trace against the end_of_forward ones."""
    cold_at, save_at = {}, {}
    for j, op in enumerate(w.ops):
        if op[0] == "cold":
            cold_at[op[1]] = j
        elif op[0] == "save":
            save_at[op[1]] = j
    old_cold = {op[1] for op in old.ops if op[0] == "cold"}
    check(set(cold_at) == old_cold == set(save_at)
          and [op for op in old.ops if op[0] != "cold"] == [op for op in w.ops if op[0] != "cold"],
          f"{name}: the same saved tensors go cold under both rules; only cold ops move")
    end = w.meta["marks"]["backward"]
    # The end of forward (where end_of_forward puts every cold): after the forward's last op
    # other than a cold, before backward's phase op.
    end_cold = max(j for j, op in enumerate(w.ops[:end]) if op[0] != "cold")
    check(all(save_at[t] < j < end for t, j in cold_at.items()),
          f"{name}: every cold after its save and before backward")
    early = sum(1 for j in cold_at.values() if j < end_cold)
    share = early / len(cold_at)
    check(share >= min_share and early == w.meta["cold"]["before_end_of_forward"],
          f"{name}: {early} of {len(cold_at)} saved tensors ({share:.1%}) cold before the end "
          f"of forward (>= {min_share:.0%})")


def test_magma(d):
    w = snapshot.load(d / MAGMA).validate()
    old = snapshot.load(d / MAGMA, cold="end_of_forward").validate()
    check_cold("MAGMA27", w, old, 0.95)
    check(w.meta["cold"]["block_depth"] == 1 and w.meta["cold"]["block_calls"] == 15,
          "MAGMA27: 15 block calls at depth 1 (embedding, 12 layers, ln_final, lm_head)")
    m = w.meta
    peak, peak_op = snapshot.peak_increment(w)
    check(peak == MAGMA_PEAK_INCREMENT,
          f"MAGMA27 peak increment {peak:,} == {MAGMA_PEAK_INCREMENT:,} B")
    loss = m["marks"]["loss"]
    at_loss = snapshot.live_bytes_at(w, loss)
    check(m["loss_function"] == "cross_entropy" and at_loss == MAGMA_LIVE_AT_CROSS_ENTROPY,
          f"MAGMA27 live at the start of cross_entropy {at_loss:,} == "
          f"{MAGMA_LIVE_AT_CROSS_ENTROPY:,} B")
    check(m["live"]["peak_increment"] == peak and m["live"]["at_loss"] == at_loss,
          "MAGMA27 meta carries both figures")
    check(m["marks"]["forward"] < loss < peak_op < m["marks"]["backward"],
          "MAGMA27 peak during cross-entropy (after its start, before backward)")
    check(m["phases"] == ["other", "forward", "backward"] and "optimizer" not in m["marks"],
          f"MAGMA27 phases {m['phases']} (fwd+CE+bwd, no optimizer)")
    check(w.live_bytes()[0] == peak + m["carried_in"]["bytes"],
          "MAGMA27 Workload.live_bytes() peak = increment + carried-in bytes (freed later)")
    saved = w.saved_bytes()
    live_at_backward = snapshot.live_bytes_at(w, m["marks"]["backward"])
    # 12 layers x 38 units of activations are live at cross-entropy and must be saved;
    # every saved tensor is live when backward starts.
    check(m["saved"]["bytes"] == saved and 12 * 38 * MAGMA_UNIT <= saved <= live_at_backward,
          f"MAGMA27 saved {saved / 1e9:.3f} GB within [12x38 units, live at backward "
          f"{live_at_backward / 1e9:.3f} GB]")
    ms = w.compute_ns() / 1e6
    check(50 <= ms <= 1000, f"MAGMA27 modelled step compute {ms:.1f} ms in 50 ms..1 s")
    w2 = snapshot.load(d / MAGMA, compute="timestamps").validate()
    ms2 = w2.compute_ns() / 1e6
    check(200 <= ms2 <= 300, f"MAGMA27 host-clock compute {ms2:.1f} ms (trace spans 248 ms)")


def test_wedsonlin(d):
    for s, gb in WEDSONLIN_GB.items():
        path = d / WEDSONLIN.format(s)
        if not path.is_file():
            check(False, f"Wedsonlin s={s}: {path.name} present")
            continue
        data = snapshot.read(path)
        w = snapshot.load(path, snapshot=data).validate()
        old = snapshot.load(path, snapshot=data, cold="end_of_forward").validate()
        check_cold(f"Wedsonlin s={s}", w, old, 0.95)
        m = w.meta
        peak, _ = snapshot.peak_increment(w)
        check(round(peak / 1e9, 3) == gb, f"Wedsonlin s={s} peak increment "
              f"{peak / 1e9:.3f} GB == {gb} GB")
        mk = m["marks"]
        check(m["phases"] == ["other", "forward", "backward", "optimizer"]
              and mk["forward"] < mk["loss"] < mk["backward"] < mk["optimizer"],
              f"Wedsonlin s={s} phases forward < cross_entropy < backward < optimizer")
        saved = w.saved_bytes()
        check(m["saved"]["tensors"] > 0
              and saved <= snapshot.live_bytes_at(w, mk["backward"]),
              f"Wedsonlin s={s} {m['saved']['tensors']} saved tensors, {saved / 1e9:.3f} GB, "
              f"all live when backward starts")
        if s == 128:
            check(saved_are_released(data, w),
                  "Wedsonlin s=128: the saved tensors are exactly those backward frees in "
                  "XxxBackward::release_variables (its C++ frames)")


def saved_are_released(data, w):
    """Whether the rule's saved set equals the tensors freed under release_variables."""
    saved = {op[1] for op in w.ops if op[0] == "save"}
    live, tid, released = {}, w.meta["carried_in"]["tensors"], set()
    for e in data["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = tid
            tid += 1
        elif e["action"] == "free_completed":
            t = live.pop(e["addr"], None)
            if t is not None and any("::release_variables(" in f["name"] for f in e["frames"]):
                released.add(t)
    return saved == released and len(saved) > 0


def test_replay(d):
    """MAGMA27 under vramswap at 50% of its no-offload peak (cudasim, virtual time): it
    completes with block_exit cold points, and runs out of memory in the forward with
    end_of_forward ones (nothing is evictable before the forward ends)."""
    try:
        from vramswap import _lib
        from vramswap.bench import runner, scenarios
    except ImportError as e:
        check(False, f"vramswap.bench.runner imports ({e})")
        return
    if not _lib.library_path().is_file():
        print(f"skipped: the replay of MAGMA27 (no {_lib.library_path()}; build the project "
              "or set VRAMSWAP_LIBRARY)")
        return
    data = snapshot.read(d / MAGMA)
    w = snapshot.load(d / MAGMA, snapshot=data)
    old = snapshot.load(d / MAGMA, snapshot=data, cold="end_of_forward")
    base = dict(card_bytes=80 << 30, pcie_gbps=55.0)
    none = runner.run_many(w, [dict(base, policy="none")])[0]
    check(none["status"] == "ok", f"MAGMA27 replays without offload ({none.get('error')})")
    if none["status"] != "ok":
        return
    half = none["peak_device_bytes"] // 2 // scenarios.GRANULE * scenarios.GRANULE
    r, r_old = (runner.run_many(x, [dict(base, policy="vramswap", limit_bytes=half, horizon=4)])[0]
                for x in (w, old))
    check(r["status"] == "ok" and r["peak_device_bytes"] <= half,
          f"MAGMA27 at 50% of its no-offload peak ({half:,} B) completes under vramswap: "
          f"status {r['status']} {r.get('error') or ''}, peak {r['peak_device_bytes']:,} B, "
          f"{r['bytes_d2h']:,} B out, {r['bytes_h2d']:,} B in, "
          f"step {r['step_time_ns']} ns, ideal {r['ideal_ns']} ns")
    check(r_old["status"] == "oom" and r_old["error_op"] < old.meta["marks"]["backward"],
          f"with end_of_forward cold points the same run runs out of memory in the forward "
          f"(status {r_old['status']} at op {r_old['error_op']})")


def test_cli(d):
    env = dict(os.environ, PYTHONPATH=str(REPO / "plugin" / "python"))
    r = subprocess.run([sys.executable, "-m", "vramswap.bench.snapshot", str(d / MAGMA)],
                       env=env, capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and "12,550,078,464" in r.stdout and "saved for backward" in r.stdout,
          "python3 -m vramswap.bench.snapshot prints the summary")
    r = subprocess.run([sys.executable, "-m", "vramswap.bench.snapshot", str(d / "nope.pickle")],
                       env=env, capture_output=True, text=True, timeout=120)
    check(r.returncode == 1 and "nope.pickle" in r.stderr, "the CLI reports a missing file")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        test_refusal(Path(tmp))
        test_malformed(Path(tmp))
        test_replay_cli(Path(tmp))
    test_synthetic()
    test_cold_points()
    d = traces_dir()
    if d is None:
        print("skipped: the real snapshots (no "
              f"{MAGMA} in $VRAMSWAP_TRACES_DIR or <repo>/bench/traces[/torch_snapshots])")
    else:
        test_magma(d)
        test_wedsonlin(d)
        test_replay(d)
        test_cli(d)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
