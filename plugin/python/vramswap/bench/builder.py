"""What the step generators (gpt.py, vgg.py) share: OpEmitter, which turns tensor-level
events into a Workload (workload.py) with a roofline compute model, and StepBuilder, the ops
every model has in eager PyTorch (Linear, autocast casts, dropout, gradient accumulation),
with what autograd saves for each; describe() summarizes a generated workload.

Thread safety: the builders are used by one generator on one thread; nothing is shared.
"""
import math

from .workload import PHASES, Workload

kDtypeBytes = {"fp32": 4, "bf16": 2, "fp16": 2}
kIndexBytes = 8       # int64 token ids, positions, targets


class OpEmitter:
    """Builds a Workload from tensor-level events and keeps each saved tensor's stage, so
    that a generator can say "the forward dropped it" (cold if saved, else free) and "the
    backward is done with it" (release, then free) without tracking which case applies.
    Compute ops come from a roofline: ns = max(flops / flop_rate, bytes / byte_rate).

    Thread safety: none; one generator on one thread."""

    def __init__(self, name, tflops, hbm_gbps):
        if tflops <= 0 or hbm_gbps <= 0:
            raise ValueError(f"tflops ({tflops}) and hbm_gbps ({hbm_gbps}) must be > 0")
        self.workload = Workload(name)
        self.flop_rate = tflops * 1e12
        self.byte_rate = hbm_gbps * 1e9
        self.phase_now = "other"
        self.flops = {p: 0 for p in PHASES}
        self._size = {}     # live tid -> bytes
        self._seen = set()  # every tid ever allocated
        self._stage = {}    # saved tid -> last of save/cold/use/release

    def phase(self, name):
        self.workload.phase(name)
        self.phase_now = name

    def alloc(self, tid, nbytes):
        nbytes = int(nbytes)
        if tid in self._seen:
            raise ValueError(f"tensor {tid} allocated twice")
        if nbytes <= 0:
            raise ValueError(f"tensor {tid} has size {nbytes}")
        self._seen.add(tid)
        self._size[tid] = nbytes
        self.workload.alloc(tid, nbytes)
        return tid

    def free(self, tid):
        del self._size[tid]
        self.workload.free(tid)

    def kernel(self, label, flops=0, nbytes=0):
        seconds = max(flops / self.flop_rate, nbytes / self.byte_rate)
        self.workload.compute(math.ceil(seconds * 1e9), label)
        self.flops[self.phase_now] += int(flops)

    def save(self, tid):
        """Autograd saved the tensor; a second save of the same storage adds nothing."""
        if tid not in self._stage:
            self._stage[tid] = "save"
            self.workload.save(tid)

    def cold(self, tid):
        if self._stage.get(tid) == "save":
            self._stage[tid] = "cold"
            self.workload.cold(tid)

    def use(self, tid):
        self._stage[tid] = "use"
        self.workload.use(tid)

    def release(self, tid):
        if self._stage.get(tid) not in (None, "release"):
            self._stage[tid] = "release"
            self.workload.release(tid)

    def drop(self, tid):
        """The forward dropped its last reference: cold if autograd saved it (and it is not
        already cold or in use by backward), else freed."""
        if tid in self._stage:
            self.cold(tid)
        else:
            self.free(tid)

    def done(self, tid):
        """Backward is done with the tensor and nothing else holds it: release, free."""
        self.release(tid)
        self.free(tid)

    def keep(self, tid, frozen):
        self.workload.keep(tid, frozen)

    def kuse(self, tid):
        self.workload.kuse(tid)

    def kdone(self, tid):
        self.workload.kdone(tid)


class _Linear:
    """One Linear's forward record: what its backward reads."""
    __slots__ = ("name", "param", "x", "w", "rows", "fin", "fout", "lora")

    def __init__(self, name, param, x, w, rows, fin, fout, lora=None):
        self.name, self.param, self.x, self.w = name, param, x, w
        self.rows, self.fin, self.fout = rows, fin, fout
        self.lora = lora  # a frozen Linear's adapter: (A's record, B's record), else None


class StepBuilder:
    """What every generated training step shares: the precision (fp32, or autocast to a
    2-byte dtype over fp32 parameters), the OpEmitter, autocast's weight-cast cache, and the
    ops whose saved tensors and grads do not depend on the model: Linear, a dtype cast,
    dropout, and a parameter grad reaching AccumulateGrad. Subclasses build the model.

    Thread safety: none; one step on one thread."""

    def __init__(self, name, dtype, tflops, hbm_gbps, dropout=0.0):
        if dtype not in kDtypeBytes:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(kDtypeBytes)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout {dropout}: expected 0 <= p < 1")
        self.dtype = dtype
        self.autocast = dtype != "fp32"
        self.cdt = kDtypeBytes[dtype]           # matmul/conv operand and output bytes
        self.dropout = dropout
        self.tflops, self.hbm_gbps = tflops, hbm_gbps
        self.E = OpEmitter(name, tflops, hbm_gbps)
        self._wcache = {}   # param -> weight-cast tid of the current autocast region
        self._bcache = []   # bias-cast tids of the current autocast region
        # LoRA (subclasses set them): the Linears whose weight and bias are frozen, their
        # weights kept ("param.<name>.w": used only by autocast's cast, once per region), and
        # the adapters' rank (each frozen Linear gets trainable "<name>.lora_a" and
        # "<name>.lora_b", fin x r and r x fout, added to its output).
        self.frozen = set()
        self.lora_rank = 0

    def step_meta(self, workload, optimizer_state_bytes_per_param):
        """The meta keys every generated step has (describe() reads them): the compute model,
        the parameter, gradient and optimizer-state bytes (fp32 parameters, subclasses' `params`
        list), FLOPs and compute time by phase, and the peak and final live bytes."""
        params = sum(n for _, n in self.params)
        trainable = sum(n for _, n in getattr(self, "trainable", self.params))
        peak, final = workload.live_bytes()
        return {
            "tflops": self.tflops, "hbm_gbps": self.hbm_gbps,
            "params": params,
            "param_bytes": params * 4,
            "trainable_params": trainable,
            "grad_bytes": trainable * 4,
            "optimizer_state_bytes": trainable * optimizer_state_bytes_per_param,
            "flops": dict(self.E.flops),
            "flops_total": sum(self.E.flops.values()),
            "compute_ns": {p: workload.compute_ns(p) for p in PHASES},
            "compute_ns_total": workload.compute_ns(),
            "peak_live_bytes": peak,
            "final_live_bytes": final,
        }

    def _weight(self, prefix, param, numel, bias_numel):
        """The weight a Linear computes with: None (the fp32 parameter itself) or, under
        autocast, its cast, made on first use in the current autocast region."""
        if not self.autocast:
            return None
        E = self.E
        if param not in self._wcache:
            w = E.alloc(f"{prefix}.w_cast", numel * self.cdt)
            if param in self.frozen:
                E.kuse(f"param.{param}.w")
            E.kernel(f"{prefix}.w_cast", nbytes=numel * (4 + self.cdt))
            if param in self.frozen:
                E.kdone(f"param.{param}.w")
            self._wcache[param] = w
            if bias_numel:
                b = E.alloc(f"{prefix}.b_cast", bias_numel * self.cdt)
                E.kernel(f"{prefix}.b_cast", nbytes=bias_numel * (4 + self.cdt))
                self._bcache.append(b)
        return self._wcache[param]

    def _autocast_exit(self):
        """The autocast region ends: its cache lets go of the weight and bias casts."""
        for w in self._wcache.values():
            self.E.drop(w)
        for b in self._bcache:
            self.E.free(b)
        self._wcache, self._bcache = {}, []

    def _linear(self, prefix, param, x, x_bytes, rows, fin, fout, grad, bias=True):
        """Forward of one Linear (F.linear under autocast or not). -> (out, record)."""
        E = self.E
        internal = None
        if self.autocast and x_bytes != self.cdt:
            internal = E.alloc(f"{prefix}.in_cast", rows * fin * self.cdt)
            E.kernel(f"{prefix}.in_cast", nbytes=rows * fin * (x_bytes + self.cdt))
            x = internal
        w = self._weight(prefix, param, fin * fout, fout if bias else 0)
        out = E.alloc(f"{prefix}.out", rows * fout * self.cdt)
        frozen = param in self.frozen
        if grad:
            # x for dW (a frozen Linear needs only W, for dX); in _linear_saves' order
            for t in self._linear_saves(None if frozen else x, w, bias):
                E.save(t)
        E.kernel(prefix, flops=2 * rows * fin * fout,
                 nbytes=(rows * fin + fin * fout + rows * fout) * self.cdt)
        lora = None
        if frozen and self.lora_rank:
            r, xb = self.lora_rank, self.cdt if internal is not None else x_bytes
            a, a_rec = self._linear(f"{prefix}.lora_a", f"{param}.lora_a", x, xb, rows, fin, r, grad, bias=False)
            b, b_rec = self._linear(f"{prefix}.lora_b", f"{param}.lora_b", a, self.cdt, rows, r, fout, grad,
                                    bias=False)
            E.drop(a)
            E.kernel(f"{prefix}.lora_add", nbytes=rows * fout * 3 * self.cdt)
            E.free(b)
            lora = (a_rec, b_rec)
        if internal is not None:
            E.drop(internal)
        return out, _Linear(prefix, param, x, w, rows, fin, fout, lora)

    @staticmethod
    def _linear_saves(x, w, bias):
        """The tensors a Linear saves, in the order autograd saves them and its backward
        reads them (x: the input or None, w: the weight's cast or None). Torch 2.x's autograd
        nodes hold saved inputs sorted by name: with a bias F.linear is addmm(b, x, w.t()),
        mat1 = x before mat2 = w; without one it is mm(x, w.t()) (matmul folds a 3-D input
        to 2-D), mat2 = w before self = x."""
        order = (x, w) if bias else (w, x)
        return [t for t in order if t is not None]

    def _linear_backward(self, rec, dy, need_dx=True, bias=True, release_input=True):
        """Backward of one Linear: dX, dW, db; the weight grads accumulate into .grad.
        Frees the saved input (unless an op further back also saved it) and the weight
        cast, not the incoming grad. -> dX or None."""
        E, c = self.E, self.cdt
        if rec.param in self.frozen:
            return self._frozen_linear_backward(rec, dy, need_dx, release_input)
        for t in self._linear_saves(rec.x, rec.w, bias):
            E.use(t)
        dx = E.alloc(f"{rec.name}.dx", rec.rows * rec.fin * c) if need_dx else None
        dw = E.alloc(f"{rec.name}.dw", rec.fin * rec.fout * c)
        db = E.alloc(f"{rec.name}.db", rec.fout * c) if bias else None
        mm = 2 * rec.rows * rec.fin * rec.fout
        E.kernel(f"{rec.name}.bwd", flops=mm * (2 if need_dx else 1),
                 nbytes=(rec.rows * rec.fout * 2 + rec.rows * rec.fin * (2 if need_dx else 1)
                         + rec.fin * rec.fout * 2) * c)
        if release_input:
            E.done(rec.x)
        if rec.w is not None:
            E.done(rec.w)
        self._accumulate(f"{rec.name}.dw", dw, rec.fin * rec.fout)
        if db is not None:
            self._accumulate(f"{rec.name}.db", db, rec.fout)
        return dx

    def _frozen_linear_backward(self, rec, dy, need_dx, release_input):
        """A frozen Linear's backward: dX only (no dW, no db), then its adapter's (B, then A,
        whose dX adds in). -> dX or None."""
        E, c = self.E, self.cdt
        dx = None
        if need_dx:
            E.use(rec.w)
            dx = E.alloc(f"{rec.name}.dx", rec.rows * rec.fin * c)
            E.kernel(f"{rec.name}.bwd", flops=2 * rec.rows * rec.fin * rec.fout,
                     nbytes=(rec.rows * rec.fout + rec.rows * rec.fin + rec.fin * rec.fout) * c)
            E.done(rec.w)
        elif rec.w is not None:
            E.use(rec.w)
            E.done(rec.w)
        if rec.lora is None:
            return dx
        a_rec, b_rec = rec.lora
        da = self._linear_backward(b_rec, dy, need_dx=True, bias=False)
        dxa = self._linear_backward(a_rec, da, need_dx=need_dx, bias=False, release_input=release_input)
        E.free(da)
        if dxa is not None:
            E.kernel(f"{rec.name}.lora_dx_add", nbytes=rec.rows * rec.fin * 3 * c)
            E.free(dxa)
        return dx

    def _accumulate(self, label, g, numel, g_bytes=None):
        """A parameter gradient reaches AccumulateGrad: under autocast through the cast's
        backward (to fp32) first; .grad += g in place; g is freed."""
        E = self.E
        g_bytes = self.cdt if g_bytes is None else g_bytes
        if g_bytes != 4:
            g32 = E.alloc(f"{label}.fp32", numel * 4)
            E.kernel(f"{label}.to_fp32", nbytes=numel * (g_bytes + 4))
            E.free(g)
            g = g32
        E.kernel(f"{label}.accumulate", nbytes=numel * 12)
        E.free(g)

    def _dropout(self, prefix, x, numel, elem_bytes, grad, out_tid=None):
        """F.dropout with p > 0 (CUDA native_dropout): a new output and a 1-byte mask,
        which is saved. -> (out, mask) or (x, None) when p == 0."""
        if self.dropout == 0.0:
            return x, None
        E = self.E
        out = E.alloc(out_tid or f"{prefix}.out", numel * elem_bytes)
        mask = E.alloc(f"{prefix}.mask", numel)
        if grad:
            E.save(mask)
        E.kernel(prefix, nbytes=numel * (2 * elem_bytes + 1))
        E.drop(mask)
        return out, mask

    def _dropout_backward(self, prefix, mask, dy, numel, elem_bytes, free_input=True):
        E = self.E
        E.use(mask)
        dx = E.alloc(f"{prefix}.dx", numel * elem_bytes)
        E.kernel(f"{prefix}.bwd", nbytes=numel * (2 * elem_bytes + 1))
        E.done(mask)
        if free_input:
            E.free(dy)
        return dx

    def _cast(self, label, t, numel, from_bytes, to_bytes, free_input=True):
        """A dtype cast (autocast's, or the engine's cast of a grad to its input's dtype).
        Returns t unchanged when the dtypes agree."""
        if from_bytes == to_bytes:
            return t
        E = self.E
        out = E.alloc(label, numel * to_bytes)
        E.kernel(label, nbytes=numel * (from_bytes + to_bytes))
        if free_input:
            E.free(t)
        return out


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def describe(workload):
    """A short human summary of a generated workload's meta (gpt or vgg).

    Thread safety: reads the workload only."""
    m = workload.meta
    model = ", ".join(f"{k}={v}" for k, v in m.get("model", {}).items())
    ns = m["compute_ns"]
    lines = [
        f"{workload.name}: {len(workload.ops)} ops",
        f"  model       {model}",
        f"  params      {m['params']:,} ({_gib(m['param_bytes'])}; grads {_gib(m['grad_bytes'])};"
        f" optimizer states {_gib(m['optimizer_state_bytes'])})",
        f"  saved       {_gib(m['saved_bytes_forward'])} in forward"
        + (f" ({_gib(m['saved_bytes_per_layer'])} per layer)" if "saved_bytes_per_layer" in m
           else ""),
        f"  live        peak {_gib(m['peak_live_bytes'])},"
        f" at the end {_gib(m['final_live_bytes'])}",
        f"  compute     {m['compute_ns_total'] / 1e6:.2f} ms (forward {ns['forward'] / 1e6:.2f},"
        f" backward {ns['backward'] / 1e6:.2f}, optimizer {ns['optimizer'] / 1e6:.2f},"
        f" other {ns['other'] / 1e6:.2f}) at {m['tflops']:g} TFLOP/s, {m['hbm_gbps']:g} GB/s",
        f"  FLOPs       {m['flops_total'] / 1e12:.3f} TFLOP",
    ]
    for key in ("card", "pcie_gbps"):
        if key in m:
            lines.append(f"  {key:<11} {m[key]}")
    return "\n".join(lines)
