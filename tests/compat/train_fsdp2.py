#!/usr/bin/python3
"""A plain FSDP2 script (no vramswap in it), one rank of a torchrun launch on the gloo
backend: the suite's Llama (zoo.llama) with each decoder layer and then the whole model
sharded by torch.distributed.fsdp.fully_shard (parameters, gradients and AdamW state split
across the ranks; each layer's parameters all-gathered before its forward and again before
its backward, freed after each), trained for a few AdamW steps, each rank on batches of its
own. Rank 0 writes to OUT (JSON) every rank's losses, a sha256 of each step's gradient
shards (the rank's own, after the reduce-scatter), a sha256 of its parameter shards after
training, and a sha256 of the whole state_dict() gathered (DTensor.full_tensor(): the same
on every rank).

Usage: torchrun --nproc-per-node N train_fsdp2.py OUT [--steps N]
"""
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from train_model import digest, rank_finish, rank_start, rank_train


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def main():
    a, rank, world, model, batches = rank_start()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    result = rank_train(a, rank, model, batches, local)
    state = model.state_dict()
    result["shard_sha256"] = digest(local(v) for v in state.values())
    result["param_sha256"] = digest(v.full_tensor() if isinstance(v, DTensor) else v for v in state.values())
    rank_finish(a, result)


if __name__ == "__main__":
    main()
