"""Train one epoch under LedgerCheck on CPU ranks (gloo) with accumulate_grad_batches=2: one corpus or a mixture of
two, padded or packed; stop mid-epoch with a checkpoint, resume from it, or plant a swapped document on one rank.

Run: python tests/ddp/fit_ledger.py OUT_DIR DATA_DIR KIND LAYOUT PHASE DEVICES [PLANNED DELIVERED]
KIND is ``plain`` or ``mixture``, LAYOUT ``padded`` or ``packed``; DATA_DIR holds ``web.jsonl`` and ``code.jsonl`` and
the tokenization cache (test_ledger_ddp.py writes them). PHASE ``stop`` trains STOP_AT micro-batches per rank, saves
OUT_DIR/mid.ckpt and raises at the next training_step; ``resume`` continues from mid.ckpt on DEVICES ranks; ``skip``
does the same with ``skip_steps=[SKIP_STEPS]`` (those optimizer steps of the run left out), ``replace`` with
``skip_steps=[SKIP_STEPS], replace=True`` (the next documents take their places); ``swap``
runs the epoch with rank 1's dataset handing sample DELIVERED where the plan has PLANNED; ``epochs`` continues from
mid.ckpt on DEVICES ranks for two epochs with ``skip_steps`` the JSON list PLANNED (optimizer steps of the run, any
epoch), recorded only (no ledger while training). Every phase checks against
OUT_DIR/ledger.parquet (written beforehand by the test) and records what it received in OUT_DIR/received
(``LedgerCheck(record=...)``, for ``lit-balance ledger check``). Each rank writes OUT_DIR/{phase}_rank{r}.json: per trained
micro-batch its batch_idx, indices and is_fill, and the LedgerMismatchError message if one stopped it.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from lit_balance import BalancedTextDataModule, Mixture
from lit_balance.callbacks import LedgerCheck, LedgerMismatchError
from stopping_lm import StoppingLM  # tests/ddp/stopping_lm.py

from launch import run_as_ranks  # launch.py (the repository root)

STOP_AT = 4  # micro-batches per rank before the stop: two optimizer steps
ACCUMULATE = 2
SKIP_STEPS = (3, 4)  # optimizer step 3 of the run (after the stop at step 2) left out by the ``skip`` phase
TOKENIZER = Path(__file__).resolve().parents[2] / "lit_balance/data/tokenizer/tokenizer.json"


def datamodule(data: Path, kind: str, layout: str, skip_steps=None, replace=False) -> BalancedTextDataModule:
    """The DataModule every phase and the test's ledger use."""
    if kind == "plain":
        corpus = data / "web.jsonl"
    else:
        corpus = Mixture({"web": {"corpus": data / "web.jsonl", "weight": 0.6},
                          "code": {"corpus": data / "code.jsonl", "weight": 0.4}})
    return BalancedTextDataModule(corpus, str(TOKENIZER), max_tokens=96, max_length=40, val_fraction=0,
                                  packing=layout == "packed", cache_dir=data / "cache", seed=7, skip_steps=skip_steps,
                                  replace=replace)


class Recorder(L.Callback):
    def __init__(self, out: Path, stop: bool) -> None:
        self.out, self.stop, self.batches = out, stop, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append([batch_idx, batch["indices"].tolist(), batch["is_fill"].tolist(), trainer.current_epoch])
        if self.stop and batch_idx == STOP_AT - 1:
            trainer.save_checkpoint(self.out / "mid.ckpt")


class Swap(L.Callback):
    """On rank 1, the training dataset hands ``delivered``'s item where the plan has ``planned`` (a loader bug)."""

    def __init__(self, planned: int, delivered: int) -> None:
        self.planned, self.delivered = planned, delivered

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 1:
            dataset = trainer.datamodule.train_dataset
            item = dataset._item
            dataset._item = lambda i, is_fill=False: item(self.delivered if i == self.planned else i, is_fill)


def main() -> None:
    out, data, kind, layout, phase, devices = (Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4],
                                               sys.argv[5], int(sys.argv[6]))
    skip = [SKIP_STEPS] if phase in ("skip", "replace") else json.loads(sys.argv[7]) if phase == "epochs" else None
    dm = datamodule(data, kind, layout, skip_steps=skip, replace=phase == "replace")
    model = StoppingLM(dm.vocab_size, stop_at=STOP_AT if phase == "stop" else None)
    recorder = Recorder(out, stop=phase == "stop")
    callbacks = [recorder, LedgerCheck(None if phase == "epochs" else out / "ledger.parquet",
                                       record=out / "received")]
    if phase == "swap":
        callbacks.append(Swap(int(sys.argv[7]), int(sys.argv[8])))
    strategy = DDPStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2 if phase == "epochs" else 1,
                        logger=False,
                        accumulate_grad_batches=ACCUMULATE, callbacks=callbacks, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        num_sanity_val_steps=0)
    mismatch = None
    try:
        resumed = phase in ("resume", "skip", "replace", "epochs")
        trainer.fit(model, datamodule=dm, ckpt_path=out / "mid.ckpt" if resumed else None)
    except LedgerMismatchError as error:
        if phase != "swap":
            raise
        mismatch = str(error)
    except RuntimeError as error:
        if phase != "stop" or "simulated stop" not in str(error):
            raise
    (out / f"{phase}_rank{trainer.global_rank}.json").write_text(json.dumps({
        "batches": recorder.batches, "mismatch": mismatch, "global_step": trainer.global_step}))


if __name__ == "__main__":
    run_as_ranks(main, int(sys.argv[6]))
