#!/usr/bin/python3
"""A plain torch DDP training script (no vramswap in it), for `vramswap run` tests.

One rank of a DistributedDataParallel run with the gloo backend, on the CPU: the rank and
the rendezvous come from the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; LOCAL_RANK is read and unused on the CPU). A small language model (token
embedding, a few pre-norm TransformerEncoder layers, a head) trains with AdamW for a few
steps on random tokens, each rank on its own batch (seed + rank), gradients averaged by
DDP. Writes to OUT (JSON): the rank, each step's loss and a sha256 of the parameters after
training (the same on every rank, since DDP keeps them in step).

Usage: RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python3 train_ddp.py OUT [--steps N]
"""
import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

WIDTH, HEADS, FFN, LAYERS, SEQ, VOCAB, BATCH = 64, 2, 128, 4, 64, 128, 48


class LanguageModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, LAYERS)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens), mask=self.mask))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    int(os.environ.get("LOCAL_RANK", rank))  # set by torchrun; one process per CPU "device" here
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial parameters on every rank (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(LanguageModel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(args.steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    with open(args.out, "w") as f:
        json.dump({"rank": rank, "losses": losses, "params": h.hexdigest()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
