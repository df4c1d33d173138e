#!/usr/bin/python3
"""A plain torch 2.x training script (no vramswap in it), for the torch 2 feature tests: a
small GPT-2-style language model trained with AdamW for a few steps, the forward run with
one torch 2 feature (--feature).

    tokens -> token + position embedding -> --layers x Block -> LayerNorm -> head tied to the
    token embedding -> cross-entropy (inside the model's forward, as GPT-2's, so that the
    logits are saved inside the outermost module)

    Block(x):  x = x + proj(scaled_dot_product_attention(q, k, v, is_causal=True))
               x = x + fc2(gelu(fc1(LayerNorm(x)), tanh))    (q, k, v from LayerNorm(x))

Features:
  eager        the model as it is (attention through F.scaled_dot_product_attention)
  compile      every block compiled, block.compile() (inductor; on the CPU it compiles C++),
               as torchtitan compiles a transformer block by block. A model compiled whole
               is one autograd node whose saved tensors reach the saved-tensor hooks only
               when its whole forward has run, so nothing can be offloaded while it runs.
  checkpoint   the blocks in CHECKPOINTED under torch.utils.checkpoint.checkpoint(...,
               use_reentrant=False)
  sac          the blocks in CHECKPOINTED under selective activation checkpointing: the
               same with context_fn=create_selective_checkpoint_contexts(policy), the
               policy saving the matmuls' outputs (MATMULS) and recomputing the rest
  autocast     the forward under torch.autocast("cpu", dtype=torch.bfloat16)
  save_on_cpu  the blocks in SAVE_ON_CPU_BLOCKS under torch.autograd.graph.save_on_cpu()

Random tokens with a fixed seed, fp32 parameters, one thread: every op is deterministic, so
two runs of the same feature give the same bytes. The default sizes (128 sequences of 64
tokens, width 64) make an fp32 activation 2 MiB, one granule of cudasim's VMM, as in
tests/python/models.py: tagged blocks then share no granule and waste no page, so that a
limit in whole MiB is a fair budget for what a run must keep.

Writes to OUT (JSON) the loss of each step, a sha256 of each step's gradients (every
parameter's .grad bytes, in order), a sha256 of the parameters after training and, for
compile, how many graphs dynamo compiled.

Usage: python3 train_gpt2.py OUT [--feature F] [--steps N] [--batch B] [--layers L]
                             [--width W] [--heads H] [--seq T] [--vocab V]

train() is what the tests that drive vramswap from inside a process call: the forward runs
inside forward_scope() (e.g. vramswap.offload), and save_on_cpu() makes the context of the
save_on_cpu feature (a counting subclass, for instance).
"""
import argparse
import contextlib
import functools
import hashlib
import json

import torch
import torch.nn.functional as F

FEATURES = ("eager", "compile", "checkpoint", "sac", "autocast", "save_on_cpu")
# Of the default 4 layers: the last half is checkpointed (backward recomputes them first,
# while the first half's saved tensors, left to an offloader, can stay away longest), and
# the last one saves on the CPU (what backward needs first: what an offloader keeps anyway).
CHECKPOINTED = (2, 3)
SAVE_ON_CPU_BLOCKS = (3,)


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        nn = torch.nn
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self, vocab, seq, width, heads, layers):
        super().__init__()
        nn = torch.nn
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2's
        self.run_block = None  # run_block(i, block, x) -> x; None: block(x)
        for name, p in self.named_parameters():  # GPT-2's initialization
            if name.endswith("weight") and p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, tokens, targets):
        pos = torch.arange(tokens.shape[1])
        x = self.wte(tokens) + self.wpe(pos)
        for i, block in enumerate(self.blocks):
            x = self.run_block(i, block, x) if self.run_block else block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# What selective checkpointing saves: the outputs of the matmuls (linear layers are addmm
# or mm on 2-D inputs, bmm/matmul otherwise); everything else is recomputed in backward.
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.matmul.default, torch.ops.aten.baddbmm.default, torch.ops.aten.linear.default}


def save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def block_runner(feature, save_on_cpu):
    """run_block for the feature, or None (each block called as it is)."""
    from torch.utils import checkpoint as cp
    if feature == "checkpoint":
        return lambda i, block, x: (cp.checkpoint(block, x, use_reentrant=False) if i in CHECKPOINTED
                                    else block(x))
    if feature == "sac":
        context_fn = functools.partial(cp.create_selective_checkpoint_contexts, save_matmuls)
        return lambda i, block, x: (cp.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
                                    if i in CHECKPOINTED else block(x))
    if feature == "save_on_cpu":
        def run(i, block, x):
            if i not in SAVE_ON_CPU_BLOCKS:
                return block(x)
            with save_on_cpu():
                return block(x)
        return run
    return None


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--feature", choices=FEATURES, default="eager")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128)
    return ap


def train(a, forward_scope=contextlib.nullcontext, save_on_cpu=torch.autograd.graph.save_on_cpu):
    """Trains as the command line `a` says; -> the result (JSON-able)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(a.vocab, a.seq, a.width, a.heads, a.layers)
    model.run_block = block_runner(a.feature, save_on_cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if a.feature == "compile":
        for block in model.blocks:
            block.compile()
    run = model
    autocast = (functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16) if a.feature == "autocast"
                else contextlib.nullcontext)
    result = {"loss": [], "grad_sha256": []}
    for _ in range(a.steps):
        tokens = torch.randint(a.vocab, (a.batch, a.seq))
        targets = torch.randint(a.vocab, (a.batch, a.seq))
        opt.zero_grad()
        with forward_scope(), autocast():
            loss = run(tokens, targets)
        loss.backward()
        result["loss"].append(loss.item())
        result["grad_sha256"].append(digest(p.grad for p in model.parameters()))
        opt.step()
    result["param_sha256"] = digest(model.parameters())
    if a.feature == "compile":  # the graphs dynamo handed to inductor: reported, not compared
        from torch._dynamo.utils import counters
        result["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return result


def main():
    a = parser().parse_args()
    result = train(a)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"loss {result['loss'][-1]!r}")


if __name__ == "__main__":
    main()
