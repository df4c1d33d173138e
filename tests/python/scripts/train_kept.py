#!/usr/bin/python3
"""A plain torch training script (no vramswap in it), for the kept-block tests
(tests/python/test_kept_blocks.py): the models there, trained three steps with a fixed seed.

  lora              a frozen embedding, six frozen 1024x1024 layers each with a trainable
                    rank-16 adapter, a frozen head; SGD on the adapters
  lora_checkpoint   the same, layers 2 and 3 under torch.utils.checkpoint (non-reentrant)
  lora_accum        the same, two forwards (two microbatches) before one backward: each
                    frozen weight saved twice
  mlp               four 1024x1024 layers trained with AdamW: its first optimizer step holds
                    the parameters, their gradients and AdamW's two states at once

Usage: python3 train_kept.py OUT [--model lora|lora_checkpoint|lora_accum|mlp] [--device cpu|cuda]
                              [--workspace MIB]
Writes to OUT (JSON): each step's loss and a sha256 of the trained parameters after training.
--workspace MIB (cpu only) allocates what torch on a GPU allocates for cuBLAS and keeps for the
rest of the run: MIB at the first forward's first product and MIB more at the first backward's
(one workspace per thread and stream: the backward runs on autograd's device thread; 32 MiB
each on a Hopper card with CUBLAS_WORKSPACE_CONFIG=:4096:8). On a GPU those two took 64 of the
LoRA model's 101 MiB peak (H200, torch 2.11, 2026-11-27), so a limit there is tighter around
the model than the same share of the peak in the CPU-emulation mode.
On cuda: deterministic algorithms and no TF32 (the environment must set
CUBLAS_WORKSPACE_CONFIG=:4096:8, as tests/gpu/kept.py does), so that runs compare bit for bit.
"""
import argparse
import hashlib
import json

import torch

STEPS = 3


def lora_model(checkpointed=False, rank=16, layers=6):
    """-> (model, (tokens, targets)): the LoRA model of the docstring (a frozen 512x1024
    embedding, `layers` frozen 1024x1024 layers each with a trainable rank-`rank` adapter, a
    frozen 1024x512 head; `checkpointed`: layers 2 and 3 under torch.utils.checkpoint), the
    same for given arguments. tests/python/test_kept_access.py builds its smaller one here."""
    nn = torch.nn

    class Adapted(nn.Module):
        def __init__(self, d, r):
            super().__init__()
            self.base = nn.Linear(d, d)
            self.a = nn.Linear(d, r, bias=False)
            self.b = nn.Linear(r, d, bias=False)

        def forward(self, x):
            return self.base(x) + self.b(self.a(x))

    class LoRA(nn.Module):
        def __init__(self, d=1024, r=rank, n=layers, vocab=512):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Adapted(d, r) for _ in range(n))
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens, targets):
            x = self.embed(tokens)
            for i, layer in enumerate(self.layers):
                if checkpointed and i in (2, 3):
                    from torch.utils.checkpoint import checkpoint
                    x = torch.tanh(checkpoint(layer, x, use_reentrant=False))
                else:
                    x = torch.tanh(layer(x))
            return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    model = LoRA()
    for name, p in model.named_parameters():
        p.requires_grad = name.endswith(".a.weight") or name.endswith(".b.weight")
    tokens = torch.randint(0, 512, (4, 32))
    targets = torch.randint(0, 512, (4, 32))
    return model, (tokens, targets)


def mlp_model():
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    x = torch.randn(16, 1024)
    y = torch.randn(16, 1024)
    return model, (x, y)


def build(name, device="cpu"):
    """-> (model, data, optimizer, loss_fn) for a model of the docstring, on `device`."""
    if name == "mlp":
        model, data = mlp_model()
        model.to(device)
        data = tuple(t.to(device) for t in data)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        return model, data, opt, lambda: torch.nn.functional.mse_loss(model(data[0]), data[1])
    model, data = lora_model(name == "lora_checkpoint")
    model.to(device)
    data = tuple(t.to(device) for t in data)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if name == "lora_accum":
        return model, data, opt, lambda: model(*data) + 0.5 * model(data[0].flip(0), data[1].flip(0))
    return model, data, opt, lambda: model(*data)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="lora", choices=("lora", "lora_checkpoint", "lora_accum", "mlp"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--workspace", type=int, default=0, metavar="MIB")
    args = parser.parse_args()
    if args.workspace and args.device != "cpu":
        parser.error("--workspace emulates a GPU's cuBLAS workspaces: cpu only")
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
    model, _, opt, loss_fn = build(args.model, args.device)
    losses = []
    workspaces = []

    def workspace(*_):
        if len(workspaces) < 2:
            workspaces.append(torch.empty(args.workspace << 18, device=args.device))  # float32

    for _ in range(STEPS):
        if args.workspace:
            workspace()
        loss = loss_fn()
        if args.workspace and len(workspaces) < 2:
            loss.register_hook(workspace)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    digest = hashlib.sha256()
    for p in model.parameters():
        if p.requires_grad:
            digest.update(p.detach().cpu().numpy().tobytes())
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "trained": digest.hexdigest()}, f)


if __name__ == "__main__":
    main()
