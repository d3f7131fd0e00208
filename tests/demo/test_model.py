"""DemoTransformerLM rejects bad sizes and rates at construction; val/loss is the exact mean over all ranks' tokens."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from lit_balance.demo import DemoTransformerLM

import launch as _procs  # launch.py: the fork server's preload

SMALL = {"vocab_size": 16, "d_model": 8, "num_heads": 2, "num_layers": 1, "dim_feedforward": 16}


@pytest.mark.parametrize(("name", "value", "error", "words"), [
    ("d_model", "abc", TypeError, ["d_model must be an int", "'abc'", "str"]),
    ("num_heads", 2.0, TypeError, ["num_heads must be an int", "2.0", "float"]),
    ("num_heads", 2.5, TypeError, ["num_heads must be an int", "2.5", "float"]),
    ("vocab_size", 2.5, TypeError, ["vocab_size must be an int", "2.5"]),
    ("vocab_size", True, TypeError, ["vocab_size must be an int", "True", "bool"]),
    ("num_layers", 0, ValueError, ["num_layers must be >= 1", "got 0"]),
    ("dim_feedforward", -4, ValueError, ["dim_feedforward must be >= 1", "got -4"]),
    ("num_heads", 3, ValueError, ["d_model (8) must be divisible by num_heads (3)"]),
    ("lr", math.nan, ValueError, ["lr must be a finite number", "nan"]),
    ("lr", -1, ValueError, ["lr must be a finite number >= 0", "-1"]),
    ("lr", math.inf, ValueError, ["lr must be a finite number", "inf"]),
    ("lr", "1e-3", TypeError, ["lr must be a real number", "'1e-3'", "str"]),
    ("weight_decay", -1, ValueError, ["weight_decay must be a finite number >= 0", "-1"]),
    ("dropout", 1.5, ValueError, ["dropout must be a finite number in [0.0, 1.0]", "1.5"]),
    ("dropout", True, TypeError, ["dropout", "True", "bool"]),
])
def test_bad_arguments_raise_at_construction(name, value, error, words):
    with pytest.raises(error) as excinfo:
        DemoTransformerLM(**{**SMALL, name: value})
    message = str(excinfo.value)
    for word in words:
        assert word in message, message


def test_valid_arguments_keep_their_values():
    model = DemoTransformerLM(vocab_size=np.int64(16), d_model=8, num_heads=np.int32(2), num_layers=1, dim_feedforward=16,
                          dropout=0, lr=np.float32(0.5), weight_decay=0)
    assert dict(model.hparams) == {"vocab_size": 16, "d_model": 8, "num_heads": 2, "num_layers": 1,
                                   "dim_feedforward": 16, "dropout": 0.0, "lr": 0.5, "weight_decay": 0.0,
                                   "packed_attention": "auto"}
    assert type(model.hparams.vocab_size) is int and type(model.hparams.lr) is float
    assert model.configure_optimizers().defaults["lr"] == 0.5


# -- val/loss: the exact mean over every supervised validation token of every rank ----------------------------

# Per rank, the rows (token counts) of each validation batch; a row of length l has l - 1 supervised tokens,
# a batch whose lengths are negative is a fill batch (labels all -100). Rank 0: 59 + 30 = 89 tokens,
# rank 1: 29 + 29 = 58, so Lightning's integer batch_size reduction of a weighted mean would be biased.
RANK_BATCHES = {0: [[30, 31], [31], [-5]], 1: [[30], [30], [-7, -3]]}
TINY = {"vocab_size": 16, "d_model": 16, "num_heads": 2, "num_layers": 1, "dim_feedforward": 32}


def _batch(lengths, seed):
    import torch

    from lit_balance.data.collate import IGNORE_INDEX

    generator = torch.Generator().manual_seed(seed)
    width = max(abs(n) for n in lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), IGNORE_INDEX, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids = torch.randint(1, TINY["vocab_size"], (abs(n),), generator=generator)
        input_ids[row, :abs(n)] = ids
        attention_mask[row, :abs(n)] = 1
        if n > 0:
            labels[row, :n] = ids
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _rank_batches(rank):
    return [_batch(lengths, seed=100 * rank + i) for i, lengths in enumerate(RANK_BATCHES[rank])]


class RankValidationLM(DemoTransformerLM):
    """The demo model validating on its rank's batches of RANK_BATCHES (all of them on a single process)."""

    def val_dataloader(self):
        from torch.utils.data import DataLoader

        world, rank = self.trainer.world_size, self.global_rank
        batches = _rank_batches(0) + _rank_batches(1) if world == 1 else _rank_batches(rank)
        return DataLoader(batches, batch_size=None)  # each item is a batch; no sampler is injected (see _trainer)


def _exact_mean(model, batches):
    """Mean next-token cross-entropy over every supervised token, in float64, in this process."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for batch in batches:
            logits = model(batch["input_ids"], batch["attention_mask"])[:, :-1]
            targets = batch["labels"][:, 1:].reshape(-1)
            losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets, ignore_index=-100,
                                     reduction="none")
            total += float(losses.sum())
            count += int((targets != -100).sum())
    return total / count, count


def _trainer(devices, strategy="auto"):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)


def _tiny_model():
    import torch

    torch.manual_seed(0)
    return RankValidationLM(**TINY)


def test_token_mean_loss_is_the_mean_over_all_tokens_of_merged_ranks():
    import torch

    from lit_balance.lightning.metrics import TokenMeanLoss

    ranks = [TokenMeanLoss(), TokenMeanLoss()]
    for loss_sum, n in [(300.0, 59), (120.0, 30), (0.0, 0)]:
        ranks[0].update(torch.tensor(loss_sum, dtype=torch.float32), n)
    ranks[1].update(90.0, 29)
    ranks[1].update(torch.tensor([60.0, 1.0]), torch.tensor([20, 9]))
    ranks[0].merge_state(ranks[1])  # what the "sum" reduction over ranks does
    assert float(ranks[0].compute()) == pytest.approx((300 + 120 + 90 + 61) / 147, abs=1e-12)
    # not the mean of the ranks' means
    assert float(ranks[0].compute()) != pytest.approx(((300 + 120) / 89 + 151 / 58) / 2, abs=1e-6)
    empty = TokenMeanLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics warns of compute() before update()
        assert math.isnan(float(empty.compute()))
    with pytest.raises(ValueError, match="num_tokens to be an int >= 0, got -1"):
        empty.update(1.0, -1)
    with pytest.raises(ValueError, match="0 over 0 tokens; got loss_sum=2 over num_tokens=0"):
        empty.update(2.0, 0)
    with pytest.raises(ValueError, match="finite loss_sum"):
        empty.update(float("nan"), 3)


def test_val_loss_is_the_exact_token_mean_in_one_process():
    model = _tiny_model()
    exact, count = _exact_mean(model, _rank_batches(0) + _rank_batches(1))
    assert count == 89 + 58
    trainer = _trainer(devices=1)
    trainer.validate(model, verbose=False)
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(exact, abs=1e-6)
    trainer.validate(model, verbose=False)  # the sums start again at every validation run
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(exact, abs=1e-6)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_val_loss_is_the_exact_token_mean_over_two_ranks_with_unequal_token_counts():
    import multiprocessing
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    model = _tiny_model()
    per_rank = [_exact_mean(model, _rank_batches(rank))[1] for rank in (0, 1)]
    assert per_rank == [89, 58]
    exact, _ = _exact_mean(model, _rank_batches(0) + _rank_batches(1))
    # started as "spawn" starts them, but from a process that imported torch and Lightning once (the standard
    # library's fork server, the one launch.py uses), not two fresh interpreters
    multiprocessing.get_context("forkserver").set_forkserver_preload(_procs.PRELOAD)
    trainer = _trainer(devices=2, strategy=DDPStrategy(start_method="forkserver", timeout=timedelta(seconds=60)))
    trainer.validate(model, verbose=False)
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(exact, abs=1e-6)
