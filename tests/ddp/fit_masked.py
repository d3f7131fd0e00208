"""Fit a tiny LM on 2 CPU ranks (gloo) from a Hugging Face Dataset or a prompt–completion JSONL; record each rank.

Run: python tests/ddp/fit_masked.py OUT_DIR MODE
MODE "dataset": a ``datasets.Dataset`` with a ``text`` column (each record's prompt and completion joined), plan
loss divisor.
MODE "jsonl-plan": a prompt–completion JSONL file, plan loss divisor (the batch's ``step_supervised_tokens``).
MODE "jsonl-allreduce": the same file, all-reduce loss divisor (the model drops ``step_supervised_tokens``).
Every run: Trainer(accumulate_grad_batches=2), one epoch. Each rank writes OUT_DIR/rank{r}.json (the
micro-batches it ran, the divisor path of every step, the planned and counted targets per step) and, for the first
optimizer step, OUT_DIR/step0_rank{r}.pt (its micro-batches and the gradients the optimizer saw); rank 0 writes
OUT_DIR/init.pt (initial weights) and OUT_DIR/train_rows.json (what the training split holds).
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import token_loss_sum

from launch import run_as_ranks  # launch.py (the repository root)

MODEL = {"d_model": 16, "num_heads": 2, "num_layers": 1, "dim_feedforward": 32}


def records(n=90):
    """Prompt–completion records of varied lengths (a few words of prompt, a few of completion)."""
    words = "the cat sat on a mat while dogs ran far away from every big red house near old trees".split()
    out = []
    for i in range(n):
        prompt = " ".join(words[(i * 7 + k) % len(words)] for k in range(2 + i % 9)) + " ?"
        completion = " " + " ".join(words[(i * 5 + k) % len(words)] for k in range(1 + (i * 3) % 11))
        out.append({"prompt": prompt, "completion": completion})
    return out


def corpus(mode, out):
    if mode == "dataset":
        import datasets

        return datasets.Dataset.from_dict({"text": [r["prompt"] + r["completion"] for r in records()]})
    path = out / "pc.jsonl"
    if not path.exists():  # both ranks may get here at once: each writes its own file, then renames it (atomic)
        mine = out / f"pc.jsonl.{os.getpid()}"
        mine.write_text("".join(json.dumps(r) + "\n" for r in records()), encoding="utf-8")
        os.replace(mine, path)
    return path


class Model(DemoTransformerLM):
    def __init__(self, out, drop_plan):
        super().__init__(vocab_size=30522, **MODEL)
        self.out, self.drop_plan = out, drop_plan
        self.first_step_batches, self.modes, self.micro_batches, self.steps = [], [], [], []
        self._planned, self._counted = None, 0

    def on_fit_start(self):
        if self.global_rank == 0:
            torch.save(self.state_dict(), self.out / "init.pt")

    def training_step(self, batch, batch_idx):
        self.micro_batches.append([batch_idx, batch["indices"].tolist(), batch["is_fill"].tolist()])
        self._planned = [batch["step_supervised_tokens"], batch["step_real_tokens"] - batch["step_rows"]]
        self._counted += int((batch["labels"][:, 1:] != -100).sum())
        if self.trainer.global_step == 0:
            self.first_step_batches.append({k: batch[k].clone() for k in ("input_ids", "attention_mask", "labels")})
        if self.drop_plan:  # no planned divisor: StepTokenLoss takes the all-reduce path
            batch = {k: v for k, v in batch.items() if k != "step_supervised_tokens"}
        loss_sum, n = token_loss_sum(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        return self.step_loss.micro_batch(self, batch, loss_sum, n)

    def on_before_optimizer_step(self, optimizer):
        mode = self.step_loss.mode
        loss = self.step_loss.finish_step(self)
        self.modes.append(mode)
        # [planned targets of the step (global), targets of this rank's micro-batches, targets counted by the loss,
        #  the step's loss, the step's real tokens minus rows (global)]
        self.steps.append([self._planned[0], self._counted, self.step_loss.last_step_tokens, float(loss),
                           self._planned[1]])
        self._counted = 0
        if self.trainer.global_step == 0:
            grads = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
            torch.save({"batches": self.first_step_batches, "grads": grads, "loss": float(loss),
                        "tokens": self.step_loss.last_step_tokens}, self.out / f"step0_rank{self.global_rank}.pt")


def main():
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    data = BalancedTextDataModule(corpus(mode, out), max_tokens=96, max_length=24, val_fraction=0, seed=5,
                                  cache_dir=out / "cache")
    model = Model(out, drop_plan=mode == "jsonl-allreduce")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        max_epochs=1, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    ds = data.train_dataset
    if trainer.global_rank == 0:
        rows = [{"input_ids": ds[i]["input_ids"].tolist(), "labels": ds[i].get("labels", ds[i]["input_ids"]).tolist()}
                for i in range(len(ds))]
        (out / "train_rows.json").write_text(json.dumps(rows))
    record = {"modes": model.modes, "micro_batches": model.micro_batches, "steps": model.steps,
              "num_batches": len(data.train_sampler), "num_train": len(ds)}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_as_ranks(main, 2)
