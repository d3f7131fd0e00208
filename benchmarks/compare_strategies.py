"""End-to-end strategy benchmark: the same LM, corpus, real tokens and optimizer under six batching strategies.

Run:
    python -m benchmarks.compare_strategies # 2 CPU DDP ranks, every strategy
    python -m benchmarks.compare_strategies --quick # under 10 minutes on 2 cores
    python -m benchmarks.compare_strategies --accelerator gpu --devices 4 --model-size bert --precision bf16-mixed

Every strategy trains :class:`lit_balance.demo.DemoTransformerLM` (token-weighted loss, AdamW with the same learning rate)
for the same number of epochs over the same training documents of the built-in corpus (Python standard library
docstrings, BERT-uncased WordPiece, truncated to ``--max-length`` tokens), with the same per-rank budget of
``--max-tokens`` padded token slots per micro-batch, and is validated on the same held-out documents after every
epoch. Each strategy runs under torch's own launcher (``python -m torch.distributed.run``, one process per rank
running this module again with a hidden worker flag) with a timeout; the parent collects one JSON file per run.

Strategies:

* ``random``: torch ``DistributedSampler`` (shuffle, ``drop_last=True``) + ``BatchSampler`` of the largest fixed
  batch size that never exceeds the budget, ``max_tokens // max_length`` rows.
* ``random_accum``: the same micro-batches with ``accumulate_grad_batches`` chosen so that an optimizer step holds
  about ``lit_balance``'s target of real tokens (:func:`matched_accumulate`): the convergence control. At one
  micro-batch per step, ``random`` takes about 20x more optimizer steps than ``lit_balance`` for the same real
  tokens and the same learning rate, so its validation loss measures the step count, not the batching.
* ``sorted_buckets``: sort by length (random order among equal lengths), cut into batches of that fixed size,
  shuffle the batch order every epoch, deal round-robin to ranks.
* ``dynamic``: sort by length, fill each micro-batch up to ``max_tokens`` *real* tokens (fairseq-style
  ``batch_by_size``; :func:`benchmarks.peers.sort_fill_batches`), shuffle, deal round-robin.
* ``dynamic_accum``: the same micro-batches with ``Trainer(accumulate_grad_batches=--accumulate)``.
* ``lit_balance``: :class:`lit_balance.BalancedBatchSampler` with
  :class:`~lit_balance.callbacks.AdaptiveGradAccumulation` (target: ``--accumulate`` x ranks x ``max_tokens`` real
  tokens per optimizer step, the nominal step of ``dynamic_accum``), :class:`~lit_balance.callbacks.StragglerMonitor`
  and :class:`~lit_balance.callbacks.CostModelFeedback`.

Equal micro-batch counts: ``random`` and ``random_accum`` drop the last ``len(train) % ranks`` shuffled samples per
epoch (what ``DistributedSampler(drop_last=True)`` does); ``sorted_buckets`` and ``dynamic*`` drop the last
``micro-batches % ranks`` micro-batches of the shuffled order per epoch (:func:`deal_even`). Dropped samples are
never trained and never counted: real tokens are counted from the micro-batches that ran.

Second scenario (``slowed_rank``): ``lit_balance`` with and without ``CostModelFeedback`` while rank
``--slow-rank`` is made ``1 + --slowdown`` times slower by a demo-only hook (it busy-waits ``--slowdown`` x the
wall time of its own compute: forward+loss, backward and the parameter update, but not its waits for the other
ranks: the last backward of an optimizer step, which also waits in DDP's all-reduce, is slowed by the rank's own
backward/forward ratio measured on its ``no_sync`` micro-batches).

Measured per run (rank 0 writes it after one ``all_gather`` at the end of training):

* ``real_tokens_per_s``: real (non-padding) training tokens of all ranks / seconds, the seconds being, per epoch,
  the slowest rank's interval from its first ``on_train_batch_start`` to its last ``on_train_batch_end``
  (start-up and validation excluded), over the epochs after the first (the headline: feedback needs one epoch to
  fit); ``real_tokens_per_s_all_epochs`` over every epoch.
* ``optimizer_steps_per_s`` over the same epochs; ``padding_ratio`` ``1 - real / padded slots`` (all ranks).
* ``straggler_ratio``: max / median over ranks of the summed compute seconds (forward + loss, from
  ``on_train_batch_start`` to ``on_before_backward``, the interval of StragglerMonitor: no collective inside);
  ``step_straggler_ratio``: the same per optimizer step, summed over steps (what ranks wait for).
* ``peak_memory_mb``: the largest rank's peak resident set size (``resource.getrusage``, whole process) on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA; ``max_micro_batch_slots`` and ``over_budget_micro_batches``.
* the loss of every optimizer step against global real tokens trained (``curves.json``), ``loss_step_noise``
  (standard deviation of step-to-step loss differences over the second half of the steps, / sqrt 2), and
  ``val_loss`` after every epoch: the mean over every validation token on all ranks. The validation-loss target
  compares ``lit_balance`` with the ``random_accum`` runs (several seeds; :data:`NOISE_RULE`).

Outputs in ``--output-dir``: ``results.json`` (one object per run), ``curves.json``, ``summary.json`` (the target
ratios and how val-loss noise was judged), ``results.md`` (the table), ``loss_vs_tokens.png``,
``tokens_per_s.png``, and ``logs/<run>.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import lit_balance
from benchmarks._harness import git_state, launch_ranks, non_negative, number, positive_int
from benchmarks._training import REAL, CompareLM, Meter, loss_curve, loss_step_noise, run_stats
from benchmarks.peers import EpochBatchSampler, deal_even, fixed_batch_size, sort_fill_batches, sorted_bucket_batches
from lit_balance import BalancedBatchSampler, PadCollator, TokenDataset
from lit_balance.cache import load_or_build
from lit_balance.callbacks import AdaptiveGradAccumulation, CostModelFeedback, StragglerMonitor
from lit_balance.corpus import resolve_corpus
from lit_balance.tokenizer import resolve_tokenizer

STRATEGIES = ("random", "random_accum", "sorted_buckets", "dynamic", "dynamic_accum", "lit_balance")
#: Strategies that draw micro-batches with torch's DistributedSampler and a fixed batch size.
_DISTRIBUTED_SAMPLER = ("random", "random_accum")
SCENARIOS = ("main", "slowed_rank")
#: DemoTransformerLM sizes: ``small`` is the main job's model (4.3M parameters with the 30,522-token vocabulary),
#: ``bert`` BERT-base's shape (about 110M), ``tiny`` for tests.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 32, "num_heads": 2, "num_layers": 1, "dim_feedforward": 64},
    "small": {"d_model": 128, "num_heads": 4, "num_layers": 2, "dim_feedforward": 512},
    "bert": {"d_model": 768, "num_heads": 12, "num_layers": 12, "dim_feedforward": 3072},
}
#: Per model size, ``(max_tokens, max_length)`` when not given: padded slots per micro-batch per rank, tokens kept.
DEFAULT_BUDGET = {"tiny": (512, 128), "small": (1024, 256), "bert": (16384, 512)}
#: Keys every object of results.json has.
RESULT_KEYS = ("run", "strategy", "scenario", "seed", "status", "real_tokens_per_s", "real_tokens_per_s_all_epochs",
               "optimizer_steps_per_s", "padding_ratio", "straggler_ratio", "step_straggler_ratio", "peak_memory_mb",
               "val_loss", "train_real_tokens")
#: Defaults of a run and of ``--quick`` (7.5-9 minutes on 2 CPU cores): training documents (a seeded subset of the
#: built-in corpus's training split), share of documents held out, epochs of the main scenario, runs of
#: ``random_accum`` with different seeds, and the slowed-rank scenario's epochs and documents (None: ``num_docs``).
#: Feedback can only move work between ranks when an epoch has enough micro-batches: ``--quick`` gives its
#: slowed-rank runs 640 documents (about 20 micro-batches per rank per epoch) and 2 epochs; with 320, 3 epochs it
#: measured 1.00x. 320 main-scenario documents took 10 min 6 s on a slow day (2026-12-01), hence 256.
FULL = {"num_docs": 2000, "val_fraction": 0.05, "epochs": 2, "random_seeds": 3, "slowed_epochs": 3,
        "slowed_num_docs": None}
QUICK = {"num_docs": 256, "val_fraction": 0.02, "epochs": 2, "random_seeds": 2, "slowed_epochs": 2,
         "slowed_num_docs": 640}
_WORKER_FLAG = "--_worker"
#: How the validation-loss target is judged against run-to-run noise.
NOISE_RULE = ("noise = sample standard deviation (ddof=1) of the final validation loss over the `random_accum` runs "
              "with different seeds (model initialisation and data order both change), measured in the same "
              "invocation; `random_accum` is `random` with as many real tokens per optimizer step as lit_balance's "
              "target; lit_balance is no worse beyond noise when its validation loss is at most the mean of those "
              "runs plus twice that deviation")



def matched_accumulate(target_tokens_per_step: int, num_replicas: int, batch_size: int, mean_length: float) -> int:
    """``random_accum``'s ``accumulate_grad_batches``: micro-batches per rank whose real tokens, over all ranks,
    come nearest ``target_tokens_per_step`` (at least 1).

    Args:
        target_tokens_per_step: real tokens per optimizer step to match (global).
        num_replicas: ranks.
        batch_size: rows per micro-batch.
        mean_length: mean real tokens per training document (after truncation).

    Example:
        >>> matched_accumulate(8192, 2, 4, 47.8)  # 21 x 2 x 4 x 47.8 = 8,030 real tokens per step
        21
    """
    per_micro_step = num_replicas * batch_size * mean_length
    return max(1, round(target_tokens_per_step / per_micro_step)) if per_micro_step > 0 else 1



# ------------------------------------------------------------------------------------------------------------------
# Data of one run and the run itself (inside the DDP processes; what it measures: benchmarks._training).


def split_documents(num_docs: int, val_fraction: float, num_train: int | None, seed: int = 0) -> tuple[np.ndarray,
                                                                                                       np.ndarray]:
    """``(train_docs, val_docs)``: a seeded split of corpus documents, the same for every strategy and run.

    Args:
        num_docs: documents in the corpus.
        val_fraction: share held out for validation (at least one document).
        num_train: keep this many training documents (a seeded subset), or None for all.
        seed: data seed (independent of the run's seed, so every run sees the same documents).

    Raises:
        ValueError: nothing left for training, or ``num_train < 1``.
    """
    perm = np.random.default_rng([seed, 0xC0]).permutation(num_docs)
    num_val = max(1, round(val_fraction * num_docs))
    train = perm[num_val:]
    if num_train is not None:
        if num_train < 1:
            raise ValueError(f"num_train must be >= 1, got {num_train}")
        train = train[:num_train]
    if train.size == 0:
        raise ValueError(f"{num_docs} documents, val_fraction={val_fraction}: none left to train on")
    return np.sort(train), np.sort(perm[:num_val])


class CompareData(L.LightningDataModule):
    """The built-in corpus split once; the training loader of one strategy, the same validation loader for all.

    Args:
        strategy: one of :data:`STRATEGIES`.
        max_tokens: padded token slots per micro-batch, per rank.
        max_length: tokens kept per document.
        num_train: training documents (seeded subset), or None for all.
        val_fraction: share of documents held out.
        seed: seed of the samplers (the run's seed).
        cache_dir: tokenization cache (None: lit_balance's default).
    """

    def __init__(self, strategy: str, max_tokens: int, max_length: int, num_train: int | None, val_fraction: float,
                 seed: int, cache_dir: str | None = None) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.strategy, self.max_tokens, self.max_length = strategy, max_tokens, max_length
        self.num_train, self.val_fraction, self.seed, self.cache_dir = num_train, val_fraction, seed, cache_dir
        self.tokenizer = resolve_tokenizer(None)
        self.source = resolve_corpus(None)
        self.vocab_size = self.tokenizer.vocab_size
        self.batch_size = fixed_batch_size(max_tokens, max_length)

    def prepare_data(self) -> None:
        load_or_build(self.source, self.tokenizer, self.cache_dir)

    def datasets(self) -> tuple[TokenDataset, TokenDataset]:
        """``(train, validation)`` documents of the run, truncated to ``max_length``."""
        corpus = load_or_build(self.source, self.tokenizer, self.cache_dir)
        train_docs, val_docs = split_documents(len(corpus), self.val_fraction, self.num_train)
        return (TokenDataset(corpus.token_ids, corpus.offsets, train_docs, self.max_length),
                TokenDataset(corpus.token_ids, corpus.offsets, val_docs, self.max_length))

    def setup(self, stage: str | None = None) -> None:
        self.train_dataset, self.val_dataset = self.datasets()
        world, rank = self.trainer.world_size, self.trainer.global_rank
        lengths = self.train_dataset.lengths
        self.collator = PadCollator(self.tokenizer.pad_token_id)
        self.batch_sampler: Any = None
        if self.strategy in _DISTRIBUTED_SAMPLER:
            self.sampler: Any = DistributedSampler(self.train_dataset, num_replicas=world, rank=rank, shuffle=True,
                                                   seed=self.seed, drop_last=True)
            self.batch_sampler = BatchSampler(self.sampler, self.batch_size, drop_last=False)
        elif self.strategy == "sorted_buckets":
            self.sampler = EpochBatchSampler(partial(sorted_bucket_batches, lengths, self.batch_size, self.seed),
                                             world, rank)
        elif self.strategy in ("dynamic", "dynamic_accum"):
            self.sampler = EpochBatchSampler(partial(sort_fill_batches, lengths, self.max_tokens, self.seed), world, rank)
        else:
            self.sampler = BalancedBatchSampler(lengths, self.max_tokens, num_replicas=world, rank=rank, seed=self.seed)
        self.val_sampler = BalancedBatchSampler(self.val_dataset.lengths, self.max_tokens, num_replicas=world,
                                                rank=rank, shuffle=False, seed=0)

    def planned_tokens(self, epoch: int) -> tuple[int, int]:
        """``(samples, real tokens)`` the strategy plans to train in ``epoch`` (global, after dropping for equal
        counts); compared with what the run really trained."""
        lengths = self.train_dataset.lengths
        if self.strategy in _DISTRIBUTED_SAMPLER:
            kept = set()
            for r in range(self.sampler.num_replicas):
                other = DistributedSampler(self.train_dataset, num_replicas=self.sampler.num_replicas, rank=r,
                                           shuffle=True, seed=self.seed, drop_last=True)
                other.set_epoch(epoch)
                kept.update(other)
            idx = np.fromiter(kept, dtype=np.int64)
        elif isinstance(self.sampler, EpochBatchSampler):
            per_rank, _ = deal_even(self.sampler.build(epoch), self.sampler.num_replicas)
            idx = np.array([i for batches in per_rank for b in batches for i in b], dtype=np.int64)
        else:  # BalancedBatchSampler, drop_last=False: every sample every epoch, whatever the speeds
            idx = np.arange(len(lengths), dtype=np.int64)
        return int(idx.size), int(lengths[idx].sum())

    def train_dataloader(self) -> DataLoader:
        """A new loader every epoch (``reload_dataloaders_every_n_epochs=1``) over this rank's sampler.

        Lightning (2.6, ``_FitLoop.on_advance_start``) reads the loader's length before it calls ``set_epoch``;
        a :class:`BalancedBatchSampler` given new rank speeds by CostModelFeedback plans the next epoch with them
        only at ``set_epoch``, and that plan can be longer, so Lightning would end the epoch early and skip its
        last micro-batches. Selecting the epoch here first gives Lightning the right length (for every strategy
        alike; Lightning's own ``set_epoch`` with the same epoch then changes nothing).
        """
        self.sampler.set_epoch(self.trainer.current_epoch)
        if self.batch_sampler is not None:
            return DataLoader(self.train_dataset, batch_sampler=self.batch_sampler, collate_fn=self.collator)
        return DataLoader(self.train_dataset, sampler=self.sampler, batch_size=None, collate_fn=self.collator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, sampler=self.val_sampler, batch_size=None, collate_fn=self.collator)



def run_worker(spec_path: Path) -> None:
    """Train one strategy as described by the JSON spec at ``spec_path``; rank 0 writes ``spec["result_path"]``."""
    spec = json.loads(Path(spec_path).read_text())
    L.seed_everything(spec["seed"], verbose=False)
    data = CompareData(spec["strategy"], spec["max_tokens"], spec["max_length"], spec["num_docs"],
                       spec["val_fraction"], spec["seed"], spec.get("cache_dir"))
    slowed = spec["scenario"] == "slowed_rank"
    model = CompareLM(slow_rank=spec["slow_rank"] if slowed else None, slowdown=spec["slowdown"] if slowed else 0.0,
                      vocab_size=data.vocab_size, lr=spec["lr"], **MODEL_SIZES[spec["model_size"]])
    meter = Meter()
    callbacks: list[L.Callback] = [meter]
    accumulate = 1
    if spec["strategy"] == "dynamic_accum":
        accumulate = spec["accumulate"]
    elif spec["strategy"] == "random_accum":
        lengths = data.datasets()[0].lengths
        accumulate = matched_accumulate(spec["target_tokens_per_step"], spec["devices"], data.batch_size,
                                        float(lengths.mean()) if lengths.size else 0.0)
    adaptive = None
    if spec["strategy"] == "lit_balance":
        adaptive = AdaptiveGradAccumulation(target_tokens_per_step=spec["target_tokens_per_step"])
        callbacks += [StragglerMonitor(log_every_n_micro_batches=50, warn_ratio=10.0), adaptive]
        if spec["feedback"]:
            callbacks.append(CostModelFeedback())
    trainer = L.Trainer(
        accelerator=spec["accelerator"], devices=spec["devices"], precision=spec["precision"],
        strategy=DDPStrategy(timeout=timedelta(seconds=spec["ddp_timeout_s"])), max_epochs=spec["epochs"],
        accumulate_grad_batches=accumulate, callbacks=callbacks, use_distributed_sampler=False,
        reload_dataloaders_every_n_epochs=1,  # CostModelFeedback's rank speeds can lengthen an epoch; all alike
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    if not trainer.is_global_zero:
        return
    stats = run_stats(meter.gathered, meter.epoch_intervals, meter.peak_memory_mb, spec["max_tokens"])
    planned = [data.planned_tokens(e)[1] for e in range(spec["epochs"])]
    if stats["real_tokens_per_epoch"] != planned:
        print(f"WARNING: trained real tokens per epoch {stats['real_tokens_per_epoch']} differ from the planned "
              f"{planned}", flush=True)
    tokens, losses = loss_curve(model.step_losses, meter.gathered)
    cum = np.concatenate([[0.0], np.cumsum(meter.gathered[:, :, REAL].sum(axis=0))])
    val = [{"epoch": e, "tokens": float(cum[m]), "val_loss": v} for e, m, v in model.val_losses]
    result = {
        **{k: spec[k] for k in ("run", "strategy", "scenario", "seed", "feedback")}, "status": "ok", **stats,
        "val_loss": val[-1]["val_loss"] if val else float("nan"), "val_losses": val,
        "loss_step_noise": loss_step_noise(losses), "final_train_loss": losses[-1] if losses else float("nan"),
        "all_planned_tokens_trained": stats["real_tokens_per_epoch"] == planned,
        "planned_real_tokens_per_epoch": planned, "trained_real_tokens_per_epoch": stats.pop("real_tokens_per_epoch"),
        "dropped_samples_per_epoch": [len(data.train_dataset) - data.planned_tokens(e)[0]
                                      for e in range(spec["epochs"])],
        "dropped_tokens_per_epoch": [int(data.train_dataset.lengths.sum()) - t for t in planned],
        "train_documents": len(data.train_dataset), "world_size": trainer.world_size,
        "fixed_batch_size": data.batch_size if spec["strategy"] in (*_DISTRIBUTED_SAMPLER, "sorted_buckets") else None,
        "accumulate_grad_batches": (sorted({h[2] for h in adaptive.history}) if adaptive is not None
                                    else [accumulate]),
        "planned_rank_speeds_per_epoch": [meter.planned_speeds.get(e) for e in range(spec["epochs"])],
        "curve": {"tokens": tokens, "loss": losses},
    }
    Path(spec["result_path"]).write_text(json.dumps(result))


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, default=Path("compare_strategies_out"),
                   help="where results.json, the plots and logs go (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"smaller run: {QUICK['num_docs']} training documents, {QUICK['epochs']} epochs, "
                        f"{QUICK['random_seeds']} random_accum seeds (under 10 minutes on 2 CPU cores)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                   help="strategies of the main scenario (default: all)")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                   help="main: every strategy; slowed_rank: lit_balance with/without feedback, one rank slowed")
    p.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default: %(default)s)")
    p.add_argument("--devices", type=positive_int, default=2, help="ranks (default: %(default)s)")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed on GPUs "
                   "(default: %(default)s)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="small: the main job's 4.3M-parameter LM; bert: BERT-base's shape, for GPUs "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="padded token slots per micro-batch, per rank (default: 1024; bert: 16384)")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="tokens kept per document (default: 256; bert: 512)")
    p.add_argument("--num-docs", type=positive_int, default=None,
                   help=f"training documents, a seeded subset (default: {FULL['num_docs']}; --quick: "
                        f"{QUICK['num_docs']}); more than the split holds means all")
    p.add_argument("--val-fraction", type=number(lambda v: 0 < v < 1, "a number in (0, 1)"), default=None,
                   help=f"documents held out (default: {FULL['val_fraction']}; --quick: {QUICK['val_fraction']})")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help=f"epochs of every main-scenario run; >= 2 for the after-first-epoch headline (default: "
                        f"{FULL['epochs']})")
    p.add_argument("--slowed-epochs", type=positive_int, default=None,
                   help="epochs of the slowed-rank runs: feedback fits in the first, the headline counts the others "
                        f"(default: {FULL['slowed_epochs']}; --quick: {QUICK['slowed_epochs']})")
    p.add_argument("--slowed-num-docs", type=positive_int, default=None,
                   help="training documents of the slowed-rank runs (default: --num-docs; --quick: "
                        f"{QUICK['slowed_num_docs']})")
    p.add_argument("--random-seeds", type=positive_int, default=None,
                   help="runs of `random_accum` with seeds seed, seed+1, ...: their spread is the val-loss noise "
                        f"(default: {FULL['random_seeds']}; --quick: {QUICK['random_seeds']})")
    p.add_argument("--accumulate", type=positive_int, default=4,
                   help="dynamic_accum's accumulate_grad_batches; lit_balance targets this many global budgets "
                        "of real tokens per optimizer step, and random_accum accumulates to about as many "
                        "(default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of every run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="model and sampler seed of every run (default: %(default)s)")
    p.add_argument("--slowdown", type=non_negative, default=0.5,
                   help="slowed_rank: extra share of time the slowed rank busy-waits (0.5: 1.5x slower)")
    p.add_argument("--slow-rank", type=int, default=1, help="slowed_rank: the rank slowed (default: %(default)s)")
    p.add_argument("--timeout-s", type=positive_int, default=3600,
                   help="per-run subprocess timeout, seconds (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="tokenization cache (default: lit_balance's)")
    p.add_argument(_WORKER_FLAG, dest="worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def resolve_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill size- and mode-dependent defaults and check combinations; ``parser.error`` on bad input."""
    preset = QUICK if args.quick else FULL
    max_tokens, max_length = DEFAULT_BUDGET[args.model_size]
    args.max_tokens = args.max_tokens or max_tokens
    args.max_length = args.max_length or max_length
    args.num_docs = args.num_docs or preset["num_docs"]
    args.val_fraction = args.val_fraction or preset["val_fraction"]
    args.epochs = args.epochs or preset["epochs"]
    args.slowed_epochs = args.slowed_epochs or preset["slowed_epochs"]
    args.slowed_num_docs = args.slowed_num_docs or preset["slowed_num_docs"] or args.num_docs
    args.random_seeds = args.random_seeds or preset["random_seeds"]
    if args.max_length > args.max_tokens:
        parser.error(f"--max-length {args.max_length} exceeds --max-tokens {args.max_tokens}: no fixed batch size "
                     "fits the budget")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if "slowed_rank" in args.scenarios:
        if args.devices < 2:
            parser.error("the slowed_rank scenario needs --devices >= 2; pass --scenarios main for one device")
        if not 0 <= args.slow_rank < args.devices:
            parser.error(f"--slow-rank must be in [0, {args.devices}), got {args.slow_rank}")
    if args.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        parser.error(f"--accelerator {args.accelerator}: no CUDA device is available here; use --accelerator cpu")
    args.strategies = list(dict.fromkeys(args.strategies))
    args.scenarios = list(dict.fromkeys(args.scenarios))
    return args


def plan_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One spec per subprocess: the main strategies, extra `random_accum` seeds (noise), the slowed-rank pair.

    Order: the main strategies, one extra `random_accum` seed, the slowed-rank pair, the other `random_accum`
    seeds (so a stretch of load on a shared machine does not hit all of them).
    """
    common = {k: getattr(args, k) for k in ("accelerator", "devices", "precision", "model_size", "max_tokens",
                                            "max_length", "num_docs", "val_fraction", "epochs", "accumulate", "lr",
                                            "slowdown", "slow_rank", "cache_dir")}
    common["target_tokens_per_step"] = args.accumulate * args.devices * args.max_tokens
    common["ddp_timeout_s"] = min(args.timeout_s, 600)
    runs, extra, slowed = [], [], []
    if "main" in args.scenarios:
        for s in args.strategies:
            runs.append({**common, "run": s, "strategy": s, "scenario": "main", "seed": args.seed, "feedback": True})
        if "random_accum" in args.strategies:
            extra = [{**common, "run": f"random_accum_seed{args.seed + i}", "strategy": "random_accum",
                      "scenario": "main", "seed": args.seed + i, "feedback": True} for i in range(1, args.random_seeds)]
    if "slowed_rank" in args.scenarios:
        slowed = [{**common, "epochs": args.slowed_epochs, "num_docs": args.slowed_num_docs,
                   "run": f"lit_balance_slowed_{'feedback' if feedback else 'no_feedback'}",
                   "strategy": "lit_balance", "scenario": "slowed_rank", "seed": args.seed, "feedback": feedback}
                  for feedback in (False, True)]
    return runs + extra[:1] + slowed + extra[1:]



def launch(spec: dict[str, Any], out_dir: Path, timeout_s: int, worker: Sequence[str] | None = None) -> dict[str, Any]:
    """Run one spec as ``spec["devices"]`` ranks under ``torchrun`` (:func:`benchmarks._harness.launch_ranks`:
    every rank is stopped when one fails or time runs out, so none waits forever for a collective); return its
    result dict.

    ``worker``: what each rank runs, before the spec's path (default: this module with the hidden worker flag).
    """
    worker = list(worker or ["-m", "benchmarks.compare_strategies", _WORKER_FLAG])
    runs_dir, logs_dir = out_dir / "runs", out_dir / "logs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    logs_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "result_path": str((runs_dir / f"{spec['run']}.json").resolve())}
    Path(spec["result_path"]).unlink(missing_ok=True)
    spec_path = runs_dir / f"{spec['run']}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    status, rc = launch_ranks([*worker, str(spec_path.resolve())], spec["devices"], logs_dir / f"{spec['run']}.log",
                              out_dir, timeout_s)
    wall = time.perf_counter() - start
    result_path = Path(spec["result_path"])
    if status == "ok" and (rc != 0 or not result_path.exists()):
        status = "failed"
    if status != "ok":
        tail = (logs_dir / f"{spec['run']}.log").read_text(errors="replace")[-2000:]
        result: dict[str, Any] = {k: spec[k] for k in ("run", "strategy", "scenario", "seed", "feedback")}
        result.update({"status": status, "returncode": rc, "log_tail": tail})
        for key in RESULT_KEYS:
            result.setdefault(key, None)
    else:
        result = json.loads(result_path.read_text())
    result["subprocess_wall_s"] = wall
    result["load_avg_1min_before"] = load_before
    result["load_avg_1min_after"] = os.getloadavg()[0]
    return result


def _ok(results: list[dict[str, Any]], run: str) -> dict[str, Any] | None:
    r = next((r for r in results if r["run"] == run), None)
    return r if r is not None and r["status"] == "ok" else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def evaluate_targets(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The target ratios of the specification, each with its measured value and whether it was met.

    Val-loss noise: :data:`NOISE_RULE`.
    """
    lb, rnd, dyn = _ok(results, "lit_balance"), _ok(results, "random"), _ok(results, "dynamic")
    targets: dict[str, Any] = {}

    def put(name: str, value: float | None, ok: bool | None, rule: str, **extra: Any) -> None:
        targets[name] = {"value": value, "met": ok, "rule": rule, **extra}

    if lb and rnd:
        v = _ratio(lb["real_tokens_per_s"], rnd["real_tokens_per_s"])
        put("tokens_per_s_vs_random", v, v >= 3.0, "lit_balance / random real tokens/s >= 3",
            whole_run=_ratio(lb["real_tokens_per_s_all_epochs"], rnd["real_tokens_per_s_all_epochs"]))
    if lb and dyn:
        v = _ratio(lb["real_tokens_per_s"], dyn["real_tokens_per_s"])
        put("tokens_per_s_vs_dynamic", v, v >= 1.05, "lit_balance / dynamic real tokens/s >= 1.05",
            whole_run=_ratio(lb["real_tokens_per_s_all_epochs"], dyn["real_tokens_per_s_all_epochs"]))
        v = _ratio(lb["peak_memory_mb"], dyn["peak_memory_mb"])
        put("peak_memory_vs_dynamic", v, v <= 1.02, "lit_balance / dynamic peak memory <= 1.02")
    if lb:
        put("micro_batches_over_budget", lb["over_budget_micro_batches"], lb["over_budget_micro_batches"] == 0,
            f"lit_balance micro-batches above {args.max_tokens} padded slots == 0",
            max_micro_batch_slots=lb["max_micro_batch_slots"])
        put("straggler_ratio", lb["straggler_ratio"], lb["straggler_ratio"] <= 1.05,
            "lit_balance max/median per-rank compute s <= 1.05", step_straggler_ratio=lb["step_straggler_ratio"])
    seeds = [r for r in results if r["strategy"] == "random_accum" and r["scenario"] == "main"
             and r["status"] == "ok"]
    if lb and len(seeds) >= 2:
        vals = np.array([r["val_loss"] for r in seeds])
        mean, std = float(vals.mean()), float(vals.std(ddof=1))
        diff = lb["val_loss"] - mean
        put("val_loss_vs_random", diff, diff <= 2 * std, "lit_balance val_loss - mean(random_accum seeds) <= 2 x "
            "std(random_accum seeds) (random batches, about the same real tokens per optimizer step)",
            random_accum_val_losses=vals.tolist(), random_accum_mean=mean, random_accum_std=std,
            lit_balance_val_loss=lb["val_loss"], real_tokens_per_step=[lb.get("real_tokens_per_optimizer_step"),
                                                                       seeds[0].get("real_tokens_per_optimizer_step")])
    # not targets: `random` takes one micro-batch per optimizer step (about 20x the steps of lit_balance at the same
    # learning rate); `dynamic_accum` about lit_balance's real tokens per step, with other micro-batches
    for name in ("random", "dynamic_accum"):
        other = _ok(results, name)
        if lb and other:
            put(f"val_loss_vs_{name}_run", lb["val_loss"] - other["val_loss"], None,
                f"informational, not a target: lit_balance - {name} val_loss",
                **{f"{name}_val_loss": other["val_loss"]},
                real_tokens_per_step=[lb.get("real_tokens_per_optimizer_step"),
                                      other.get("real_tokens_per_optimizer_step")])
    no_fb, fb = _ok(results, "lit_balance_slowed_no_feedback"), _ok(results, "lit_balance_slowed_feedback")
    if no_fb and fb:
        v = _ratio(fb["real_tokens_per_s"], no_fb["real_tokens_per_s"])
        per_slot = no_fb["compute_s_per_padded_slot_per_rank"]
        fast = min(per_slot)
        slow = per_slot[args.slow_rank]
        speed = fast / slow if slow > 0 else 1.0  # measured relative speed of the slowed rank (forward + loss)
        n = len(per_slot)
        ideal = (1 / speed) / (n / (n - 1 + speed))  # equal split vs split proportional to speed
        put("feedback_vs_no_feedback", v, v >= 1.18, "slowed rank: feedback / no feedback real tokens/s >= 1.18 "
            "(epochs after the first)", whole_run=_ratio(fb["real_tokens_per_s_all_epochs"],
                                                          no_fb["real_tokens_per_s_all_epochs"]),
            measured_slow_rank_speed=speed, ideal_for_measured_speed=ideal)
    return targets


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def markdown_table(results: list[dict[str, Any]], max_tokens: int) -> str:
    """The per-run table (Markdown), in run order."""
    head = ["run", "scenario", "real tokens/s (epochs >= 1)", "real tokens/s (all)", "optimizer steps/s",
            "padding ratio", "straggler ratio (run / per step)", "peak memory MB (max rank)",
            f"largest micro-batch (budget {max_tokens})", "loss step noise", "val loss", "train real tokens",
            "optimizer steps", "accumulate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['run']} | {r['scenario']} | {r['status']} |" + " - |" * (len(head) - 3))
            continue
        acc = r.get("accumulate_grad_batches") or []
        lines.append("| " + " | ".join([
            r["run"], r["scenario"], _fmt(r["real_tokens_per_s"], 0), _fmt(r["real_tokens_per_s_all_epochs"], 0),
            _fmt(r["optimizer_steps_per_s"], 2), _fmt(r["padding_ratio"]),
            f"{_fmt(r['straggler_ratio'])} / {_fmt(r['step_straggler_ratio'])}", _fmt(r["peak_memory_mb"], 0),
            f"{r['max_micro_batch_slots']} ({r['over_budget_micro_batches']} over)", _fmt(r["loss_step_noise"]),
            _fmt(r["val_loss"]), f"{r['train_real_tokens']:,}", str(r["optimizer_steps"]),
            "-".join(map(str, [min(acc), max(acc)])) if acc and min(acc) != max(acc) else str(acc[0] if acc else "-"),
        ]) + " |")
    return "\n".join(lines)


def targets_text(targets: dict[str, Any]) -> str:
    """One line per target: value, rule, met or not."""
    lines = []
    for name, t in targets.items():
        met = {True: "met", False: "NOT met", None: "not judged"}[t["met"]]
        extra = ", ".join(f"{k} {_fmt(v) if not isinstance(v, list) else '[' + ', '.join(map(_fmt, v)) + ']'}"
                          for k, v in t.items() if k not in ("value", "met", "rule"))
        lines.append(f"- {name}: {_fmt(t['value'])} ({t['rule']}): {met}" + (f"; {extra}" if extra else ""))
    return "\n".join(lines)


COLORS = {"random": "tab:gray", "random_accum": "tab:green", "sorted_buckets": "tab:brown", "dynamic": "tab:orange",
          "dynamic_accum": "tab:red", "lit_balance": "tab:blue"}


def plot(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``loss_vs_tokens.png`` (main scenario: step loss, smoothed, and validation loss after each epoch, against
    global real training tokens) and ``tokens_per_s.png`` (real tokens/s of every run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in (r for r in ok if r["scenario"] == "main"):
        tokens, loss = np.array(r["curve"]["tokens"]), np.array(r["curve"]["loss"])
        if tokens.size == 0:
            continue
        window = max(1, tokens.size // 40)  # a moving mean over 1/40 of the run's steps
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        extra = r["run"] != r["strategy"]
        ax.plot(tokens[window - 1:], smooth, color=COLORS[r["strategy"]], alpha=0.45 if extra else 1.0,
                lw=1.0 if extra else 1.6, label=r["run"])
        ax.plot([v["tokens"] for v in r["val_losses"]], [v["val_loss"] for v in r["val_losses"]], "o",
                color=COLORS[r["strategy"]], alpha=0.45 if extra else 1.0, ms=5)
    ax.set_xlabel("real training tokens (all ranks)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("training loss (moving mean of optimizer steps) and validation loss (dots, epoch ends)")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out_dir / "loss_vs_tokens.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [r["run"] for r in ok]
    head = [r["real_tokens_per_s"] for r in ok]
    whole = [r["real_tokens_per_s_all_epochs"] for r in ok]
    y = np.arange(len(ok))
    ax.barh(y, head, color=[COLORS[r["strategy"]] for r in ok], label="epochs after the first")
    ax.plot(whole, y, "k|", ms=14, label="all epochs")
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("real tokens / s (all ranks)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "tokens_per_s.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def _machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "lightning": L.__version__, "numpy": np.__version__, "lit_balance": lit_balance.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _commit() -> str | None:
    commit, dirty = git_state("benchmarks", "lit_balance")
    return None if commit is None else commit[:7] + ("+local changes" if dirty else "")


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    """Parse the command line; run the benchmark (parent) or one run (hidden worker flag).

    Returns:
        The results list (parent), or None (worker).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        run_worker(args.worker)
        return None
    args = resolve_args(args, parser)
    start = time.perf_counter()
    out_dir = args.output_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([str(Path(sys.argv[0])), *(argv if argv is not None else sys.argv[1:])])
    # tokenize once here, so the runs only load the cache
    corpus = load_or_build(resolve_corpus(None), resolve_tokenizer(None), args.cache_dir)
    train_docs, val_docs = split_documents(len(corpus), args.val_fraction, args.num_docs)
    lengths = np.minimum(corpus.lengths, args.max_length)
    print(f"world size {args.devices} ({args.accelerator}) | budget {args.max_tokens} padded slots per micro-batch "
          f"per rank | max_length {args.max_length} | fixed batch size {fixed_batch_size(args.max_tokens, args.max_length)} "
          f"rows | {len(train_docs)} training documents ({int(lengths[train_docs].sum()):,} tokens), "
          f"{len(val_docs)} validation | {args.epochs} epochs | slowed-rank runs: {args.slowed_epochs} epochs, "
          f"{args.slowed_num_docs} documents | model "
          f"{args.model_size} | lr {args.lr} | "
          f"lit_balance target {args.accumulate * args.devices * args.max_tokens} real tokens per optimizer step",
          flush=True)
    results = []
    for spec in plan_runs(args):
        r = launch(spec, out_dir, args.timeout_s)
        results.append(r)
        if r["status"] == "ok":
            print(f"{r['run']:>32}: {r['real_tokens_per_s']:8.0f} real tokens/s (all epochs "
                  f"{r['real_tokens_per_s_all_epochs']:.0f}) | padding {r['padding_ratio']:.3f} | straggler "
                  f"{r['straggler_ratio']:.3f} | peak {r['peak_memory_mb']:.0f} MB | val loss {r['val_loss']:.4f} | "
                  f"{r['subprocess_wall_s']:.0f} s", flush=True)
        else:
            print(f"{r['run']:>32}: {r['status']} after {r['subprocess_wall_s']:.0f} s (see logs/{r['run']}.log)",
                  flush=True)
    curves = {r["run"]: r.pop("curve") for r in results if "curve" in r}
    targets = evaluate_targets(results, args)
    table = markdown_table(results, args.max_tokens)
    wall = time.perf_counter() - start
    summary = {
        "command": command, "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall, "commit": _commit(), "machine": _machine(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
        "train_documents": len(train_docs), "train_tokens_per_epoch": int(lengths[train_docs].sum()),
        "validation_documents": len(val_docs), "targets": targets,
        "val_loss_noise": NOISE_RULE,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "curves.json").write_text(json.dumps({r: c for r, c in curves.items()}))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    for r in results:
        r["curve"] = curves.get(r["run"], {"tokens": [], "loss": []})
    plot(results, out_dir)
    for r in results:
        r.pop("curve")
    text = f"{table}\n\n{targets_text(targets)}\n"
    (out_dir / "results.md").write_text(text)
    print(text + f"\nwall time {wall:.0f} s; results in {out_dir}", flush=True)
    return results


if __name__ == "__main__":
    main()
