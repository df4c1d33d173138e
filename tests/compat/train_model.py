#!/usr/bin/python3
"""A plain training script (no vramswap in it), as a user writes one: builds one of the
suite's models (zoo.py) and trains it for a few AdamW steps.

Writes to OUT (JSON) the loss of each step, a sha256 of each step's gradients (every
trainable parameter's .grad bytes, in order) and a sha256 of the model's state_dict() after
training (parameters and buffers, as a user saves them: under `vramswap run
--offload-frozen` a frozen weight may be off the device between its uses, and state_dict()
is how it is read then; README, "Reading and writing kept tensors outside their uses").
The seed is fixed and the inputs are drawn from generators of their own, so two runs of the
same model give the same bytes where every op is deterministic (one thread: the suite sets
OMP_NUM_THREADS=1).

train(name, steps) is what the suite's reference process calls for every model in turn.

Usage: python3 train_model.py MODEL OUT [--steps N]
"""
import argparse
import hashlib
import json

import torch

import zoo


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(name, steps=3):
    """Trains zoo model `name` for `steps` AdamW steps; -> the result (JSON-able)."""
    torch.manual_seed(0)
    model, batch, loss_of = zoo.MODELS[name][2](torch)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    result = {"loss": [], "grad_sha256": []}
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, batch(step))
        loss.backward()
        result["loss"].append(loss.item())
        result["grad_sha256"].append(digest(p.grad for p in params))
        opt.step()
    result["param_sha256"] = digest(model.state_dict().values())
    return result


def loop_start():
    """What the three training loops (train_trainer.py, train_accelerate.py,
    train_lightning.py) begin with: their arguments (OUT, --steps), the suite's Llama, seeded,
    and its batches as the rows of a dataset; -> (args, model, rows)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, batch, _ = zoo.llama(torch)
    rows = [{"input_ids": ids, "labels": ids} for s in range(a.steps) for ids in batch(s)["input_ids"]]
    return a, model, rows


def rank_start():
    """What the distributed scripts (train_ddp.py, train_fsdp2.py) begin with, in each rank
    torchrun starts: their arguments (OUT, --steps), the gloo process group (the rank and
    the rendezvous from torchrun's variables), the suite's Llama, seeded alike on every rank,
    and the rank's batches: -> (args, rank, world, model, batches), where batches(step) are
    the inputs of the rank's own shard of step `step` (zoo's batch step * world + rank)."""
    import torch.distributed as dist
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, batch, _ = zoo.llama(torch)
    return a, rank, world, model, lambda step: batch(step * world + rank)


def rank_train(a, rank, model, batches, local=lambda t: t):
    """The distributed scripts' loop: AdamW over `model` for a.steps steps on the rank's
    batches -> {"rank", "loss", "grad_sha256"} (each step's loss and the sha256 of every
    gradient, `local` taking a sharded one to the rank's own part)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = {"rank": rank, "loss": [], "grad_sha256": []}
    for step in range(a.steps):
        opt.zero_grad()
        loss = model(**batches(step)).loss
        loss.backward()
        result["loss"].append(loss.item())
        result["grad_sha256"].append(digest(local(p.grad) for p in model.parameters()))
        opt.step()
    return result


def rank_finish(a, result):
    """Gathers every rank's result; rank 0 writes {"world", "ranks": [result of rank 0,
    1, ...]} to OUT. Ends the process group."""
    import torch.distributed as dist
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, result)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"world": len(ranks), "ranks": ranks}, f, indent=1)
        print(f"loss {[r['loss'][-1] for r in ranks]!r}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=list(zoo.MODELS))
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    result = train(a.model, a.steps)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"loss {result['loss'][-1]!r}")


if __name__ == "__main__":
    main()
