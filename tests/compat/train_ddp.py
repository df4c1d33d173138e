#!/usr/bin/python3
"""A plain DistributedDataParallel script (no vramswap in it), one rank of a torchrun launch
on the gloo backend: the suite's Llama (zoo.llama) wrapped in DDP, trained for a few AdamW
steps, each rank on batches of its own, gradients averaged by DDP. Rank 0 writes to OUT
(JSON) every rank's losses, a sha256 of each step's gradients (after DDP's all-reduce: the
same on every rank) and a sha256 of the model's state_dict() after training (the same on
every rank).

Usage: torchrun --nproc-per-node N train_ddp.py OUT [--steps N]
"""
from torch.nn.parallel import DistributedDataParallel

from train_model import digest, rank_finish, rank_start, rank_train


def main():
    a, rank, world, model, batches = rank_start()
    model = DistributedDataParallel(model)
    model.train()
    result = rank_train(a, rank, model, batches)
    result["param_sha256"] = digest(model.module.state_dict().values())
    rank_finish(a, result)


if __name__ == "__main__":
    main()
