#!/usr/bin/python3
"""A plain accelerate training loop (no vramswap in it): the suite's Llama (zoo.llama) and
AdamW prepared by accelerate.Accelerator on the CPU, with its DataLoader, for a few steps;
writes to OUT (JSON) the loss of each step and a sha256 of the model's state_dict() after
training.

Usage: python3 train_accelerate.py OUT [--steps N]
"""
import json

import torch
from accelerate import Accelerator

import zoo
from train_model import digest, loop_start


def main():
    a, model, rows = loop_start()
    loader = torch.utils.data.DataLoader(rows, batch_size=zoo.BATCH, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.train()
    losses = []
    for inputs in loader:
        loss = model(**inputs).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model = accelerator.unwrap_model(model)
    result = {"loss": losses, "param_sha256": digest(model.state_dict().values())}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"loss {losses[-1]!r}")


if __name__ == "__main__":
    main()
