"""Frozen weights streamed layer by layer: vramswap.offload_frozen, on the kept blocks of
kept.py.

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
not seen) or as Note [Reads outside a use] in kept.py allows, never written but by
model.load_state_dict (the same Note), and no saved-tensor hooks nested inside an offload
scope keep a frozen weight itself for backward.
"""
import threading
import weakref

import torch

from . import sim
from .kept import (FORWARD, _cold, _cold_quietly, _keep, _offloads, _snapshot, _to_host, _uncovered,
                   _unkeep_all, _unkept, _use, _Uses)
from .tracker import _tracker

_SMALL_BYTES = 1 << 20  # half a granule: the pool's small blocks share granules


def _storage_nbytes(t):
    """The bytes of t's whole storage (torch 2.x: untyped_storage; 1.13: storage)."""
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return storage.nbytes()


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


def _register_load_hooks(module, pre, post):
    """`pre` as the module's load_state_dict pre-hook, `post` as its post-hook where torch has
    them (post-hooks: torch >= 1.13) -> their handles."""
    register = getattr(module, "register_load_state_dict_pre_hook", None)  # torch >= 2.0
    handles = [register(pre) if register is not None
               else module._register_load_state_dict_pre_hook(pre, with_module=True)]
    register = getattr(module, "register_load_state_dict_post_hook", None)
    if register is not None:
        handles.append(register(post))
    return handles


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
        self._uses = _Uses()
        self._loading = []    # (module, name, param) unkept for load_state_dict to write (_load_pre)
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
                self._hooks.extend(_register_load_hooks(m, self._load_pre, self._load_post))
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
        if self._loading:
            self._settle()  # a load_state_dict that raised before its post-hook
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
        self._settle()
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

    def _load_pre(self, module, state_dict, prefix, *_):
        """Before torch copies `state_dict` into `module` (Note [Reads outside a use]): the
        weights an earlier module's load took are kept again (written by now), and the keep
        of this module's kept parameters that the state dict has ends: an evicted one comes
        back, and the host copy of each (the old contents) is dropped. Ends materialize()'s
        holds of them. When one cannot come back (no room), those taken are kept again,
        unchanged, and it raises an out-of-memory naming load_state_dict."""
        self._settle()
        taken = []
        for name, p in module._parameters.items():
            entry = self._kept.get(id(p)) if p is not None else None
            if entry is None or prefix + name not in state_dict or p.data_ptr() != entry[1].ptr:
                continue  # not kept, not loaded, or storage the forward keeps anew (_entries)
            message = _unkept(entry[1])
            if message:
                self._settle()
                label = prefix[:-1] or type(module).__name__
                raise _uncovered(f"load_state_dict() at module {label!r}", [(entry[1], message)],
                                 "it stays kept and nothing of this module was written (the modules loaded "
                                 "before it were); load_state_dict() writes one module's kept weights at a time, "
                                 "and this module's alone do not fit.")
            self._uses.forget(entry[1].handle)
            self._loading.append((module, name, p))
            taken.append(p)
        if taken:
            sim.synchronize()  # the fetches unkeep started have landed: torch's CPU copy ignores streams

    def _load_post(self, module, incompatible_keys):
        self._settle()

    def _settle(self):
        """Keeps again, cold, the weights _load_pre took, written now: frozen from the loaded
        contents on (a new handle). A Parameter that the load replaced (load_state_dict(
        assign=True)) is kept in its place."""
        while self._loading:
            module, name, p = self._loading.pop(0)
            now = module._parameters.get(name)
            if now is not p:
                self._kept.pop(id(p), None)
                params = self._params.get(id(module), [])
                i = next((i for i, q in enumerate(params) if q is p), None)
                if i is not None and now is None:
                    del params[i]
                elif i is not None:
                    params[i] = now
                p = now
            if p is not None:
                self._keep_param(p)

    def _blocks_of(self, obj):
        """materialize(obj)'s blocks here: those of obj's parameters when it is a module."""
        if not isinstance(obj, torch.nn.Module):
            return [], None
        return self._blocks({id(p) for p in obj.parameters()})

    def _blocks(self, ids):
        """The kept blocks of the parameters whose ids are in `ids`, as (_Uses, _Kept), and the
        device of the first."""
        self._settle()
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
        self._settle()
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
