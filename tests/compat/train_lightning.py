#!/usr/bin/python3
"""A plain Lightning script (no vramswap in it): the suite's Llama (zoo.llama) in a
LightningModule with AdamW, trained by lightning.Trainer on the CPU (one device) for a few
steps, with no logger, checkpoint or progress bar; writes to OUT (JSON) the loss of each
step and a sha256 of the model's state_dict() after training.

Usage: python3 train_lightning.py OUT [--steps N]
"""
import json

import lightning as L
import torch

import zoo
from train_model import digest, loop_start


class LanguageModel(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.losses = []

    def training_step(self, inputs, index):
        loss = self.model(**inputs).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    a, model, rows = loop_start()
    loader = torch.utils.data.DataLoader(rows, batch_size=zoo.BATCH, shuffle=True)
    module = LanguageModel(model)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=a.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    result = {"loss": module.losses, "param_sha256": digest(model.state_dict().values())}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"loss {module.losses[-1]!r}")


if __name__ == "__main__":
    main()
