"""Kept blocks from torch: frozen weights streamed layer by layer (offload_frozen) and
optimizer state that leaves the device between optimizer steps (offload_optimizer).

Both rest on vramswap's kept blocks (Note [Kept blocks] in src/residency/engine.h): a block
with a handle that outlives every step, used through vramswap_use and ended by
vramswap_mark_cold, cold (and so evictable) in between. Pointers never change while a block
is kept: each tensor is moved once, when it is first kept, into a tagged block (allocated
inside an offload scope) if it is not in one already, and its Parameter or state entry
points there from then on. Tensors too small to be tagged (VRAMSWAP_MIN_OFFLOAD_BYTES) stay
where they are, resident.

Note [Frozen weights]
---------------------
offload_frozen(module) keeps the parameters of every module under `module` whose own
parameters all have requires_grad=False (a LoRA base layer; the adapters stay resident) as
*frozen* blocks: their contents never change, so a weight is copied to the host once and
every later eviction only unmaps its pages. A forward pre-hook uses the module's weights
(fetched if they left; the next ones in the learned order are prefetched) and a forward hook
ends the use, when it is known that nothing but vramswap's tracker holds them for backward:
 * grad mode was off, or no output needs a gradient: nothing saved them;
 * vramswap's tracker packed the weight during the call (an offload scope is open): backward
   gets it back through the tracker's unpack, and the engine marks it cold again after
   that use is released.
Otherwise the saved tensors went elsewhere:
 * during backward (torch.utils.checkpoint recomputing the module): checkpoint's hooks hold
   the weight until the recomputed module's backward, so the use ends when the gradient of
   its inputs is computed (a hook on each input that needs one), or at the latest when the
   backward that runs finishes (a callback queued at its end);
 * inside an offload scope, with hooks nested inside the tracker's (checkpoint's forward,
   which keeps nothing; save_on_cpu, which keeps a copy): the use ends now;
 * with no offload scope open, autograd saved the weight itself and backward reads it with no
   call to vramswap: the use ends when the backward that the output's graph runs has
   finished (a callback at its end, queued by a hook on the output's grad_fn).
Moving the kept weights leaves holes: `module.to(device)` placed each layer's small
parameters (a bias, the adapters) right after its weight, so once the weights move out each
layer's few small blocks hold a granule of their own mapped. So the module's other small
parameters (below half a granule) move too, all at once, as Module.to() moves them (their
storage through host memory, `param.data` replaced): allocated one after another, they share
a few granules. On an H200 (torch 2.11) the LoRA model of tests/gpu/kept.py ran out of
memory at its no-offload peak less 14 MiB: its six layers' adapters held six granules of
2 MiB for 1.2 MiB of tensors.
The promises the caller makes: a frozen parameter is read only inside the forward of a
module that holds it (a weight tied into another module's forward by a functional call is
not seen) or as Note [Reads outside a use] allows, never written, and no saved-tensor hooks
nested inside an offload scope keep a frozen weight itself for backward.

Note [Optimizer state]
----------------------
offload_optimizer(optimizer) replaces the optimizer's step() (an instance attribute, so a
learning-rate scheduler that wraps it keeps working) by one that runs the original step on
a few parameters at a time (consecutive ones of a group whose bytes stay within 1/32 of the
device's limit, at least one): their state is used (fetched, the next parameters' state
prefetched), the original step runs with every parameter group holding only those
parameters, and the state is marked cold again. State created by that step (the first one) is kept right
after it. So only a window of the state is on the device at once, and the state of the
whole model leaves between steps when memory is short; the math is the original step's,
element for element. It suits optimizers whose step treats each parameter on its own (SGD,
Adam, AdamW and their foreach and fused forms); one that couples parameters (LBFGS) must not
be wrapped.

Note [Reads outside a use]
--------------------------
Between its uses a kept block may be evicted: its pages are unmapped and its address
reserved, so any read of its tensor faults (an illegal address on a GPU, SIGSEGV in the
CPU-emulation mode) until the block is used again. Host-backed addresses for evicted blocks
would make every read safe; until then, the reads torch lets us see bring the blocks back:
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
 * materialize(module_or_optimizer): every kept block under it is used (brought back) and
   stays in use, never evicted, until the next ordinary use of the block takes it over (its
   module's forward, the optimizer's step) or the returned object's release() (the end of a
   `with` block). All or nothing: when they do not all fit, the ones brought back are cold
   again and it raises an out-of-memory naming materialize and the bytes. A held block is
   memory the next step cannot use until its module's forward: release it first when
   memory is tight.
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


_SMALL_BYTES = 1 << 20  # half a granule: the pool's small blocks share granules


def _storage_nbytes(t):
    """The bytes of t's whole storage (torch 2.x: untyped_storage; 1.13: storage)."""
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return storage.nbytes()


def _to_host(t):
    """A copy of contiguous `t` in memory that is not vramswap's, and a function that copies it
    into a tensor like t. In the CPU-emulation mode a CPU tensor is vramswap's memory, so the
    copy is a numpy array of its bytes."""
    if t.device.type != "cpu":
        host = t.detach().to("cpu", copy=True)
        return lambda dst: dst.copy_(host)
    raw = t.detach().reshape(-1).view(torch.uint8).numpy().copy()
    return lambda dst: dst.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(raw))


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
        lib.vramswap_scope_push()
        try:
            moved = torch.empty(shape, dtype=dtype, device=device) if copy_into else torch.empty_like(t)
        finally:
            lib.vramswap_scope_pop()
        with torch.no_grad():
            if copy_into:
                copy_into(moved)
            else:
                moved.copy_(t)
        h = lib.vramswap_keep(moved.data_ptr(), int(frozen))
        if h == 0:
            return moved, None  # not tagged there either: too small
        t = moved
    _check(lib.vramswap_mark_cold(h, _stream()), "vramswap_mark_cold")
    return t, _Kept(h, t.data_ptr(), t.numel() * t.element_size())


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


_offloads = weakref.WeakSet()  # the live FrozenOffload and OptimizerOffload objects (materialize)
_copies = {}  # id(state dict) -> {id(param): host copy}: a parameter tied into two modules copied once


def _copies_of(destination):
    """The host copies already made for `destination` (a module's state dict being filled)."""
    key = id(destination)
    copies = _copies.get(key)
    if copies is None:
        try:
            weakref.finalize(destination, _copies.pop, key, None)
        except TypeError:  # a plain dict passed as destination: no weak reference, no sharing
            return {}
        copies = _copies[key] = {}
    return copies


def _register_state_dict_post_hook(module, method):
    def hook(module, destination, prefix, local_metadata):  # torch marks it: a function, not a method
        method(module, destination, prefix, local_metadata)

    register = getattr(module, "register_state_dict_post_hook", None)  # torch >= 2.5
    return register(hook) if register is not None else module._register_state_dict_hook(hook)


def _uncovered(what, failures):
    """The out-of-memory remove() raises when blocks could not come back."""
    from ._errors import OutOfMemoryError
    nbytes = sum(k.nbytes for k, _ in failures)
    return OutOfMemoryError(
        f"vramswap: out of memory in {what}: {len(failures)} kept tensors of {_size(nbytes)} could not come back "
        f"to the device; they stay kept (the offload goes on for them: call remove() again once there is "
        f"room). [{failures[0][1]}]")


def _grad_fns(output):
    """The grad_fn of every tensor in `output` (a tensor, or a tuple, list or dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output.grad_fn] if output.grad_fn is not None else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [fn for o in output for fn in _grad_fns(o)]
    return []


def _unkeep_all(kept_by_key, kept_of, uses, who):
    """Ends the keep of every entry of `kept_by_key` (kept_of(entry): its _Kept), deleting
    the entries that ended; a stale handle (its block already freed) counts as ended. Raises
    the out-of-memory of _uncovered, naming `who`, for those that could not come back."""
    failures = []
    for key, entry in list(kept_by_key.items()):
        kept = kept_of(entry)
        lib = _lib.lib()
        if lib is not None and lib.vramswap_unkeep(kept.handle) != 0:
            message = _lib.last_error()
            if "stale" not in message:  # a stale handle: its block was freed, nothing to undo
                failures.append((kept, message))
                continue
        uses.forget(kept.handle)
        del kept_by_key[key]
    if failures:
        raise _uncovered(who, failures)


class FrozenOffload:
    """What offload_frozen returns: the kept weights and the hooks; remove() undoes both (the
    weights come back to the device and stay there)."""

    def __init__(self, module):
        self._kept = {}       # id(param) -> (param, _Kept)
        self._params = {}     # id(module) -> its kept parameters
        self._hooks = []
        self._state = threading.local()
        self._uses = _Uses()
        seen = set()
        for m in module.modules():
            own = list(m.parameters(recurse=False))
            if not own or any(p.requires_grad for p in own):
                continue
            params = []
            for p in own:
                if id(p) not in seen:
                    seen.add(id(p))
                    self._keep_param(p)
                if id(p) in self._kept:
                    params.append(p)
            if params:
                self._params[id(m)] = params
                self._hooks.append(m.register_forward_pre_hook(self._pre))
                self._hooks.append(m.register_forward_hook(self._post))
                self._hooks.append(_register_state_dict_post_hook(m, self._state_dict_post))
        self._pack_small(module)
        _offloads.add(self)

    def _pack_small(self, module):
        """Moves the other small parameters of `module` on the kept weights' devices together
        (Note [Frozen weights])."""
        devices = {p.device for p, _ in self._kept.values()}
        small, seen = [], set(self._kept)
        for p in module.parameters():
            t = p.data
            if id(p) in seen or t.device not in devices:
                continue
            seen.add(id(p))
            nbytes = t.numel() * t.element_size()
            if (t.layout == torch.strided and 0 < nbytes < _SMALL_BYTES and t._base is None
                    and t.is_contiguous() and t.storage_offset() == 0 and _storage_nbytes(t) == nbytes):
                small.append(p)
        moves = [(p, p.data.shape, p.data.dtype, _to_host(p.data)) for p in small]
        for p in small:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        with torch.no_grad():
            for p, shape, dtype, copy_into in moves:
                moved = torch.empty(shape, dtype=dtype, device=p.device)
                copy_into(moved)
                p.data = moved

    def _keep_param(self, p):
        empty = torch.empty(0, dtype=p.dtype, device=p.device)

        def release():
            p.data = empty  # the parameter's old storage goes while its bytes wait on the host

        t, kept = _keep(lambda: p.data, frozen=True, release=release)
        if t is not p.data:
            p.data = t
        if kept is None:
            self._kept.pop(id(p), None)
            return
        self._kept[id(p)] = (p, kept)

    def __len__(self):
        """How many parameters are kept."""
        return len(self._kept)

    def kept_bytes(self):
        return sum(p.numel() * p.element_size() for p, _ in self._kept.values())

    def _entries(self, module):
        out = []
        for p in self._params.get(id(module), ()):
            entry = self._kept.get(id(p))
            if entry is not None and p.data_ptr() != entry[1].ptr:
                self._keep_param(p)  # the program replaced its storage: keep the new one
                entry = self._kept.get(id(p))
            if entry is not None:
                out.append(entry[1])
        return out

    def _pre(self, module, inputs):
        entries = self._entries(module)
        for kept in entries:
            self._uses.begin(kept.handle)  # this use ends a materialize() hold: its cold mark ends it
            _use(kept, FORWARD)
        sim.synchronize()
        calls = getattr(self._state, "calls", None)
        if calls is None:
            calls = self._state.calls = []
        calls.append((module, torch.is_grad_enabled(), [(k, _tracker.live(k.handle)) for k in entries]))

    def _post(self, module, inputs, output):
        calls = getattr(self._state, "calls", None)
        # The innermost call of this module (a module whose forward raised left its entry).
        while calls and calls[-1][0] is not module:
            calls.pop()
        if not calls:
            return
        _, grad, entries = calls.pop()
        fns = _grad_fns(output) if grad else []
        later = []
        for kept, live_before in entries:
            if not fns or _tracker.live(kept.handle) > live_before:
                self._uses.end(kept.handle)
                _cold(kept)  # nothing saved it, or backward gets it through the tracker
            else:
                later.append(kept)
        if not later:
            return

        done = []

        def cold(*_):
            if done:
                return None
            done.append(True)
            for kept in later:
                self._uses.end(kept.handle)
                _cold_quietly(kept)
            return None

        try:
            # Backward is running: this is torch.utils.checkpoint's recomputation, whose saved
            # tensors its own hooks hold until the recomputed module ran backward. That is done
            # once the gradient of its inputs is (a hook on each input that needs one), or at
            # the latest when the backward finishes (a callback queued at its end).
            torch.autograd.Variable._execution_engine.queue_callback(cold)
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(cold)
            return
        except RuntimeError:
            pass
        if _tracker.scope_open():
            # Inside an offload scope the tracker's hooks would have packed the weight; hooks
            # nested inside them took the saves instead: checkpoint's forward, which keeps none.
            cold()
            return
        # No offload scope: autograd saved the weight itself, for a backward vramswap does not
        # see. Cold once the backward that the output's graph runs has finished.
        def end_of_backward(*_):
            torch.autograd.Variable._execution_engine.queue_callback(cold)
        for fn in fns:
            fn.register_hook(end_of_backward)

    def _state_dict_post(self, module, destination, prefix, local_metadata=None):
        """The state dict's entries of `module`'s kept parameters become host copies (Note
        [Reads outside a use]): this module's blocks on the device at once, no more."""
        wanted = []
        for name, p in module._parameters.items():
            entry = self._kept.get(id(p)) if p is not None else None
            key = prefix + name
            t = destination.get(key) if entry is not None else None
            # Skipped: keep_vars=True (the entry is the Parameter), or an entry the module's own
            # _save_to_state_dict made of something else.
            if isinstance(t, torch.Tensor) and t is not p and t.data_ptr() == entry[1].ptr:
                wanted.append((key, p, t, entry[1]))
        if not wanted:
            return
        copies = _copies_of(destination)  # a tied parameter is copied once per state dict
        entries = {}
        for key, p, t, kept in wanted:
            if id(p) not in copies and id(p) not in entries:
                entries[id(p)] = (key, t, self._uses, kept)
        if entries:
            label = prefix[:-1] or type(module).__name__
            first = next(iter(entries.values()))
            made = _snapshot(list(entries.values()), first[1].device, f"state_dict() at module {label!r}",
                             "state_dict() brings back one module's kept weights at a time, and this "
                             "module's alone do not fit.")
            for p_id, (key, _, _, _) in entries.items():
                copies[p_id] = made[key]
        for key, p, _, _ in wanted:
            destination[key] = copies[id(p)]

    def _blocks(self, ids):
        """The kept blocks of the parameters whose ids are in `ids`, as (_Uses, _Kept), and the
        device of the first."""
        blocks, device = [], None
        for pid, (p, kept) in self._kept.items():
            if pid in ids and p.data_ptr() == kept.ptr:
                blocks.append((self._uses, kept))
                device = device or p.device
        return blocks, device

    def remove(self):
        """Removes the hooks and ends every keep (evicted weights come back first, one at a
        time). A weight that cannot come back (no room) stays kept, its hooks with it, and
        remove() raises an out-of-memory naming it: call it again once there is room."""
        _unkeep_all(self._kept, lambda entry: entry[1], self._uses, "FrozenOffload.remove()")
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _offloads.discard(self)


def offload_frozen(module):
    """Streams the frozen parameters under `module` (Note [Frozen weights]): every module
    whose own parameters all have requires_grad=False has them kept as frozen blocks, used in
    its forward and evicted after it under pressure (copied to the host once; later evictions
    cost no copy), prefetched ahead of their next use. Parameters keep their identity (their
    storage moves once, now, into blocks vramswap can evict). Returns a FrozenOffload (len:
    the parameters kept; remove() undoes it)."""
    return FrozenOffload(module)


class OptimizerOffload:
    """What offload_optimizer returns (Note [Optimizer state]); remove() restores the
    optimizer's own step() and ends every keep."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._kept = {}  # (id(param), state key) -> _Kept
        self._untagged = set()  # (id(param), state key, address): state too small to keep
        self._budgets = {}      # device -> the chunk budget (_budget)
        self._uses = _Uses()
        self._step = optimizer.step
        optimizer.step = self.step
        register = getattr(optimizer, "register_state_dict_post_hook", None)  # torch >= 2.1
        self._state_dict_hook = register(self._state_dict_post) if register is not None else None
        _offloads.add(self)

    def _state_of(self, p):
        state = self.optimizer.state.get(p)
        return state if isinstance(state, dict) else {}

    def _use(self, p):
        used = []
        for key, t in self._state_of(p).items():
            kept = self._kept.get((id(p), key))
            if kept is not None and isinstance(t, torch.Tensor) and t.data_ptr() == kept.ptr:
                self._uses.begin(kept.handle)  # this use ends a materialize() hold
                _use(kept, AFTER_BACKWARD)
                used.append(kept)
        if used:
            sim.synchronize()
        return used

    def _done(self, p, used):
        state = self._state_of(p)
        for key in list(state):
            t = state[key]
            if not isinstance(t, torch.Tensor):
                continue
            kept = self._kept.get((id(p), key))
            if (kept is not None and t.data_ptr() == kept.ptr) or (id(p), key, t.data_ptr()) in self._untagged:
                continue

            def release():
                state[key] = None  # the state's old storage goes while its bytes wait on the host

            del t
            moved, kept = _keep(lambda: state[key], frozen=False, release=release)  # new state, or replaced
            state[key] = moved
            if kept is None:
                self._untagged.add((id(p), key, moved.data_ptr()))  # too small: not tried again
                continue
            self._kept[(id(p), key)] = kept
        for kept in used:
            self._uses.end(kept.handle)
            _cold(kept)

    def _budget(self, device):
        """1/32 of the device's limit, read once per device (the limit is fixed at vramswap's
        first allocation)."""
        budget = self._budgets.get(device)
        if budget is None:
            from . import memory_stats
            stats = memory_stats(device if device.type == "cuda" else None)
            budget = self._budgets[device] = max(stats.get("device_limit_bytes", 0) // 32, 1)
        return budget

    def _chunks(self, params):
        """Consecutive parameters stepped together: as many as keep the chunk's parameter
        bytes within 1/32 of the device's limit (AdamW's state is twice that), at least
        one. Each call of the original step() costs Python time: AdamW on torch 1.13 (CPU,
        one thread, 100 parameters of 16 floats) took 44 us a parameter called one at a time
        against 23 us in one call. On a card with room to spare a model's whole state fits
        in one chunk."""
        chunks, chunk, size = [], [], 0
        for p in params:
            if p.grad is None:
                continue
            budget = self._budget(p.device)
            nbytes = p.numel() * p.element_size()
            if chunk and size + nbytes > budget:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(p)
            size += nbytes
        if chunk:
            chunks.append(chunk)
        return chunks

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.optimizer.param_groups
        params = [g["params"] for g in groups]
        try:
            for i, group_params in enumerate(params):
                for chunk in self._chunks(group_params):
                    used = {id(p): self._use(p) for p in chunk}
                    for j, g in enumerate(groups):
                        g["params"] = chunk if j == i else []
                    self._step()
                    for p in chunk:
                        self._done(p, used[id(p)])
        finally:
            for g, ps in zip(groups, params):
                g["params"] = ps
        return loss

    def _kept_state(self, p, state):
        """(key, tensor, _Uses, _Kept) for each kept tensor of `state` (p's)."""
        out = []
        for key, t in state.items():
            kept = self._kept.get((id(p), key))
            if kept is not None and isinstance(t, torch.Tensor) and t.data_ptr() == kept.ptr:
                out.append((key, t, self._uses, kept))
        return out

    def _state_dict_post(self, optimizer, state_dict):
        """The kept state in the optimizer's state dict becomes host copies (Note [Reads outside
        a use]), one parameter's state on the device at a time. The state dict's per-parameter
        dicts are the optimizer's own: the ones with kept state are replaced, not changed."""
        packed = state_dict.get("state")
        if not isinstance(packed, dict):
            return None
        owner = {id(st): p for p, st in self.optimizer.state.items()}
        new = {}
        for index, st in packed.items():
            p = owner.get(id(st))
            entries = self._kept_state(p, st) if p is not None and isinstance(st, dict) else []
            if entries:
                made = _snapshot(entries, entries[0][1].device, f"optimizer.state_dict() at parameter {index}",
                                 "optimizer.state_dict() brings back one parameter's state at a time, and "
                                 "this parameter's alone does not fit.")
                st = {key: made.get(key, t) for key, t in st.items()}
            new[index] = st
        return {**state_dict, "state": new}

    def _blocks(self):
        """Every kept block of the state, as (_Uses, _Kept), and the device of the first."""
        blocks, device = [], None
        for p, state in self.optimizer.state.items():
            if isinstance(state, dict):
                for _, t, uses, kept in self._kept_state(p, state):
                    blocks.append((uses, kept))
                    device = device or t.device
        return blocks, device

    def remove(self):
        """Restores the optimizer's own step() and ends every keep (evicted state comes back
        first, one tensor at a time). State that cannot come back (no room) stays kept, with
        the wrapped step(), and remove() raises an out-of-memory naming it."""
        _unkeep_all(self._kept, lambda kept: kept, self._uses, "OptimizerOffload.remove()")
        if self.optimizer.step == self.step:
            del self.optimizer.step
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
        _offloads.discard(self)


def offload_optimizer(optimizer):
    """Keeps the optimizer's state tensors (Note [Optimizer state]): cold between optimizer
    steps (evicted when memory is short), used one parameter at a time inside step(), the
    next parameters' state prefetched. The parameters after N steps are those of the
    optimizer's own step, bit for bit. Returns an OptimizerOffload (remove() undoes it)."""
    return OptimizerOffload(optimizer)


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
    p.cpu()); state_dict() needs no call. All or nothing: when the blocks cannot all be on the
    device at once under the limit, raises vramswap.OutOfMemoryError naming materialize and
    the bytes, with every block evictable again. Call it outside forward and step()."""
    if isinstance(obj, torch.optim.Optimizer):
        offloads = [o for o in list(_offloads) if isinstance(o, OptimizerOffload) and o.optimizer is obj]
        found = [o._blocks() for o in offloads]
    elif isinstance(obj, torch.nn.Module):
        ids = {id(p) for p in obj.parameters()}
        found = [o._blocks(ids) for o in list(_offloads) if isinstance(o, FrozenOffload)]
    else:
        raise TypeError(f"vramswap.materialize takes a torch.nn.Module or a torch.optim.Optimizer, "
                        f"not {type(obj).__name__}")
    blocks, seen, device = [], set(), None
    for found_blocks, found_device in found:
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
