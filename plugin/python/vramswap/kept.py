"""Kept blocks from torch: what offload_frozen (kept_frozen.py: frozen weights streamed layer
by layer, Note [Frozen weights]) and offload_optimizer (kept_optimizer.py: optimizer state
that leaves the device between optimizer steps, Note [Optimizer state]) share: keeping a
tensor, its uses, and the reads and writes outside them (materialize, here).

Both rest on vramswap's kept blocks (Note [Kept blocks] in src/residency/engine.h): a block
with a handle that outlives every step, used through vramswap_use and ended by
vramswap_mark_cold, cold (and so evictable) in between. Pointers never change while a block
is kept: each tensor is moved once, when it is first kept, into a tagged block (allocated
inside an offload scope) if it is not in one already, and its Parameter or state entry
points there from then on. Tensors too small to be tagged (VRAMSWAP_MIN_OFFLOAD_BYTES) stay
where they are, resident.

Note [Reads outside a use]
--------------------------
Between its uses a kept block may be evicted: its pages are unmapped and its address
reserved, so any read or write of its tensor faults (an illegal address on a GPU, SIGSEGV
in the CPU-emulation mode) until the block is used again. Host-backed addresses for evicted blocks
would make every read safe; until then, the reads and writes torch lets us see bring the
blocks back:
 * state_dict(): a state_dict post-hook on every module with kept parameters, and one on the
   optimizer, replace each kept tensor's entry by a copy in host memory (a CPU tensor; in the
   CPU-emulation mode one outside vramswap's memory), made one module (one parameter's state)
   at a time: the blocks are used, copied out and marked cold again. So the state dict's
   extra device memory is one module's kept weights (one parameter's state), whatever the
   model's size, and nothing stays on the device afterwards. Entries are snapshots, not
   aliases: a frozen weight never changes, and the state is what torch.save writes anyway.
   Why not the device tensors, brought back by a pre-hook: the dict is read after
   state_dict() returns (by torch.save), so they would all have to stay on the device as
   long as it lives, which cannot fit when the base is larger than the limit (the case
   offload_frozen is for; tests/python/test_kept_access.py saves such a model).
   Not covered: state_dict(keep_vars=True), whose entries are the Parameters themselves.
 * model.load_state_dict(): a load pre-hook on every module with kept parameters ends the
   keep of those the state dict has (vramswap_unkeep: brought back if they left, the host
   copy of a frozen one dropped, since it holds the old contents) before torch copies into
   them, and they are kept again once written, frozen from the loaded contents on (a new
   handle; their first eviction copies them out again): at the next such module's pre-hook,
   or at this module's post-hook. So one module's kept weights are on the device at once,
   as for state_dict(). A Parameter that load_state_dict(assign=True) replaced is kept in its
   place. Not covered: a module whose own _load_from_state_dict runs no pre-hooks.
 * optimizer.load_state_dict(): torch casts every state tensor of the state dict to its
   parameter's device at once, more than fits when the state is larger than the limit (the
   case offload_optimizer is for). A load pre-hook hands them past that cast, each wrapped
   (load pre-hooks registered after offload_optimizer see the wrappers), and a post-hook,
   the first to run, copies each into a new kept block, cold at once, one tensor at a time,
   placed as torch's cast would place it (the parameter's device, its dtype for a floating
   parameter). The replaced state's blocks, freed with it, are forgotten; one the program
   still holds becomes an ordinary block.
 * materialize(module_or_optimizer): every kept block under it is used (brought back) and
   stays in use, never evicted, until the next ordinary use of the block takes it over (its
   module's forward, the optimizer's step, a load_state_dict) or the returned object's
   release() (the end of a `with` block). All or nothing: when they do not all fit, the
   ones brought back are cold again and it raises an out-of-memory naming materialize and
   the bytes. A held block is memory the next step cannot use until its module's forward:
   release it first when memory is tight.
 * remove(): every block comes back and becomes ordinary device memory; one that cannot (no
   room) stays kept, and remove() raises an out-of-memory naming it.
Not covered: any other read of a kept tensor outside its uses (p.sum(), p.cpu(), a
parameter tied into another module's forward); call materialize first.
These uses are in the after-backward lane, where no forward's order is disturbed.
"""
import threading
import weakref

import torch

from . import _lib, sim
from .tracker import _tracker

FORWARD, AFTER_BACKWARD = 0, 1  # VRAMSWAP_USE_FORWARD, VRAMSWAP_USE_AFTER_BACKWARD


def _stream():
    return _tracker._stream()


def _check(rc, what):
    if rc == -2:
        from ._errors import OutOfMemoryError
        message = _lib.last_error()
        raise OutOfMemoryError(message if message.startswith("vramswap: ") else "vramswap: " + message)
    _lib.check(rc, what)


class _Kept:
    """One kept tensor: the handle of its block, the address it was kept at, its bytes."""

    __slots__ = ("handle", "ptr", "nbytes")

    def __init__(self, handle, ptr, nbytes):
        self.handle = handle
        self.ptr = ptr
        self.nbytes = nbytes


def _to_host(t):
    """A copy of contiguous `t` in memory that is not vramswap's, and a function that copies it
    into a tensor like t. In the CPU-emulation mode a CPU tensor is vramswap's memory, so the
    copy is a numpy array of its bytes."""
    if t.device.type != "cpu":
        host = t.detach().to("cpu", copy=True)
        return lambda dst: dst.copy_(host)
    raw = t.detach().reshape(-1).view(torch.uint8).numpy().copy()
    return lambda dst: dst.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(raw))


def _tagged(make):
    """make() called inside an offload scope: the tensor it allocates is in a tagged block
    (one too small to be tagged comes from the ordinary pool all the same)."""
    lib = _lib.lib()
    lib.vramswap_scope_push()
    try:
        return make()
    finally:
        lib.vramswap_scope_pop()


def _cold_kept(t, h):
    """The kept block `h` holding t marked cold -> its _Kept."""
    _check(_lib.lib().vramswap_mark_cold(h, _stream()), "vramswap_mark_cold")
    return _Kept(h, t.data_ptr(), t.numel() * t.element_size())


def _keep(get, frozen, release=None):
    """(tensor, _Kept) for t = get() kept by vramswap: t itself when its block is tagged, else a
    copy in a tagged block; (t, None) when it cannot be kept (too small, not vramswap's, a
    view). `release()`, when given, drops the caller's reference to t before the copy is made
    (t's bytes wait in host memory meanwhile), so that moving a tensor costs no device memory;
    the caller holds no other reference (hence `get`: an argument would keep t alive)."""
    lib = _lib.lib()
    t = get()
    if t.layout != torch.strided or t.numel() == 0 or t._base is not None:
        return t, None
    h = lib.vramswap_keep(t.data_ptr(), int(frozen))
    if h == 0:
        copy_into = None
        if release is not None and t.is_contiguous():
            copy_into = _to_host(t)
            shape, dtype, device = t.shape, t.dtype, t.device
            release()
            del t
            moved = _tagged(lambda: torch.empty(shape, dtype=dtype, device=device))
        else:
            moved = _tagged(lambda: torch.empty_like(t))
        with torch.no_grad():
            if copy_into:
                copy_into(moved)
            else:
                moved.copy_(t)
        h = lib.vramswap_keep(moved.data_ptr(), int(frozen))
        if h == 0:
            return moved, None  # not tagged there either: too small
        t = moved
    return t, _cold_kept(t, h)


def _use(kept, lane):
    _check(_lib.lib().vramswap_use(kept.handle, _stream(), lane), "vramswap_use")


def _cold(kept):
    _check(_lib.lib().vramswap_mark_cold(kept.handle, _stream()), "vramswap_mark_cold")


def _size(n):
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)"


def _limit_bytes(device):
    """The device's limit (0 when vramswap reports none): memory_stats' device_limit_bytes."""
    from . import memory_stats
    try:
        stats = memory_stats(device if device.type == "cuda" else None)
    except ValueError:
        return 0
    return stats.get("device_limit_bytes", 0)


def _host_copy(t):
    """A copy of t in host memory: a CPU tensor, outside vramswap's memory also in the
    CPU-emulation mode (where a CPU tensor torch allocates is vramswap's)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu", copy=True)
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().copy()
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)


class _Uses:
    """Who has one offload's kept blocks in use outside the block's own cold marks (Note [Reads
    outside a use]): the ordinary uses in progress (a forward between its pre-hook and the
    mark_cold that ends it) and materialize()'s holds (handle -> how many live Materialized
    hold it). An ordinary use takes a held block over: its own mark_cold ends the use.
    Thread-safe (a lock: forward hooks run on any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy = set()
        self._holds = {}

    def begin(self, handle):
        with self._lock:
            self._holds.pop(handle, None)
            self._busy.add(handle)

    def end(self, handle):
        with self._lock:
            self._busy.discard(handle)

    def hold(self, handle):
        with self._lock:
            self._holds[handle] = self._holds.get(handle, 0) + 1

    def let_go(self, handle):
        """One hold of `handle` ends; True when it was the last and no ordinary use took the
        block over (the caller marks it cold)."""
        with self._lock:
            n = self._holds.get(handle)
            if n is None:
                return False
            if n > 1:
                self._holds[handle] = n - 1
                return False
            del self._holds[handle]
            return handle not in self._busy

    def idle(self, handle):
        """Neither held nor in an ordinary use: a use made by state_dict or materialize may
        mark it cold again."""
        with self._lock:
            return handle not in self._holds and handle not in self._busy

    def forget(self, handle):
        with self._lock:
            self._holds.pop(handle, None)
            self._busy.discard(handle)


def _cold_quietly(kept):
    _lib.lib().vramswap_mark_cold(kept.handle, _stream())  # refused only when freed meanwhile


def _bring_back(blocks, device, what, hint):
    """Uses every block of `blocks` ((_Uses, _Kept) pairs) in the after-backward lane: all of
    them are on the device when it returns. All or nothing: on an out-of-memory the blocks it
    used that nobody else uses are cold again, and it raises one naming `what` and the bytes."""
    from ._errors import OutOfMemoryError
    done = []
    for uses, kept in blocks:
        try:
            _use(kept, AFTER_BACKWARD)
        except Exception as e:
            for u, k in done:
                if u.idle(k.handle):
                    _cold_quietly(k)
            if not isinstance(e, OutOfMemoryError):
                raise
            total = sum(k.nbytes for _, k in blocks)
            back = sum(k.nbytes for _, k in done)
            limit = _limit_bytes(device)
            raise OutOfMemoryError(
                f"vramswap: out of memory in {what}: {len(blocks)} kept tensors of {_size(total)} cannot all be "
                f"on the device at once under its limit of {_size(limit)}: {_size(back)} were back when the next "
                f"{_size(kept.nbytes)} did not fit; they are evictable again. {hint} [{e}]") from None
        done.append((uses, kept))
    sim.synchronize()


def _snapshot(entries, device, what, hint):
    """Host copies of kept tensors (Note [Reads outside a use]): `entries` are (key, tensor,
    _Uses, _Kept); their blocks are brought back together, copied out, and those nobody else
    uses marked cold again. -> {key: host copy}."""
    blocks = [(uses, kept) for _, _, uses, kept in entries]
    _bring_back(blocks, device, what, hint)
    try:
        return {key: _host_copy(t) for key, t, _, _ in entries}
    finally:
        for uses, kept in blocks:
            if uses.idle(kept.handle):
                _cold_quietly(kept)


def _unkept(kept):
    """Ends the keep of `kept` (vramswap_unkeep: an evicted block is brought back first) ->
    "" when it ended, or was over already (a stale handle: the block was freed), else why not
    (no room to bring it back: it stays kept)."""
    lib = _lib.lib()
    if lib is None or lib.vramswap_unkeep(kept.handle) == 0:
        return ""
    message = _lib.last_error()
    return "" if "stale" in message else message or "vramswap_unkeep failed"


def _uncovered(what, failures, outcome):
    """The out-of-memory raised when kept blocks could not come back: `failures` are (_Kept,
    message); `outcome` says what became of them."""
    from ._errors import OutOfMemoryError
    nbytes = sum(k.nbytes for k, _ in failures)
    return OutOfMemoryError(
        f"vramswap: out of memory in {what}: {len(failures)} kept tensors of {_size(nbytes)} could not come back "
        f"to the device; {outcome} [{failures[0][1]}]")


def _unkeep_all(kept_by_key, kept_of, uses, who):
    """Ends the keep of every entry of `kept_by_key` (kept_of(entry): its _Kept), deleting
    the entries that ended; a stale handle (its block already freed) counts as ended. Raises
    the out-of-memory of _uncovered, naming `who`, for those that could not come back."""
    failures = []
    for key, entry in list(kept_by_key.items()):
        kept = kept_of(entry)
        message = _unkept(kept)
        if message:
            failures.append((kept, message))
            continue
        uses.forget(kept.handle)
        del kept_by_key[key]
    if failures:
        raise _uncovered(who, failures, "they stay kept (the offload goes on for them: call remove() again once "
                         "there is room).")


_offloads = weakref.WeakSet()  # the live FrozenOffload and OptimizerOffload objects (materialize)


class Materialized:
    """What materialize returns: the kept blocks it brought back, in use (never evicted) until
    release() (or the end of a `with` block), or until the block's next ordinary use (its
    module's forward, the optimizer's step) takes it over and ends it. Thread-safe."""

    def __init__(self, blocks):
        self._blocks = blocks  # (_Uses, _Kept)

    def __len__(self):
        """How many kept tensors it holds."""
        return len(self._blocks)

    def nbytes(self):
        return sum(kept.nbytes for _, kept in self._blocks)

    def release(self):
        """The blocks may leave the device again (those an ordinary use took over meanwhile
        are that use's). Calling it again does nothing."""
        blocks, self._blocks = self._blocks, []
        for uses, kept in blocks:
            if uses.let_go(kept.handle):
                _cold_quietly(kept)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def materialize(obj):
    """Brings every kept block under `obj` back to the device (Note [Reads outside a use]): a
    module's parameters that offload_frozen keeps, or an optimizer's state that
    offload_optimizer keeps. They stay there until the returned Materialized's release() (or
    the end of `with vramswap.materialize(model):`), or until their next ordinary use. Call it
    before reading such tensors outside the forward or step that uses them (p.sum(),
    p.cpu()); state_dict() and load_state_dict() need no call. All or nothing: when the
    blocks cannot all be on the device at once under the limit, raises
    vramswap.OutOfMemoryError naming materialize and the bytes, with every block evictable
    again. Call it outside forward and step()."""
    if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        raise TypeError(f"vramswap.materialize takes a torch.nn.Module or a torch.optim.Optimizer, "
                        f"not {type(obj).__name__}")
    blocks, seen, device = [], set(), None
    for offload in list(_offloads):
        found_blocks, found_device = offload._blocks_of(obj)  # ([], None) when obj is not its kind
        for uses, kept in found_blocks:
            if kept.handle not in seen:
                seen.add(kept.handle)
                blocks.append((uses, kept))
        device = device or found_device
    if blocks:
        _bring_back(blocks, device, f"materialize({type(obj).__name__})",
                    "materialize() holds them all at once: materialize a smaller module, free memory or "
                    "raise VRAMSWAP_LIMIT (state_dict() needs no materialize: it copies one module at a time).")
        for uses, kept in blocks:
            uses.hold(kept.handle)
    return Materialized(blocks)


_MOVED = {"FrozenOffload": "kept_frozen", "offload_frozen": "kept_frozen",
          "OptimizerOffload": "kept_optimizer", "offload_optimizer": "kept_optimizer"}


def __getattr__(name):
    """vramswap.kept.offload_frozen and the rest, from the modules that define them."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module("." + _MOVED[name], __package__), name)
