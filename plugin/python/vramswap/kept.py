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
not seen), never written, and no saved-tensor hooks nested inside an offload scope keep a
frozen weight itself for backward.

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
"""
import threading

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
    """One kept tensor: the handle of its block and the address it was kept at."""

    __slots__ = ("handle", "ptr")

    def __init__(self, handle, ptr):
        self.handle = handle
        self.ptr = ptr


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
    return t, _Kept(h, t.data_ptr())


def _use(kept, lane):
    _check(_lib.lib().vramswap_use(kept.handle, _stream(), lane), "vramswap_use")


def _cold(kept):
    _check(_lib.lib().vramswap_mark_cold(kept.handle, _stream()), "vramswap_mark_cold")


def _unkeep(kept):
    lib = _lib.lib()
    if lib is not None:
        lib.vramswap_unkeep(kept.handle)  # a stale handle (its block freed) is refused: nothing to undo


def _grad_fns(output):
    """The grad_fn of every tensor in `output` (a tensor, or a tuple, list or dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output.grad_fn] if output.grad_fn is not None else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [fn for o in output for fn in _grad_fns(o)]
    return []


class FrozenOffload:
    """What offload_frozen returns: the kept weights and the hooks; remove() undoes both (the
    weights come back to the device and stay there)."""

    def __init__(self, module):
        self._kept = {}       # id(param) -> (param, _Kept)
        self._params = {}     # id(module) -> its kept parameters
        self._hooks = []
        self._state = threading.local()
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
        self._pack_small(module)

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
                _lib.lib().vramswap_mark_cold(kept.handle, _stream())  # refused only when freed meanwhile
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

    def remove(self):
        """Removes the hooks and ends every keep (evicted weights come back first)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for _, kept in self._kept.values():
            _unkeep(kept)
        self._kept = {}


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
        self._step = optimizer.step
        optimizer.step = self.step

    def _state_of(self, p):
        state = self.optimizer.state.get(p)
        return state if isinstance(state, dict) else {}

    def _use(self, p):
        used = []
        for key, t in self._state_of(p).items():
            kept = self._kept.get((id(p), key))
            if kept is not None and isinstance(t, torch.Tensor) and t.data_ptr() == kept.ptr:
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

    def remove(self):
        if self.optimizer.step == self.step:
            del self.optimizer.step
        for kept in self._kept.values():
            _unkeep(kept)
        self._kept = {}


def offload_optimizer(optimizer):
    """Keeps the optimizer's state tensors (Note [Optimizer state]): cold between optimizer
    steps (evicted when memory is short), used one parameter at a time inside step(), the
    next parameters' state prefetched. The parameters after N steps are those of the
    optimizer's own step, bit for bit. Returns an OptimizerOffload (remove() undoes it)."""
    return OptimizerOffload(optimizer)
