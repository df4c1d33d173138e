"""Replays an operator log of the DTR prototype (Dynamic Tensor Rematerialization, its
instrumented PyTorch) as a Workload.

A log is JSON lines, one instruction each, in program order:
  {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"|"BACKWARD"}
                                       the measured iteration starts; backward starts
  CONSTANT NAME, then MEMORY NAME n    a tensor made outside the logged ops (a parameter,
                                       an input) of n bytes
  CALL NAME ARGS RESULT TIME           an operator: reads ARGS (tensor names), makes RESULT
                                       (names), took TIME ns on the GPU; each result is
                                       followed by its MEMORY (bytes) and ALIAS lines: ALIAS
                                       -1 is a storage of its own, k a view of ARGS[k]'s
  MUTATE NAME ARGS MUTATE TIME         an in-place operator: writes ARGS[i] for i in MUTATE
  COPY DST SRC                         DST is one more name (reference) of SRC's tensor
  COPY_FROM DST SRC                    DST now names SRC's tensor (its old one loses a
                                       reference)
  RELEASE NAME                         the program dropped that reference
(the format as the prototype's simulator, simrd, reads it). A storage is freed when the last
reference to it, under any name and through any view, is released.

load(path) -> Workload: the instructions after START become
  alloc    a CONSTANT's storage, or a CALL result's own storage (ALIAS -1, more than 0 B)
  free     its last reference released
  compute  each CALL and MUTATE, TIME ns, labelled with the operator's name
  phase    "other" from START (the constants made before the first operator: parameters,
           then the inputs, those of them the step frees), "forward" from the first
           operator, "backward" from the BACKWARD annotation (a log without one is refused:
           where backward starts is then unknown), and "other" again at the end, where what
           the step made and still holds (gradients, the loss) is freed, as
           optimizer.zero_grad(set_to_none=True) and the next iteration would: so the step
           can be repeated, and vramswap measured following its plan
           (meta["freed_at_end_bytes"])
and the saved-tensor ops by Note [Saved tensors in an operator log]. Views and extra
references are only names: a use through any of them is a use of the storage.

Note [Saved tensors in an operator log]
---------------------------------------
The log does not say what autograd saved, but it says what backward reads: a storage an
operator made in the forward, still live when backward starts and read (or written) by an
operator of backward is one autograd kept for it. Per such storage:
  save     right after its alloc
  cold     right after the forward's last operator that reads or writes it (the operator
           that made it, when nothing in the forward reads it again): from there only
           autograd holds it
  use      right before backward's first operator that reads or writes it
  release  right before its free (none when it is live at the end)
Constants (parameters, inputs) are never saved: they outlive the step. A storage made in the
forward and not read by backward is a temporary, or an output backward does not need.

Thread safety: pure functions of the file.
"""
import json
from pathlib import Path

from .workload import Workload


class DtrLogError(ValueError):
    """The log breaks the format; the message names the file, the line and what is wrong."""


def read(path):
    """-> the instructions (dicts) of the log at `path`, each with its 1-based line number
    under "_line"."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise DtrLogError(f"{path}: line {n}: not JSON: {e}") from None
            if not isinstance(r, dict) or "INSTRUCTION" not in r:
                raise DtrLogError(f"{path}: line {n}: not an instruction (no INSTRUCTION key)")
            r["_line"] = n
            records.append(r)
    return records


def is_log(path):
    """Whether `path` is a file whose first line is a DTR instruction."""
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline())
        return isinstance(first, dict) and "INSTRUCTION" in first
    except (OSError, UnicodeDecodeError, ValueError):
        return False


class _Storage:
    __slots__ = ("tid", "size", "refs", "constant", "phase", "last_fwd", "first_bwd", "freed")

    def __init__(self, tid, size, constant, phase):
        self.tid, self.size, self.refs, self.constant, self.phase = tid, size, 1, constant, phase
        self.last_fwd = None   # index in `events` of the forward's last operator touching it
        self.first_bwd = None  # index in `events` of backward's first operator touching it
        self.freed = None      # index in `events` of its free


def load(path, name=None):
    """The log at `path` as a Workload (module docstring). Raises DtrLogError."""
    path = Path(path)
    records = read(path)
    starts = [i for i, r in enumerate(records) if r.get("ANNOTATION") == "START"]
    body = records[starts[0] + 1:] if starts else records

    def fail(r, what):
        raise DtrLogError(f"{path}: line {r['_line']}: {what}")

    if not any(r.get("ANNOTATION") == "BACKWARD" for r in body):
        raise DtrLogError(f"{path}: no BACKWARD annotation after START: where backward starts is unknown, so "
                          "what autograd saved cannot be told (logs of several backward passes, such as an "
                          "unrolled GAN's, have none)")
    names = {}      # name -> _Storage (None: a tensor with no storage, 0 bytes)
    storages = []   # every _Storage, in allocation order
    events = []     # ("alloc", st) ("free", st) ("compute", ns, label, [st...]) ("phase", p)
    phase = "other"
    counts = {"releases_unknown": 0}

    def set_phase(p):
        nonlocal phase
        if p != phase:
            phase = p
            events.append(("phase", p))

    def drop(st):
        if st is None:
            return
        st.refs -= 1
        if st.refs == 0:
            st.freed = len(events)
            events.append(("free", st))

    def touch(st_list):
        i = len(events) - 1  # the compute just appended
        for st in st_list:
            if st is None or st.constant:
                continue
            if phase == "forward":
                st.last_fwd = i
            elif phase == "backward" and st.first_bwd is None:
                st.first_bwd = i

    def lookup(r, n):
        if n not in names:
            fail(r, f"{r['INSTRUCTION']} {r.get('NAME', '')} reads {n!r}, which no earlier instruction made")
        return names[n]

    events.append(("phase", "other"))
    i = 0
    while i < len(body):
        r = body[i]
        kind = r["INSTRUCTION"]
        i += 1
        if kind == "ANNOTATE":
            if r.get("ANNOTATION") == "BACKWARD":
                set_phase("backward")
        elif kind == "CONSTANT":
            m = body[i] if i < len(body) else None
            if not m or m["INSTRUCTION"] != "MEMORY" or m.get("NAME") != r.get("NAME"):
                fail(r, f"CONSTANT {r.get('NAME')!r} is not followed by its MEMORY line")
            i += 1
            size = int(m["MEMORY"])
            if r["NAME"] in names:
                fail(r, f"CONSTANT {r['NAME']!r} names a tensor made before")
            st = None
            if size > 0:
                st = _Storage(len(storages), size, True, phase)
                storages.append(st)
                events.append(("alloc", st))
            names[r["NAME"]] = st
        elif kind in ("CALL", "MUTATE"):
            if phase == "other":
                set_phase("forward")
            args = [lookup(r, n) for n in r.get("ARGS", [])]
            made = []
            if kind == "CALL":
                for res in r.get("RESULT", []):
                    m = body[i] if i < len(body) else None
                    a = body[i + 1] if i + 1 < len(body) else None
                    if (not m or not a or m["INSTRUCTION"] != "MEMORY" or a["INSTRUCTION"] != "ALIAS"
                            or m.get("NAME") != res or a.get("NAME") != res):
                        fail(r, f"CALL {r.get('NAME')}: result {res!r} is not followed by its MEMORY and ALIAS lines")
                    i += 2
                    if res in names:
                        fail(r, f"CALL {r.get('NAME')}: result {res!r} names a tensor made before")
                    alias = int(a["ALIAS"])
                    if alias >= 0:
                        if alias >= len(args):
                            fail(a, f"ALIAS {alias} of {res!r}: CALL {r.get('NAME')} has {len(args)} argument(s)")
                        st = args[alias]
                        if st is not None:
                            st.refs += 1
                    else:
                        size = int(m["MEMORY"])
                        st = None
                        if size > 0:
                            st = _Storage(len(storages), size, False, phase)
                            storages.append(st)
                            events.append(("alloc", st))
                            made.append(st)
                    names[res] = st
            touched = args + made
            events.append(("compute", int(r.get("TIME", 0)), r.get("NAME", kind.lower()), touched))
            touch(touched)
        elif kind == "COPY":
            src = lookup(r, r["SRC"])
            if r["DST"] in names:
                fail(r, f"COPY to {r['DST']!r}, a name already in use")
            names[r["DST"]] = src
            if src is not None:
                src.refs += 1
        elif kind == "COPY_FROM":
            src = lookup(r, r["SRC"])
            old = lookup(r, r["DST"])
            names[r["DST"]] = src
            if src is not None:
                src.refs += 1
            drop(old)
        elif kind == "RELEASE":
            if r["NAME"] not in names:
                counts["releases_unknown"] += 1  # a tensor made before START
                continue
            drop(names.pop(r["NAME"]))
        else:
            fail(r, f"unknown instruction {kind!r}")

    # A step a training loop can repeat (measure.py's Note [Warm-up steps]): the constants made
    # before the first operator that the step frees (its inputs) go last, just before the
    # forward; what the step made and still holds at its end (gradients, the loss) is freed
    # at its end, as optimizer.zero_grad(set_to_none=True) and the next iteration do.
    first_op = next((k for k, ev in enumerate(events) if ev[0] == "phase" and ev[1] == "forward"), None)
    if first_op is None:
        raise DtrLogError(f"{path}: no operator before the BACKWARD annotation: the log has no forward")
    prelude = events[1:first_op]
    if all(ev[0] == "alloc" for ev in prelude):  # else left as it is (then not repeatable)
        events[1:first_op] = ([ev for ev in prelude if ev[1].freed is None] +
                              [ev for ev in prelude if ev[1].freed is not None])
    held = [st for st in storages if st.freed is None and not (st.constant and st.phase == "other")]
    if held:
        events.append(("phase", "other"))
        for st in held:
            st.freed = len(events)
            events.append(("free", st))
    saved = [st for st in storages
             if not st.constant and st.phase == "forward" and st.first_bwd is not None and st.last_fwd is not None]
    # Where each saved-tensor op goes: (event index, before or after it) -> ops.
    before, after = {}, {}
    for st in saved:
        after.setdefault(st.last_fwd, []).append(("cold", st.tid))
        before.setdefault(st.first_bwd, []).append(("use", st.tid))
        if st.freed is not None:
            before.setdefault(st.freed, []).append(("release", st.tid))
    saved_set = {st.tid for st in saved}
    w = Workload(name or path.stem, meta={"source": "dtr", "log": path.name})
    for k, ev in enumerate(events):
        w.ops.extend(before.get(k, ()))
        if ev[0] == "phase":
            w.phase(ev[1])
        elif ev[0] == "alloc":
            w.alloc(ev[1].tid, ev[1].size)
            if ev[1].tid in saved_set:
                w.save(ev[1].tid)
        elif ev[0] == "free":
            w.free(ev[1].tid)
        else:
            w.compute(ev[1], ev[2])
        w.ops.extend(after.get(k, ()))
    w.meta.update({
        "operators": sum(1 for ev in events if ev[0] == "compute"),
        "storages": len(storages),
        "constant_bytes": sum(st.size for st in storages if st.constant),
        "saved": len(saved),
        "saved_bytes": sum(st.size for st in saved),
        "releases_of_unknown_names": counts["releases_unknown"],
        "freed_at_end_bytes": sum(st.size for st in held),
    })
    return w
