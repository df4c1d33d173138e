#!/usr/bin/python3
"""Cross-check of the workload generators (vramswap.bench.gpt, vramswap.bench.vgg) against
real autograd: tiny configurations run on torch's CPU in fp32 under
torch.autograd.graph.saved_tensors_hooks, which see every tensor autograd saves.

For each model the test compares, with the generator's workload of the same shapes:
  - the bytes of the distinct storages saved in the forward (parameters and 0-dim scalars
    left out, as the generators leave them out), in total and for the first block;
  - the order of the saves (the sizes of the storages, in the order they were first saved);
  - the order in which backward first reads each of them (unpack vs the "use" ops).
Cases: GPT eager attention, with and without reentrant activation checkpointing (the
variant gpt.py models), GPT with F.scaled_dot_product_attention (the CPU runs its flash
kernel, whose saves are CUDA's flash and memory-efficient kernels': query, key, value,
logsumexp, output), and VGG-16 on 32 x 32 images.

What the CPU cannot show and the test therefore does not check: CUDA autocast's casts
(the CPU autocast lists differ) and dropout with p > 0 (the CPU saves a mask in the input's
dtype, CUDA's fused kernel a 1-byte one): the models run in fp32 with p = 0. Nor which of
two saves of one size by one op comes first (bmm's copies of q and k^T): the sizes and the
first uses read the same either way.

Usage: /usr/bin/python3 tests/bench_py/test_generators_torch.py   (exit status 0: every
check held, or torch is missing and the test is skipped; 1: a check failed). ~10 s.
"""
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugin" / "python"))

try:
    import torch
    import torch.utils.checkpoint
except ImportError:
    print("skip: torch is not importable by this python (try /usr/bin/python3)")
    sys.exit(0)

from vramswap.bench import gpt, vgg  # noqa: E402

failures = []


def check(name, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))
    if not ok:
        failures.append(name)


class SavedRecorder:
    """Saved-tensor hooks that record each saved storage once (first save), its bytes, and
    the order backward first unpacks them. Parameters and 0-dim tensors are ignored."""

    def __init__(self, params):
        self.param_ptrs = {p.data_ptr() for p in params}
        self.storages = []      # [(data_ptr, nbytes)] in first-save order
        self.index = {}         # data_ptr -> position in storages
        self.first_unpack = []  # positions, in first-unpack order
        self.mark = None        # a label attached to saves while set (the first block)
        self.marked = set()

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if t.dim() == 0 or ptr in self.param_ptrs:
            return (None, t)
        if ptr not in self.index:
            self.index[ptr] = len(self.storages)
            self.storages.append((ptr, t.untyped_storage().nbytes()))
            if self.mark:
                self.marked.add(self.index[ptr])
        return (self.index[ptr], t)

    def unpack(self, packed):
        pos, t = packed
        if pos is not None and pos not in self.first_unpack:
            self.first_unpack.append(pos)
        return t

    def total(self):
        return sum(n for _, n in self.storages)

    def marked_bytes(self):
        return sum(self.storages[i][1] for i in self.marked)


def workload_facts(wl):
    """-> (sizes of forward saves in order, forward positions in first-use order)."""
    sizes, order, pos, uses, phase = {}, [], {}, [], "other"
    for op in wl.ops:
        if op[0] == "phase":
            phase = op[1]
        elif op[0] == "alloc":
            sizes[op[1]] = op[2]
        elif op[0] == "save" and phase == "forward":
            pos[op[1]] = len(order)
            order.append(sizes[op[1]])
        elif op[0] == "use" and op[1] in pos and pos[op[1]] not in uses:
            uses.append(pos[op[1]])
    return order, uses


# -- GPT --------------------------------------------------------------------------------
L, C, H, F, T, B, V = 2, 32, 4, 128, 16, 2, 64


def build_gpt(flash=False):
    """nanoGPT's layout in plain torch: explicit attention with a tril bias buffer, or
    (flash) F.scaled_dot_product_attention with is_causal, as nanoGPT runs it on torch 2."""
    nn, Fn = torch.nn, torch.nn.functional
    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

        def forward(self, x):
            b, t, c = x.size()
            q, k, v = self.c_attn(x).split(C, dim=2)
            q = q.view(b, t, H, c // H).transpose(1, 2)
            k = k.view(b, t, H, c // H).transpose(1, 2)
            v = v.view(b, t, H, c // H).transpose(1, 2)
            if flash:
                y = Fn.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
                y = y.transpose(1, 2).contiguous().view(b, t, c)
                return Fn.dropout(self.c_proj(y), p=0.0, training=True)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            att = Fn.softmax(att, dim=-1)
            att = Fn.dropout(att, p=0.0, training=True)
            y = att @ v
            y = y.transpose(1, 2).contiguous().view(b, t, c)
            return Fn.dropout(self.c_proj(y), p=0.0, training=True)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(C, F)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(F, C)

        def forward(self, x):
            x = self.c_fc(x)
            x = self.gelu(x)
            x = self.c_proj(x)
            return Fn.dropout(x, p=0.0, training=True)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(C), Attention()
            self.ln_2, self.mlp = nn.LayerNorm(C), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, V, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, targets, checkpoint=False):
            pos = torch.arange(0, idx.size(1), dtype=torch.long)
            x = Fn.dropout(self.wte(idx) + self.wpe(pos), p=0.0, training=True)
            for block in self.h:
                if checkpoint:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
                else:
                    x = block(x)
            x = self.ln_f(x)
            logits = self.lm_head(x)
            return Fn.cross_entropy(logits.view(-1, V), targets.view(-1))

    return GPT()


def run_gpt(checkpoint, flash=False):
    model = build_gpt(flash)
    rec = SavedRecorder(list(model.parameters()) + list(model.buffers()))
    model.h[0].register_forward_pre_hook(lambda *a: setattr(rec, "mark", "L0"))
    model.h[0].register_forward_hook(lambda *a: setattr(rec, "mark", None))
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
        loss = model(idx, targets, checkpoint)
    loss.backward()
    return rec


def check_gpt(checkpoint, flash=False):
    case = "gpt" + ("-flash" if flash else "") + ("-ckpt" if checkpoint else "")
    rec = run_gpt(checkpoint, flash)
    wl = gpt.generate(layers=L, hidden=C, heads=H, ffn=F, seq=T, batch=B, vocab=V,
                      dtype="fp32", checkpointing="full" if checkpoint else False,
                      attention="flash" if flash else "eager")
    wl.validate()
    check(f"{case}: forward saved bytes, torch {rec.total()} == generator "
          f"{wl.meta['saved_bytes_forward']}", rec.total() == wl.meta["saved_bytes_forward"])
    if not checkpoint:  # checkpointed, block 0's input is saved before block 0 runs
        check(f"{case}: block 0 saved bytes, torch {rec.marked_bytes()} == generator "
              f"{wl.meta['saved_bytes_per_layer']}",
              rec.marked_bytes() == wl.meta["saved_bytes_per_layer"])
    order, uses = workload_facts(wl)
    torch_order = [n for _, n in rec.storages]
    check(f"{case}: save order by size ({len(order)} tensors)", torch_order == order,
          f"torch {torch_order} generator {order}")
    check(f"{case}: backward's first-use order", rec.first_unpack == uses,
          f"torch {rec.first_unpack} generator {uses}")


# -- VGG ----------------------------------------------------------------------------------
def build_vgg():
    """torchvision's vgg16 (cfg D, no batch norm) in plain torch, dropout p = 0."""
    nn = torch.nn
    torch.manual_seed(0)
    layers, cin = [], 3
    for v in vgg.kVgg16:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(cin, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            cin = v

    class VGG(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(*layers)
            self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
            self.classifier = nn.Sequential(
                nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(p=0.0),
                nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(p=0.0),
                nn.Linear(4096, 1000))

        def forward(self, x):
            x = self.features(x)
            x = self.avgpool(x)
            x = torch.flatten(x, 1)
            return self.classifier(x)

    return VGG()


def check_vgg():
    batch, image = 2, 32
    model = build_vgg()
    rec = SavedRecorder(model.parameters())
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, 1000, (batch,))
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    wl = vgg.generate(batch=batch, image=image, dropout=0.0)
    wl.validate()
    check(f"vgg: forward saved bytes, torch {rec.total()} == generator "
          f"{wl.meta['saved_bytes_forward']}", rec.total() == wl.meta["saved_bytes_forward"])
    order, uses = workload_facts(wl)
    torch_order = [n for _, n in rec.storages]
    check(f"vgg: save order by size ({len(order)} tensors)", torch_order == order,
          f"torch {torch_order} generator {order}")
    check("vgg: backward's first-use order", rec.first_unpack == uses,
          f"torch {rec.first_unpack} generator {uses}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    check_gpt(checkpoint=False)
    check_gpt(checkpoint=True)
    check_gpt(checkpoint=False, flash=True)
    check_vgg()
    print(f"{'FAIL' if failures else 'ok'}: {len(failures)} failed")
    sys.exit(1 if failures else 0)
