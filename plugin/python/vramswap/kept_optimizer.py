"""Optimizer state off the device between optimizer steps: vramswap.offload_optimizer, on
the kept blocks of kept.py.

Note [Optimizer state]
----------------------
offload_optimizer(optimizer) replaces the optimizer's step() (an instance attribute, so a
learning-rate scheduler that wraps it keeps working) by one that runs the original step on
a few parameters at a time (consecutive ones of a group whose bytes stay within 1/32 of the
device's limit, at least one): their state is used (fetched, the next parameters' state
prefetched), the original step runs with every parameter group holding only those
parameters, and the state is marked cold again. State created by that step (the first one) is
kept right after it; state optimizer.load_state_dict loads is kept as it is loaded (Note [Reads
outside a use] in kept.py). So only a window of the state is on the device at once, and the state of the
whole model leaves between steps when memory is short; the math is the original step's,
element for element. It suits optimizers whose step treats each parameter on its own (SGD,
Adam, AdamW and their foreach and fused forms); one that couples parameters (LBFGS) must not
be wrapped.
"""
import torch

from . import _lib, sim
from .kept import (AFTER_BACKWARD, _cold, _cold_kept, _keep, _offloads, _snapshot, _tagged, _unkeep_all, _unkept,
                   _use, _Uses)


class _Loaded:
    """A state tensor of the state dict optimizer.load_state_dict loads, wrapped by the load
    pre-hook so that torch's cast leaves it as it is: the post-hook (or, when the load raised
    before it, the next step) copies it into a kept block (Note [Reads outside a use])."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        v = self.value
        return f"vramswap.kept_optimizer._Loaded({v.dtype}, {tuple(v.shape)}, {v.device})"


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
        self._hooks = []
        # torch >= 2.1 (no hooks before: the state loaded is kept by the step after the load).
        # The load post-hook runs first, so that no other one sees a _Loaded.
        for name, hook, first in (("register_state_dict_post_hook", self._state_dict_post, False),
                                  ("register_load_state_dict_pre_hook", self._load_pre, False),
                                  ("register_load_state_dict_post_hook", self._load_post, True)):
            register = getattr(optimizer, name, None)
            if register is not None:
                self._hooks.append(register(hook, prepend=True) if first else register(hook))
        _offloads.add(self)

    def _state_of(self, p):
        state = self.optimizer.state.get(p)
        return state if isinstance(state, dict) else {}

    def _use(self, p):
        state = self._state_of(p)
        if any(isinstance(t, _Loaded) for t in state.values()):
            self._place_loaded(p, state)  # a load_state_dict that raised before its post-hook
        used = []
        for key, t in state.items():
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

    def _load_pre(self, optimizer, state_dict):
        """Before torch loads `state_dict` (Note [Reads outside a use]): a copy of it whose
        parameters' state tensors (but "step", which torch leaves where it is) are wrapped in
        _Loaded, which torch's cast to the device passes as they are. None (torch loads it
        as it is) when its parameters do not pair with the optimizer's: torch refuses it."""
        packed, groups = state_dict.get("state"), state_dict.get("param_groups")
        if not isinstance(packed, dict) or not isinstance(groups, (list, tuple)):
            return None
        try:
            saved = [i for g in groups for i in g["params"]]
        except (KeyError, TypeError):
            return None
        ours = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(saved) != len(ours):
            return None
        saved = set(saved)
        state = {}
        for index, st in packed.items():
            if index in saved and isinstance(st, dict):
                st = {key: _Loaded(v) if (key != "step" and isinstance(v, torch.Tensor)
                                          and v.layout == torch.strided) else v
                      for key, v in st.items()}
            state[index] = st
        return {**state_dict, "state": state}

    def _load_post(self, optimizer):
        """After torch loaded a state dict: what was kept of the replaced state is forgotten
        (freed with it; a block the program still holds becomes an ordinary one, brought back,
        when there is room), and each loaded tensor is placed (_place_loaded)."""
        old, self._kept, self._untagged = self._kept, {}, set()
        for kept in old.values():
            self._uses.forget(kept.handle)
            _unkept(kept)  # what cannot come back stays kept until it is freed
        for p, state in list(self.optimizer.state.items()):
            if isinstance(state, dict):
                self._place_loaded(p, state)

    def _place_loaded(self, p, state):
        """Each _Loaded tensor of `state` (p's) copied into a kept block, cold at once, so that
        the engine may evict it to make room for the next, as torch's cast (Optimizer.
        _process_value_according_to_param_policy, a Tensor.to) would place it: on p's device,
        in p's dtype when p is floating, with the value's strides when they are dense."""
        lib = _lib.lib()
        for key in list(state):
            loaded = state[key]
            if not isinstance(loaded, _Loaded):
                continue
            value = loaded.value
            dtype = p.dtype if p.is_floating_point() else value.dtype
            moved = _tagged(lambda: torch.empty_like(value, dtype=dtype, device=p.device))
            with torch.no_grad():
                moved.copy_(value)
            state[key] = moved
            del loaded, value
            h = lib.vramswap_keep(moved.data_ptr(), 0)
            if h == 0:
                self._untagged.add((id(p), key, moved.data_ptr()))  # too small: not tried again
                continue
            self._kept[(id(p), key)] = _cold_kept(moved, h)

    def _blocks_of(self, obj):
        """materialize(obj)'s blocks here: those of the state when obj is this optimizer."""
        return self._blocks() if obj is self.optimizer else ([], None)

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
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _offloads.discard(self)


def offload_optimizer(optimizer):
    """Keeps the optimizer's state tensors (Note [Optimizer state]): cold between optimizer
    steps (evicted when memory is short), used one parameter at a time inside step(), the
    next parameters' state prefetched. The parameters after N steps are those of the
    optimizer's own step, bit for bit. Returns an OptimizerOffload (remove() undoes it)."""
    return OptimizerOffload(optimizer)
