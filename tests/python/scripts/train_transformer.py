#!/usr/bin/python3
"""A plain torch training script (no vramswap in it), for `vramswap run` tests.

Trains a small language model built from torch's own nn.TransformerEncoder (pre-norm
layers: multi-head attention, layer norm, residual connections, a feed-forward block) with
AdamW for a few steps, on random tokens with a fixed seed, and writes to OUT (JSON): the loss
of each step, a sha256 of each step's gradients (every parameter's .grad bytes, in order), a
sha256 of the parameters after training, and a float sum of the last gradients.

Usage: python3 train_transformer.py OUT [--steps N] [--batch B] [--vocab V] [--heads H] [--layers L]
                                   [--largest-saved FILE]

--largest-saved FILE: the first forward runs under saved-tensor hooks (that return each
tensor as it is) that note the largest tensor autograd saves; FILE gets {"bytes": N}. For a
plain run only: under `vramswap run` these hooks would stand in for vramswap's.

With --vocab 4096 the embedding and the head's weight are 1 MiB each (and so are their
gradients and AdamW's two states): parameters large enough for vramswap to tag, were they
allocated inside an offload scope.
"""
import argparse
import hashlib
import json

import torch

WIDTH, HEADS, FFN, LAYERS, SEQ = 64, 4, 128, 4, 64


class LanguageModel(torch.nn.Module):
    def __init__(self, vocab, heads=HEADS, layers=LAYERS):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, heads, FFN, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(WIDTH, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens), mask=self.mask))


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--largest-saved")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LanguageModel(a.vocab, a.heads, a.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = {"loss": [], "grad_sha256": []}
    for _ in range(a.steps):
        tokens = torch.randint(a.vocab, (a.batch, SEQ))
        targets = torch.randint(a.vocab, (a.batch, SEQ))
        opt.zero_grad()
        if a.largest_saved and not result["loss"]:
            sizes = [0]

            def note(t):
                sizes.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
                logits = model(tokens)
                loss = torch.nn.functional.cross_entropy(logits.view(-1, a.vocab), targets.view(-1))
            with open(a.largest_saved, "w") as f:
                json.dump({"bytes": max(sizes)}, f)
        else:
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, a.vocab), targets.view(-1))
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
