#!/usr/bin/python3
"""A plain torch training script (no vramswap in it), for `vramswap run` tests: a small
residual convolutional network with batch norm, trained with SGD and momentum.

    image -> conv 3x3 + BN + ReLU -> STAGES x (BLOCKS residual blocks, two by default, the
    second stage and on starting with a stride-2 block and a 1x1 projection) -> average
    pool -> linear

Each residual block: conv 3x3, BN, ReLU, conv 3x3, BN, + shortcut, ReLU (resnet18's basic
block). Batch norm's running statistics are buffers updated in the forward; its saved mean
and inverse deviation are small tensors saved for backward beside the large activations.
Random images and labels with a fixed seed; with one thread every op is deterministic.
Writes to OUT (JSON) the loss of each step, a sha256 of each step's gradients and a sha256
of the parameters and buffers after training.

Usage: python3 train_cnn.py OUT [--steps N] [--batch B] [--size PIXELS] [--width C] [--blocks N]
"""
import argparse
import hashlib
import json

import torch

CLASSES = 10


class Block(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.project = None
        if stride != 1 or cin != cout:
            self.project = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.project is None else self.project(x)))


class Net(torch.nn.Module):
    def __init__(self, width, stages=3, blocks=2):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, c = [], width
        for i in range(stages):
            cout = width * 2 ** i
            layers += [Block(c, cout, 1 if i == 0 else 2)] + [Block(cout, cout, 1) for _ in range(blocks - 1)]
            c = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c, CLASSES)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net(a.width, blocks=a.blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    result = {"loss": [], "grad_sha256": []}
    for _ in range(a.steps):
        images = torch.randn(a.batch, 3, a.size, a.size)
        labels = torch.randint(CLASSES, (a.batch,))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        result["loss"].append(loss.item())
        result["grad_sha256"].append(digest(p.grad for p in model.parameters()))
        opt.step()
    result["param_sha256"] = digest(list(model.parameters()) + list(model.buffers()))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"loss {result['loss'][-1]!r}")


if __name__ == "__main__":
    main()
