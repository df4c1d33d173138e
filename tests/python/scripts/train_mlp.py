#!/usr/bin/python3
"""A plain torch training script (no vramswap in it), for `vramswap run` tests.

Trains 2 steps (SGD with momentum) of a small residual MLP (layer norm, an in-place ReLU,
residual connections) with a fixed seed, and writes to OUT (JSON): the loss of each step,
a sha256 of each step's gradients (every parameter's .grad bytes, in order), a sha256 of the
parameters after training, and a float sum of the last gradients.

Usage: python3 train_mlp.py OUT [--steps N] [--batch B]
"""
import argparse
import hashlib
import json

import torch

WIDTH, HIDDEN, BLOCKS = 512, 1024, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        h.relu_()
        return x + self.fc2(h)


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)], torch.nn.LayerNorm(WIDTH))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = {"loss": [], "grad_sha256": []}
    for _ in range(a.steps):
        x = torch.randn(a.batch, WIDTH)
        target = torch.randn(a.batch, WIDTH)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        result["loss"].append(loss.item())
        result["grad_sha256"].append(digest(grads))
        opt.step()
    result["grad_sum"] = float(sum(g.double().sum() for g in grads))
    result["param_sha256"] = digest(model.parameters())
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"loss {result['loss'][-1]!r}")


if __name__ == "__main__":
    main()
