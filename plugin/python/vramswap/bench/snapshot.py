"""Replays a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot()) as a Workload.

A snapshot is a pickled dict: "segments" (the caching allocator's blocks when it was dumped),
"device_traces" (one list of events per device, oldest first, recorded since
torch.cuda.memory._record_memory_history() started), "allocator_settings" and
"external_annotations". read() loads it with an unpickler that refuses every class: the
dumps hold only builtin types, and refusing classes is what keeps a downloaded pickle from
running code. load() turns one device's events into a Workload (vramswap.bench.workload):

  alloc          -> ("alloc", tid, size)   tids count up, so a reused address gets a new one
  free_completed -> ("free", tid)
  plus phases, the saved-tensor ops (save/cold/use/release) and modelled compute time,
  each inferred as the notes below say.

Invariants of the result: it passes Workload.validate(); every alloc and free_completed of
the chosen device's trace appears once, in trace order; the tensors allocated before
recording began that the trace frees are allocated first (Note [Carried-in tensors]), and
meta["carried_in"]["tids"] names them.

Note [Which trace actions are used]
-----------------------------------
  alloc             a block handed to a tensor; "size" is the requested size (unrounded)
  free_completed    the block is back in the allocator and reusable: the workload's "free".
                    On one stream it directly follows free_requested (all 5 shipped traces:
                    every free_requested is followed by its free_completed); with
                    record_stream on other streams it comes when their work is done, which
                    is when the memory really returns, so it is the one to replay.
  free_requested    the tensor's last reference went; ignored (see free_completed)
  segment_alloc/_free, segment_map/_unmap
                    the caching allocator's own cudaMalloc/cudaFree or mapping of pages:
                    its policy, which the replay's allocator replaces; ignored
  snapshot          a marker written when a snapshot was taken; ignored
  oom               the recorded run failed an allocation; counted in meta["ooms"]
  anything else     counted in meta["actions"], otherwise ignored
Only events of the chosen device are used; device_traces[i] is device i's timeline. A
multi-GPU run (DDP, ...) has one trace per device whose relative order is unknown except
through time_us, so each device is loaded on its own (load(path, device=i)); load() says
which devices have events when the chosen one has none.

Note [Carried-in tensors]
-------------------------
Tensors allocated before recording started appear only in "segments" (those still live at
the dump: parameters, gradients, optimizer state) or, if the traced step frees them, as a
free_completed of an address the trace never allocated: MAGMA27 frees the previous
iteration's logits (327,680,000 B) when `logits = model(x)` rebinds the name; the Wedsonlin
runs' AdamW builds new m and v tensors and frees the old ones (3,385,466,880 B). The latter
are "carried in": they occupy device memory until the trace frees them, so by default
(carried_in=True) load() allocates them at the head of the workload, in an "other" phase,
and frees them where the trace does. Dropping them instead (carried_in=False) moves the
replay's peak: in Wedsonlin s=256 from cross-entropy (4.0 GB over the start) to AdamW (5.2
GB of new tensors, with the old ones they replace not counted). Tensors live throughout the
trace (parameters...) are in no workload: they are a constant offset, meta["resident_bytes"]
(active blocks of "segments" not allocated by the trace).

Note [Live-bytes figures]
-------------------------
The figures in the traces' README are computed by summing the sizes of alloc events minus
those of free_completed events, carried-in frees included: the change of allocated device
memory since recording started. They are reproduced exactly:
  peak_increment(w)   the highest live bytes minus the workload's live bytes at its start
                      (the carried-in tensors), which is that sum's maximum: MAGMA27
                      12,550,078,464 B during cross-entropy; Wedsonlin 1.918 / 4.008 / 7.331 /
                      19.111 GB for s = 128 / 256 / 512 / 1024. Each Wedsonlin trace holds one
                      training step (forward, cross-entropy, backward, AdamW): recording
                      started after the 5 warm-ups, so its "training-step peak increment"
                      is this figure, over the state at the step's start.
  live_bytes_at(w, i) the bytes of tensors allocated during the trace and live just before
                      op i (carried-in tensors excluded): MAGMA27 at meta["marks"]["loss"],
                      the first op of cross_entropy, 11,894,554,624 B.
Workload.live_bytes() counts the carried-in tensors too, so its peak is the peak increment
plus the carried-in bytes still live at that point (MAGMA27: 12,877,758,468 B).

Note [Phases]
-------------
Each event's frames (innermost first; Python frames, and C++ frames when the snapshot was
taken with them) decide its phase, in this order:
  backward   a C++ frame of torch::autograd::Engine (the engine's worker thread), or a
             Python frame backward/_make_grads/grad in torch/_tensor.py or torch/autograd/
             (the loss.backward() call site's own work)
  optimizer  a Python frame in an optim/ directory (torch.optim's step wrapper,
             zero_grad), a frame name naming an optimizer (adam, sgd, ...), an ATen op
             _fused_adam*/_foreach_*, or a time_us inside an external annotation
             "Optimizer.step#..." START..END of the device
  forward    a Python frame "forward" or torch.nn.Module's _call_impl, or a loss function
             (cross_entropy, nll_loss, ... : the loss is part of the autograd graph)
  other      frames, but none of the above
  (none)     no frames at all (MAGMA27's Windows build records Python frames only, so the
             autograd engine's thread has none): the phase of the event before it
Then a run of "other" between a forward run and the next forward or backward run joins the
forward (module-level glue such as `logits = model(x)` freeing the old logits, the loss
mean), so a training step is one forward run, one backward run, one optimizer run. A phase
op is emitted at each change. meta["marks"] gives the op index where each phase first
starts, and "loss" where the first loss-function frame appears.

Note [Saved tensors]
--------------------
A tensor allocated in a forward run that is still live when the next backward run starts
and is freed during that run is one autograd saved: while loss.backward() runs, the
program's own thread waits, and what the engine frees are the saved variables it releases
after each node (SavedVariable::reset_data under XxxBackward::release_variables in the
Wedsonlin frames) and the buffers it made itself. In all four Wedsonlin traces the rule's
saved set is exactly the set of tensors freed under release_variables. Forward tensors freed in forward are
temporaries; forward tensors that outlive backward (the logits the script still holds) are
not offloadable by this rule, even if autograd saved them too. Per saved tensor:
  save     right after its alloc
  cold     when the forward's block call that made it has returned (Note [Cold points]);
           with load(cold="end_of_forward"), at the end of the forward run before its
           backward run, as before
  use      before the work of the backward node that releases it. The engine runs one node
           at a time: its kernels, then release_variables frees what it saved. With C++
           frames, the node is named in the free's frames (XxxBackward0::release_variables)
           and in its kernels' allocations (XxxBackward0::apply / _apply_functional): use
           goes before the first event of that node's contiguous run. Without them (Python
           frames only), the node's work is approximated by all events since the previous
           release of a saved tensor: use goes right after it (earlier than the real read
           when nodes that save nothing ran in between, so a prefetch is asked for early,
           never late).
  release  right before its free

Note [Cold points]
------------------
A saved tensor is "cold" once only autograd's saved reference holds it: the forward code
has dropped its own. The trace does not say when that happens (it has no reads, and the
forward's last reference going is not an event, since autograd still holds the block), so
load(cold=...) places it by one of these rules; a rule that places it too early would, on a
real run, let vramswap evict a tensor the forward still reads (a fault), and on a replay
only makes the run look better than it is, so each one errs late:
  "end_of_forward"   at the end of the forward run before the backward run that uses it:
                     every forward read is surely done. Too late for a replay under a
                     limit below a peak reached inside the forward (MAGMA27 and Wedsonlin
                     s=1024 peak there): nothing is evictable until the forward ends, so
                     the replay runs out of memory with the saved tensors all hot.
  "block_exit"       (default) when the model's block call that allocated it has returned,
                     with the block's output held one block longer, never later than the
                     end of forward:
    Blocks. Every allocation's Python frames give its chain of nn.Module calls, outermost
      first: a frame directly inside torch.nn.Module._call_impl is a module's forward
      (model.py:253 -> model.py:382 -> ...). Cut at depth d, consecutive forward
      allocations with the same chain above d and the same callee at d (file, function)
      are one call; a new call starts when the chain or callee changes, or when the
      callee's line falls back to, or before, the first line of the current call after
      having moved past it (the loop `for layer in self.layers: x = layer(x)` enters the
      same function from the same line again). An allocation with no module call at
      depth d (the model's own code between calls, the loss at module level) is in none.
      d is the shallowest depth where one callee is called twice from the same line (the
      layer loop: d=1 in the shipped traces, 15 calls in MAGMA27: embedding, 12 blocks,
      ln_final, lm_head; 27 in Wedsonlin's 24 layers), else the shallowest depth that
      splits the forward in two; no such depth, no blocks: "end_of_forward" is used.
    Exit. A call's exit is the first forward allocation after it that is outside it (the
      next call's first op, or the model's own code after it): the block's forward has
      returned by then, its locals are gone, and what it made is referenced only by its
      return value and by autograd. Frees are not used to place it, so a return's frees
      of the block's temporaries come before it (later, not earlier).
    Output. The block's return value is the next block's input: the caller's `x` holds it
      until the next call returns and x is rebound, and the next block reads it (its
      first norm saves it). It is recognised as what the block allocated at the line of
      its last allocation (model.py:387, `x = x + ffn(...)`; with `return x + f(x)` the
      whole last statement, f's internals included: more held, never less): those saved
      tensors go cold at the exit of the next call at depth d (ln_final's for the last
      layer), or at the end of forward when none follows.
    Sound as long as no saved tensor of block k other than its last statement's is read
      after block k returns: a model that passes more than one tensor between blocks (a
      tuple (x, v), a value residual, a shared first-layer output) breaks it; use
      "next_block_exit" or "end_of_forward" for those. Also not covered: a block whose
      forward allocates first inside a loop (each iteration would look like a new call).
      Tensors allocated outside every call at depth d (module-level loss, model-level
      code) go cold at the end of forward. Measured: 268 of MAGMA27's 272 saved tensors
      (11.57 of 12.22 GB) go cold before the end of forward, 532 of 536 and 771 of 777 in
      Wedsonlin s=128 / s=1024 (the rest: cross-entropy's, at module level).
  "next_block_exit"  like "block_exit", but every saved tensor of a block call is held
                     until the next call's exit (as the output is): for models that pass
                     more than the last statement's output between blocks.
meta["cold"] gives the rule, the depth and number of block calls, and how many saved
tensors (and bytes) go cold before the end of forward. Only "cold" ops move: every other op
is the same under every rule.

Note [Compute model]
--------------------
Snapshots carry no GPU time (time_us is the host's clock when the allocator was called,
including the cost of capturing stacks). A compute model gives each event the GPU time of
the work it stands for, inserted as ("compute", ns, label) right after the event:
  "bytes"       (default) each alloc stands for the kernel producing it:
                ns = max(MIN_KERNEL_NS, size * TRAFFIC_PER_BYTE / BANDWIDTH_BYTES_PER_S).
                Frees cost nothing. See the constants for the choice; it gives MAGMA27
                (CS336 small, b=32, s=256, fp32) 0.12 s per step and the Wedsonlin medium
                steps 0.07 / 0.09 / 0.15 / 0.34 s (s = 128 ... 1024): 0.4-0.6x the spans
                of the traces' host clocks (0.25 s; 0.17 / 0.27 / 0.28 / 0.65 s), which
                also count the cost of capturing every allocation's stack.
  "timestamps"  the host-clock gap to the next event (time_us), for traces whose host kept
                pace with the GPU and were recorded without expensive stack capture
  "none"        no compute ops
  a callable    fn(event, next_event) -> ns (next_event None at the end), for any other
                model; bytes_model(...) builds the default with other constants
The label is the backward node (MulBackward0), else the ATen op (mm, mul_Tensor), else
the innermost Python function, else the phase.

Thread safety: pure functions of their arguments; nothing is shared between calls.
"""
import argparse
import os
import pickle
import re
import sys
from collections import Counter
from types import SimpleNamespace

from .workload import Workload

# HBM bandwidth of a current training card: A100-80GB 2.04 TB/s, H100 PCIe 2.0 TB/s (the
# snapshots do not say which GPU ran them; an H100 SXM's 3.35 TB/s would give 0.6x the time).
BANDWIDTH_BYTES_PER_S = 2.0e12
# Bytes a kernel moves per byte it writes: an elementwise binary op reads two operands of
# the output's size and writes one (3); reductions and matmuls do more per output byte
# (a softmax reads a row several times; fp32 matmuls are compute-bound), so 4 overall.
TRAFFIC_PER_BYTE = 4.0
# No kernel is shorter than its launch and tail (~2 us on current GPUs), however small.
MIN_KERNEL_NS = 2000

LOSS_FUNCTIONS = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "kl_div", "smooth_l1_loss", "huber_loss")
_OPTIMIZER_NAME = re.compile(r"adam|sgd|lamb|lion|rmsprop|adagrad|adafactor|zero_grad", re.I)
_NODE_APPLY = re.compile(r"torch::autograd::(?:\w+::)*?(\w+)(?:::apply\(|_apply_functional\()")
_NODE_RELEASE = re.compile(r"(\w+)::release_variables\(")
_ATEN_OP = re.compile(r"at::_ops::(\w+)::call\(")
# ATen ops that only make the output tensor: a label names the op that called them.
_ALLOCATING_OPS = ("empty", "new_empty", "resize_")
_BACKWARD_FRAMES = ("backward", "_make_grads", "grad", "_engine_run_backward")


class SnapshotError(ValueError):
    """The file is not a usable memory snapshot; the message names the file."""


class RefusingUnpickler(pickle.Unpickler):
    """An unpickler that refuses every class (and every persistent id): memory snapshots
    hold only dicts, lists, tuples, strings and numbers, so anything else is a pickle that
    would run code on load."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"refusing to load class {module}.{name}: snapshots hold only builtin types")


def read(path):
    """-> the snapshot dict, read with RefusingUnpickler. Raises FileNotFoundError for a
    missing file and SnapshotError for anything that is not a memory snapshot, or not one
    load() can read (check()), naming the file, where and what was expected."""
    path = os.fspath(path)
    expected = "a torch.cuda.memory._dump_snapshot() pickle"
    try:
        with open(path, "rb") as f:
            data = RefusingUnpickler(f).load()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; expected {expected}") from None
    except IsADirectoryError:
        raise SnapshotError(f"{path}: is a directory; expected {expected}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, UnicodeDecodeError, OverflowError) as e:
        raise SnapshotError(f"{path}: not {expected}: {e}") from e
    return check(data, path)


# ---- the snapshot's structure ----------------------------------------------------------------

def _a(value):
    """'an int', 'a str', ... (with the value when it is short), for error messages."""
    name = type(value).__name__
    shown = repr(value)
    article = "an" if name[:1] in "aeiou" else "a"
    return f"{article} {name}" + (f" ({shown})" if len(shown) <= 40 and name not in ("list", "dict") else "")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


# What load() reads of an event, by key: (test, what is expected).
_ADDRESS = (lambda v: _is_int(v) and v >= 0, "a non-negative integer (the block's address)")
_SIZE = (lambda v: _is_int(v) and v > 0, "a positive integer (the block's size in bytes)")
_TIME = (_is_number, "a number (the host clock, in microseconds)")
_FRAME_KEYS = (("name", str, "a string"), ("filename", str, "a string"), ("line", int, "an integer"))


def check(data, path="snapshot"):
    """Raises SnapshotError, naming the file, the place (device_traces[0][12],
    segments[3].blocks[0], ...) and what was expected, unless `data` (a dict as read()
    returns it) has the structure load() reads: events as dicts with a string "action";
    for allocations and frees an "addr" and a positive "size"; numbers for "time_us";
    frames as lists of {name, filename, line}; segments and their blocks as dicts with
    integer sizes. What load() does not read is not checked. Returns `data`."""
    def fail(where, what, expected):
        raise SnapshotError(f"{path}: not a usable memory snapshot: {where}: {what}; expected {expected}")

    if not isinstance(data, dict) or not isinstance(data.get("device_traces"), list) \
            or not isinstance(data.get("segments"), list):
        if isinstance(data, dict):
            bad = [f"no {k!r}" if k not in data else f"{k!r} is {_a(data[k])}"
                   for k in ("segments", "device_traces") if not isinstance(data.get(k), list)]
            got = f"a dict with keys {sorted(map(str, data))[:8]} ({', '.join(bad)})"
        else:
            got = _a(data)
        raise SnapshotError(f"{path}: not a torch.cuda.memory._dump_snapshot() pickle: found {got}, "
                            "expected a dict with 'segments' and 'device_traces' lists")

    def frames_of(where, frames):
        if frames is None:
            return
        if not isinstance(frames, list):
            fail(where, f"'frames' is {_a(frames)}", "a list of frames")
        for j, frame in enumerate(frames):
            if type(frame) is dict and type(frame.get("name")) is str \
                    and type(frame.get("filename")) is str and type(frame.get("line")) is int:
                continue  # the common case, checked fast
            at = f"{where}, frames[{j}]"
            if not isinstance(frame, dict):
                fail(at, f"is {_a(frame)}", "a dict with name, filename and line")
            for key, kind, expected in _FRAME_KEYS:
                if key not in frame:
                    fail(at, f"no {key!r}", expected)
                if not isinstance(frame[key], kind) or isinstance(frame[key], bool):
                    fail(at, f"{key!r} is {_a(frame[key])}", expected)

    for d, trace in enumerate(data["device_traces"]):
        if not isinstance(trace, list):
            fail(f"device_traces[{d}]", f"is {_a(trace)}", "a list of events (one per allocator action)")
        for i, e in enumerate(trace):
            where = f"device_traces[{d}][{i}]"
            if not isinstance(e, dict):
                fail(where, f"is {_a(e)}", "an event: a dict with 'action', 'addr', 'size', ...")
            action = e.get("action")
            if not isinstance(action, str):
                fail(where, "no 'action'" if "action" not in e else f"'action' is {_a(action)}",
                     "a string such as 'alloc' or 'free_completed'")
            where += f" ({action})"
            if action in ("alloc", "free_completed"):
                for key, (test, expected) in (("addr", _ADDRESS), ("size", _SIZE)):
                    if key not in e:
                        fail(where, f"no {key!r}", expected)
                    if not test(e[key]):
                        fail(where, f"{key!r} is {_a(e[key])}", expected)
                frames_of(where, e.get("frames"))
            if "time_us" in e and not _TIME[0](e["time_us"]):
                fail(where, f"'time_us' is {_a(e['time_us'])}", _TIME[1])
    for k, segment in enumerate(data["segments"]):
        where = f"segments[{k}]"
        if not isinstance(segment, dict):
            fail(where, f"is {_a(segment)}", "a segment: a dict with 'device', 'blocks', ...")
        if "device" in segment and not _is_int(segment["device"]):
            fail(where, f"'device' is {_a(segment['device'])}", "an integer (the device index)")
        blocks = segment.get("blocks", [])
        if not isinstance(blocks, list):
            fail(where, f"'blocks' is {_a(blocks)}", "a list of blocks")
        for j, block in enumerate(blocks):
            at = f"{where}.blocks[{j}]"
            if not isinstance(block, dict):
                fail(at, f"is {_a(block)}", "a block: a dict with 'size', 'state', ...")
            for key in ("size", "requested_size"):
                if key in block and not (_is_int(block[key]) and block[key] >= 0):
                    fail(at, f"{key!r} is {_a(block[key])}", "a non-negative integer (bytes)")
    annotations = data.get("external_annotations")
    if annotations is not None and not isinstance(annotations, list):
        fail("external_annotations", f"is {_a(annotations)}", "a list of annotations")
    for k, a in enumerate(annotations or ()):
        if isinstance(a, dict) and "time_us" in a and not _TIME[0](a["time_us"]):
            fail(f"external_annotations[{k}]", f"'time_us' is {_a(a['time_us'])}", _TIME[1])
    return data


# ---- compute models ----------------------------------------------------------------------

def bytes_model(bandwidth_bytes_per_s=BANDWIDTH_BYTES_PER_S, traffic_per_byte=TRAFFIC_PER_BYTE,
                min_kernel_ns=MIN_KERNEL_NS):
    """-> the "bytes" compute model with these constants (see Note [Compute model])."""
    if bandwidth_bytes_per_s <= 0 or traffic_per_byte <= 0 or min_kernel_ns < 0:
        raise ValueError("bytes_model: bandwidth and traffic must be positive, "
                         "min_kernel_ns non-negative")
    ns_per_byte = traffic_per_byte / bandwidth_bytes_per_s * 1e9

    def model(event, next_event):
        if event["action"] != "alloc":
            return 0
        return max(min_kernel_ns, event["size"] * ns_per_byte)
    model.description = (f"bytes: {bandwidth_bytes_per_s / 1e12:g} TB/s, "
                         f"{traffic_per_byte:g} B moved per B allocated, "
                         f"min {min_kernel_ns / 1000:g} us")
    return model


def timestamps_model(event, next_event):
    """The "timestamps" compute model: the host-clock gap to the next event."""
    if next_event is None:
        return 0
    if "time_us" not in event or "time_us" not in next_event:
        raise ValueError("the timestamps compute model needs the events' time_us, which "
                         "this trace lacks (recorded by torch before 2.1?)")
    return max(0, next_event["time_us"] - event["time_us"]) * 1000


timestamps_model.description = "timestamps: host-clock gaps between events"

COMPUTE_MODELS = {"bytes": bytes_model, "timestamps": lambda: timestamps_model, "none": None}


def _compute_model(compute):
    if callable(compute):
        return compute
    if compute not in COMPUTE_MODELS:
        raise ValueError(f"unknown compute model {compute!r}; known: "
                         f"{', '.join(COMPUTE_MODELS)}, or a callable fn(event, next_event)")
    factory = COMPUTE_MODELS[compute]
    return None if factory is None else factory()


# ---- frames ------------------------------------------------------------------------------

def _scan(frames):
    """-> (phase or None, label, apply node, release node, loss function) of one event."""
    if not frames:
        return None, "", None, None, None
    backward = optimizer = forward = False
    py_name = aten = node = release = loss = None
    for frame in frames:
        name = frame["name"]
        filename = frame["filename"]
        if filename.endswith(".py"):
            if py_name is None:
                py_name = name
            path = filename.replace("\\", "/")
            if name in _BACKWARD_FRAMES and ("torch/autograd/" in path
                                             or path.endswith("torch/_tensor.py")):
                backward = True
            elif "/optim/" in path or _OPTIMIZER_NAME.search(name):
                optimizer = True
            elif name in ("forward", "_call_impl"):
                forward = True
            elif name in LOSS_FUNCTIONS:
                forward = True
                loss = loss or name
            continue
        if "autograd" in name:
            if "autograd::Engine::" in name:
                backward = True
            if node is None and "apply" in name:
                m = _NODE_APPLY.search(name)
                if m:
                    node = m.group(1)
            if release is None and "release_variables" in name:
                m = _NODE_RELEASE.search(name)
                if m:
                    release = m.group(1)
        elif aten is None and "at::_ops::" in name:
            m = _ATEN_OP.search(name)
            if m and not m.group(1).startswith(_ALLOCATING_OPS):
                aten = m.group(1)
                if aten.startswith(("_fused_adam", "_foreach_")):
                    optimizer = True
    phase = ("backward" if backward else "optimizer" if optimizer
             else "forward" if forward else "other")
    return phase, node or aten or py_name or "", node, release, loss


def _module_path(frames):
    """-> ((filename, name, line), ...) of the nn.Module forward calls in an event's frames,
    outermost first (Note [Cold points]): a Python frame directly inside
    torch.nn.Module._call_impl, or named "forward" when the event has no _call_impl frame."""
    py = [f for f in frames if f["filename"].endswith(".py")]
    has_call_impl = any(f["name"] == "_call_impl" for f in py)
    path = []
    for j, f in enumerate(py):
        outer = py[j + 1] if j + 1 < len(py) else None
        if (outer is not None and outer["name"] == "_call_impl") if has_call_impl \
                else f["name"] == "forward":
            path.append((f["filename"], f["name"], f["line"]))
    path.reverse()
    return tuple(path)


def _segment_calls(paths, events, depth):
    """-> [[kept indices of one call at this depth], ...] in order; events: the forward
    allocation events (kept indices, ascending); paths: event -> _module_path. An event
    whose path is not deeper than depth ends the current call and is in none."""
    calls, key, last_line = [], None, None
    for k in events:
        path = paths[k]
        if len(path) <= depth:
            key = None
            continue
        here = (path[:depth], path[depth][:2])
        line = path[depth][2]
        # A new call: another callee or call site, or the same callee entered again from the
        # same line (a loop over layers): its line falls back to or before the first line
        # of the current call, after having moved past it.
        if here != key or (line < last_line and line <= calls[-1][1]):
            calls.append([[], line])
            key = here
        calls[-1][0].append(k)
        last_line = line
    return [c for c, _ in calls]


def _block_depth(paths, events):
    """-> the module-call depth of the model's repeated blocks: the shallowest depth at which
    one callee is called at least twice from the same call site (a loop over layers), else
    the shallowest depth that splits the forward into two calls or more; None if none."""
    deepest = max((len(paths[k]) for k in events), default=0)
    fallback = None
    for depth in range(deepest):
        calls = _segment_calls(paths, events, depth)
        keys = Counter((paths[c[0]][:depth], paths[c[0]][depth][:2]) for c in calls)
        if any(n >= 2 for n in keys.values()):
            return depth
        if fallback is None and len(calls) >= 2:
            fallback = depth
    return fallback


class _BlockCalls:
    """The forward's block calls (Note [Cold points]) and where each one's tensors go cold."""

    def __init__(self, depth, calls, forward_allocs, paths):
        self.depth, self.calls = depth, calls
        self.call_of = {k: c for c, ks in enumerate(calls) for k in ks}
        position = {k: j for j, k in enumerate(forward_allocs)}
        # exit[c]: the first forward allocation after call c that is outside it, or None.
        self.exit = []
        for ks in calls:
            j = position[ks[-1]] + 1
            self.exit.append(forward_allocs[j] if j < len(forward_allocs) else None)
        # The line, in the block's own forward, of each call's last allocation.
        self.last_line = [paths[ks[-1]][depth][2] for ks in calls]
        self.paths = paths

    def cold_point(self, k, carry_all=False):
        """-> the kept index before which the tensor allocated at event k goes cold, or None
        for the end of forward: the exit of its block call, or of the next block call when
        the tensor may be the block's output (carry_all: always)."""
        c = self.call_of.get(k)
        if c is None:
            return None
        if carry_all or self.paths[k][self.depth][2] == self.last_line[c]:
            c += 1
            if c >= len(self.calls):
                return None
        return self.exit[c]


def _block_calls(kept, phases, paths):
    """-> _BlockCalls of the forward allocations, or None when the frames show no blocks."""
    forward_allocs = [k for k, ev in enumerate(kept) if ev[1] == "alloc" and phases[k] == "forward"]
    depth = _block_depth(paths, forward_allocs)
    if depth is None:
        return None
    calls = _segment_calls(paths, forward_allocs, depth)
    return _BlockCalls(depth, calls, forward_allocs, paths)


def _optimizer_windows(snapshot, device):
    """-> [(start_us, end_us)] of the "Optimizer.step#..." annotations of the device."""
    windows, open_at = [], {}
    for a in snapshot.get("external_annotations") or ():
        if not isinstance(a, dict) or a.get("device", device) != device:
            continue
        name = str(a.get("name", ""))
        if not name.startswith("Optimizer."):
            continue
        if a.get("stage") == "START":
            open_at[name] = a.get("time_us", 0)
        elif a.get("stage") == "END" and name in open_at:
            windows.append((open_at.pop(name), a.get("time_us", 0)))
    return windows


def _assign_phases(phases):
    """Fills None from the event before and folds "other" runs between forward runs and
    what follows into forward (Note [Phases]). Modifies and returns the list."""
    current = "other"
    for i, p in enumerate(phases):
        if p is None:
            phases[i] = current
        else:
            current = p
    runs = []  # [phase, start, end)
    for i, p in enumerate(phases):
        if runs and runs[-1][0] == p:
            runs[-1][2] = i + 1
        else:
            runs.append([p, i, i + 1])
    for k in range(1, len(runs) - 1):
        if runs[k][0] == "other" and runs[k - 1][0] == "forward" \
                and runs[k + 1][0] in ("forward", "backward"):
            for i in range(runs[k][1], runs[k][2]):
                phases[i] = "forward"
    return phases


# ---- load --------------------------------------------------------------------------------

COLD_POINTS = ("block_exit", "next_block_exit", "end_of_forward")


def _kept_events(path, trace, carried_in):
    """The alloc and free_completed events, each as (trace index, "alloc"/"free", tid, size),
    with tensors carried in (freed in the trace, allocated before it) first when
    `carried_in` (Note [Carried-in tensors]). -> (kept, carried [(key, size)], remap
    {key: tid}, sizes {traced tid: (size, kept index)}, number of traced tids)."""
    kept, live_at, carried, sizes = [], {}, [], {}
    next_tid = 0
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            addr = e["addr"]
            if addr in live_at:
                first = kept[sizes[live_at[addr]][1]][0]
                raise SnapshotError(f"{path}: event {i} allocates address {addr:#x}, which "
                                    f"event {first} allocated and no event freed")
            tid = next_tid
            next_tid += 1
            live_at[addr] = tid
            sizes[tid] = (e["size"], len(kept))
            kept.append((i, "alloc", tid, e["size"]))
        elif action == "free_completed":
            tid = live_at.pop(e["addr"], None)
            if tid is None:
                if not carried_in:
                    continue
                tid = ("carried", len(carried))
                carried.append((tid, e["size"]))
            elif sizes[tid][0] != e["size"]:
                raise SnapshotError(f"{path}: event {i} frees {e['size']} B at "
                                    f"{e['addr']:#x}, which was allocated with "
                                    f"{sizes[tid][0]} B")
            kept.append((i, "free", tid, e["size"]))
    # Carried-in tensors take the first tids; traced ones are shifted after them.
    shift = len(carried)
    remap = {tid: k for k, (tid, _) in enumerate(carried)}
    kept = [(i, kind, remap[tid] if isinstance(tid, tuple) else tid + shift, size)
            for i, kind, tid, size in kept]
    return kept, carried, remap, sizes, next_tid


class _Frames:
    """What each kept event's frames say: its phase (Note [Phases]; the optimizer's windows
    from the snapshot's annotations), label, autograd node, released node and module path
    (allocations only), and where the loss is computed."""

    def __init__(self, data, device, trace, kept):
        windows = _optimizer_windows(data, device)
        self.phases, self.labels, self.nodes, self.releases, self.paths = [], [], [], [], []
        self.loss_event, self.loss_function = None, None
        for k, (i, kind, tid, size) in enumerate(kept):
            e = trace[i]
            phase, label, node, release, loss = _scan(e.get("frames") or ())
            self.paths.append(_module_path(e.get("frames") or ()) if kind == "alloc" else ())
            if phase != "backward" and windows:
                t = e.get("time_us", -1)
                if any(lo <= t <= hi for lo, hi in windows):
                    phase = "optimizer"
            if loss and self.loss_event is None:
                self.loss_event, self.loss_function = k, loss
            self.phases.append(phase)
            self.labels.append(label)
            self.nodes.append(node)
            self.releases.append(release)
        _assign_phases(self.phases)
        # Runs: maximal stretches of events of one phase.
        self.run_of, self.run_phase = [], []
        for p in self.phases:
            if not self.run_phase or self.run_phase[-1] != p:
                self.run_phase.append(p)
            self.run_of.append(len(self.run_phase) - 1)


def _saved_and_cold(kept, frames, cold):
    """Saved tensors (allocated in a forward run, freed in the first backward run after it:
    Note [Saved tensors]) and where each goes cold (Note [Cold points]). -> (saved tids,
    free_at {tid: kept index}, cold_before {kept index: tids}, cold_after_run {forward run:
    tids}, the block calls or None)."""
    run_of, run_phase = frames.run_of, frames.run_phase
    alloc_at, free_at = {}, {}
    for k, (i, kind, tid, size) in enumerate(kept):
        (alloc_at if kind == "alloc" else free_at)[tid] = k
    next_backward, nb = [None] * len(run_phase), None
    last_forward_before, lf = [None] * len(run_phase), None
    for r in range(len(run_phase) - 1, -1, -1):
        next_backward[r] = nb
        if run_phase[r] == "backward":
            nb = r
    for r in range(len(run_phase)):
        last_forward_before[r] = lf
        if run_phase[r] == "forward":
            lf = r
    run_end = [0] * len(run_phase)  # run -> the kept index after its last event
    for k, r in enumerate(run_of):
        run_end[r] = k + 1
    saved = set()
    cold_after_run = {}  # forward run -> tids made cold when it ends
    cold_before = {}  # kept index -> tids made cold just before it
    blocks = _block_calls(kept, frames.phases, frames.paths) if cold != "end_of_forward" else None
    for tid, a in sorted(alloc_at.items()):
        f = free_at.get(tid)
        ra = run_of[a]
        if f is None or run_phase[ra] != "forward" or next_backward[ra] != run_of[f]:
            continue
        saved.add(tid)
        last_forward = last_forward_before[run_of[f]]
        at = blocks.cold_point(a, carry_all=cold == "next_block_exit") if blocks else None
        if at is not None and at < run_end[last_forward]:
            cold_before.setdefault(at, []).append(tid)
        else:
            cold_after_run.setdefault(last_forward, []).append(tid)
    return saved, free_at, cold_before, cold_after_run, blocks


def _use_points(kept, saved, frames):
    """Where backward uses each saved tensor (Note [Saved tensors]): {kept index k: the tids
    used before event k}."""
    run_of, nodes, releases = frames.run_of, frames.nodes, frames.releases
    uses_before = {}
    is_saved_free = [kind == "free" and tid in saved for (i, kind, tid, size) in kept]
    batch_start = window_start = None
    for k in range(len(kept)):
        if not is_saved_free[k]:
            continue
        run = run_of[k]
        if k > 0 and is_saved_free[k - 1] and run_of[k - 1] == run:
            pass  # same batch: batch_start and window_start stay
        else:
            batch_start = k
            j = k - 1
            while j >= 0 and run_of[j] == run and not is_saved_free[j]:
                j -= 1
            window_start = j + 1
        at = window_start
        node = releases[k]
        if node is not None:
            at, j = batch_start, batch_start - 1
            while j >= window_start:
                if nodes[j] == node:
                    at = j
                elif nodes[j] is not None:
                    break
                j -= 1
        uses_before.setdefault(at, []).append(kept[k][2])
    return uses_before


def load(path, compute="bytes", device=0, carried_in=True, snapshot=None, cold="block_exit"):
    """-> the Workload of one device's trace (see the notes above). compute: "bytes",
    "timestamps", "none" or a callable fn(event, next_event) -> ns. carried_in: whether
    tensors allocated before the trace and freed in it are allocated at the head (Note
    [Carried-in tensors]). snapshot: the dict read() returned, to skip reading it again.
    cold: where saved tensors become cold, "block_exit" (default), "next_block_exit" or
    "end_of_forward" (Note [Cold points])."""
    if cold not in COLD_POINTS:
        raise ValueError(f"unknown cold point {cold!r}; known: {', '.join(COLD_POINTS)}")
    data = read(path) if snapshot is None else check(snapshot, os.fspath(path))
    source = os.path.basename(os.fspath(path))
    model = _compute_model(compute)
    traces = data["device_traces"]
    if not 0 <= device < len(traces) or not traces[device]:
        having = [f"{i} ({len(t)} events)" for i, t in enumerate(traces) if t]
        raise SnapshotError(f"{path}: device {device} has no trace events; devices with "
                            f"events: {', '.join(having) or 'none'}")
    # What each Note finds in the trace, gathered for the two steps below.
    p = SimpleNamespace(trace=traces[device])
    p.kept, p.carried, p.remap, p.sizes, p.next_tid = _kept_events(path, p.trace, carried_in)
    p.frames = _Frames(data, device, p.trace, p.kept)
    p.saved, p.free_at, p.cold_before, p.cold_after_run, p.blocks = _saved_and_cold(p.kept, p.frames, cold)
    p.uses_before = _use_points(p.kept, p.saved, p.frames)

    w = Workload(name=os.path.splitext(source)[0])
    _emit(w, p, model)
    _describe(w, p, data, device, source, cold, model)
    return w


def _emit(w, p, model):
    """Writes the workload's ops from the kept events: carried-in tensors first (Note
    [Carried-in tensors]), a phase op where the phase changes (Note [Phases]), the saved
    tensors' save, cold, use and release around their allocs and frees (Note [Saved
    tensors], Note [Cold points]), and a compute op after each event (Note [Compute
    model]). Sets p.phase_bytes (bytes allocated per phase), p.first_op_of_phase and
    p.op_of_event (the op of each kept event)."""
    trace, kept, carried, remap, frames = p.trace, p.kept, p.carried, p.remap, p.frames
    saved, cold_before, cold_after_run, uses_before = p.saved, p.cold_before, p.cold_after_run, p.uses_before
    ops = w.ops
    phases, run_of = frames.phases, frames.run_of
    phase_bytes, first_op_of_phase = Counter(), {}
    if carried:
        first_op_of_phase["other"] = 0
        w.phase("other")
        for tid, size in carried:
            w.alloc(remap[tid], size)
            phase_bytes["other"] += size
    current, run = ("other" if carried else None), None
    op_of_event = []
    for k, (i, kind, tid, size) in enumerate(kept):
        if run_of[k] != run:
            for t in cold_after_run.get(run, ()):
                w.cold(t)
            run = run_of[k]
            if phases[k] != current:
                current = phases[k]
                first_op_of_phase.setdefault(current, len(ops))
                w.phase(current)
        op_of_event.append(len(ops))
        for t in cold_before.get(k, ()):
            w.cold(t)
        for t in uses_before.get(k, ()):
            w.use(t)
        if kind == "alloc":
            w.alloc(tid, size)
            phase_bytes[current] += size
            if tid in saved:
                w.save(tid)
        else:
            if tid in saved:
                w.release(tid)
            w.free(tid)
        if model is not None:
            nxt = trace[kept[k + 1][0]] if k + 1 < len(kept) else None
            ns = int(round(model(trace[i], nxt)))
            if ns > 0:
                w.compute(ns, frames.labels[k] or current)
    for t in cold_after_run.get(run, ()):
        w.cold(t)
    p.phase_bytes, p.first_op_of_phase, p.op_of_event = phase_bytes, first_op_of_phase, op_of_event


def _describe(w, p, data, device, source, cold, model):
    """Fills w.meta: where the trace came from, what was used of it, the phases and marks,
    the saved and cold tensors, the carried-in ones and the live-bytes figures (Note
    [Live-bytes figures])."""
    trace, kept, carried, sizes, next_tid, free_at = p.trace, p.kept, p.carried, p.sizes, p.next_tid, p.free_at
    saved, frames, blocks, cold_before = p.saved, p.frames, p.blocks, p.cold_before
    first_op_of_phase, op_of_event, phase_bytes = p.first_op_of_phase, p.op_of_event, p.phase_bytes
    ops = w.ops
    shift = len(carried)
    marks = dict(first_op_of_phase)
    if frames.loss_event is not None:
        marks = {"loss": op_of_event[frames.loss_event], **marks}
    carried_bytes = sum(size for _, size in carried)
    traced_live_end = sum(sizes[tid - shift][0] for tid in range(shift, shift + next_tid)
                          if tid not in free_at)
    active = sum(b.get("requested_size", b.get("size", 0)) for s in data["segments"]
                 if s.get("device", device) == device for b in s.get("blocks", ())
                 if b.get("state") == "active_allocated")
    actions = Counter(e.get("action") for e in trace)
    w.meta.update({
        "source": source,
        "device": device,
        "events": len(trace),
        "events_used": len(kept),
        "actions": dict(actions),
        "ooms": actions.get("oom", 0),
        "phases": [op[1] for op in ops if op[0] == "phase"],
        "phase_alloc_bytes": dict(phase_bytes),
        "marks": marks,
        "loss_function": frames.loss_function,
        "saved": {"tensors": len(saved),
                  "bytes": sum(sizes[t - shift][0] for t in saved)},
        "cold": {"mode": cold,
                 "block_depth": blocks.depth if blocks else None,
                 "block_calls": len(blocks.calls) if blocks else 0,
                 "before_end_of_forward": sum(map(len, cold_before.values())),
                 "bytes_before_end_of_forward": sum(sizes[t - shift][0]
                                                    for ts in cold_before.values()
                                                    for t in ts)},
        "carried_in": {"tensors": len(carried), "bytes": carried_bytes,
                       "tids": list(range(shift))},
        "resident_bytes": max(0, active - traced_live_end),
        "compute_model": "none" if model is None else getattr(model, "description",
                                                               "a caller's callable"),
    })
    peak, peak_op = peak_increment(w)
    w.meta["live"] = {
        "peak_increment": peak, "peak_increment_op": peak_op,
        "peak_increment_phase": _phase_at(w, peak_op),
        "at_loss": live_bytes_at(w, marks["loss"]) if "loss" in marks else None,
        "peak_live": w.live_bytes()[0], "final_live": w.live_bytes()[1],
    }


# ---- figures -----------------------------------------------------------------------------

def live_bytes_at(workload, index, carried_in=False):
    """Bytes of tensors live just before workload.ops[index] (index len(ops): at the end).
    Only tensors allocated during the trace count, unless carried_in is true (Note
    [Live-bytes figures])."""
    if not 0 <= index <= len(workload.ops):
        raise IndexError(f"op index {index} outside 0..{len(workload.ops)}")
    skip = set() if carried_in else set(workload.meta.get("carried_in", {}).get("tids", ()))
    sizes, live = {}, 0
    for op in workload.ops[:index]:
        if op[0] == "alloc" and op[1] not in skip:
            sizes[op[1]] = op[2]
            live += op[2]
        elif op[0] == "free" and op[1] in sizes:
            live -= sizes.pop(op[1])
    return live


def peak_increment(workload):
    """-> (bytes, op index): the highest live bytes minus the live bytes at the start (the
    carried-in tensors), and the alloc op where it is reached; the README's "peak
    increment" (Note [Live-bytes figures]). (0, None) if live bytes never rise."""
    carried = set(workload.meta.get("carried_in", {}).get("tids", ()))
    sizes, live, start = {}, 0, 0
    peak, peak_op = 0, None
    for i, op in enumerate(workload.ops):
        if op[0] == "alloc":
            sizes[op[1]] = op[2]
            live += op[2]
            if op[1] in carried:
                start += op[2]
            elif live - start > peak:
                peak, peak_op = live - start, i
        elif op[0] == "free":
            live -= sizes.pop(op[1])
    return peak, peak_op


def _phase_at(workload, index):
    phase = "other"
    if index is None:
        return None
    for op in workload.ops[:index]:
        if op[0] == "phase":
            phase = op[1]
    return phase


def summary(workload):
    """-> a few lines describing a loaded snapshot workload, for humans."""
    m = workload.meta
    gb = 1e9
    lines = [f"{m['source']} device {m['device']}: {m['events']} events "
             f"({', '.join(f'{k} {v}' for k, v in sorted(m['actions'].items()))}), "
             f"{len(workload.ops)} ops"]
    if m["carried_in"]["tensors"]:
        lines.append(f"  carried in: {m['carried_in']['tensors']} tensors, "
                     f"{m['carried_in']['bytes'] / gb:.3f} GB allocated before the trace "
                     f"and freed in it")
    lines.append(f"  resident (live throughout, not in the workload): "
                 f"{m['resident_bytes'] / gb:.3f} GB")
    lines.append(f"  phases: {' -> '.join(m['phases'])}")
    for phase in dict.fromkeys(m["phases"]):
        lines.append(f"    {phase:<10} allocs {m['phase_alloc_bytes'].get(phase, 0) / gb:9.3f} GB"
                     f"   compute {workload.compute_ns(phase) / 1e6:9.2f} ms")
    lines.append(f"  compute: {workload.compute_ns() / 1e6:.2f} ms ({m['compute_model']})")
    lines.append(f"  saved for backward: {m['saved']['tensors']} tensors, "
                 f"{m['saved']['bytes'] / gb:.3f} GB")
    c = m["cold"]
    blocks = (f", {c['block_calls']} block calls at module depth {c['block_depth']}"
              if c["block_depth"] is not None else "")
    lines.append(f"  cold points ({c['mode']}{blocks}): {c['before_end_of_forward']} saved "
                 f"tensors, {c['bytes_before_end_of_forward'] / gb:.3f} GB, cold before "
                 f"the end of forward")
    live = m["live"]
    lines.append(f"  peak increment: {live['peak_increment']:,} B "
                 f"({live['peak_increment'] / gb:.3f} GB) at op {live['peak_increment_op']} "
                 f"({live['peak_increment_phase']})")
    if live["at_loss"] is not None:
        lines.append(f"  live at the start of {m['loss_function']} (op {m['marks']['loss']}): "
                     f"{live['at_loss']:,} B")
    lines.append(f"  Workload.live_bytes(): peak {live['peak_live']:,} B, "
                 f"final {live['final_live']:,} B")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python3 -m vramswap.bench.snapshot",
        description="Summarize a torch.cuda.memory._dump_snapshot() pickle as a workload.")
    parser.add_argument("snapshot", nargs="+")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--compute", default="bytes", choices=sorted(COMPUTE_MODELS))
    parser.add_argument("--cold", default="block_exit", choices=COLD_POINTS)
    args = parser.parse_args(argv)
    for path in args.snapshot:
        try:
            w = load(path, compute=args.compute, device=args.device, cold=args.cold).validate()
        except (OSError, SnapshotError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(summary(w))
    return 0


if __name__ == "__main__":
    sys.exit(main())
