"""GPT-style training steps generated from shapes: the workload (workload.py) of one step of
a nanoGPT-like decoder in eager PyTorch, tensor by tensor, with what autograd saves.

    generate(layers=12, hidden=768, heads=12, seq=1024, batch=8)  -> Workload
    python3 -m vramswap.bench.gpt --layers 12 --hidden 768 --batch 8 --seq 1024

The model (nanoGPT's GPT-2 layout; bias on every Linear and LayerNorm, lm_head tied to wte):

    x = drop(wte(idx) + wpe(arange(T)))
    per block:  x = x + proj(attention(ln_1(x)));  x = x + fc2(gelu(fc(ln_2(x))))
    loss = cross_entropy(lm_head(ln_f(x)), targets)

Precision. dtype "fp32": no autocast, everything fp32 (matmuls in true fp32: PyTorch leaves
TF32 off for matmuls by default). dtype "bf16"/"fp16": torch.autocast over fp32 parameters
(the AMP recipe nanoGPT uses). Under CUDA autocast a Linear casts its fp32 input to a 2-byte
copy and saves that copy; it casts its weight once per autocast region (the cast cache) and
saves the cast; LayerNorm, softmax, log_softmax run in fp32 (autocast's fp32 list); the
residual stream stays fp32 (fp32 + bf16 promotes). fp16 adds GradScaler's unscale pass.

What eager PyTorch saves for backward, per op (verified on torch 2.x CPU in fp32 by
tests/bench_py/test_generators_torch.py; parameters and 0-dim scalars are left out: a
module holds its parameters, so they are never cold, and scalars are bytes). Order: torch
2.x's generated autograd nodes (tools/autograd/gen_autograd_functions.py) hold an op's saved
inputs sorted by argument name, then its saved outputs sorted by name; the forward saves
them and the backward reads them in that order, not in the order of the op's arguments:
  embedding        the index tensor (idx for wte: the batch, held by the training loop;
                   the positions arange(T) for wpe)
  LayerNorm        its input, mean and rstd (fp32, one per row: 4 bytes x rows each)
  Linear           its input (under autocast the 2-byte cast of it) and its weight (under
                   autocast the weight's cast, a new tensor per autocast region); with a
                   bias, addmm's mat1 (input) then mat2 (weight); without one (lm_head,
                   LoRA's adapters) mm's mat2 (weight) then self (input)
  q @ k^T          matmul reshapes the strided q and k^T views of the qkv output to
                   (B*H, T, D) and (B*H, D, T): both are copies, and bmm saves the copies,
                   mat2 (k^T's) before self (q's)
  * scale          nothing (the scalar is a CPU wrapped number)
  masked_fill      its mask: `bias[:, :, :T, :T] == 0`, a new T x T bool per block
  softmax          its output (fp32 under autocast, after an fp32 cast of its input)
  att @ v          a contiguous copy of v (bmm's mat2), then att (self; under autocast
                   its 2-byte cast)
  y.transpose(1, 2).contiguous()   a copy, saved by proj as its input
  GELU             its input
  dropout          p == 0: nothing (F.dropout returns its input); p > 0: a 1-byte mask
                   (CUDA's fused native_dropout) and a new output
  cross_entropy    log_softmax's output (fp32; nll_loss saves it again) and the targets
  flash attention  (attention="flash": F.scaled_dot_product_attention, flash backend)
                   key, query, value (views of the qkv output: that tensor), logsumexp
                   (B*H*T fp32), its output (which proj saves too); no T x T tensor at
                   all. Its backward allocates dq, dk, dv and, as temporaries, flash-attn
                   2's fp32 dq accumulator and softmax_d. (fp32 runs SDPA's memory-efficient
                   kernel, whose saves and their order are the same; it is modeled the same
                   way.)
The default is attention="eager": it is what nanoGPT runs without SDPA, what Hugging Face's
attn_implementation="eager" does, and the case where saved activations grow with T^2 and
offloading matters most; "flash" is the modern default path, with far smaller saves.

When the forward drops its own reference (the "cold" op), following CPython: an argument
stays referenced by its caller until the call returns, a local until it is rebound.
  - tensors made inside one op (autocast casts of activations, matmul's copies of q, k, v,
    the mask, LayerNorm's mean/rstd, log_softmax inside cross_entropy, dropout masks):
    right after that op;
  - a Linear's input or GELU's input inside the MLP (`x = self.c_fc(x)` rebinds): after the
    op that consumed it; proj's input y: after proj;
  - a module's argument (ln_1's output into attention, ln_2's output into the MLP) and the
    attention's locals (q, k, v: the qkv output; att: the softmax output): at the end of
    that module's forward;
  - the residual stream: the block input is the caller's loop variable until the block
    returns, the mid-block residual is rebound by the block's second add: both at the end
    of the block; the last block's output is rebound by `x = ln_f(x)`: after ln_f;
  - autocast's weight casts: when the autocast region exits (end of the forward, or end of
    a checkpoint's recompute);
  - idx and targets: never (the training loop holds them).
  A tensor that nothing saved is freed at the same point instead.
  logits are dropped after the loss (as torchtitan's `del pred` does; nanoGPT's loop keeps
  them through backward, which would add batch*seq*vocab*2 bytes).

Activation checkpointing ("full": torch.utils.checkpoint around every block, reentrant, so
ctx.save_for_backward hands each block input to the saved-tensor hooks): the forward runs
each block under no_grad (nothing saved inside; its tensors are freed where they would go
cold; autocast still caches the weight casts until the forward ends) and saves the block
input. Backward, per block in reverse: unpack the input, recompute the block under grad and
a fresh autocast region (its tensors saved again, in the backward phase, outside any offload
scope), run the block's backward on them, release the input. The non-reentrant checkpoint
keeps the inputs in its own frame instead, out of reach of saved-tensor hooks.

Microbatches: `microbatches` forward/backward pairs in sequence, each with its own batch of
`batch` sequences; gradients accumulate in place into .grad. Parameters, gradients and
AdamW's exp_avg/exp_avg_sq are allocated first, in an "other" phase, and stay live (the
steady state of a loop that zeroes grads rather than setting them to None). The optimizer
phase is fused AdamW (no temporaries; nanoGPT's choice) or, with optimizer="foreach",
torch's default multi-tensor AdamW, whose sqrt(exp_avg_sq) is a temporary per parameter.
The nanoGPT attention-mask buffer (block_size^2 fp32 per block) is live in eager mode.
The step's peak is usually in the loss's backward: log_softmax's output, nll_loss's grad and
log_softmax's grad are batch * seq * vocab * 4 bytes each, live together.

Compute model (roofline, per kernel): ns = max(flops / tflops, bytes / hbm_gbps). Matmul
FLOPs are 2*m*n*k (backward: twice that, dgrad and wgrad; eager attention computes the full
T x T, flash skips the causal half and its backward is 2.5x its forward); bytes are what a
kernel reads and writes once. Defaults stand for an H100 SXM at realistic efficiency:
  tflops 400 (bf16/fp16: ~40% of the 989 TFLOP/s dense tensor-core peak) and 50 for
         fp32 (~75% of the 67 TFLOP/s FP32 peak; PyTorch keeps TF32 off for matmuls by
         default): assumed efficiencies for eager GEMMs at GPT-2 sizes, not measurements;
  hbm_gbps 2500 (~75% of HBM3's 3350 GB/s), likewise assumed.
  (Peaks: NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s BF16/FP16 dense, 66.9 FP32, 3.35 TB/s.)

Tensor ids are readable strings: "mb<m>.L<l>.<op>.<what>" ("mb0.L3.attn.probs"); a block's
input is "mb<m>.L<l>.x" (made by block l-1), recomputed tensors carry ".rc". The ops every
model shares (Linear, casts, dropout, grad accumulation) are builder.py's, vgg.py's too.

Thread safety: generate() builds fresh objects on the calling thread; nothing is shared.
"""
import argparse
import sys

from .builder import StepBuilder, describe, kDtypeBytes, kIndexBytes

# Defaults of the compute model (see the module docstring for the sources).
kTflopsHalf = 400.0   # bf16/fp16 matmuls on an H100 SXM, realistic for eager PyTorch
kTflopsFp32 = 50.0    # fp32 (no TF32) matmuls on an H100 SXM
kHbmGbps = 2500.0     # sustained HBM3 bandwidth on an H100 SXM
kFlashBackwardRatio = 2.5  # flash-attention backward FLOPs over its forward (5 matmuls vs 2)



class _GPTStep(StepBuilder):
    """One training step, emitted op by op (see the module docstring for the rules)."""

    def __init__(self, layers, hidden, heads, ffn, seq, batch, dtype, checkpointing,
                 microbatches, vocab, tflops, hbm_gbps, optimizer, attention, dropout,
                 lora_rank=0, kept_optimizer=False):
        if checkpointing not in (False, None, "full"):
            raise ValueError(f"checkpointing {checkpointing!r}: expected False or 'full'")
        if attention not in ("eager", "flash"):
            raise ValueError(f"attention {attention!r}: expected 'eager' or 'flash'")
        if optimizer not in (True, False, "fused", "foreach"):
            raise ValueError(f"optimizer {optimizer!r}: expected True, False, 'fused' or "
                             "'foreach'")
        for key, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                           ("ffn", ffn), ("seq", seq), ("batch", batch),
                           ("microbatches", microbatches), ("vocab", vocab)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} {value!r}: expected an integer >= 1")
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
        if not isinstance(lora_rank, int) or lora_rank < 0:
            raise ValueError(f"lora_rank {lora_rank!r}: expected an integer >= 0")
        if lora_rank and dtype == "fp32":
            raise ValueError("lora_rank needs autocast (bf16 or fp16): the frozen weights are kept and used "
                             "by their casts")
        if kept_optimizer and optimizer not in (True, "fused"):
            raise ValueError("kept_optimizer needs the fused AdamW (optimizer True or 'fused')")
        self.L, self.C, self.H, self.F, self.T, self.B = layers, hidden, heads, ffn, seq, batch
        self.V, self.M = vocab, microbatches
        self.N = batch * seq
        self.sdt = 4                            # softmax / log_softmax: fp32 either way
        self.checkpointing = checkpointing or False
        self.attention = attention
        self.optimizer = {True: "fused", False: None}.get(optimizer, optimizer)
        self.kept_optimizer = bool(kept_optimizer)
        self.rank = lora_rank
        if tflops is None:
            tflops = kTflopsFp32 if dtype == "fp32" else kTflopsHalf
        super().__init__(self._name(dtype), dtype, tflops, hbm_gbps, dropout)
        if lora_rank:
            self.frozen = {f"L{layer}.{n}" for layer in range(layers)
                           for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
            self.lora_rank = lora_rank
        self.params = self._param_list()
        # The parameters with a gradient (and optimizer state): all but the frozen Linears'.
        frozen_names = {f"{f}.{wb}" for f in self.frozen for wb in ("w", "b")}
        self.trainable = [(n, k) for n, k in self.params if n not in frozen_names]

    def _name(self, dtype):
        parts = [f"gpt-{self.L}L-{self.C}h-{self.H}a", f"b{self.B}", f"s{self.T}", dtype]
        if self.attention != "eager":
            parts.append(self.attention)
        if self.checkpointing:
            parts.append("ckpt")
        if self.M > 1:
            parts.append(f"mb{self.M}")
        if self.rank:
            parts.append(f"lora{self.rank}")
        if self.kept_optimizer:
            parts.append("kept-adamw")
        return "-".join(parts)

    # -- parameters --------------------------------------------------------------------
    def _param_list(self):
        C, F = self.C, self.F
        ps = [("wte", self.V * C), ("wpe", self.T * C)]
        for layer in range(self.L):
            p = f"L{layer}"
            ps += [(f"{p}.ln_1.w", C), (f"{p}.ln_1.b", C),
                   (f"{p}.attn.qkv.w", 3 * C * C), (f"{p}.attn.qkv.b", 3 * C),
                   (f"{p}.attn.proj.w", C * C), (f"{p}.attn.proj.b", C),
                   (f"{p}.ln_2.w", C), (f"{p}.ln_2.b", C),
                   (f"{p}.mlp.fc.w", F * C), (f"{p}.mlp.fc.b", F),
                   (f"{p}.mlp.proj.w", C * F), (f"{p}.mlp.proj.b", C)]
            if self.rank:
                r = self.rank
                for n, fin, fout in (("attn.qkv", C, 3 * C), ("attn.proj", C, C), ("mlp.fc", C, F),
                                     ("mlp.proj", F, C)):
                    ps += [(f"{p}.{n}.lora_a", fin * r), (f"{p}.{n}.lora_b", r * fout)]
        ps += [("ln_f.w", C), ("ln_f.b", C)]
        return ps

    def _layernorm(self, prefix, x, grad):
        """LayerNorm forward on the fp32 stream. -> (out, mean, rstd)."""
        E, N, C = self.E, self.N, self.C
        out = E.alloc(f"{prefix}.out", N * C * 4)
        mean = E.alloc(f"{prefix}.mean", N * 4)
        rstd = E.alloc(f"{prefix}.rstd", N * 4)
        if grad:
            E.save(x)
            E.save(mean)
            E.save(rstd)
        E.kernel(prefix, nbytes=N * C * 8 + N * 8)
        E.drop(mean)
        E.drop(rstd)
        return out, (x, mean, rstd)

    def _layernorm_backward(self, prefix, saved, dout, release_input=True):
        """-> dx (fp32); frees mean/rstd and (unless the checkpoint holds it) the input."""
        E, N, C = self.E, self.N, self.C
        x, mean, rstd = saved
        for t in saved:
            E.use(t)
        dx = E.alloc(f"{prefix}.dx", N * C * 4)
        dgamma = E.alloc(f"{prefix}.dgamma", C * 4)
        dbeta = E.alloc(f"{prefix}.dbeta", C * 4)
        E.kernel(f"{prefix}.bwd", nbytes=N * C * 12 + N * 8)
        E.done(mean)
        E.done(rstd)
        if release_input:
            E.done(x)
        self._accumulate(f"{prefix}.dgamma", dgamma, C, g_bytes=4)
        self._accumulate(f"{prefix}.dbeta", dbeta, C, g_bytes=4)
        return dx

    # -- one block ---------------------------------------------------------------------
    def _block_forward(self, p, lp, x, out_tid, grad):
        """Block forward: p is the tid prefix, lp the parameter prefix, x the fp32 input.
        grad=False is the checkpointed forward under no_grad. -> (out, saved records)."""
        E, N, C, F, T, B, H = self.E, self.N, self.C, self.F, self.T, self.B, self.H
        c = self.cdt
        s = {}
        ln1, s["ln_1"] = self._layernorm(f"{p}.ln_1", x, grad)
        qkv, s["qkv"] = self._linear(f"{p}.attn.qkv", f"{lp}.attn.qkv", ln1, 4, N, C, 3 * C,
                                     grad)
        bhtt = B * H * T * T
        if self.attention == "eager":
            q = E.alloc(f"{p}.attn.q", N * C * c)    # matmul's reshape copies of the
            k = E.alloc(f"{p}.attn.k", N * C * c)    # strided q and k^T views
            E.kernel(f"{p}.attn.qk_copy", nbytes=4 * N * C * c)
            scores = E.alloc(f"{p}.attn.scores", bhtt * c)
            if grad:                                 # bmm(self=q, mat2=k^T): mat2 first
                E.save(k)
                E.save(q)
            E.kernel(f"{p}.attn.qk", flops=2 * N * T * C, nbytes=2 * N * C * c + bhtt * c)
            E.drop(q)
            E.drop(k)
            scaled = E.alloc(f"{p}.attn.scaled", bhtt * c)
            E.kernel(f"{p}.attn.scale", nbytes=2 * bhtt * c)
            E.free(scores)
            mask = E.alloc(f"{p}.attn.mask", T * T)  # bias[:, :, :T, :T] == 0
            E.kernel(f"{p}.attn.mask", nbytes=T * T * 5)
            masked = E.alloc(f"{p}.attn.masked", bhtt * c)
            if grad:
                E.save(mask)
            E.kernel(f"{p}.attn.masked_fill", nbytes=2 * bhtt * c + T * T)
            E.drop(mask)
            E.free(scaled)
            sm_in = self._cast(f"{p}.attn.softmax_in", masked, bhtt, c, self.sdt,
                               free_input=False)
            probs = E.alloc(f"{p}.attn.probs", bhtt * self.sdt)
            if grad:
                E.save(probs)
            E.kernel(f"{p}.attn.softmax", nbytes=2 * bhtt * self.sdt)
            if sm_in != masked:
                E.free(sm_in)
            E.free(masked)                         # `att = F.softmax(att, dim=-1)`
            att, s["attn_drop"] = self._dropout(f"{p}.attn.drop", probs, bhtt, self.sdt, grad)
            if att != probs:
                E.drop(probs)                      # `att = self.attn_dropout(att)`
            att_mm = self._cast(f"{p}.attn.probs_h", att, bhtt, self.sdt, c, free_input=False)
            v = E.alloc(f"{p}.attn.v", N * C * c)
            E.kernel(f"{p}.attn.v_copy", nbytes=2 * N * C * c)
            av = E.alloc(f"{p}.attn.av", N * C * c)
            if grad:                                 # bmm(self=att, mat2=v): mat2 first
                E.save(v)
                E.save(att_mm)
            E.kernel(f"{p}.attn.av", flops=2 * N * T * C, nbytes=bhtt * c + 2 * N * C * c)
            if att_mm != att:
                E.drop(att_mm)
            E.drop(v)
            y = E.alloc(f"{p}.attn.y", N * C * c)    # transpose(1, 2).contiguous()
            E.kernel(f"{p}.attn.y_copy", nbytes=2 * N * C * c)
            E.free(av)
            s["eager"] = (q, k, mask, probs, att, att_mm, v)
        else:
            y = E.alloc(f"{p}.attn.out", N * C * c)
            lse = E.alloc(f"{p}.attn.lse", B * H * T * 4)
            if grad:                                 # key/query/value, logsumexp, output
                E.save(qkv)
                E.save(lse)
                E.save(y)
            E.kernel(f"{p}.attn.flash", flops=4 * N * T * C // 2,
                     nbytes=4 * N * C * c + B * H * T * 4)
            E.drop(lse)
            s["flash"] = (qkv, lse, y)
        o, s["proj"] = self._linear(f"{p}.attn.proj", f"{lp}.attn.proj", y, c, N, C, C, grad)
        E.drop(y)
        o2, s["resid_drop1"] = self._dropout(f"{p}.attn.resid_drop", o, N * C, c, grad)
        if o2 != o:
            E.free(o)
        # end of the attention module: its argument (ln_1's output) and locals go
        if self.attention == "eager":
            E.drop(att)
        E.drop(qkv)
        E.drop(ln1)
        x_mid = E.alloc(f"{p}.x_mid", N * C * 4)
        E.kernel(f"{p}.add1", nbytes=N * C * (8 + c))
        E.free(o2)
        ln2, s["ln_2"] = self._layernorm(f"{p}.ln_2", x_mid, grad)
        f, s["fc"] = self._linear(f"{p}.mlp.fc", f"{lp}.mlp.fc", ln2, 4, N, C, F, grad)
        g = E.alloc(f"{p}.mlp.gelu", N * F * c)
        if grad:
            E.save(f)
        E.kernel(f"{p}.mlp.gelu", nbytes=2 * N * F * c)
        E.drop(f)
        m, s["fc2"] = self._linear(f"{p}.mlp.proj", f"{lp}.mlp.proj", g, c, N, F, C, grad)
        E.drop(g)
        m2, s["resid_drop2"] = self._dropout(f"{p}.mlp.resid_drop", m, N * C, c, grad)
        if m2 != m:
            E.free(m)
        E.drop(ln2)                                 # the MLP's argument
        out = E.alloc(out_tid, N * C * 4)
        E.kernel(f"{p}.add2", nbytes=N * C * (8 + c))
        E.free(m2)
        E.drop(x_mid)
        s["gelu"] = f
        return out, s

    def _branch_grad(self, cast_label, drop_prefix, drop_mask, dx):
        """The grad a residual branch's last op gets: dx (fp32, kept) cast to the matmul
        dtype, then through the branch's residual dropout when it has one."""
        n, c = self.N * self.C, self.cdt
        d = self._cast(cast_label, dx, n, 4, c, free_input=False)
        if drop_mask is None:
            return d
        return self._dropout_backward(drop_prefix, drop_mask, d, n, c, free_input=d != dx)

    def _block_backward(self, p, s, dx, release_input=True):
        """Backward of one block. dx: the fp32 grad of the block output, the buffer the
        residual grads accumulate into; returns it as the grad of the block input."""
        E, N, C, F, T, B, H = self.E, self.N, self.C, self.F, self.T, self.B, self.H
        c = self.cdt
        bhtt = B * H * T * T
        # x_out = x_mid + mlp(...)
        dm2 = self._branch_grad(f"{p}.add2.dm", f"{p}.mlp.resid_drop", s["resid_drop2"], dx)
        dg = self._linear_backward(s["fc2"], dm2)
        if dm2 != dx:
            E.free(dm2)
        f = s["gelu"]
        E.use(f)
        df = E.alloc(f"{p}.mlp.gelu.dx", N * F * c)
        E.kernel(f"{p}.mlp.gelu.bwd", nbytes=3 * N * F * c)
        E.done(f)
        E.free(dg)
        dln2 = self._linear_backward(s["fc"], df)
        E.free(df)
        dln2 = self._cast(f"{p}.ln_2.dout", dln2, N * C, c, 4)
        dxm = self._layernorm_backward(f"{p}.ln_2", s["ln_2"], dln2)
        E.free(dln2)
        E.kernel(f"{p}.add1.accumulate", nbytes=3 * N * C * 4)
        E.free(dxm)
        # x_mid = x + attention(...)
        do2 = self._branch_grad(f"{p}.add1.do", f"{p}.attn.resid_drop", s["resid_drop1"], dx)
        # flash: proj's input is the attention output, which flash's backward reads too
        dy = self._linear_backward(s["proj"], do2, release_input=self.attention == "eager")
        if do2 != dx:
            E.free(do2)
        if self.attention == "eager":
            q, k, mask, probs, att, att_mm, v = s["eager"]
            dy2 = E.alloc(f"{p}.attn.dy_copy", N * C * c)   # reshape of the transposed grad
            E.kernel(f"{p}.attn.dy_copy", nbytes=2 * N * C * c)
            E.free(dy)
            E.use(v)
            E.use(att_mm)
            datt = E.alloc(f"{p}.attn.av.dprobs", bhtt * c)
            dv = E.alloc(f"{p}.attn.av.dv", N * C * c)
            E.kernel(f"{p}.attn.av.bwd", flops=4 * N * T * C,
                     nbytes=3 * bhtt * c + 3 * N * C * c)
            E.done(v)
            if att_mm != att:
                E.done(att_mm)                  # autocast's 2-byte cast of att
            elif att != probs:
                E.done(att)                     # fp32: the dropout output bmm saved
            E.free(dy2)
            dv_r = E.alloc(f"{p}.attn.dv_view", N * C * c)
            E.kernel(f"{p}.attn.dv_view", nbytes=2 * N * C * c)
            E.free(dv)
            datt = self._cast(f"{p}.attn.dprobs_fp32", datt, bhtt, c, self.sdt)
            if s["attn_drop"] is not None:
                datt = self._dropout_backward(f"{p}.attn.drop", s["attn_drop"], datt, bhtt,
                                              self.sdt)
            E.use(probs)
            dsm = E.alloc(f"{p}.attn.softmax.dx", bhtt * self.sdt)
            E.kernel(f"{p}.attn.softmax.bwd", nbytes=3 * bhtt * self.sdt)
            E.done(probs)
            E.free(datt)
            dsm = self._cast(f"{p}.attn.softmax.dx_h", dsm, bhtt, self.sdt, c)
            E.use(mask)
            dmf = E.alloc(f"{p}.attn.masked_fill.dx", bhtt * c)
            E.kernel(f"{p}.attn.masked_fill.bwd", nbytes=2 * bhtt * c + T * T)
            E.done(mask)
            E.free(dsm)
            dsc = E.alloc(f"{p}.attn.scale.dx", bhtt * c)
            E.kernel(f"{p}.attn.scale.bwd", nbytes=2 * bhtt * c)
            E.free(dmf)
            E.use(k)
            E.use(q)
            dq = E.alloc(f"{p}.attn.qk.dq", N * C * c)
            dk = E.alloc(f"{p}.attn.qk.dk", N * C * c)
            E.kernel(f"{p}.attn.qk.bwd", flops=4 * N * T * C, nbytes=bhtt * c + 4 * N * C * c)
            E.done(k)
            E.done(q)
            E.free(dsc)
            dq_r = E.alloc(f"{p}.attn.dq_view", N * C * c)
            dk_r = E.alloc(f"{p}.attn.dk_view", N * C * c)
            E.kernel(f"{p}.attn.dqk_view", nbytes=4 * N * C * c)
            E.free(dq)
            E.free(dk)
            parts = (dq_r, dk_r, dv_r)
        else:
            qkv, lse, y = s["flash"]
            for t in (qkv, lse, y):
                E.use(t)
            dq = E.alloc(f"{p}.attn.flash.dq", N * C * c)
            dk = E.alloc(f"{p}.attn.flash.dk", N * C * c)
            dv = E.alloc(f"{p}.attn.flash.dv", N * C * c)
            dq_accum = E.alloc(f"{p}.attn.flash.dq_accum", N * C * 4)  # flash-attn 2 bwd
            softmax_d = E.alloc(f"{p}.attn.flash.softmax_d", B * H * T * 4)
            E.kernel(f"{p}.attn.flash.bwd",
                     flops=int(kFlashBackwardRatio * 4 * N * T * C // 2),
                     nbytes=8 * N * C * c + N * C * 8 + B * H * T * 8)
            E.free(dq_accum)
            E.free(softmax_d)
            for t in (qkv, lse, y):
                E.done(t)
            E.free(dy)
            parts = (dq, dk, dv)
        dqkv = E.alloc(f"{p}.attn.dqkv", 3 * N * C * c)      # split's backward: a cat
        E.kernel(f"{p}.attn.split.bwd", nbytes=6 * N * C * c)
        for t in parts:
            E.free(t)
        dln1 = self._linear_backward(s["qkv"], dqkv)
        E.free(dqkv)
        dln1 = self._cast(f"{p}.ln_1.dout", dln1, N * C, c, 4)
        dxi = self._layernorm_backward(f"{p}.ln_1", s["ln_1"], dln1, release_input)
        E.free(dln1)
        E.kernel(f"{p}.add1.accumulate_input", nbytes=3 * N * C * 4)
        E.free(dxi)
        return dx

    # -- the step ----------------------------------------------------------------------
    def build(self):
        E, T = self.E, self.T
        param_count = sum(n for _, n in self.trainable)
        E.phase("other")
        for name, numel in self.params:
            tid = E.alloc(f"param.{name}", numel * 4)
            if name.endswith(".w") and name[:-2] in self.frozen:
                self._kept(tid, True)  # vramswap.offload_frozen: loaded, then cold
        if self.attention == "eager":
            for layer in range(self.L):
                E.alloc(f"buffer.L{layer}.attn.bias", T * T * 4)
        for name, numel in self.trainable:
            E.alloc(f"grad.{name}", numel * 4)
        if self.optimizer:
            for name, numel in self.trainable:
                for state in ("exp_avg", "exp_avg_sq"):
                    tid = E.alloc(f"adamw.{state}.{name}", numel * 4)
                    if self.kept_optimizer:
                        self._kept(tid, False)  # vramswap.offload_optimizer: zeroed, then cold
        E.kernel("zero_grad", nbytes=param_count * 4)
        for m in range(self.M):
            self._microbatch(m)
        if self.optimizer:
            self._optimizer_step(param_count)
        return E.workload

    def _kept(self, tid, frozen):
        """A kept tensor, written once (loaded or zeroed) before the step."""
        E = self.E
        E.keep(tid, frozen)
        E.kuse(tid)
        E.kdone(tid)

    def _microbatch(self, m):
        E, N, C, T, V, L = self.E, self.N, self.C, self.T, self.V, self.L
        c = self.cdt
        mb = f"mb{m}"
        E.phase("other")
        idx = E.alloc(f"{mb}.idx", N * kIndexBytes)          # the batch, copied in
        targets = E.alloc(f"{mb}.targets", N * kIndexBytes)
        E.phase("forward")
        pos = E.alloc(f"{mb}.pos", T * kIndexBytes)
        E.kernel(f"{mb}.arange", nbytes=T * kIndexBytes)
        tok = E.alloc(f"{mb}.wte.out", N * C * 4)
        E.save(idx)
        E.kernel(f"{mb}.wte", nbytes=N * kIndexBytes + 2 * N * C * 4)
        pe = E.alloc(f"{mb}.wpe.out", T * C * 4)
        E.save(pos)
        E.kernel(f"{mb}.wpe", nbytes=T * kIndexBytes + 2 * T * C * 4)
        x0 = E.alloc(f"{mb}.L0.x" if self.dropout == 0.0 else f"{mb}.emb_sum", N * C * 4)
        E.kernel(f"{mb}.emb_add", nbytes=N * C * 8 + T * C * 4)
        x, emb_drop = self._dropout(f"{mb}.emb_drop", x0, N * C, 4, True, out_tid=f"{mb}.L0.x")
        if x != x0:
            E.free(x0)
        # the block inputs: "mb.L<l>.x" is made by block l-1 (block 0's is the embedding)
        saved = []
        for layer in range(L):
            out_tid = f"{mb}.L{layer + 1}.x"
            p = f"{mb}.L{layer}"
            if self.checkpointing:
                E.save(x)                       # ctx.save_for_backward(block input)
                out, _ = self._block_forward(p, f"L{layer}", x, out_tid, grad=False)
                saved.append(x)
            else:
                out, s = self._block_forward(p, f"L{layer}", x, out_tid, grad=True)
                saved.append(s)
            E.drop(x)                           # the caller's loop variable moves on
            x = out
        lnf, lnf_saved = self._layernorm(f"{mb}.ln_f", x, True)
        E.drop(x)                               # `x = self.transformer.ln_f(x)`
        logits, head = self._linear(f"{mb}.lm_head", "wte", lnf, 4, N, C, V, True, bias=False)
        lg_in = self._cast(f"{mb}.loss.logits_fp32", logits, N * V, c, 4, free_input=False)
        logp = E.alloc(f"{mb}.loss.logp", N * V * 4)
        E.save(logp)
        E.kernel(f"{mb}.loss.log_softmax", nbytes=2 * N * V * 4)
        if lg_in != logits:
            E.free(lg_in)
        E.save(targets)
        E.kernel(f"{mb}.loss.nll", nbytes=N * 4 + N * kIndexBytes)
        E.drop(logp)
        E.free(logits)                          # the loop keeps only the loss
        E.drop(lnf)                             # GPT.forward's locals go on return
        E.free(tok)
        E.free(pe)
        E.drop(pos)
        self._autocast_exit()

        E.phase("backward")
        E.use(logp)                             # nll_loss saved its input too
        E.use(targets)
        dlogp = E.alloc(f"{mb}.loss.nll.dx", N * V * 4)
        E.kernel(f"{mb}.loss.nll.bwd", nbytes=N * V * 4 + N * kIndexBytes)
        E.release(targets)
        E.use(logp)
        dlg = E.alloc(f"{mb}.loss.log_softmax.dx", N * V * 4)
        E.kernel(f"{mb}.loss.log_softmax.bwd", nbytes=3 * N * V * 4)
        E.done(logp)
        E.free(dlogp)
        dlg = self._cast(f"{mb}.lm_head.dout", dlg, N * V, 4, c)
        dlnf = self._linear_backward(head, dlg, bias=False)
        E.free(dlg)
        dlnf = self._cast(f"{mb}.ln_f.dout", dlnf, N * C, c, 4)
        dx = self._layernorm_backward(f"{mb}.ln_f", lnf_saved, dlnf)
        E.free(dlnf)
        for layer in reversed(range(L)):
            p = f"{mb}.L{layer}"
            if self.checkpointing:
                xin = saved[layer]
                E.use(xin)                      # ctx.saved_tensors in the checkpoint's bwd
                rp = f"{p}.rc"
                out, s = self._block_forward(rp, f"L{layer}", xin, f"{rp}.x_out", grad=True)
                self._autocast_exit()
                dx = self._block_backward(rp, s, dx, release_input=False)
                E.free(out)
                E.done(xin)
            else:
                dx = self._block_backward(p, saved[layer], dx)
        if emb_drop is not None:
            dx = self._dropout_backward(f"{mb}.emb_drop", emb_drop, dx, N * C, 4)
        # emb_sum = wte(idx) + wpe(pos): the position grad is summed over the batch
        dpe = E.alloc(f"{mb}.wpe.dout", T * C * 4)
        E.kernel(f"{mb}.emb_add.bwd", nbytes=N * C * 4 + T * C * 4)
        E.use(pos)
        dwpe = E.alloc(f"{mb}.wpe.dw", T * C * 4)
        E.kernel(f"{mb}.wpe.bwd", nbytes=T * C * 8 + T * kIndexBytes)
        E.done(pos)
        E.free(dpe)
        self._accumulate(f"{mb}.wpe.dw", dwpe, T * C, g_bytes=4)
        E.use(idx)
        dwte = E.alloc(f"{mb}.wte.dw", V * C * 4)       # embedding_dense_backward
        E.kernel(f"{mb}.wte.bwd", nbytes=V * C * 4 + N * C * 8 + N * kIndexBytes)
        E.release(idx)
        E.free(dx)
        self._accumulate(f"{mb}.wte.dw", dwte, V * C, g_bytes=4)
        E.phase("other")
        E.free(idx)
        E.free(targets)

    def _optimizer_step(self, param_count):
        E = self.E
        E.phase("optimizer")
        if self.dtype == "fp16":
            E.kernel("grad_scaler.unscale", nbytes=param_count * 8)
        if self.optimizer == "fused" and self.kept_optimizer:
            # vramswap.offload_optimizer: step() per chunk of parameters (here one layer's, and
            # the embeddings and the final norm apart), each chunk's state used around it
            chunks = {}
            for name, numel in self.trainable:
                chunks.setdefault(name.split(".")[0] if name.startswith("L") else name, []).append((name, numel))
            for key, group in chunks.items():
                states = [f"adamw.{s}.{n}" for n, _ in group for s in ("exp_avg", "exp_avg_sq")]
                for t in states:
                    E.kuse(t)
                E.kernel(f"adamw.fused.{key}", nbytes=sum(k for _, k in group) * 28)
                for t in states:
                    E.kdone(t)
            return
        if self.optimizer == "fused":
            # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
            E.kernel("adamw.fused", nbytes=param_count * 28)
            return
        # torch's multi-tensor AdamW: decay, lerp, mul, addcmul, then sqrt(exp_avg_sq) into
        # a new tensor per parameter, div_, add_, addcdiv_ into the params
        E.kernel("adamw.foreach.moments", nbytes=param_count * 4 * 10)
        temps = [E.alloc(f"adamw.denom.{name}", numel * 4) for name, numel in self.trainable]
        E.kernel("adamw.foreach.denom", nbytes=param_count * 4 * 6)
        E.kernel("adamw.foreach.update", nbytes=param_count * 4 * 4)
        for t in temps:
            E.free(t)


def _saved_facts(workload, layer_prefix):
    """-> (forward saved bytes, one layer's forward saved bytes, saved bytes by phase)."""
    sizes, phase, layer = {}, "other", 0
    for op in workload.ops:
        if op[0] == "phase":
            phase = op[1]
        elif op[0] == "alloc":
            sizes[op[1]] = op[2]
        elif (op[0] == "save" and phase == "forward" and op[1].startswith(layer_prefix)
              and ".rc." not in op[1]):
            layer += sizes[op[1]]
    by_phase = workload.saved_bytes_by_phase()
    return by_phase["forward"], layer, by_phase


def generate(layers=12, hidden=768, heads=12, ffn=None, seq=1024, batch=8, dtype="bf16",
             checkpointing=False, microbatches=1, vocab=50257, tflops=None,
             hbm_gbps=kHbmGbps, optimizer=True, attention="eager", dropout=0.0, lora_rank=0,
             kept_optimizer=False):
    """One training step of a GPT-style decoder as a Workload (the module docstring gives
    the model, the saved-tensor rules and the compute model).

    ffn: MLP width (default 4 * hidden). seq: tokens per sequence (also wpe's block size).
    batch: sequences per microbatch. dtype: "bf16"/"fp16" (autocast over fp32 parameters)
    or "fp32". checkpointing: False or "full" (every block). tflops: None picks 400 for
    bf16/fp16, 50 for fp32. optimizer: True (fused AdamW), "foreach", or False (no
    optimizer states, no optimizer phase). attention: "eager" or "flash". dropout: p of
    every dropout site (0: none). lora_rank: r > 0 freezes the four Linears of every block
    (weights kept frozen, as vramswap.offload_frozen keeps them; bf16/fp16 only: a frozen
    weight is read by its cast) and adds trainable rank-r adapters to each; the embeddings
    and norms stay trainable. kept_optimizer: AdamW's state is kept (vramswap.offload_optimizer)
    and the fused step runs per layer, each layer's state used around its chunk.

    workload.meta carries the shape facts: params, bytes of params/grads/optimizer states,
    saved bytes (forward, per layer), FLOPs and compute ns by phase, peak and final live
    bytes. Deterministic: equal arguments give equal ops.

    Thread safety: builds fresh objects; calls on different threads do not interact."""
    ffn = 4 * hidden if ffn is None else ffn
    step = _GPTStep(layers, hidden, heads, ffn, seq, batch, dtype, checkpointing,
                    microbatches, vocab, tflops, hbm_gbps, optimizer, attention, dropout,
                    lora_rank, kept_optimizer)
    wl = step.build()
    fwd_saved, layer_saved, by_phase = _saved_facts(wl, "mb0.L0.")
    wl.meta.update({
        "source": "gpt",
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "ffn": ffn,
                  "seq": seq, "batch": batch, "vocab": vocab, "dtype": dtype,
                  "checkpointing": step.checkpointing, "microbatches": microbatches,
                  "attention": attention, "dropout": dropout,
                  "optimizer": step.optimizer or "none", "lora_rank": lora_rank,
                  "kept_optimizer": bool(kept_optimizer)},
        **step.step_meta(wl, 8 if step.optimizer else 0),  # AdamW: exp_avg, exp_avg_sq
        "saved_bytes_forward": fwd_saved,
        "saved_bytes_forward_per_microbatch": fwd_saved // microbatches,
        "saved_bytes_per_layer": layer_saved,
        "saved_bytes_by_phase": by_phase,
    })
    return wl


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m vramswap.bench.gpt",
                                 description="Summarize a generated GPT training step.")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dtype", choices=sorted(kDtypeBytes), default="bf16")
    ap.add_argument("--checkpointing", choices=["none", "full"], default="none")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--attention", choices=["eager", "flash"], default="eager")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--optimizer", choices=["fused", "foreach", "none"], default="fused")
    ap.add_argument("--tflops", type=float, default=None)
    ap.add_argument("--hbm-gbps", type=float, default=kHbmGbps)
    a = ap.parse_args(argv)
    wl = generate(layers=a.layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, seq=a.seq,
                  batch=a.batch, dtype=a.dtype,
                  checkpointing="full" if a.checkpointing == "full" else False,
                  microbatches=a.microbatches, vocab=a.vocab, tflops=a.tflops,
                  hbm_gbps=a.hbm_gbps,
                  optimizer=False if a.optimizer == "none" else a.optimizer,
                  attention=a.attention, dropout=a.dropout)
    wl.validate()
    print(describe(wl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
