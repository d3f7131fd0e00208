"""Train a small transformer LM on the built-in corpus with token-budgeted, rank-balanced micro-batches.

Run:
    python recipes/train.py                                  # conf/config.yaml: 2 CPU ranks, 40 steps
    python recipes/train.py trainer.devices=4 data.max_tokens=8192
    python recipes/train.py data.packing=true                # padding-free: whole documents packed into one row
    python recipes/train.py data.max_tokens=auto data.memory_limit=2147483648   # budget measured per rank (bytes)
    python recipes/train.py trainer=gpu_ddp experiment=budget_4k
    python recipes/train.py --config-dir my_conf --config-name config trainer.max_steps=100
    python recipes/train.py --cfg job                        # print the composed config and exit
    python recipes/train.py ckpt_path=outputs/train/<date>/<time>/logs/checkpoints/last.ckpt trainer.max_steps=80

A Hydra application (https://hydra.cc): ``key=value`` overrides an existing key, ``group=option`` picks
another file of ``conf/<group>/``, ``+key=value`` adds a key; ``--config-dir``/``--config-name`` select
another config. ``hydra.utils.instantiate`` builds each ``_target_`` node. Prints the derived budget and the
training split's plan (padding ratio, useful compute fraction, micro-batches per rank) first, shows a progress bar
on stdout while training (rank 0; ``BalanceProgressBar``: epoch, optimizer step, real tokens/s, padding ratio and
straggler ratio, where the ranks' time went, as the monitors in ``callbacks`` log them), and, at the end, per rank and
in total: micro-batches, real tokens, padded slots, padding ratio, compute, data wait, rank wait and other seconds
(``RunSummary``). The run directory (``outputs/train/<date>/<time>``) keeps, in ``logs/``, the metrics file
(``metrics.csv``: every logged figure by step), checkpoints (``checkpoints/``: ``last.ckpt``, the last optimizer step
however training ended, and the one after the last validation) and ``training.png`` (the figures per rank over steps);
the last lines name them and the command that resumes (every override of the run, ``ckpt_path``, and twice the steps
after a run that reached ``trainer.max_steps``). Ctrl-C (SIGINT) or SIGTERM on any rank (or the whole process group,
DataLoader workers included: they ignore it) stops every rank at the end of that optimizer step (or of the validation
under way), which ``last.ckpt`` keeps, with the same end; a second Ctrl-C waits for it; the exit status is then 128 +
the signal's number.
A setting lit_balance rejects ends the run with one line on stderr naming the key (``data.memory_limit``), printed
once (``HYDRA_FULL_ERROR=1``: the traceback). Printed lines are at most 80 characters, but for paths and commands.

With ``trainer.strategy=ddp`` Lightning re-runs this script once per extra rank, with the same overrides,
in the launch directory, and points it at the same Hydra run directory
(``lightning/fabric/strategies/launchers/subprocess_script.py``); ``hydra.job.chdir`` is false, so every
rank reads relative paths (``data.corpus``, ``data.cache_dir``) from the launch directory.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf

from lit_balance import BalancedTextDataModule
from lit_balance.callbacks import LastStepCheckpoint
from lit_balance.cli.messages import (HYDRA_DEBUG_ENV, INPUT_ERRORS, check_before_launch, exit_on_input_error,
                                      fit_message, input_error, install_hint, mark_run)
from lit_balance.lightning.outputs import hydra_resume_command, report_outputs, shown_path as _shown
from lit_balance.report import summary_line
from lit_balance.world import data_parallel_world

_START = time.perf_counter()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Run :func:`train`; a setting lit_balance rejects (or a missing extra) ends the run with one line on stderr
    naming the Hydra key to change, printed once however many ranks met it, and exit status 2
    (``HYDRA_FULL_ERROR=1``: the traceback instead)."""
    mark_run()  # the ranks trainer.fit starts inherit the run's id: an error they all meet is printed once
    prog = _shown(sys.argv[0])
    try:
        train(cfg)
    except INPUT_ERRORS as error:
        if input_error(error) is None:  # not a rejected setting: a bug, with its traceback
            raise
        exit_on_input_error("", fit_message(error, hydra=True, default=("data", BalancedTextDataModule)), error,
                            prog=prog, debug_env=HYDRA_DEBUG_ENV)
    except ImportError as error:
        if install_hint(error) is None:
            raise
        exit_on_input_error("", install_hint(error), error, prog=prog, debug_env=HYDRA_DEBUG_ENV)


def train(cfg: DictConfig) -> None:
    """Build the data module, model, callbacks and Trainer that ``cfg`` describes, and fit."""
    L.seed_everything(cfg.seed, verbose=False)
    paths = {}
    if cfg.data.get("cache_dir"):  # a relative one is read from the launch directory, even with hydra.job.chdir
        paths["cache_dir"] = to_absolute_path(os.path.expanduser(cfg.data.cache_dir))
    dm = instantiate(cfg.data, **paths)
    replaced = None
    if not OmegaConf.is_missing(cfg.model, "vocab_size") and cfg.model.get("vocab_size") != dm.vocab_size:
        replaced = (f"model.vocab_size={cfg.model.vocab_size} replaced by the data's vocabulary, {dm.vocab_size} token "
                    "ids (the model's embedding covers every id of the data)")
    model = instantiate(cfg.model, vocab_size=dm.vocab_size)
    callbacks = list((instantiate(cfg.callbacks) or {}).values()) if cfg.get("callbacks") else []
    if not cfg.trainer.get("enable_progress_bar", True):  # trainer.enable_progress_bar=false: no bar, as asked
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    check_before_launch(dm, trainer)  # here, once, rather than on every rank after they started
    if replaced and trainer.is_global_zero:
        print(replaced, flush=True)
    try:
        num_replicas = data_parallel_world(trainer).num_replicas
    except RuntimeError:  # ModelParallelStrategy: the data-parallel size is its device mesh's, built by fit
        num_replicas = None
    world = (f"data-parallel size {num_replicas}" if num_replicas is not None
             else f"world size {trainer.world_size} processes (data-parallel size set when fit builds the mesh)")
    if trainer.is_global_zero and (dm.max_tokens == "auto" or num_replicas is None):
        print(f"{world} | per-rank budget: {dm.max_tokens}"
              + (f", measured before the first epoch\n(memory_limit {dm.memory_limit} bytes, memory_fraction "
                 f"{dm.memory_fraction})" if dm.max_tokens == "auto" else "")
              + f" | max_length {dm.max_length} tokens\ncorpus: {dm.corpus_description}", flush=True)
    elif trainer.is_global_zero and dm.stream is not None:  # a stream: no plan before training (docs/streams.md)
        print(f"{world} | per-rank budget {dm.max_tokens} per micro-batch | max_length {dm.max_length} tokens\n"
              f"corpus: {dm.stream.description}, planned window by window while training", flush=True)
    elif trainer.is_global_zero:
        unit = "tokens per packed row" if dm.packing else "padded slots"
        global_budget = sum(dm.settings.rank_max_tokens(num_replicas)) * trainer.accumulate_grad_batches
        print(
            f"{world} | per-rank budget {dm.max_tokens} {unit} per micro-batch\n"
            f"global budget {global_budget} {unit} per optimizer step | max_length {dm.max_length} tokens\n"
            f"corpus: {dm.corpus_description}",
            flush=True,
        )
        # the DataModule has no Trainer yet, so its setup here takes part in no collective
        print(summary_line(dm.plan_summary(num_replicas, trainer.accumulate_grad_batches)), flush=True)
    ckpt_path = to_absolute_path(cfg.ckpt_path) if cfg.get("ckpt_path") else None
    started = time.time()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    last = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LastStepCheckpoint)), None)
    stopped_by = last.stopped_by if last is not None else None
    if stopped_by:  # stopping: a further Ctrl-C while the last lines print (and the plot is drawn) waits for them
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    if trainer.is_global_zero and dm.token_budget is not None:
        print(f"token budget: {dm.token_budget.describe()}", flush=True)
    if trainer.is_global_zero:
        sampler = dm.train_sampler
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if stopped_by:
            print(f"stopped by {stopped_by} at optimizer step {trainer.global_step} of {trainer.max_steps}, on every "
                  "rank", flush=True)
        if dm.stream is not None:
            state = dm.stream.batches.state_dict()
            counts = (f"stream: pass {state['epoch']}, window {state['window']}, {state['start']} documents before it"
                      f"{' (its end)' if state['finished'] else ''}\n")
        else:
            counts = (f"train documents {len(dm.train_dataset)} | empty after tokenization, dropped: "
                      f"{dm.num_empty_documents}\nmicro-batches per rank per epoch {len(sampler)} | fill rows this "
                      f"epoch {sampler.num_fill_rows}\n")
        print(
            counts + f"last train/loss {metrics['train/loss']:.3f} | "
            + (f"val/loss {metrics['val/loss']:.3f} | " if "val/loss" in metrics else "validation not run | ")
            + f"script wall time {time.perf_counter() - _START:.1f} s",
            flush=True,
        )
        print("\n".join(report_outputs(trainer, since=started)), flush=True)
        if last is not None and last.last_model_path:
            print(f"resume: {_resume(last.last_model_path, trainer.max_steps, finished=not stopped_by)}", flush=True)
    if stopped_by and trainer.is_global_zero:  # the launcher's rank: the others end as usual (Lightning's launcher
        sys.exit(128 + signal.Signals[stopped_by].value)  # stops every rank when one exits with an error status)


def _resume(ckpt: str, max_steps: int, finished: bool) -> str:
    """The command that resumes this run from ``ckpt``, with every override it was given (Hydra's record of them);
    after a run that reached ``max_steps``, with twice as many steps."""
    hydra_cfg = HydraConfig.get()
    config_dir = next((s["path"] for s in hydra_cfg.runtime.config_sources if s["provider"] == "command-line"), None)
    config_name = hydra_cfg.job.config_name if hydra_cfg.job.config_name != "config" else None
    return hydra_resume_command(_shown(sys.argv[0]), list(hydra_cfg.overrides.task), _shown(ckpt),
                                max_steps=2 * max_steps if finished and max_steps > 0 else None,
                                config_dir=config_dir and _shown(config_dir), config_name=config_name)


if __name__ == "__main__":
    main()
