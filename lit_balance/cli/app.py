"""The ``lit-balance`` command: LightningCLI's subcommands with any LightningModule, and ``plan``."""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, _InstantiatorFn

from lit_balance.cli.messages import (
    INPUT_ERRORS,
    ErrorFirstMixin,
    ErrorFirstParser,
    exit_on_input_error,
    fit_message,
    in_data_setup,
    input_error,
)
from lit_balance.cli.plan import plan_parser, run_plan
from lit_balance.cli.tokenize import run_tokenize, tokenize_parser
from lit_balance.errors import InputValueError
from lit_balance.lightning.datamodule import BalancedTextDataModule
from lit_balance.world import data_parallel_world

__all__ = ["LitBalanceArgumentParser", "LitBalanceCLI", "build_cli", "configs_parser", "main", "write_configs"]


class LitBalanceArgumentParser(ErrorFirstMixin, LightningArgumentParser):
    """Lightning's argument parser, with errors printed first (:class:`~lit_balance.cli.messages.ErrorFirstMixin`)."""


class _ModelInstantiator(_InstantiatorFn):
    """Lightning's model instantiator, minus linked values the model's ``__init__`` does not take.

    jsonargparse skips an instantiation link whose target the chosen class lacks (``vocab_size`` for a model
    without it), but still reports it as applied, and Lightning would record it in ``model.hparams``, which
    ``load_from_checkpoint`` then passes back to ``__init__``.
    """

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        prefix = f"{self.key}.init_args."
        links = {key: value for key, value in applied_instantiation_links.items()
                 if not key.startswith(prefix) or _takes(class_type, key[len(prefix):])}
        return super().__call__(class_type, *args, applied_instantiation_links=links, **kwargs)


def _takes(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` has a parameter ``name`` (by name, not through ``**kwargs``)."""
    parameter = inspect.signature(cls.__init__).parameters.get(name)
    return parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)


class LitBalanceCLI(LightningCLI):
    """LightningCLI for any LightningModule on :class:`BalancedTextDataModule`, plus ``plan``, ``configs`` and
    ``tokenize``.

    Built by :func:`build_cli` with ``subclass_mode_model=True``: ``--model.class_path=my.Module`` (or
    ``model: {class_path: ..., init_args: ...}`` in a config) picks any LightningModule, and the model defaults to
    :class:`~lit_balance.demo.DemoTransformerLM`, whose arguments a config may give without a ``class_path``. When
    the model's ``__init__`` takes ``vocab_size``, it is linked to the instantiated data module's ``vocab_size``
    (``link_arguments(..., apply_on="instantiate")``), so configs never repeat it; other models get no
    ``vocab_size``. Flags cannot be abbreviated. A setting rejected by lit_balance (building the data module or
    model, the data module's ``setup``, or ``plan``) exits with status 2 and one stderr line naming the flag
    (``lit-balance fit: error: --data.max_tokens must be ...``); other errors keep their traceback, and
    ``JSONARGPARSE_DEBUG=true`` raises rejected settings too. A flag the parser does not know prints the error first,
    then the closest flag, then the usage (:class:`LitBalanceArgumentParser`). With the progress bar on and no bar
    among the callbacks, the Trainer gets a :class:`~lit_balance.callbacks.BalanceProgressBar`. ``configs DIR``
    writes the shipped ``conf/`` and ``recipes/`` (:func:`write_configs`). ``tokenize INPUT --output-folder DIR``
    tokenizes a JSONL/Parquet corpus into a datatrove token store (:mod:`lit_balance.cli.tokenize`).
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """The parsers of the command and of each subcommand; flags must be spelled out (no abbreviations)."""
        kwargs.setdefault("allow_abbrev", False)  # else --data.max_token=2048 silently sets data.max_tokens
        return super().init_parser(**kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", LitBalanceArgumentParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        if self.subclass_mode_model:
            parser.set_defaults({"model": {"class_path": "lit_balance.demo.DemoTransformerLM"}})
            parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        else:
            parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        if self.subclass_mode_model:  # replaces Lightning's (jsonargparse keeps the last one added for a type)
            self.parser.add_instantiator(_ModelInstantiator(cli=self, key="model"), LightningModule, subclasses=True)

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        fit_parser = parser._subcommands_action._name_parser_map.get("fit")
        parser._subcommands_action.add_subcommand(
            "plan", plan_parser(fit_parser),
            help="Plan one epoch without training and report padding, balance and cost")
        parser._subcommands_action.add_subcommand(
            "configs", configs_parser(),
            help="Write the shipped configs (conf/) and recipes (recipes/) into a directory")
        parser._subcommands_action.add_subcommand(
            "tokenize", tokenize_parser(),
            help="Tokenize a JSONL/Parquet corpus into a datatrove token store (datatrove's executor)")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Any:
        """Lightning's, plus a :class:`~lit_balance.callbacks.BalanceProgressBar` when the progress bar is on and no
        other bar is given: the epoch and optimizer step right, and the monitors' live figures when they run."""
        from lightning.pytorch.callbacks import ProgressBar

        from lit_balance.lightning.callbacks import BalanceProgressBar

        given = [*(config.get("callbacks") or []), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks = [*callbacks, BalanceProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def _set_seed(self) -> None:
        if self.subcommand not in ("plan", "configs", "tokenize"):
            super()._set_seed()

    def instantiate_classes(self) -> None:
        if self.subcommand in ("plan", "configs", "tokenize"):
            return
        try:
            super().instantiate_classes()
        except INPUT_ERRORS as error:
            if self.subcommand is None or not input_error(error) is not None:
                raise
            exit_on_input_error(self.subcommand, fit_message(error), error)

    def before_fit(self) -> None:
        """Print the derived budget and the training split's plan (:func:`~lit_balance.report.summary_line`; rank 0);
        with ``max_tokens="auto"``, that the budget will be measured at fit start (the DataModule logs it then)."""
        from lit_balance.report import summary_line

        trainer, dm = self.trainer, self.datamodule
        if not trainer.is_global_zero:
            return
        tail = f"max_length {dm.max_length} tokens | corpus: {dm.source.description}"
        if dm.max_tokens == "auto":
            print(f"world size {trainer.world_size} processes | per-rank budget: max_tokens=auto, measured at fit "
                  f"start on worst-case micro-batches (memory_limit {dm.memory_limit} bytes, memory_fraction "
                  f"{dm.memory_fraction}) | {tail}", flush=True)
            return
        try:
            num_replicas = data_parallel_world(trainer).num_replicas
        except RuntimeError:  # ModelParallelStrategy: the data-parallel size is its device mesh's, built by fit
            num_replicas = None
        if num_replicas is None:
            print(f"world size {trainer.world_size} processes (data-parallel size set when fit builds the device "
                  f"mesh) | per-rank budget {dm.max_tokens} padded slots per micro-batch | {tail}", flush=True)
            return
        try:
            budgets = dm.settings.rank_max_tokens(num_replicas)
        except INPUT_ERRORS as error:
            exit_on_input_error(self.subcommand, fit_message(error), error)
        print(f"data-parallel size {num_replicas} | per-rank budget {dm.max_tokens} padded slots per micro-batch | "
              f"global budget {sum(budgets) * trainer.accumulate_grad_batches} padded slots "
              f"per optimizer step | {tail}", flush=True)
        if isinstance(dm, BalancedTextDataModule):  # the preview communicates with no other rank
            print(summary_line(dm.plan_summary(num_replicas, trainer.accumulate_grad_batches)), flush=True)

    def after_fit(self) -> None:
        """Name the metrics file, logger directories and checkpoint the fit wrote, and plot the figures (rank 0;
        :func:`lit_balance.lightning.outputs.report_outputs`)."""
        from lit_balance.lightning.outputs import report_outputs

        if self.trainer.is_global_zero:
            print("\n".join(report_outputs(self.trainer)), flush=True)

    def _run_subcommand(self, subcommand: str) -> None:
        # a bad setting or input file (a lit_balance check raised): one line naming the flag, exit status 2, no
        # traceback (JSONARGPARSE_DEBUG=true raises instead); any other error keeps its traceback
        if subcommand == "configs":
            options = self.config.configs
            try:
                lines = write_configs(options.directory, overwrite=options.overwrite)
            except INPUT_ERRORS as error:
                if input_error(error) is None:
                    raise
                exit_on_input_error(subcommand, str(error), error)
            print("\n".join(lines), flush=True)
            return
        if subcommand == "tokenize":
            try:
                self.tokenize_result = run_tokenize(self.config.tokenize)
            except INPUT_ERRORS as error:
                if input_error(error) is None:
                    raise
                exit_on_input_error(subcommand, str(error), error)
            return
        if subcommand == "plan":
            try:
                self.plan_summary = run_plan(self.config.plan)
            except INPUT_ERRORS as error:
                if not input_error(error) is not None:
                    raise
                exit_on_input_error(subcommand, str(error), error)
            return
        try:
            super()._run_subcommand(subcommand)
        except INPUT_ERRORS as error:
            if not (input_error(error) is not None and in_data_setup(input_error(error))):
                raise
            exit_on_input_error(subcommand, fit_message(error), error)


def build_cli(args: list[str] | None = None) -> LitBalanceCLI:
    """Run the ``lit-balance`` command on ``args`` and return the :class:`LitBalanceCLI`.

    The returned object holds what the subcommand built: ``trainer``, ``model`` and ``datamodule`` after
    ``fit``, ``plan_summary`` after ``plan``, ``tokenize_result`` after ``tokenize``.

    Args:
        args: command-line arguments without the program name (default: ``sys.argv[1:]``).
    """
    return LitBalanceCLI(
        LightningModule,
        BalancedTextDataModule,
        subclass_mode_model=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "lit-balance"},
        args=args,
    )


def configs_parser() -> ErrorFirstParser:
    """The ``configs`` subcommand's parser: ``lit-balance configs DIRECTORY [--overwrite true]``."""
    parser = ErrorFirstParser(allow_abbrev=False,
                              description="Write the configs (conf/) and recipes (recipes/) that come with the "
                                          "package into DIRECTORY, to run and edit them: cd DIRECTORY; python "
                                          "recipes/train.py; lit-balance fit --config conf/cli/fit_cpu.yaml")
    parser.add_argument("directory", type=Path, help="where conf/ and recipes/ go (created if missing)")
    parser.add_argument("--overwrite", type=bool, default=False, help="replace files that already exist")
    return parser


def _shipped() -> list[tuple[str, Any]]:
    """``(relative path, resource)`` of every shipped config and recipe: ``conf/**/*.yaml``, ``recipes/*.py``."""
    found: list[tuple[str, Any]] = []

    def walk(node: Any, rel: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            path = f"{rel}/{child.name}"
            if child.is_dir():
                walk(child, path)
            elif child.name.endswith((".yaml", ".py")):
                found.append((path, child))

    root = resources.files("lit_balance")
    for top in ("conf", "recipes"):
        if root.joinpath(top).is_dir():
            walk(root.joinpath(top), top)
    return found


def write_configs(directory: str | os.PathLike, overwrite: bool = False) -> list[str]:
    """Copy the configs and recipes that come with the package into ``directory`` (``conf/``, ``recipes/``).

    Args:
        directory: the target directory (created if missing).
        overwrite: replace files that exist; False: refuse before writing anything.

    Returns:
        Lines for the user: what was written and how to run it.

    Raises:
        ValueError: some target files exist and ``overwrite`` is False (names them).
        RuntimeError: the installed package holds no configs (a broken installation).
    """
    directory = Path(directory)
    files = _shipped()
    if not files:
        raise RuntimeError("the installed lit_balance holds no conf/ or recipes/ files; reinstall it "
                           "(pip install --force-reinstall lit_balance)")
    existing = [rel for rel, _ in files if (directory / rel).exists()]
    if existing and not overwrite:
        raise InputValueError(
            f"expected a directory without conf/ and recipes/ files, got {len(existing)} existing files in "
            f"{directory} (e.g. {', '.join(existing[:3])}); pass --overwrite true to replace them, or another "
            "directory")
    for rel, resource in files:
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with resources.as_file(resource) as source:
            shutil.copyfile(source, target)
    configs = sum(rel.startswith("conf/") for rel, _ in files)
    wrote = f"wrote {configs} configs to {directory / 'conf'} and {len(files) - configs} recipes to {directory / 'recipes'}"
    run = f"run them there: cd {directory} && python recipes/train.py   (or: lit-balance fit --config conf/cli/fit_cpu.yaml)"
    return [wrote, run]


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lit-balance`` console script (and of ``python -m lit_balance.cli``).

    Puts the working directory first on ``sys.path``, as ``python -m`` does, so that ``--model.class_path=my_lm.MyLM``
    finds ``my_lm.py`` there (the console script's own ``sys.path[0]`` is its ``bin`` directory). Every rank that
    Lightning's DDP launcher starts runs this too, in the same working directory.

    Args:
        args: command-line arguments without the program name (default: ``sys.argv[1:]``).
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    build_cli(args)
