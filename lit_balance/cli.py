"""The ``lit-balance`` command: Lightning CLI subcommands (fit, validate, ...) and the ``plan`` dry run.

Run:
    lit-balance fit --config conf/cli/fit_cpu.yaml          # 2 CPU DDP ranks, BalancedTextDataModule + DemoTransformerLM
    lit-balance fit --print_config                          # every option with its default
    lit-balance plan --lengths lit_balance/data/lengths/lengths_fortunes.npy --num-replicas 8 --max-tokens 2048
    python -m lit_balance.cli plan --help                   # the same without the console script

``fit``, ``validate``, ``test`` and ``predict`` are :class:`lightning.pytorch.cli.LightningCLI`'s: the model is
:class:`~lit_balance.demo.DemoTransformerLM` (``--model.*``), the data :class:`~lit_balance.BalancedTextDataModule`
(``--data.*``), ``model.vocab_size`` is taken from the built data module, and callbacks are set with
``--trainer.callbacks`` (class paths and init args) in the config. ``plan`` plans one epoch without
training and reports it (see :mod:`lit_balance.report`).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import numpy as np
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_balance._validate import check_int
from lit_balance.cost import CostModel
from lit_balance.datamodule import BalancedTextDataModule
from lit_balance.demo import DemoTransformerLM
from lit_balance.settings import BatchingSettings

__all__ = ["LitBalanceCLI", "build_cli", "main", "plan_parser", "run_plan"]


_DEFAULT_MAX_TOKENS = 4096  # as BalancedTextDataModule's


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def plan_parser() -> ArgumentParser:
    """The ``plan`` subcommand's parser (jsonargparse; ``--config`` reads the same options from YAML)."""
    parser = ArgumentParser(description="Plan one epoch without training: per-rank micro-batches, tokens, padding "
                                        "and cost, rank imbalance and useful compute fraction, against "
                                        "DistributedSampler with a fixed batch size; writes a table, a JSON summary "
                                        "and PNG plots.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file holding any of these options")
    group = parser.add_argument_group("input: a lengths file, or a corpus and tokenizer as for BalancedTextDataModule")
    group.add_argument("--lengths", type=Path | None, default=None,
                       help="a .npy array or a text file (one integer per line) of tokens per sample; "
                            "when given, the corpus options are not used")
    group.add_argument("--corpus", type=str | None, default=None,
                       help="null = the built-in corpus; or a path or glob of .txt / .jsonl files")
    group.add_argument("--tokenizer", type=str | None, default=None,
                       help="null = the built-in BERT-uncased WordPiece; or a tokenizer.json path")
    group.add_argument("--text-key", type=str, default="text", help="JSONL field holding the text")
    group.add_argument("--max-length", type=int | None, default=512,
                       help="tokens kept per sample (truncation), also applied to --lengths; null = none")
    group.add_argument("--val-fraction", type=float, default=0.05,
                       help="share of corpus documents held out for validation (the plan covers the training split)")
    group.add_argument("--cache-dir", type=str | None, default=None, help="tokenization cache directory")
    group = parser.add_argument_group("sampler, as BalancedBatchSampler (see lit_balance.BatchingSettings)")
    group.add_argument("--num-replicas", type=int, default=2, help="ranks (world size)")
    group.add_argument("--epoch", type=int, default=0, help="the epoch to plan (as set_epoch)")
    hints = typing.get_type_hints(BatchingSettings)
    for setting in dataclasses.fields(BatchingSettings):
        default = _DEFAULT_MAX_TOKENS if setting.name == "max_tokens" else setting.default
        group.add_argument(_flag(setting.name), type=hints[setting.name], default=default,
                           help=setting.metadata["help"])
    group = parser.add_argument_group("cost model: cost = per_batch + rows * (linear * L + quadratic * L**2)")
    group.add_argument("--linear", type=float, default=1.0, help="cost per padded token slot")
    group.add_argument("--quadratic", type=float, default=0.0, help="cost per squared padded length, per row")
    group.add_argument("--per-batch", type=float, default=0.0, help="cost per micro-batch")
    parser.add_argument("--output-dir", type=Path, default=Path("plan_report"),
                        help="where plan_table.txt, plan_summary.json and the PNG plots go")
    parser.add_argument("--plots", type=bool, default=True, help="write the PNG plots")
    return parser


# plan options whose Python names (as in BalancedBatchSampler / BalancedTextDataModule messages) become flags
_PLAN_FLAGS = (*BatchingSettings.names(), "max_length", "num_replicas", "val_fraction", "text_key", "cache_dir",
               "linear", "quadratic", "per_batch", "epoch")
_NAMES = "|".join(_PLAN_FLAGS)
_QUOTED_RE = re.compile(rf"(?<![\w.-])({_NAMES})=([\"'])([\w-]+)\2(?: or ([\"'])([\w-]+)\4)?")
_VALUE_RE = re.compile(rf"(?<![\w.-])({_NAMES})=([^\s,;:()\[\]]*)")
_PATH_RE = re.compile(r"^(corpus|tokenizer) (file|path|glob pattern)\b")
_COST_RE = re.compile(r"\bCostModel\.(?=linear|quadratic|per_batch)")
_NAME_RE = re.compile(rf"(?<![\w.-])({_NAMES})(?!\w)")


def _flag_names(message: str) -> str:
    """Rewrite library messages' Python argument names as flags: ``too_long="skip"`` -> ``--too-long skip``."""
    def quoted(m: re.Match) -> str:
        return f"{_flag(m[1])} {m[3]}" + (f" or {_flag(m[1])} {m[5]}" if m[5] else "")

    def valued(m: re.Match) -> str:
        value = {"True": "true", "False": "false", "None": "null"}.get(m[2], m[2])
        return f"{_flag(m[1])} {value}".rstrip()

    message = _COST_RE.sub("", _PATH_RE.sub(r"--\1 \2", message))
    message = _VALUE_RE.sub(valued, _QUOTED_RE.sub(quoted, message))
    return _NAME_RE.sub(lambda m: _flag(m[1]), message)


def _check_max_length(cfg: Namespace) -> None:
    """``--max-length`` up front: with ``--lengths`` it only clips the array, so nothing downstream names it."""
    if cfg.max_length is not None:
        check_int("--max-length", cfg.max_length, 1, "pass --max-length N (tokens kept per sample) or null for none")


def _load_lengths(path: Path) -> np.ndarray:
    expected = "a .npy file of integer token counts (np.save of a 1-D int array) or a text file of one integer per line"
    if not path.is_file():
        raise ValueError(f"--lengths {str(path)!r} is not a file; pass {expected}")
    if path.suffix == ".npy":
        try:
            with open(path, "rb") as file:
                head = file.read(6)
        except OSError as error:
            raise ValueError(f"--lengths {str(path)!r} cannot be read: {error}") from error
        if head != b"\x93NUMPY":
            raise ValueError(f"--lengths {str(path)!r} must be {expected}; got a file that is not a NumPy .npy "
                             f"array (it starts with {head!r}, not the .npy header)")
        try:
            lengths = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:
            got = ("an array of Python objects (dtype object, e.g. a ragged list)" if "Object arrays" in str(error)
                   else f"a .npy file that cannot be read ({error})")
            raise ValueError(f"--lengths {str(path)!r} must be {expected}; got {got}") from error
        if not isinstance(lengths, np.ndarray):  # e.g. an .npz archive named .npy
            raise ValueError(f"--lengths {str(path)!r} must be {expected}; got a {type(lengths).__name__}")
    else:
        try:
            lengths = np.loadtxt(path, dtype=np.int64, ndmin=1)
        except ValueError as error:
            raise ValueError(f"--lengths {str(path)!r}: expected one integer per line: {error}") from error
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise ValueError(f"--lengths {str(path)!r} must be {expected}; got dtype {lengths.dtype} "
                         f"and shape {lengths.shape}")
    if lengths.size == 0 or lengths.min() < 1:
        got = "no lengths" if lengths.size == 0 else f"the length {int(lengths.min())} at index {int(lengths.argmin())}"
        raise ValueError(f"--lengths {str(path)!r} must hold token counts >= 1, got {got}; drop empty samples")
    return lengths.astype(np.int64)


def _corpus_lengths(cfg: Namespace, settings: BatchingSettings) -> tuple[np.ndarray, str]:
    dm = BalancedTextDataModule(cfg.corpus, cfg.tokenizer, settings=settings, max_length=cfg.max_length,
                                val_fraction=cfg.val_fraction, text_key=cfg.text_key, cache_dir=cfg.cache_dir)
    dm.prepare_data()  # tokenizes into the cache, with a progress bar, unless cached
    dm.setup("fit")
    return np.asarray(dm.train_dataset.lengths, dtype=np.int64), (
        f"{dm.source.description}, training split: {len(dm.train_dataset)} documents "
        f"(val_fraction={dm.val_fraction}, max_length={dm.max_length})")


def run_plan(cfg: Namespace) -> dict[str, Any]:
    """Run the ``plan`` subcommand on parsed options; print the report and write it to ``--output-dir``.

    Returns:
        The report's summary (see :meth:`lit_balance.report.PlanReport.summary`).

    Raises:
        ValueError, TypeError: a bad option or ``--lengths`` file (the message names the flag, e.g.
            ``--max-length``, ``--too-long skip``).
        FileNotFoundError: a ``--corpus`` or ``--tokenizer`` path does not exist.
    """
    from rich.console import Console

    from lit_balance.report import format_report, plan_report, save_plots, write_summary

    _check_max_length(cfg)
    try:
        settings = BatchingSettings.from_dict({name: cfg[name] for name in BatchingSettings.names()})
        if cfg.lengths is not None:
            lengths = _load_lengths(Path(cfg.lengths))
            if cfg.max_length is not None:
                lengths = np.minimum(lengths, cfg.max_length)
            source = f"{cfg.lengths} ({lengths.size} samples, max_length={cfg.max_length})"
        else:
            lengths, source = _corpus_lengths(cfg, settings)
        report = plan_report(
            lengths, settings=settings, num_replicas=cfg.num_replicas, epoch=cfg.epoch,
            cost_model=CostModel(linear=cfg.linear, quadratic=cfg.quadratic, per_batch=cfg.per_batch),
        )
    except (FileNotFoundError, TypeError, ValueError) as error:
        # the library names its Python arguments (max_tokens, too_long="skip"); here they are flags
        cls = next(c for c in (FileNotFoundError, TypeError, ValueError) if isinstance(error, c))
        raise cls(_flag_names(str(error))) from error
    console = Console(record=True, width=max(Console().width, 120))
    console.print(f"plan of {source}: {cfg.num_replicas} ranks, max_tokens={cfg.max_tokens} padded slots per "
                  f"micro-batch per rank, epoch {cfg.epoch}", highlight=False, soft_wrap=True)
    for renderable in format_report(report):
        console.print(renderable)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = [write_summary(report, output_dir)]
    if cfg.plots:
        written += save_plots(report, output_dir)
    table_path = output_dir / "plan_table.txt"
    table_path.write_text(console.export_text(), encoding="utf-8")
    console.print("wrote " + ", ".join(str(p) for p in [table_path, *written]), highlight=False, soft_wrap=True)
    return report.summary()


class LitBalanceCLI(LightningCLI):
    """LightningCLI for :class:`DemoTransformerLM` on :class:`BalancedTextDataModule`, plus the ``plan`` subcommand.

    ``model.vocab_size`` is linked to the instantiated data module's ``vocab_size``
    (``link_arguments(..., apply_on="instantiate")``), so configs never repeat it.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        parser._subcommands_action.add_subcommand(
            "plan", plan_parser(), help="Plan one epoch without training and report padding, balance and cost")

    def _set_seed(self) -> None:
        if self.subcommand != "plan":
            super()._set_seed()

    def instantiate_classes(self) -> None:
        if self.subcommand != "plan":
            super().instantiate_classes()

    def before_fit(self) -> None:
        """Print the derived budget (rank 0) before training."""
        trainer, dm = self.trainer, self.datamodule
        if trainer.is_global_zero:
            print(f"world size {trainer.world_size} | per-rank budget {dm.max_tokens} padded slots per micro-batch | "
                  f"global budget {dm.max_tokens * trainer.world_size * trainer.accumulate_grad_batches} padded slots "
                  f"per optimizer step | max_length {dm.max_length} tokens | corpus: {dm.source.description}",
                  flush=True)

    def _run_subcommand(self, subcommand: str) -> None:
        if subcommand == "plan":
            try:
                self.plan_summary = run_plan(self.config.plan)
            except (FileNotFoundError, TypeError, ValueError) as error:
                # a bad option or input file: usage and the message (naming the flag), exit status 2, no
                # traceback (set JSONARGPARSE_DEBUG=1 to raise instead)
                subcommands = getattr(self.parser, "_subcommands_action", None)
                parser = getattr(subcommands, "_name_parser_map", {}).get("plan", self.parser)
                parser.error(str(error), error)
            return
        super()._run_subcommand(subcommand)


def build_cli(args: list[str] | None = None) -> LitBalanceCLI:
    """Run the ``lit-balance`` command on ``args`` and return the :class:`LitBalanceCLI`.

    The returned object holds what the subcommand built: ``trainer``, ``model`` and ``datamodule`` after
    ``fit``, ``plan_summary`` after ``plan``.

    Args:
        args: command-line arguments without the program name (default: ``sys.argv[1:]``).
    """
    return LitBalanceCLI(
        DemoTransformerLM,
        BalancedTextDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "lit-balance"},
        args=args,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lit-balance`` console script (and of ``python -m lit_balance.cli``).

    Args:
        args: command-line arguments without the program name (default: ``sys.argv[1:]``).
    """
    build_cli(args)


if __name__ == "__main__":
    main()
