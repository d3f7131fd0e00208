"""End-to-end strategy table: the same LM, corpus and optimizer under seven batching strategies, in interleaved pairs.

Run:
    python -m research.compare_strategies          # 3 pairs, 2 CPU DDP ranks, every strategy (41 min here)
    python -m research.compare_strategies --quick  # 2 pairs, fewer documents (sized for under 10 min on 2 cores)
    python -m research.compare_strategies --accelerator gpu --devices 4 --model-size bert --precision bf16-mixed

Every run trains :class:`lit_balance.demo.DemoTransformerLM` (token-weighted loss, AdamW with the same learning rate)
for the same number of epochs over the same training documents of the built-in corpus (Python standard library
docstrings, BERT-uncased WordPiece, truncated to ``--max-length`` tokens), with the same per-rank budget of
``--max-tokens`` token slots per micro-batch (padded slots; packed: tokens), and is validated on the same held-out
documents after the last epoch. The documents are a seeded split (:func:`benchmarks._training.split_documents`), the
same for every run; each run's data is :class:`lit_balance.BalancedTextDataModule` over its training documents and
over its validation documents (:class:`CompareData`), which cache, truncate and batch alike for every strategy; a
baseline strategy replaces only the training batches. Each run is one job of ``--devices`` ranks under torch's own
launcher (``python -m torch.distributed.run``, each rank running this module again with a hidden worker flag) with a
timeout; the parent collects one JSON file and one trace per run.

Strategies (:data:`STRATEGIES`):

* ``random``: torch ``DistributedSampler`` (shuffle, ``drop_last=True``) + ``BatchSampler`` of the largest fixed
  batch size that never exceeds the budget, ``max_tokens // max_length`` rows, padded
  (:class:`lit_balance.PadCollator`).
* ``sorted_buckets``: sort by length (random order among equal lengths), cut into batches of that fixed size,
  shuffle the batch order every epoch, deal round-robin to ranks.
* ``dynamic``: sort by length, fill each micro-batch up to ``max_tokens`` *real* tokens (fairseq-style
  ``batch_by_size``; :func:`benchmarks.peers.sort_fill_batches`), shuffle, deal round-robin.
* ``dynamic_accum``: the same micro-batches with ``Trainer(accumulate_grad_batches=--accumulate)``.
* ``lit_balance``: the DataModule's own :class:`lit_balance.BalancedBatchSampler` (padded rows) with
  :class:`~lit_balance.callbacks.AdaptiveGradAccumulation` (target: ``--accumulate`` x ranks x ``max_tokens`` real
  tokens per optimizer step, the nominal step of ``dynamic_accum``), :class:`~lit_balance.callbacks.StragglerMonitor`
  and :class:`~lit_balance.callbacks.CostModelFeedback`.
* ``lit_balance_packed``: the same with ``packing=True``: each micro-batch is one
  :class:`lit_balance.PackedCollator` row of whole documents, at most ``max_tokens`` tokens, attended within each
  document by the model (``docs/packed_batches.md``).
* ``hf_flatten``: Hugging Face flattening over random samples: ``DistributedSampler`` (as ``random``) +
  ``BatchSampler`` of :func:`benchmarks.peers.flattening_batch_size` documents (the mean packed row is about
  the budget), concatenated into one packed row. The row is built by :class:`lit_balance.PackedCollator`, whose
  layout is that of ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (checked equal in
  ``tests/data/test_collate_packed.py``) plus the token counts the meter reads; a row passes the budget whenever its
  documents run long (counted in ``over_budget_micro_batches``).

Slowed rank (scenario ``slowed_rank``): ``lit_balance`` with and without ``CostModelFeedback`` while rank
``--slow-rank`` is made ``1 + --slowdown`` times slower by a demo-only hook (it waits ``--slowdown`` x the
wall time of its own compute: forward+loss, backward and the parameter update, but not its waits for the other
ranks). Feedback re-plans at each epoch start (the sampler's ``set_epoch``) from the costs it fitted in the epoch
before, so resume stays exact; the headline counts the epochs after the first.

Pairs: round ``k`` (``pair`` = k, 1-based; ``--pairs``, default 3, ``--quick`` 2) runs every selected strategy
once, then the two slowed-rank runs, forward in odd-numbered pairs and in reverse order in even-numbered ones, so
drift of the shared machine's load hits every strategy alike. Every run of every pair trains the same documents;
pair ``k`` seeds every run's model and sampler with ``--seed + k - 1``. Per pair the ratios of
:func:`pair_ratios` (``lit_balance / random``, ``lit_balance / dynamic``, ``lit_balance_packed / lit_balance``,
``feedback / no_feedback``, every strategy over ``lit_balance``); each headline is the median over pairs with its
min and max.

Measured per run (rank 0 writes it after one ``all_gather`` at the end of training; :mod:`research._training`):

* ``real_tokens_per_s``: real (non-padding, non-fill) training tokens of all ranks / seconds, the seconds being,
  per epoch, the slowest rank's interval from its first ``on_train_batch_start`` to its last
  ``on_train_batch_end`` (start-up and validation excluded), over the epochs after the first (the headline:
  feedback needs one epoch to fit); ``real_tokens_per_s_all_epochs`` over every epoch.
* ``optimizer_steps_per_s`` over the same epochs; ``padding_ratio`` ``1 - real / padded slots`` (all ranks).
* ``straggler_ratio``: max / median over ranks of the summed compute seconds (forward + loss, from
  ``on_train_batch_start`` to ``on_before_backward``: no collective inside); ``step_straggler_ratio``: the same
  per optimizer step, summed over steps (what ranks wait for).
* ``peak_memory_mb``: the largest rank's peak resident set size (``resource.getrusage``, whole process) on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA; ``max_micro_batch_slots`` and ``over_budget_micro_batches``
  (micro-batches above ``--max-tokens`` slots).
* ``val_loss`` after the last epoch (the mean over every validation token on all ranks); each optimizer step's
  loss against global real tokens (``curves.json``).
* the micro-batch trace (:data:`benchmarks._training.TRACE_FIELDS`, float64 ``[world_size, n, 9]``), saved in
  ``traces.npz`` under the run's name.
* ``predicted_real_tokens_per_s`` and ``calibration_error`` (predicted / measured - 1): the time model
  (:mod:`benchmarks.time_model`) fitted on the traces of every measured run of this invocation.

Projection: the fitted costs applied to every strategy's plans at 8, 64 and 512 ranks (same budgets) on the main
job's corpus lengths (the built-in corpus's training documents, truncated to ``--max-length``) and on the three
distributions shipped in ``lit_balance/data/lengths/`` (:func:`benchmarks.time_model.project`); a projection from
measured costs, not a measurement.

Outputs in ``--output-dir``: ``results.json`` (one object per run), ``summary.json`` (per-pair ratios with median
and min-max, targets, the calibration error of each run, the fitted time model, command, commit, machine, date,
wall time), ``projection.json``, ``traces.npz``, ``curves.json``, ``results.md`` (every table, ready for a docs
page, with command, commit, machine and date at the top), ``tokens_per_s.png`` (per run, by pair),
``loss_vs_tokens.png``, ``calibration.png`` and ``projection.png``, and ``logs/<run>.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from benchmarks._harness import (
    load_lengths,
    machine,
    markdown_table,
    number,
    positive_int,
)
from research._training import (
    MODEL_SIZES,
    REAL,
    CompareLM,
    Meter,
    corpus_documents,
    loss_curve,
    make_trainer,
    run_stats,
)
from benchmarks.peers import flattening_batch_size
from benchmarks.peers import fixed_batch_size, sort_fill_batches
from research.strategies import EpochBatchSampler, deal_even, sorted_bucket_batches
from research._runs import commit_label, launch_run

#: An argparse ``type``: a finite number >= 0.
non_negative = number(lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0")
from lit_balance import BalancedTextDataModule, PackedCollator, PadCollator
from lit_balance.callbacks import AdaptiveGradAccumulation, CostModelFeedback, StragglerMonitor
from lit_balance.data import resolve_tokenizer

STRATEGIES = ("random", "sorted_buckets", "dynamic", "dynamic_accum", "lit_balance", "lit_balance_packed",
              "hf_flatten")
#: Strategies that draw micro-batches with torch's DistributedSampler and a fixed batch size.
_DISTRIBUTED_SAMPLER = ("random", "hf_flatten")
#: Strategies whose micro-batch is one packed row of documents.
_PACKED = ("lit_balance_packed", "hf_flatten")
#: Strategies trained on the DataModule's own sampler, with lit_balance's callbacks (adaptive accumulation,
#: straggler monitor, feedback).
_LIT_BALANCE = ("lit_balance", "lit_balance_packed")
SCENARIOS = ("main", "slowed_rank")
#: Per model size, ``(max_tokens, max_length)`` when not given: token slots per micro-batch per rank, tokens kept.
DEFAULT_BUDGET = {"tiny": (512, 128), "small": (1024, 256), "bert": (16384, 512)}
#: Keys every object of results.json has.
RESULT_KEYS = ("run", "strategy", "scenario", "pair", "seed", "feedback", "status", "real_tokens_per_s",
               "real_tokens_per_s_all_epochs", "optimizer_steps_per_s", "padding_ratio", "straggler_ratio",
               "step_straggler_ratio", "peak_memory_mb", "val_loss", "train_real_tokens", "max_micro_batch_slots",
               "over_budget_micro_batches", "predicted_real_tokens_per_s", "calibration_error")
#: Defaults of a run and of ``--quick``: training documents (a seeded subset of the built-in corpus's training
#: split), share of documents held out, epochs of the main scenario, pairs, and the slowed-rank scenario's epochs
#: and documents (None: ``num_docs``). Feedback can only move work between ranks when an epoch has enough
#: micro-batches (about 20 per rank per epoch, 640 documents; with 320 it measured 1.00x): the default's slowed-rank
#: runs have 960 documents (about 24 per rank), ``--quick``'s 400 (about 12: it shows the pipeline runs, not what
#: feedback recovers). Headlines count the epochs after the first: on 2 shared cores one epoch's tokens/s moved by
#: 5-10 % between epochs of one run (2026-12-02), as much as the slowed rank's whole expected gain, so the default
#: counts two epochs of every main run and three of every slowed run. Sized from runs of 2026-12-02 on the quiet
#: machine: one epoch takes about 53 s random, 25 s sorted_buckets, 15-16 s the others, 26 s a slowed run, plus
#: about 14 s of start-up per run (Lightning's import in each rank, the process group, validation): about 13
#: minutes per default pair.
FULL = {"num_docs": 800, "val_fraction": 0.05, "epochs": 3, "pairs": 3, "slowed_epochs": 4, "slowed_num_docs": 960}
QUICK = {"num_docs": 96, "val_fraction": 0.01, "epochs": 2, "pairs": 2, "slowed_epochs": 2, "slowed_num_docs": 400}
#: The distributions shipped with the package, projected besides the main job's corpus.
SHIPPED_LENGTHS = ("stdlib_docstrings", "pydocs_paragraphs", "fortunes")
#: Name of the main job's corpus in projection rows.
MAIN_CORPUS = "main_job_corpus"
_WORKER_FLAG = "--_worker"


# ------------------------------------------------------------------------------------------------------------------
# Data of one run and the run itself (inside the DDP processes; what it measures: benchmarks._training).


class CompareData(L.LightningDataModule):
    """A run's data: the main job's DataModule over the training documents; for a baseline strategy, its batches.

    Two :class:`lit_balance.BalancedTextDataModule` hold the run's documents (token ids,
    :func:`benchmarks._training.corpus_documents`), so the split is the same for every run, whatever its seed: one
    over the training documents (``val_fraction=0``; ``packing=True`` for ``lit_balance_packed``), whose own sampler
    ``lit_balance`` and ``lit_balance_packed`` train on, and whose ``train_dataset`` (truncated to ``max_length``)
    every other strategy's sampler (:attr:`sampler`) draws from, collated with :class:`lit_balance.PadCollator`
    (``hf_flatten``: :class:`lit_balance.PackedCollator`); and one over the validation documents, unshuffled, whose
    padded micro-batches validate every strategy alike.

    Args:
        strategy: one of :data:`STRATEGIES`.
        train_docs, val_docs: token ids of the training and validation documents.
        max_tokens: token slots per micro-batch, per rank (padded slots; packed: tokens).
        max_length: tokens kept per document.
        seed: seed of the samplers (the run's seed).
        cache_dir: tokenization cache (None: lit_balance's default).

    Raises:
        ValueError: an unknown strategy.
    """

    def __init__(self, strategy: str, train_docs: Sequence[np.ndarray], val_docs: Sequence[np.ndarray],
                 max_tokens: int, max_length: int, seed: int, cache_dir: str | None = None) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        tokenizer = resolve_tokenizer(None)
        common = {"max_tokens": max_tokens, "max_length": max_length, "val_fraction": 0.0,
                  "vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_token_id, "cache_dir": cache_dir}
        self.train_data = BalancedTextDataModule(list(train_docs), seed=seed, packing=strategy == "lit_balance_packed",
                                                 **common)
        self.val_data = BalancedTextDataModule(list(val_docs), seed=0, shuffle=False, **common)
        self.strategy, self.max_tokens, self.seed = strategy, max_tokens, seed
        self.vocab_size, self.pad_token_id = tokenizer.vocab_size, tokenizer.pad_token_id
        self.batch_size = fixed_batch_size(max_tokens, max_length)
        self.sampler: Any = None
        self.batch_sampler: Any = None

    def prepare_data(self) -> None:
        self.train_data.prepare_data()
        self.val_data.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        self.train_data.trainer = self.trainer  # its world, rank, epoch and accumulation are the run's
        self.train_data.setup(stage)
        self.val_data.setup(stage)  # no Trainer: the process group's world and rank, one micro-batch per step
        self.train_dataset = self.train_data.train_dataset
        if self.strategy in _LIT_BALANCE:
            self.sampler = self.train_data.train_sampler
            return
        world, rank = self.trainer.world_size, self.trainer.global_rank
        lengths = self.train_dataset.lengths
        self.collator = PackedCollator(self.pad_token_id) if self.strategy in _PACKED else PadCollator(
            self.pad_token_id)
        if self.strategy == "hf_flatten":
            self.batch_size = flattening_batch_size(lengths, self.max_tokens)
        if self.strategy in _DISTRIBUTED_SAMPLER:
            self.sampler = DistributedSampler(self.train_dataset, num_replicas=world, rank=rank, shuffle=True,
                                              seed=self.seed, drop_last=True)
            self.batch_sampler = BatchSampler(self.sampler, self.batch_size, drop_last=False)
        elif self.strategy == "sorted_buckets":
            self.sampler = EpochBatchSampler(partial(sorted_bucket_batches, lengths, self.batch_size, self.seed),
                                             world, rank)
        else:  # dynamic, dynamic_accum
            self.sampler = EpochBatchSampler(partial(sort_fill_batches, lengths, self.max_tokens, self.seed), world,
                                             rank)

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
        a :class:`lit_balance.BalancedBatchSampler` given new rank speeds by CostModelFeedback plans the next epoch
        with them only at ``set_epoch``, and that plan can be longer, so the epoch is selected first (by the
        DataModule for its own sampler, here for every baseline's alike).
        """
        if self.strategy in _LIT_BALANCE:
            return self.train_data.train_dataloader()
        self.sampler.set_epoch(self.trainer.current_epoch)
        if self.batch_sampler is not None:
            return DataLoader(self.train_dataset, batch_sampler=self.batch_sampler, collate_fn=self.collator)
        return DataLoader(self.train_dataset, sampler=self.sampler, batch_size=None, collate_fn=self.collator)

    def val_dataloader(self) -> DataLoader:
        return self.val_data.train_dataloader()


def run_worker(spec_path: Path) -> None:
    """Train one run as described by the JSON spec at ``spec_path``; rank 0 writes ``spec["result_path"]`` (JSON)
    and ``spec["trace_path"]`` (the gathered trace, ``.npy``)."""
    spec = json.loads(Path(spec_path).read_text())
    L.seed_everything(spec["seed"], verbose=False)
    data = CompareData(spec["strategy"], *corpus_documents(spec["num_docs"], spec["val_fraction"], spec["cache_dir"]),
                       spec["max_tokens"], spec["max_length"], spec["seed"], spec["cache_dir"])
    slowed = spec["scenario"] == "slowed_rank"
    model = CompareLM(slow_rank=spec["slow_rank"] if slowed else None, slowdown=spec["slowdown"] if slowed else 0.0,
                      vocab_size=data.vocab_size, lr=spec["lr"], **MODEL_SIZES[spec["model_size"]])
    meter = Meter()
    callbacks: list[L.Callback] = [meter]
    accumulate = spec["accumulate"] if spec["strategy"] == "dynamic_accum" else 1
    adaptive = None
    if spec["strategy"] in _LIT_BALANCE:
        adaptive = AdaptiveGradAccumulation(target_tokens_per_step=spec["target_tokens_per_step"])
        callbacks += [StragglerMonitor(log_every_n_micro_batches=50, warn_ratio=10.0), adaptive]
        if spec["feedback"]:
            callbacks.append(CostModelFeedback())
    trainer = make_trainer(spec, callbacks, accumulate)
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
        **{k: spec[k] for k in ("run", "strategy", "scenario", "pair", "seed", "feedback")}, "status": "ok", **stats,
        "val_loss": val[-1]["val_loss"] if val else float("nan"), "val_losses": val,
        "final_train_loss": losses[-1] if losses else float("nan"),
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
        "rank_factors": [1.0 + spec["slowdown"] if slowed and r == spec["slow_rank"] else 1.0
                         for r in range(trainer.world_size)],
        "curve": {"tokens": tokens, "loss": losses},
    }
    np.save(spec["trace_path"], meter.trace)
    Path(spec["result_path"]).write_text(json.dumps(result))


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, default=Path("compare_strategies_out"),
                   help="where results.json, the plots and logs go (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"smaller run: {QUICK['pairs']} pairs, {QUICK['num_docs']} training documents, "
                        f"slowed-rank runs over {QUICK['slowed_num_docs']} (12 min 24 s measured on 2 shared CPU "
                        "cores at load average 3.5-6, about half of it the start-up of its 18 runs)")
    p.add_argument("--pairs", type=positive_int, default=None,
                   help=f"interleaved rounds of every run (default: {FULL['pairs']}; --quick: {QUICK['pairs']})")
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
                   help="token slots per micro-batch, per rank (default: 1024; bert: 16384)")
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
    p.add_argument("--accumulate", type=positive_int, default=4,
                   help="dynamic_accum's accumulate_grad_batches; lit_balance targets this many global budgets "
                        "of real tokens per optimizer step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of every run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="model and sampler seed of pair 1; pair k uses seed + k - 1 "
                   "(default: %(default)s)")
    p.add_argument("--slowdown", type=non_negative, default=0.5,
                   help="slowed_rank: extra share of time the slowed rank waits (0.5: 1.5x slower)")
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
    args.pairs = args.pairs or preset["pairs"]
    args.slowed_epochs = args.slowed_epochs or preset["slowed_epochs"]
    args.slowed_num_docs = args.slowed_num_docs or preset["slowed_num_docs"] or args.num_docs
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
    """One spec per subprocess, in run order: ``args.pairs`` rounds of every main strategy then the slowed-rank runs
    (without, then with feedback), in reverse order in every second round.

    Example:
        >>> args = resolve_args(build_parser().parse_args(["--pairs", "2", "--strategies", "random", "lit_balance"]),
        ...                     build_parser())
        >>> [(r["run"], r["seed"]) for r in plan_runs(args)][:5]  # doctest: +NORMALIZE_WHITESPACE
        [('random_pair1', 0), ('lit_balance_pair1', 0), ('lit_balance_slowed_no_feedback_pair1', 0),
         ('lit_balance_slowed_feedback_pair1', 0), ('lit_balance_slowed_feedback_pair2', 1)]
    """
    common = {k: getattr(args, k) for k in ("accelerator", "devices", "precision", "model_size", "max_tokens",
                                            "max_length", "num_docs", "val_fraction", "epochs", "accumulate", "lr",
                                            "slowdown", "slow_rank", "cache_dir")}
    common["target_tokens_per_step"] = args.accumulate * args.devices * args.max_tokens
    common["ddp_timeout_s"] = min(args.timeout_s, 600)
    runs = []
    for pair in range(1, args.pairs + 1):
        seed = args.seed + pair - 1
        round_ = []
        if "main" in args.scenarios:
            round_ += [{**common, "run": f"{s}_pair{pair}", "strategy": s, "scenario": "main", "pair": pair,
                        "seed": seed, "feedback": True} for s in args.strategies]
        if "slowed_rank" in args.scenarios:
            round_ += [{**common, "epochs": args.slowed_epochs, "num_docs": args.slowed_num_docs,
                        "run": f"lit_balance_slowed_{'feedback' if feedback else 'no_feedback'}_pair{pair}",
                        "strategy": "lit_balance", "scenario": "slowed_rank", "pair": pair, "seed": seed,
                        "feedback": feedback} for feedback in (False, True)]
        runs += round_ if pair % 2 == 1 else round_[::-1]
    return runs


def launch(spec: dict[str, Any], out_dir: Path, timeout_s: int, worker: Sequence[str] | None = None) -> dict[str, Any]:
    """Run one spec as ``spec["devices"]`` ranks under ``torchrun`` (:func:`research._runs.launch_run`: every
    rank is stopped when one fails or time runs out, so none waits forever for a collective); return its result dict,
    with every key of :data:`RESULT_KEYS` (None for a run that failed). Its trace, when the run succeeded, is
    ``runs/<run>.trace.npy``.

    ``worker``: what each rank runs, before the spec's path (default: this module with the hidden worker flag).
    """
    result = launch_run(spec, out_dir, timeout_s, worker or ["-m", "research.compare_strategies", _WORKER_FLAG],
                        keys=("run", "strategy", "scenario", "pair", "seed", "feedback"))
    for key in RESULT_KEYS:
        result.setdefault(key, None)
    return result


# ------------------------------------------------------------------------------------------------------------------
# The parent: pair ratios, targets, the time model, tables and plots.


def _key(r: dict[str, Any]) -> str:
    """Name of a run's series across pairs: the strategy, or ``slowed_feedback`` / ``slowed_no_feedback``."""
    if r.get("scenario") == "slowed_rank":
        return "slowed_feedback" if r.get("feedback") else "slowed_no_feedback"
    return r["strategy"]


def _by_pair(results: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """``{pair: {series: run}}`` of the successful runs."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for r in results:
        if r.get("status") == "ok":
            out.setdefault(int(r["pair"]), {})[_key(r)] = r
    return out


def slowed_ideal(no_feedback: dict[str, Any], slow_rank: int) -> tuple[float, float]:
    """``(speed, ideal)``: the slowed rank's measured relative speed (fastest rank's compute seconds per padded slot
    over its own, forward + loss, in the run without feedback) and the ideal feedback / no-feedback ratio for it:
    work split in proportion to speed against an equal split, ``(1 / speed) / (n / (n - 1 + speed))``.

    Example:
        >>> speed, ideal = slowed_ideal({"compute_s_per_padded_slot_per_rank": [1.0, 1.5]}, 1)
        >>> round(speed, 4), round(ideal, 4)  # speed 2/3 on 2 ranks: 1.25x
        (0.6667, 1.25)
    """
    per_slot = no_feedback["compute_s_per_padded_slot_per_rank"]
    slow = per_slot[slow_rank]
    speed = min(per_slot) / slow if slow > 0 else 1.0
    n = len(per_slot)
    return speed, (1 / speed) / (n / (n - 1 + speed))


def pair_ratios(results: list[dict[str, Any]], slow_rank: int = 1) -> dict[str, dict[str, Any]]:
    """Per pair, real tokens/s ratios of runs of the same pair; each with median, min and max over pairs.

    Ratios (numerator/denominator): ``lit_balance/random``, ``lit_balance/dynamic``,
    ``lit_balance_packed/lit_balance``, ``feedback/no_feedback`` (slowed rank), ``<strategy>/lit_balance`` for every
    other strategy, and ``slowed_recovery``: ``(feedback/no_feedback - 1) / (ideal - 1)`` with the ideal of
    :func:`slowed_ideal` from that pair's run without feedback. A pair missing either run has no value.

    Returns:
        ``{name: {"per_pair": {pair: value}, "median", "min", "max", "pairs"}}`` (None figures with no pair).

    Example:
        >>> runs = [{"pair": p, "strategy": s, "scenario": "main", "status": "ok", "real_tokens_per_s": t}
        ...         for p, s, t in [(1, "random", 100.0), (1, "lit_balance", 300.0), (2, "random", 100.0),
        ...                         (2, "lit_balance", 350.0)]]
        >>> r = pair_ratios(runs)["lit_balance/random"]
        >>> r["per_pair"], r["median"], r["min"], r["max"]
        ({1: 3.0, 2: 3.5}, 3.25, 3.0, 3.5)
    """
    pairs = _by_pair(results)
    series = sorted({k for runs in pairs.values() for k in runs}, key=lambda k: (k not in STRATEGIES, k))
    names = [("lit_balance/random", "lit_balance", "random"), ("lit_balance/dynamic", "lit_balance", "dynamic"),
             ("lit_balance_packed/lit_balance", "lit_balance_packed", "lit_balance"),
             ("feedback/no_feedback", "slowed_feedback", "slowed_no_feedback")]
    names += [(f"{s}/lit_balance", s, "lit_balance") for s in series if s in STRATEGIES and s != "lit_balance"]
    out: dict[str, dict[str, Any]] = {}
    for name, num, den in names:
        out[name] = {"per_pair": {p: runs[num]["real_tokens_per_s"] / runs[den]["real_tokens_per_s"]
                                  for p, runs in pairs.items() if num in runs and den in runs
                                  and runs[den]["real_tokens_per_s"]}}
    recovery, ideals = {}, {}
    for p, v in out["feedback/no_feedback"]["per_pair"].items():
        _, ideal = slowed_ideal(pairs[p]["slowed_no_feedback"], slow_rank)
        ideals[p] = ideal
        if ideal > 1:
            recovery[p] = (v - 1) / (ideal - 1)
    out["slowed_ideal"] = {"per_pair": ideals}
    out["slowed_recovery"] = {"per_pair": recovery}
    for entry in out.values():
        values = list(entry["per_pair"].values())
        entry.update(pairs=len(values), median=statistics.median(values) if values else None,
                     min=min(values) if values else None, max=max(values) if values else None)
    return out


def _spread(values: Sequence[float]) -> dict[str, Any]:
    values = [v for v in values if v is not None]
    return {"median": statistics.median(values) if values else None, "min": min(values) if values else None,
            "max": max(values) if values else None, "values": list(values)}


def evaluate_targets(results: list[dict[str, Any]], ratios: dict[str, dict[str, Any]], args: argparse.Namespace,
                     projection: list[dict[str, Any]] | None = None, wall_s: float | None = None) -> dict[str, Any]:
    """The targets of the specification: each with its value (median over pairs), min, max, rule and whether it was
    met (None: not judged, e.g. a run failed or the time model is missing)."""
    targets: dict[str, Any] = {}

    def put(name: str, ratio: str | None, threshold: float, rule: str, value: float | None = None,
            lo: float | None = None, hi: float | None = None, at_least: bool = True, **extra: Any) -> None:
        if ratio is not None:
            value, lo, hi = ratios[ratio]["median"], ratios[ratio]["min"], ratios[ratio]["max"]
        met = None if value is None else (value >= threshold if at_least else value <= threshold)
        targets[name] = {"value": value, "min": lo, "max": hi, "met": met, "rule": rule, **extra}

    put("tokens_per_s_vs_random", "lit_balance/random", 3.0, "median over pairs of lit_balance / random real "
        "tokens/s >= 3")
    put("tokens_per_s_vs_dynamic", "lit_balance/dynamic", 1.0, "median over pairs of lit_balance / dynamic real "
        "tokens/s >= 1")
    lb_runs = [r for r in results if r.get("status") == "ok" and r["strategy"] in _LIT_BALANCE]
    over = [r["over_budget_micro_batches"] for r in lb_runs]
    put("micro_batches_over_budget", None, 0, f"micro-batches above {args.max_tokens} slots in every lit_balance "
        "and lit_balance_packed run == 0", value=sum(over) if over else None, lo=min(over, default=None),
        hi=max(over, default=None), at_least=False,
        dynamic_over_budget=[r["over_budget_micro_batches"] for r in results
                             if r.get("status") == "ok" and r["strategy"] == "dynamic"])
    put("packed_vs_padded", "lit_balance_packed/lit_balance", 1.02, "median over pairs of lit_balance_packed / "
        "lit_balance real tokens/s >= 1.02")
    put("slowed_rank_recovery", "slowed_recovery", 0.75, "slowed rank: median over pairs of (feedback / no feedback "
        "- 1) / (ideal - 1) >= 0.75, the ideal from that pair's measured speeds",
        feedback_vs_no_feedback=ratios["feedback/no_feedback"]["median"], ideal=ratios["slowed_ideal"]["median"])
    errors = [r["calibration_error"] for r in results if r.get("status") == "ok"
              and r.get("calibration_error") is not None]
    put("calibration", None, 0.05, "every measured run: abs(predicted / measured real tokens/s - 1) <= 0.05",
        value=max(map(abs, errors)) if errors else None, lo=min(errors, default=None), hi=max(errors, default=None),
        at_least=False)
    if projection:
        for name, distributions, threshold in (
                ("projection_64_main_corpus", [MAIN_CORPUS], 1.3),
                ("projection_64_shipped", list(SHIPPED_LENGTHS), 1.0)):
            margins, bounds = {}, {}
            for d in distributions:
                at64 = {r["strategy"]: r for r in projection if r["distribution"] == d and r["num_replicas"] == 64}
                rows = {s: r["predicted_real_tokens_per_s"] for s, r in at64.items()}
                ours = max(rows.get(s, float("-inf")) for s in _LIT_BALANCE)
                others = [v for s, v in rows.items() if s not in _LIT_BALANCE]
                if others and math.isfinite(ours):
                    margins[d] = ours / max(others)
                    bound = projection_bound(at64)
                    if bound is not None:
                        bounds[d] = bound
            vals = list(margins.values())
            put(name, None, threshold, f"projection at 64 ranks on {', '.join(distributions)}: the better of "
                f"lit_balance / lit_balance_packed over the best other strategy's tokens/s >= {threshold} (least "
                "over distributions)", value=min(vals) if vals else None, lo=min(vals, default=None),
                hi=max(vals, default=None), per_distribution=margins, upper_bound_per_distribution=bounds)
    if wall_s is not None:
        limit = 600 if args.quick else 5400
        mode = "--quick" if args.quick else "default"
        put("wall_time", None, limit, f"wall time of this invocation <= {limit} s ({mode})", value=wall_s,
            at_least=False)
    # informational, not targets of the specification
    put("straggler_ratio", None, 1.05, "informational: lit_balance max/median per-rank compute s, median over "
        "pairs", value=_spread([r["straggler_ratio"] for r in lb_runs if r["strategy"] == "lit_balance"
                                and r["scenario"] == "main"])["median"], at_least=False)
    targets["straggler_ratio"]["met"] = None
    return targets


def projection_bound(rows: dict[str, dict[str, Any]]) -> float | None:
    """The largest ratio any plan of these documents could reach over the best other strategy at one world size:
    lit_balance's real tokens at useful compute fraction U = 1 with no sync (every rank busy with real tokens only,
    no per-micro-batch cost, no wait), ``tokens/s / (U x (1 - sync_share))``, over the best other strategy's
    predicted tokens/s. None when no lit_balance row has U, or no other strategy has tokens/s above 0.

    Example:
        >>> projection_bound({"lit_balance": {"predicted_real_tokens_per_s": 80.0, "useful_compute_fraction": 0.8,
        ...                                   "sync_share": 0.0},
        ...                   "dynamic": {"predicted_real_tokens_per_s": 75.0}})  # 100 / 75
        1.3333333333333333
    """
    ideals = [r["predicted_real_tokens_per_s"] / (r["useful_compute_fraction"] * (1 - r.get("sync_share", 0.0)))
              for s, r in rows.items() if s in _LIT_BALANCE and r.get("useful_compute_fraction")]
    others = [r["predicted_real_tokens_per_s"] for s, r in rows.items() if s not in _LIT_BALANCE]
    if not ideals or not others or max(others) <= 0:
        return None
    return max(ideals) / max(others)


def calibrate_and_project(results: list[dict[str, Any]], traces: dict[str, np.ndarray], args: argparse.Namespace,
                          lengths: dict[str, np.ndarray], out_dir: Path) -> dict[str, Any]:
    """Fit :mod:`benchmarks.time_model` on every successful run's trace, add ``predicted_real_tokens_per_s`` and
    ``calibration_error`` to each result, project every strategy to 8, 64 and 512 ranks on ``lengths``
    (``{distribution: token lengths}``), write ``projection.json``, ``calibration.png`` and ``projection.png``.

    Returns:
        ``{"time_model": fitted costs, "projection": rows, "predictions": per run}``.
    """
    from research import time_model  # here, not in the ranks: scipy would add to their measured memory
    runs = [time_model.RunTrace(run=r["run"], strategy=r["strategy"], trace=traces[r["run"]],
                                headline_epochs=tuple(r["headline_epochs"]), rank_factors=tuple(r["rank_factors"]),
                                measured_real_tokens_per_s=r["real_tokens_per_s"])
            for r in results if r.get("status") == "ok" and r["run"] in traces]
    model = time_model.fit_time_model(runs)
    predictions = []
    for run, r in zip(runs, (r for r in results if r.get("status") == "ok" and r["run"] in traces)):
        p = time_model.predict_run(model, run)
        r["predicted_real_tokens_per_s"] = p["predicted_real_tokens_per_s"]
        r["calibration_error"] = p["calibration_error"]
        predictions.append({"run": r["run"], "strategy": r["strategy"], "pair": r["pair"], **p})
    rows = time_model.project(model, strategies=STRATEGIES, lengths=lengths, max_tokens=args.max_tokens,
                              max_length=args.max_length, accumulate=args.accumulate, seed=args.seed)
    (out_dir / "projection.json").write_text(json.dumps(rows, indent=1))
    time_model.plot_calibration(predictions, out_dir / "calibration.png")
    time_model.plot_projection(rows, out_dir / "projection.png")
    return {"time_model": model.to_dict(), "projection": rows, "predictions": predictions}


def projection_lengths(corpus_lengths: np.ndarray, max_length: int) -> dict[str, np.ndarray]:
    """``{distribution: int64 token lengths}`` projected: the main job's corpus (training documents, already
    truncated) and the shipped distributions of ``lit_balance/data/lengths/``, truncated to ``max_length``."""
    out = {MAIN_CORPUS: np.asarray(corpus_lengths, dtype=np.int64)}
    for name in SHIPPED_LENGTHS:
        out[name] = load_lengths(name, max_length)
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def runs_table(results: list[dict[str, Any]], max_tokens: int) -> str:
    """The per-run table (Markdown), in run order."""
    head = ["run", "pair", "scenario", "real tokens/s (epochs >= 1)", "real tokens/s (all)", "predicted tokens/s",
            "optimizer steps/s", "padding ratio", "straggler ratio (run / per step)", "peak memory MB (max rank)",
            f"largest micro-batch (budget {max_tokens})", "val loss", "train real tokens", "optimizer steps",
            "accumulate", "load before"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["run"], _fmt(r.get("pair")), r["scenario"], r["status"]] + ["-"] * (len(head) - 4))
            continue
        acc = r.get("accumulate_grad_batches") or []
        rows.append([
            r["run"], str(r["pair"]), r["scenario"], _fmt(r["real_tokens_per_s"], 0),
            _fmt(r["real_tokens_per_s_all_epochs"], 0), _fmt(r.get("predicted_real_tokens_per_s"), 0),
            _fmt(r["optimizer_steps_per_s"], 2), _fmt(r["padding_ratio"]),
            f"{_fmt(r['straggler_ratio'])} / {_fmt(r['step_straggler_ratio'])}", _fmt(r["peak_memory_mb"], 0),
            f"{r['max_micro_batch_slots']} ({r['over_budget_micro_batches']} over)", _fmt(r["val_loss"]),
            f"{r['train_real_tokens']:,}", str(r["optimizer_steps"]),
            "-".join(map(str, [min(acc), max(acc)])) if acc and min(acc) != max(acc) else str(acc[0] if acc else "-"),
            _fmt(r.get("load_avg_1min_before"), 1)])
    return markdown_table(head, rows)


def ratios_table(ratios: dict[str, dict[str, Any]], pairs: int) -> str:
    """Per-pair ratios with median and min-max (Markdown)."""
    head = ["ratio (real tokens/s)", *[f"pair {p}" for p in range(1, pairs + 1)], "median", "min", "max"]
    return markdown_table(head, [[name, *[_fmt(e["per_pair"].get(p)) for p in range(1, pairs + 1)], _fmt(e["median"]),
                          _fmt(e["min"]), _fmt(e["max"])] for name, e in ratios.items()])


def targets_text(targets: dict[str, Any]) -> str:
    """The targets as a Markdown table: value (median over pairs), min-max, rule, met or not."""
    rows = []
    for name, t in targets.items():
        met = {True: "met", False: "NOT met", None: "not judged"}[t["met"]]
        spread = "-" if t["min"] is None and t["max"] is None else f"{_fmt(t['min'])} - {_fmt(t['max'])}"
        rule = t["rule"]
        if t.get("upper_bound_per_distribution"):  # the most any plan of those documents could reach
            rule += "; upper bound (U = 1, no sync): " + ", ".join(
                f"{d} {_fmt(b)}" for d, b in t["upper_bound_per_distribution"].items())
        rows.append([name, _fmt(t["value"]), spread, rule.replace("|", "/"), met])
    return markdown_table(["target", "value", "min - max", "rule", "verdict"], rows)


def calibration_table(fit: dict[str, Any] | None) -> str:
    """Measured against predicted real tokens/s per run, and the fitted costs (Markdown)."""
    if fit is None:
        return "no calibration: the time model was not fitted."
    costs = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in fit["time_model"].items())
    rows = [[p["run"], _fmt(float(p["measured_real_tokens_per_s"]), 0),
             _fmt(float(p["predicted_real_tokens_per_s"]), 0), f"{100 * p['calibration_error']:+.1f} %"]
            for p in fit["predictions"]]
    head = ["run", "measured real tokens/s", "predicted real tokens/s", "error"]
    return f"fitted time model: {costs}\n\n" + markdown_table(head, rows)


def projection_table(rows: Sequence[dict[str, Any]] | None) -> str:
    """The projection rows (Markdown), labelled as a projection from measured costs."""
    if not rows:
        return "no projection: the time model was not fitted."
    head = ["distribution", "ranks", "strategy", "predicted real tokens/s", "optimizer steps/s", "padding ratio",
            "useful compute fraction U", "largest micro-batch (slots)", "over budget"]
    body = [[r["distribution"], str(r["num_replicas"]), r["strategy"], _fmt(float(r["predicted_real_tokens_per_s"]), 0),
             _fmt(r.get("predicted_optimizer_steps_per_s"), 2), _fmt(r.get("padding_ratio")),
             _fmt(r.get("useful_compute_fraction")), _fmt(r.get("max_micro_batch_slots")),
             _fmt(r.get("over_budget_micro_batches"))] for r in rows]
    return f"{rows[0].get('label', 'projection from measured costs')}\n\n" + markdown_table(head, body)


COLORS = {"random": "tab:gray", "sorted_buckets": "tab:brown", "dynamic": "tab:orange", "dynamic_accum": "tab:red",
          "lit_balance": "tab:blue", "lit_balance_packed": "tab:cyan", "hf_flatten": "tab:purple",
          "slowed_no_feedback": "tab:olive", "slowed_feedback": "tab:green"}


def plot(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``tokens_per_s.png`` (real tokens/s of every run, grouped by strategy, one bar per pair) and
    ``loss_vs_tokens.png`` (pair 1, main scenario: step loss, smoothed, and the validation loss after the last
    epoch, against global real training tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = _by_pair(results)
    series = [k for k in COLORS if any(k in runs for runs in pairs.values())]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(pairs), 1)
    for i, (p, runs) in enumerate(sorted(pairs.items())):
        x = [j + (i - (len(pairs) - 1) / 2) * width for j, k in enumerate(series) if k in runs]
        ax.bar(x, [runs[k]["real_tokens_per_s"] for k in series if k in runs], width,
               color=[COLORS[k] for k in series if k in runs], alpha=0.55 + 0.45 * (i + 1) / len(pairs),
               edgecolor="black", lw=0.5, label=f"pair {p}")
    ax.set_xticks(range(len(series)), series, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("real tokens / s (all ranks), epochs after the first")
    ax.set_title("every run, by pair (bars left to right: pair 1, 2, ...)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths = [out_dir / "tokens_per_s.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    first = pairs.get(min(pairs)) if pairs else {}
    for key, r in first.items():
        curve = r.get("curve") or {"tokens": [], "loss": []}
        tokens, loss = np.array(curve["tokens"]), np.array(curve["loss"])
        if r["scenario"] != "main" or tokens.size == 0:
            continue
        window = max(1, tokens.size // 40)  # a moving mean over 1/40 of the run's steps
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax.plot(tokens[window - 1:], smooth, color=COLORS[key], lw=1.4, label=key)
        ax.plot([v["tokens"] for v in r["val_losses"]], [v["val_loss"] for v in r["val_losses"]], "o",
                color=COLORS[key], ms=5)
    ax.set_xlabel("real training tokens (all ranks)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("pair 1: training loss (moving mean of optimizer steps) and validation loss (dot, last epoch)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "loss_vs_tokens.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


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
    command = "python -m research.compare_strategies " + " ".join(argv if argv is not None else sys.argv[1:])
    # tokenize once here, so the runs only load the cache
    train_docs, val_docs = corpus_documents(args.num_docs, args.val_fraction, args.cache_dir)
    train_lengths = np.minimum([len(d) for d in train_docs], args.max_length)
    print(f"world size {args.devices} ({args.accelerator}) | budget {args.max_tokens} slots per micro-batch per rank "
          f"| max_length {args.max_length} | fixed batch size {fixed_batch_size(args.max_tokens, args.max_length)} "
          f"rows | {len(train_docs)} training documents ({int(train_lengths.sum()):,} tokens), "
          f"{len(val_docs)} validation | {args.epochs} epochs | {args.pairs} pairs | slowed-rank runs: "
          f"{args.slowed_epochs} epochs, {args.slowed_num_docs} documents | model {args.model_size} | lr {args.lr} | "
          f"lit_balance target {args.accumulate * args.devices * args.max_tokens} real tokens per optimizer step",
          flush=True)
    results, traces = [], {}
    for spec in plan_runs(args):
        r = launch(spec, out_dir, args.timeout_s)
        results.append(r)
        trace_path = out_dir / "runs" / f"{r['run']}.trace.npy"
        if r["status"] == "ok":
            traces[r["run"]] = np.load(trace_path)
            print(f"{r['run']:>40}: {r['real_tokens_per_s']:8.0f} real tokens/s (all epochs "
                  f"{r['real_tokens_per_s_all_epochs']:.0f}) | padding {r['padding_ratio']:.3f} | straggler "
                  f"{r['straggler_ratio']:.3f} | peak {r['peak_memory_mb']:.0f} MB | val loss {r['val_loss']:.4f} | "
                  f"{r['subprocess_wall_s']:.0f} s", flush=True)
        else:
            print(f"{r['run']:>40}: {r['status']} after {r['subprocess_wall_s']:.0f} s (see logs/{r['run']}.log)",
                  flush=True)
    np.savez(out_dir / "traces.npz", **traces)
    for r in results:
        r.setdefault("predicted_real_tokens_per_s", None)
        r.setdefault("calibration_error", None)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))  # kept should the time model fail
    fit, fit_error = None, None
    try:
        fit = calibrate_and_project(results, traces, args, projection_lengths(train_lengths, args.max_length),
                                    out_dir)
    except Exception as error:  # noqa: BLE001 - an hour of measurements is written out whatever the model does
        fit_error = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    ratios = pair_ratios(results, args.slow_rank)
    paths = plot(results, out_dir)
    curves = {r["run"]: r.pop("curve") for r in results if "curve" in r}
    wall = time.perf_counter() - start
    targets = evaluate_targets(results, ratios, args, fit["projection"] if fit else None, wall_s=wall)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    host, commit = machine(), commit_label()
    summary = {
        "command": command, "date_utc": date, "wall_s": wall, "commit": commit, "machine": host,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
        "train_documents": len(train_docs), "train_tokens_per_epoch": int(train_lengths.sum()),
        "validation_documents": len(val_docs), "pairs": args.pairs,
        "ratios": {k: {**v, "per_pair": {str(p): x for p, x in v["per_pair"].items()}} for k, v in ratios.items()},
        "targets": targets,
        "calibration": {r["run"]: r["calibration_error"] for r in results if r.get("status") == "ok"},
        "time_model": fit["time_model"] if fit else None,
        "time_model_note": fit_error,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "curves.json").write_text(json.dumps(curves))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    text = "\n\n".join([
        (f"Command: `{command}`  \nCommit: {commit}  \nMachine: {host['platform']}, {host['cpu_count']} CPUs, "
         f"torch {host['torch']}, Lightning {host['lightning']}  \nDate (UTC): {date}  \nWall time: "
         f"{wall:.0f} s; {len(train_docs)} training documents, {args.epochs} epochs, {args.pairs} pairs"),
        "### Runs\n\n" + runs_table(results, args.max_tokens),
        "### Ratios per pair\n\n" + ratios_table(ratios, args.pairs),
        "### Targets\n\n" + targets_text(targets),
        "### Calibration\n\n" + (f"the time model failed: {fit_error}" if fit_error else calibration_table(fit)),
        "### Projection\n\n" + projection_table(fit["projection"] if fit else None)]) + "\n"
    (out_dir / "results.md").write_text(text)
    print(text + f"\nplots: {', '.join(p.name for p in paths)}; wall time {wall:.0f} s; results in {out_dir}",
          flush=True)
    return results


if __name__ == "__main__":
    main()
