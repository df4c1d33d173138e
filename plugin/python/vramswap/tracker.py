"""The autograd tracker: saved-tensor hooks that drive vramswap's tracker protocol.

`offload()` opens an offload scope (vramswap_scope_push: large allocations made inside are
tagged, placed on pages of their own) and installs torch.autograd.graph.saved_tensors_hooks:

  pack(t)    vramswap_pack(t.data_ptr()) gives the handle of t's block, or 0 when the block
             is not tagged (allocated outside a scope, too small, not vramswap's): then the
             tensor itself is saved, as with no hooks. Otherwise a _Saved object holds a
             detached alias of t (a TensorImpl of our own on the same storage) and the handle.
             The first pack after the scope opens or after a backward ran calls
             vramswap_graph_begin (a new forward).
  cold       a block is cold when the only TensorImpls holding its storage are the tracker's
             own aliases: c10::StorageImpl's use count equals the number of live _Saved
             objects of that handle. The not-yet-cold handles are kept by the extension
             (torch.ops.vramswap.watch/forget/poll_cold, Note [Pending blocks] in
             csrc/cpu_sim.cpp), which checks them at each pack and unpack, when a scope
             closes, and, through vramswap's cold probe (vramswap_set_cold_probe), whenever
             an allocation finds memory short: a block whose last reference the program
             dropped between two hooks is marked then, before anything is evicted or an
             out-of-memory is reported. Then vramswap_mark_cold on the current stream.
  unpack(p)  vramswap_unpack on the current stream; in the CPU-emulation mode the legacy
             stream is synchronized before the tensor is returned (CPU ops are not
             stream-ordered).
  release    when autograd drops the packed object (after backward used it, or with the
             graph), _Saved.__del__ calls vramswap_release, before its alias (and so possibly
             the storage, and the block) goes, and queues the handle; the tracker's own
             bookkeeping (its count of live _Saved objects, the releases counter) takes the
             queued handles at its next locked step (Note [No lock in a destructor]).

  replaced   an unpack whose block the program freed while the alias held its storage
             (Note [Replaced storage]) returns the alias as it is, counted in `replaced`.

Why an alias and not t itself: the tensor autograd passes to the pack hook is usually the
forward's own TensorImpl, so holding it would make the storage's use count 1 while the
forward still uses the tensor (a residual), and the block would be evicted while
referenced. With an alias the forward's reference keeps the count above ours.

Thread safety: the tracker's bookkeeping and its counters are guarded by one lock; the
scope is per thread (vramswap's), the hooks are torch's (thread-local in 1.13).

Note [No lock in a destructor]
------------------------------
A _Saved can die anywhere: when autograd drops it, in another thread, in a cyclic garbage
collection (which starts at any allocation, the tracker's own locked regions included), or
when a list the tracker holds under its lock drops the last reference. A destructor that
took the tracker's (non-reentrant) lock would then block the thread that already holds it,
for good. So _Saved.__del__ takes no lock of the tracker's: it calls vramswap_release (the
library is thread-safe and never calls back into Python) and appends the handle to a
deque (atomic, lock-free), and every locked step of the tracker begins by draining that
queue into the bookkeeping. Until then the tracker counts one _Saved too many for the
handle, which can only delay a cold mark (a block is cold when the storage's use count
equals that count), never make one early.

Note [Replaced storage]
-----------------------
A program may give a storage other memory while autograd holds a tensor saved on it:
`untyped_storage().resize_()` frees the old memory and allocates new. FSDP does this with
every unsharded parameter (fully_shard; FSDP1's flat parameters): it all-gathers the
parameters into the storage before a layer's forward, frees the memory after it
(resize_(0)), and gathers again into fresh memory before the layer's backward. Under
`vramswap run` the first gather runs inside the offload scope, so the weight a layer saves
is a tagged block, packed; its free makes the handle stale (vramswap_unpack refuses it,
saying so). A live _Saved still holds one pack of its handle, so the handle cannot have been
released: its block was freed, and since the alias holds the storage, only because the
program replaced the storage's memory. What backward must read then is what the storage
holds now, as without vramswap, so unpack returns the alias untouched. The new memory is
the program's own (the second gather runs in backward, outside any scope): nothing to
fetch. The stale handle's release at the _Saved's death is refused and changes nothing.
"""
import collections
import contextlib
import ctypes
import threading

import torch

from . import _ext, _lib, sim


# How vramswap's last error names a handle whose block was freed (or its last pack released)
# since it was packed (include/vramswap/vramswap.h: "stale", named in the message).
_STALE = " is stale: "


class _Saved:
    """What the pack hook returns for a tagged block: an alias of the saved tensor and the
    block's handle. Its death releases one handle reference."""

    __slots__ = ("tensor", "handle")

    def __init__(self, tensor, handle):
        self.tensor = tensor
        self.handle = handle

    def __del__(self):
        tracker = _tracker
        if tracker is not None:  # None while the interpreter tears the module down
            tracker._dropped(self.handle)


class _Tracker:
    def __init__(self):
        self._lock = threading.Lock()
        self._live = {}        # handle -> number of live _Saved objects
        # The handles packed but not yet marked cold are the extension's (is_pending()).
        self._probe_installed = False
        self._depth = 0        # open offload() scopes, all threads
        self._new_graph = True
        self._drops = collections.deque()  # (handle, released) of dead _Saved, not yet counted
        self.stats = {"packs": 0, "untagged": 0, "unpacks": 0, "replaced": 0, "releases": 0}

    @contextlib.contextmanager
    def _locked(self):
        """The tracker's lock, with the queued drops applied first (Note [No lock in a
        destructor])."""
        with self._lock:
            self._drain()
            yield

    def _drain(self):
        """Applies the drops _Saved.__del__ queued to the bookkeeping. The caller holds the
        lock; the deque's own operations are atomic, so destructors may append meanwhile."""
        while True:
            try:
                h, released = self._drops.popleft()
            except IndexError:
                return
            n = self._live.get(h, 0) - 1
            if n <= 0:
                self._live.pop(h, None)
            else:
                self._live[h] = n
            _ext.load().set_aliases(h, max(n, 0))
            if released:
                self.stats["releases"] += 1

    def stats_snapshot(self):
        with self._locked():
            snapshot = dict(self.stats)
        snapshot["cold"] = _ext.load().num_cold_marks()
        return snapshot

    def live(self, h):
        """How many saved tensors of handle h the tracker holds now (its packs not yet
        released)."""
        with self._locked():
            return self._live.get(h, 0)

    def scope_open(self):
        """True while an offload() scope is open (on any thread)."""
        with self._locked():
            return self._depth > 0

    def is_pending(self, h):
        """True while handle h is packed and not yet marked cold (nor unpacked)."""
        return _ext.load().is_pending(h)

    def _install_probe(self):
        """Registers the extension's cold probe with vramswap, once."""
        with self._locked():
            if self._probe_installed:
                return
            self._probe_installed = True
        lib = _lib.lib()

        def addr(fn):
            return ctypes.cast(fn, ctypes.c_void_p).value

        probe = _ext.load().install_cold_probe(addr(lib.vramswap_mark_cold), addr(lib.vramswap_last_error))
        lib.vramswap_set_cold_probe(probe)

    # -- streams --------------------------------------------------------------------
    @staticmethod
    def _stream():
        if sim.installed():
            return None  # the legacy stream: torch's CPU ops are synchronous
        return torch.cuda.current_stream().cuda_stream

    # -- hooks ----------------------------------------------------------------------
    def pack(self, t):
        lib = _lib.lib()
        ptr = t.data_ptr() if t.layout == torch.strided else 0
        if ptr == 0 or t.numel() == 0:
            return t
        stream = self._stream()
        with self._locked():
            if self._new_graph:
                lib.vramswap_graph_begin()
                self._new_graph = False
        h = lib.vramswap_pack(ptr, stream)
        if h == 0:
            with self._locked():
                self.stats["untagged"] += 1
            return t
        saved = _Saved(t.detach(), h)
        ops = _ext.load()
        with self._locked():
            self.stats["packs"] += 1
            n = self._live[h] = self._live.get(h, 0) + 1
            ops.watch(saved.tensor, h, n)
        self.poll_cold()
        return saved

    def unpack(self, p):
        if not isinstance(p, _Saved):
            return p
        lib = _lib.lib()
        with self._locked():
            self._new_graph = True  # a backward ran: the next pack starts a forward
        _ext.load().forget(p.handle)  # unpacked: in use, not cold (before the sweep below)
        self.poll_cold()
        rc = lib.vramswap_unpack(p.handle, self._stream())
        if rc == -2:  # no device memory to bring the block back: the program's out-of-memory
            from ._errors import OutOfMemoryError
            message = _lib.last_error()
            raise OutOfMemoryError(message if message.startswith("vramswap: ") else "vramswap: " + message)
        if rc != 0 and _STALE in _lib.last_error():  # Note [Replaced storage]
            with self._locked():
                self.stats["replaced"] += 1
            return p.tensor
        _lib.check(rc, "vramswap_unpack")
        sim.synchronize()
        with self._locked():
            self.stats["unpacks"] += 1
        return p.tensor

    def _dropped(self, h):
        """A _Saved of handle h died: releases one reference of h now, and queues the
        bookkeeping. Called from _Saved.__del__, so it takes no lock (Note [No lock in a
        destructor])."""
        lib = _lib._lib
        released = lib is not None and lib.vramswap_release(h) == 0
        self._drops.append((h, released))

    # -- cold ------------------------------------------------------------------------
    def poll_cold(self):
        """Marks cold every pending block whose storage only the tracker's aliases hold."""
        with self._locked():
            pass  # the drops queued so far are counted: the extension's counts are current
        _ext.load().poll_cold(self._stream() or 0)

    # -- scope -------------------------------------------------------------------------
    def enter(self):
        self._install_probe()
        _lib.lib().vramswap_scope_push()
        with self._locked():
            if self._depth == 0:
                self._new_graph = True
            self._depth += 1

    def exit(self):
        with self._locked():
            self._depth -= 1
        _lib.lib().vramswap_scope_pop()
        self.poll_cold()


_tracker = _Tracker()


@contextlib.contextmanager
def offload(horizon=None, min_bytes=None):
    """Tensors saved for backward inside this scope may be evicted to host memory when
    memory is short, and are brought back (at the same address) before backward uses them.
    `horizon` / `min_bytes` set VRAMSWAP_HORIZON / VRAMSWAP_MIN_OFFLOAD_BYTES (the horizon
    only before vramswap's first allocation), as install(**config) takes them: a refused
    value raises ConfigError (a ValueError) naming the variable. Scopes nest."""
    _lib.configure(_lib.lib(), {"VRAMSWAP_HORIZON": horizon, "VRAMSWAP_MIN_OFFLOAD_BYTES": min_bytes})
    _tracker.enter()
    try:
        with torch.autograd.graph.saved_tensors_hooks(_tracker.pack, _tracker.unpack):
            yield
    finally:
        _tracker.exit()


def tracker_stats():
    """The tracker's own counters (packs, untagged, cold, unpacks, replaced, releases)."""
    return _tracker.stats_snapshot()


class _ForwardScopes(threading.local):
    """Per thread: how deep the module forwards being run are, and the offload() scope the
    outermost recorded one opened (None when none is open)."""

    def __init__(self):
        self.depth = 0
        self.scope = None


def _in_backward():
    """Whether autograd is running a backward on this thread (a graph task is executing)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


@contextlib.contextmanager
def offload_forwards(horizon=None, min_bytes=None):
    """Opens an offload() scope around every outermost nn.Module forward that autograd
    records (grad mode on when it starts), through torch's global module forward hooks, and
    nowhere else: what `vramswap run` uses (Note [Tag only what backward saves]).

    Note [Tag only what backward saves]
    -----------------------------------
    A scope open for a whole script tags every large allocation: parameters (created in
    __init__), gradients (in backward), optimizer state (in step()), which are never cold
    while the model lives, so tagging them costs their rounding to whole pages and buys
    nothing. The tensors backward saves are created while a forward runs with grad mode on,
    so that is when the scope is open: a forward pre-hook on every module opens it when the
    thread enters its outermost module with grad mode on (inner modules only count depth),
    the forward hook closes it when that module returns. Under torch.no_grad() no scope
    opens (evaluation saves nothing), nor while autograd runs a backward on this thread: a
    forward called there is activation checkpointing recomputing what it dropped, and the
    tensors it saves belong to checkpoint's own saved-tensor hooks (a scope opened there would
    put vramswap's hooks above them: checkpoint then finds nothing saved and raises, and
    selective checkpointing finds vramswap's operators in the recomputation). What it leaves
    untagged: tensors saved by code outside
    any module (a loss computed with torch.nn.functional on the model's output; the output
    itself was allocated inside, and is tagged), and forwards called as module.forward(x),
    which torch runs without hooks. A forward that raises skips its forward hook, so the
    scope stays open until the module that opened it is called again (its pre-hook finds
    itself the opener: the depth starts again from 0; a module that calls itself would be
    taken for that too, and its inner call's allocations would be tagged) or until this
    context exits.

    Thread safety: the depth and the open scope are per thread, as vramswap's scopes are.
    """
    state = _ForwardScopes()
    module = torch.nn.modules.module

    def _close():
        cm, _ = state.scope
        state.scope = None
        state.depth = 0
        cm.__exit__(None, None, None)

    def _pre(mod, inputs):
        if state.depth and state.scope is not None and state.scope[1] is mod:
            _close()  # the module that opened the scope starts again: its last forward raised
        if state.depth == 0:
            if not torch.is_grad_enabled() or _in_backward():
                return
            cm = offload(horizon=horizon, min_bytes=min_bytes)
            cm.__enter__()
            state.scope = (cm, mod)
        state.depth += 1

    def _post(mod, inputs, output):
        if state.depth == 0:
            return
        state.depth -= 1
        if state.depth == 0 and state.scope is not None:
            _close()

    pre = module.register_module_forward_pre_hook(_pre)
    post = module.register_module_forward_hook(_post)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        if state.scope is not None:  # this thread's outermost forward raised
            _close()
