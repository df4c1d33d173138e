#!/usr/bin/python3
"""A plain Hugging Face Trainer script (no vramswap in it): the suite's Llama (zoo.llama)
trained by transformers.Trainer for a few steps with its defaults (AdamW, a linear
schedule), on the CPU, saving nothing but OUT (JSON): the loss of each logged step and a
sha256 of the model's state_dict() after training.

Usage: python3 train_trainer.py OUT [--steps N]
"""
import json
import tempfile

import torch
from transformers import Trainer, TrainingArguments

import zoo
from train_model import digest, loop_start


def main():
    a, model, rows = loop_start()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, max_steps=a.steps, per_device_train_batch_size=zoo.BATCH,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result = {"loss": losses, "param_sha256": digest(model.state_dict().values())}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"loss {losses[-1]!r}")


if __name__ == "__main__":
    main()
