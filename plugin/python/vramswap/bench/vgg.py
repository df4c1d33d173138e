"""VGG-16 training steps generated from shapes: the vDNN case (Rhu et al., "vDNN:
Virtualized Deep Neural Networks for Scalable, Memory-Efficient Neural Network Design",
MICRO-49, 2016, arXiv:1602.08124), as eager PyTorch runs torchvision's vgg16.

    generate(batch=128)  -> Workload
    python3 -m vramswap.bench.vgg --batch 256

The model: torchvision's vgg16 (configuration "D", no batch norm) on 224 x 224 ImageNet
images: 13 conv3x3 (padding 1) each followed by an in-place ReLU, 5 max-pools (2x2, stride
2), AdaptiveAvgPool2d((7, 7)), then Linear(25088, 4096), ReLU, Dropout(0.5), Linear(4096,
4096), ReLU, Dropout(0.5), Linear(4096, 1000), and cross_entropy. 138,357,544 parameters.

What autograd saves (checked on torch 2.x CPU by tests/bench_py/test_generators_torch.py):
  conv             its input (the previous ReLU's output, or a pool's) and its weight
  ReLU(inplace)    its result: the conv output itself, which the next conv or pool saves
                   too (one tensor, saved once, used by both backwards)
  max_pool2d       its input (the same conv output again) and the int64 indices (8 bytes
                   per output element: twice the pool output in fp32)
  adaptive avgpool its input
  Linear, ReLU     as above; dropout(p=0.5) a 1-byte mask (CUDA's fused native_dropout)
  cross_entropy    log_softmax's output and the labels
Parameters are not emitted as saves (the module holds them). dtype "bf16"/"fp16" is
autocast over fp32 parameters (conv and Linear compute in 2 bytes on casts of the images and
the weights; log_softmax in fp32); the default "fp32" is what vDNN measured.

Cold points (CPython: a local lives until rebound, an argument until the call returns):
nn.Sequential rebinds its `input` after every module, so a conv/pool output goes cold after
the module that consumed it (the in-place ReLU returns the same tensor); the images and
labels never (the training loop holds them); pool indices and dropout masks right after
their op; pool5's output after the avgpool; the avgpool output, the classifier's argument,
when the classifier returns. The logits are kept by the loop until the step ends (the
torchvision reference computes accuracy from them after optimizer.step()).

Memory left out: cuDNN's convolution workspaces. Their size depends on the algorithm cuDNN
picks per layer and per version (zero for implicit GEMM, hundreds of MB for FFT or
Winograd variants), so no size here would be justified; the vDNN paper's "28 GB at batch
256" includes the workspaces of the performance-optimal algorithms, this model does not.

Optimizer: SGD with momentum (the torchvision ImageNet recipe), fused: one momentum buffer
per parameter, live from the start with the parameters and their gradients; no temporaries.

Compute model (builder.py's roofline, per kernel ns = max(flops / tflops, bytes / hbm_gbps)):
conv FLOPs 2 * B * H * W * Cout * Cin * 9 forward, twice that backward (conv1_1 computes no
input grad: the images need none). Defaults are the card vDNN used, a GeForce GTX Titan X
(Maxwell GM200, 12 GB):
  tflops   6.1  = 3072 CUDA cores x 2 FLOP x 1.0 GHz base clock (6.6 at the 1075 MHz
                  boost clock; NVIDIA quoted "7 TFLOPS"); HotHardware's and techPowerUp's
                  spec sheets of March 2015. A nominal peak: cuDNN reaches less, so compute
                  times are optimistic.
  hbm_gbps 336.5 = 384-bit GDDR5 at 7 Gbps (same spec sheets); the parameter keeps the
                  HBM name of builder.py although the card has GDDR5.
  meta["pcie_gbps"] 12: PCIe 3.0 x16 (15.75 GB/s raw); pinned host-to-device copies reach
                  about 11-12 GB/s on a Titan X (NVIDIA developer forum, "How to Optimize
                  Data Transfers in CUDA C/C++", a reader's measurement of 11 GB/s).
  meta["card_bytes"] 12 GiB (12288 MiB GDDR5).

Thread safety: generate() builds fresh objects on the calling thread; nothing is shared.
"""
import argparse
import sys

from .builder import StepBuilder, describe, kDtypeBytes, kIndexBytes

kTitanXTflops = 6.1        # fp32 peak at the base clock (see the module docstring)
kTitanXGbps = 336.5        # GDDR5 bandwidth
kTitanXPcieGbps = 12.0     # pinned copies over PCIe 3.0 x16
kTitanXBytes = 12 * 2**30  # 12288 MiB

# torchvision's cfgs["D"]: output channels of each conv, "M" a 2x2 max-pool
kVgg16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
          512, 512, 512, "M")
kPoolOut = 7               # AdaptiveAvgPool2d((7, 7))
kHidden = 4096


class _VGGStep(StepBuilder):
    """One VGG-16 training step, emitted op by op."""

    def __init__(self, batch, dtype, tflops, hbm_gbps, image, classes, dropout, optimizer):
        for key, value in (("batch", batch), ("image", image), ("classes", classes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} {value!r}: expected an integer >= 1")
        if image % 32:
            raise ValueError(f"image {image}: expected a multiple of 32 (five 2x2 pools)")
        name = f"vgg16-b{batch}-{dtype}" + (f"-{image}px" if image != 224 else "")
        super().__init__(name, dtype, tflops, hbm_gbps, dropout)
        self.B, self.S, self.K = batch, image, classes
        self.optimizer = bool(optimizer)
        self.dt = kDtypeBytes[dtype]    # activation bytes (2 under autocast)
        self.params = self._param_list()

    def _param_list(self):
        ps, cin, i, stage = [], 3, 0, 1
        for v in kVgg16:
            if v == "M":
                stage, i = stage + 1, 0
                continue
            i += 1
            ps += [(f"conv{stage}_{i}.w", v * cin * 9), (f"conv{stage}_{i}.b", v)]
            cin = v
        flat = 512 * kPoolOut * kPoolOut
        for j, (fin, fout) in enumerate(((flat, kHidden), (kHidden, kHidden),
                                         (kHidden, self.K)), 1):
            ps += [(f"fc{j}.w", fin * fout), (f"fc{j}.b", fout)]
        return ps

    def build(self):
        E, B, S, K = self.E, self.B, self.S, self.K
        dt, c = self.dt, self.cdt
        param_count = sum(n for _, n in self.params)
        E.phase("other")
        for name, numel in self.params:
            E.alloc(f"param.{name}", numel * 4)
        for name, numel in self.params:
            E.alloc(f"grad.{name}", numel * 4)
        if self.optimizer:
            for name, numel in self.params:
                E.alloc(f"sgd.momentum.{name}", numel * 4)
        E.kernel("zero_grad", nbytes=param_count * 4)
        images = E.alloc("mb0.images", B * 3 * S * S * 4)
        labels = E.alloc("mb0.labels", B * kIndexBytes)

        # -- forward ---------------------------------------------------------------------
        E.phase("forward")
        layers = []        # per conv/pool, what its backward reads
        x, x_bytes, cin, hw, stage, i = images, 4, 3, S, 1, 0
        for v in kVgg16:
            if v == "M":
                p = f"mb0.pool{stage}"
                numel = B * cin * (hw // 2) ** 2
                out = E.alloc(f"{p}.out", numel * dt)
                idx = E.alloc(f"{p}.indices", numel * kIndexBytes)
                E.save(x)                       # already saved by the ReLU before it
                E.save(idx)
                E.kernel(p, nbytes=numel * (4 * dt + dt + kIndexBytes))
                E.drop(idx)
                E.drop(x)                       # Sequential rebinds its input
                layers.append(("pool", p, x, idx, numel, cin, hw))
                x, hw, stage, i = out, hw // 2, stage + 1, 0
                continue
            i += 1
            p = f"mb0.conv{stage}_{i}"
            param = f"conv{stage}_{i}"
            numel_in, numel_out = B * cin * hw * hw, B * v * hw * hw
            xin = self._cast(f"{p}.in_cast", x, numel_in, x_bytes, c, free_input=False)
            w = self._weight(p, param, v * cin * 9, v)
            out = E.alloc(f"{p}.out", numel_out * dt)
            E.save(xin)
            if w is not None:
                E.save(w)
            E.kernel(p, flops=2 * B * hw * hw * v * cin * 9,
                     nbytes=(numel_in + numel_out + v * cin * 9) * c)
            if xin != x:
                E.drop(xin)                     # autocast's cast of the images
            if x != images:
                E.drop(x)
            E.save(out)                         # relu_ saves its result: the conv output
            E.kernel(f"{p}.relu", nbytes=2 * numel_out * dt)
            # who releases the saved input: the loop (images), this conv (autocast's cast,
            # a pool output), or the previous conv's ReLU (a conv output)
            owner = ("images" if xin == images else "self" if xin != x or i == 1 else "relu")
            layers.append(("conv", p, param, xin, w, owner, out, numel_in, numel_out, cin, v, hw))
            x, x_bytes, cin = out, dt, v
        pool5 = x
        flat = 512 * kPoolOut * kPoolOut
        avg = E.alloc("mb0.avgpool.out", B * flat * dt)
        E.save(pool5)
        E.kernel("mb0.avgpool", nbytes=(B * cin * hw * hw + B * flat) * dt)
        E.drop(pool5)                           # `x = self.avgpool(x)`
        fcs, x = [], avg
        for j, (fin, fout) in enumerate(((flat, kHidden), (kHidden, kHidden), (kHidden, K)), 1):
            out, rec = self._linear(f"mb0.fc{j}", f"fc{j}", x, dt, B, fin, fout, True)
            if x != avg:
                E.drop(x)                       # Sequential rebinds its input
            if j == 3:
                fcs.append((rec, None, None))
                x = out
                break
            E.save(out)                         # ReLU(inplace=True)
            E.kernel(f"mb0.fc{j}.relu", nbytes=2 * B * fout * dt)
            d, mask = self._dropout(f"mb0.drop{j}", out, B * fout, dt, True)
            if d != out:
                E.drop(out)
            fcs.append((rec, out, mask))
            x = d
        logits = x
        E.drop(avg)                             # the classifier's argument
        lg = self._cast("mb0.loss.logits_fp32", logits, B * K, dt, 4, free_input=False)
        logp = E.alloc("mb0.loss.logp", B * K * 4)
        E.save(logp)
        E.kernel("mb0.loss.log_softmax", nbytes=2 * B * K * 4)
        if lg != logits:
            E.free(lg)
        E.save(labels)
        E.kernel("mb0.loss.nll", nbytes=B * 4 + B * kIndexBytes)
        E.drop(logp)
        self._autocast_exit()

        # -- backward --------------------------------------------------------------------
        E.phase("backward")
        E.use(logp)                             # nll_loss saved its input too
        E.use(labels)
        dlogp = E.alloc("mb0.loss.nll.dx", B * K * 4)
        E.kernel("mb0.loss.nll.bwd", nbytes=B * K * 4 + B * kIndexBytes)
        E.release(labels)
        E.use(logp)
        dy = E.alloc("mb0.loss.log_softmax.dx", B * K * 4)
        E.kernel("mb0.loss.log_softmax.bwd", nbytes=3 * B * K * 4)
        E.done(logp)
        E.free(dlogp)
        dy = self._cast("mb0.fc3.dout", dy, B * K, 4, dt)
        def mask_before(j):
            return fcs[j - 2][2] is not None

        for j in (3, 2, 1):
            rec, relu_out, mask = fcs[j - 1]
            if relu_out is not None:
                n = B * rec.fout
                if mask is not None:
                    dy = self._dropout_backward(f"mb0.drop{j}", mask, dy, n, dt)
                E.use(relu_out)
                dr = E.alloc(f"mb0.fc{j}.relu.dx", n * dt)
                E.kernel(f"mb0.fc{j}.relu.bwd", nbytes=3 * n * dt)
                E.done(relu_out)
                E.free(dy)
                dy = dr
            # with p == 0 the previous ReLU's output is this Linear's input: its ReLU's
            # backward releases it
            dx = self._linear_backward(rec, dy, release_input=j == 1 or mask_before(j))
            E.free(dy)
            dy = dx
        # dy: grad of the avgpool output
        E.use(pool5)
        n5 = B * cin * hw * hw
        dx = E.alloc("mb0.avgpool.dx", n5 * dt)
        E.kernel("mb0.avgpool.bwd", nbytes=(B * flat + n5) * dt)
        E.done(pool5)
        E.free(dy)
        dy = dx
        for layer in reversed(layers):
            if layer[0] == "pool":
                _, p, a, idx, numel, ch, size = layer
                E.use(a)
                E.use(idx)
                dx = E.alloc(f"{p}.dx", B * ch * size * size * dt)
                E.kernel(f"{p}.bwd", nbytes=B * ch * size * size * dt
                         + numel * (dt + kIndexBytes))
                E.done(idx)                     # the conv output goes at its ReLU's bwd
                E.free(dy)
                dy = dx
                continue
            _, p, param, xin, w, owner, out, numel_in, numel_out, ch_in, ch_out, size = layer
            E.use(out)                          # ReLU's backward: threshold_backward
            dr = E.alloc(f"{p}.relu.dx", numel_out * dt)
            E.kernel(f"{p}.relu.bwd", nbytes=3 * numel_out * dt)
            E.done(out)
            E.free(dy)
            E.use(xin)
            if w is not None:
                E.use(w)
            first = p == "mb0.conv1_1"     # the images need no grad
            dx = None if first else E.alloc(f"{p}.dx", numel_in * dt)
            dw = E.alloc(f"{p}.dw", ch_out * ch_in * 9 * c)
            db = E.alloc(f"{p}.db", ch_out * c)
            mm = 2 * B * size * size * ch_out * ch_in * 9
            E.kernel(f"{p}.bwd", flops=mm if first else 2 * mm,
                     nbytes=(numel_out + (numel_in if first else 2 * numel_in)
                             + 2 * ch_out * ch_in * 9) * c)
            if owner == "images":
                E.release(images)               # the loop frees it after the step
            elif owner == "self":
                E.done(xin)
            if w is not None:
                E.done(w)
            self._accumulate(f"{p}.dw", dw, ch_out * ch_in * 9)
            self._accumulate(f"{p}.db", db, ch_out)
            E.free(dr)
            dy = dx
        E.phase("other")
        E.free(logits)
        E.free(images)
        E.free(labels)
        if self.optimizer:
            E.phase("optimizer")
            # read param, grad, momentum; write param, momentum
            E.kernel("sgd.fused", nbytes=param_count * 20)
        return E.workload


def generate(batch=128, dtype="fp32", tflops=kTitanXTflops, hbm_gbps=kTitanXGbps,
             image=224, classes=1000, dropout=0.5, optimizer=True):
    """One VGG-16 training step as a Workload (the module docstring gives the model, the
    saved-tensor rules, the compute model and the sources of the Titan X defaults).

    image: side of the square input (a multiple of 32; 224 for ImageNet). dropout: p of the
    classifier's two Dropout layers (0: none). optimizer: SGD with momentum (True) or
    nothing (False). workload.meta carries the shape facts and the card (card_bytes,
    pcie_gbps). Deterministic: equal arguments give equal ops.

    Thread safety: builds fresh objects; calls on different threads do not interact."""
    step = _VGGStep(batch, dtype, tflops, hbm_gbps, image, classes, dropout, optimizer)
    wl = step.build()
    saved_fwd = wl.saved_bytes_by_phase()["forward"]
    wl.meta.update({
        "source": "vgg",
        "model": {"net": "vgg16", "batch": batch, "image": image, "classes": classes,
                  "dtype": dtype, "dropout": dropout,
                  "optimizer": "sgd-momentum" if optimizer else "none"},
        **step.step_meta(wl, 4 if optimizer else 0),  # SGD: one momentum buffer
        "card": "GeForce GTX Titan X (Maxwell), 12 GiB", "card_bytes": kTitanXBytes,
        "pcie_gbps": kTitanXPcieGbps,
        "saved_bytes_forward": saved_fwd,
    })
    return wl


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m vramswap.bench.vgg",
                                 description="Summarize a generated VGG-16 training step.")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(kDtypeBytes), default="fp32")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--no-optimizer", action="store_true")
    ap.add_argument("--tflops", type=float, default=kTitanXTflops)
    ap.add_argument("--hbm-gbps", type=float, default=kTitanXGbps)
    a = ap.parse_args(argv)
    wl = generate(batch=a.batch, dtype=a.dtype, tflops=a.tflops, hbm_gbps=a.hbm_gbps,
                  image=a.image, dropout=a.dropout, optimizer=not a.no_optimizer)
    wl.validate()
    print(describe(wl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
