"""The ``lit-balance`` command: LightningCLI's subcommands with any LightningModule, and ``plan``."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
import shutil
import signal
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_balance.cli import messages
from lit_balance.cli.messages import (
    INPUT_ERRORS,
    ErrorFirstMixin,
    ErrorFirstParser,
    check_before_launch,
    exit_on_input_error,
    fit_message,
    in_data_setup,
    input_error,
    install_hint,
    mark_run,
)
from lit_balance.cli.ledger import ledger_parser, run_ledger
from lit_balance.cli.plan import plan_parser, run_plan
from lit_balance.cli.tokenize import run_tokenize, tokenize_parser
from lit_balance.errors import InputValueError
from lit_balance.lightning.datamodule import BalancedTextDataModule
from lit_balance.lightning.dm_settings import DEFAULT_MAX_TOKENS
from lit_balance.plan.settings import BatchingSettings
from lit_balance.world import data_parallel_world

__all__ = ["OTHER_SUBCOMMANDS", "LitBalanceArgumentParser", "LitBalanceCLI", "SubcommandRun", "build_cli",
           "configs_parser", "fit_parser", "main", "write_configs"]


#: the subcommands of the ``lit-balance`` command that do not train, each run with its own parser (:func:`build_cli`)
OTHER_SUBCOMMANDS = {
    "plan": "Plan one epoch without training and report padding, balance and cost",
    "configs": "Write the shipped configs (conf/) and recipes (recipes/) into a directory",
    "tokenize": "Tokenize a JSONL/Parquet corpus into a datatrove token store (datatrove's executor)",
    "ledger": "Check the record of what each rank received against a ledger (ledger check RECORD --ledger PATH)",
}


class LitBalanceArgumentParser(ErrorFirstMixin, LightningArgumentParser):
    """Lightning's argument parser, with errors printed first (:class:`~lit_balance.cli.messages.ErrorFirstMixin`).

    Keeps the subcommands action that :meth:`add_subcommands` returns as :attr:`subcommands_action` (None until then),
    so that :class:`LitBalanceCLI` lists ``plan``, ``configs`` and ``tokenize`` beside Lightning's subcommands.
    """

    subcommands_action: Any = None

    def add_subcommands(self, *args: Any, **kwargs: Any) -> Any:
        self.subcommands_action = super().add_subcommands(*args, **kwargs)
        return self.subcommands_action


def _takes(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` has a parameter ``name`` (by name, not through ``**kwargs``)."""
    parameter = inspect.signature(cls.__init__).parameters.get(name)
    return parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)


class LitBalanceCLI(LightningCLI):
    """LightningCLI for any LightningModule on :class:`BalancedTextDataModule`; its ``--help`` also lists ``plan``,
    ``configs`` and ``tokenize``, which :func:`build_cli` runs with their own parsers.

    Built by :func:`build_cli` with ``subclass_mode_model=True``: ``--model.class_path=my.Module`` (or
    ``model: {class_path: ..., init_args: ...}`` in a config) picks any LightningModule, and the model defaults to
    :class:`~lit_balance.demo.DemoTransformerLM`, whose arguments a config may give without a ``class_path``. When
    the model's ``__init__`` takes ``vocab_size``, it is linked to the instantiated data module's ``vocab_size``
    (``link_arguments(..., apply_on="instantiate")``), so configs never repeat it; other models get no
    ``vocab_size``, neither as an argument nor in the hyperparameters their checkpoint keeps. Flags cannot be
    abbreviated. A setting rejected by lit_balance while building the data module or model exits with status 2 and
    one stderr line naming the flag (``lit-balance fit: error: --data.max_tokens must be ...``; :func:`build_cli`
    does the same for the data module's ``setup``); other errors keep their traceback, and ``JSONARGPARSE_DEBUG=true``
    raises rejected settings too. A flag or config key the parser does not know is one line too: the error, the config
    file holding the key, the closest flag (:class:`LitBalanceArgumentParser`). Under several ranks an error they all
    meet is printed once. ``max_tokens="auto"`` on a CPU without ``memory_limit`` is refused before the ranks start.
    With the progress bar on and no bar among the callbacks, the Trainer gets a
    :class:`~lit_balance.callbacks.BalanceProgressBar`. After ``fit``, the files it wrote and, with a
    :class:`~lit_balance.callbacks.LastStepCheckpoint`, the command that resumes (:meth:`after_fit`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", LitBalanceArgumentParser)
        given = kwargs.get("args")
        self._argv = [str(a) for a in given] if isinstance(given, (list, tuple)) else list(sys.argv[1:])
        self._fit_started: float | None = None
        mark_run()  # the ranks fit starts print an error they all meet once
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """The parsers of the command and of each subcommand; flags must be spelled out (no abbreviations)."""
        kwargs.setdefault("allow_abbrev", False)  # else --data.max_token=2048 silently sets data.max_tokens
        return super().init_parser(**kwargs)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
                     ) -> None:
        """Lightning's parsers; with subcommands, ``plan``, ``configs`` and ``tokenize`` are listed beside them (in
        ``--help`` and in the choices an unknown subcommand is told); :func:`build_cli` runs them."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        action = getattr(self.parser, "subcommands_action", None)
        if add_subcommands and action is not None:
            for name, parser in (("plan", plan_parser()), ("configs", configs_parser()),
                                 ("tokenize", tokenize_parser()), ("ledger", ledger_parser())):
                action.add_subcommand(name, parser, help=OTHER_SUBCOMMANDS[name])

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # the DataModule's batching keywords default to None (not given); the command shows and passes their values
        defaults = BatchingSettings(max_tokens=DEFAULT_MAX_TOKENS).to_dict()
        taken = inspect.signature(BalancedTextDataModule.__init__).parameters
        parser.set_defaults({f"data.{name}": value for name, value in defaults.items()
                             if name in taken and name != "accumulate_grad_batches"})  # the Trainer's is used
        if self.subclass_mode_model:
            parser.set_defaults({"model": {"class_path": "lit_balance.demo.DemoTransformerLM"}})
            parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        else:
            parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def instantiate_classes(self) -> None:
        if self.subcommand in OTHER_SUBCOMMANDS:  # after an option of the command; build_cli runs them when first
            self.parser.error(f"give {self.subcommand} first, before any option: lit-balance {self.subcommand} ...")
        try:
            super().instantiate_classes()
        except INPUT_ERRORS as error:
            if self.subcommand is None or input_error(error) is None:
                raise
            exit_on_input_error(self.subcommand, fit_message(error), error)

    def after_instantiate_classes(self) -> None:
        """Drop ``vocab_size`` from the hyperparameters of a model whose ``__init__`` does not take it.

        jsonargparse skips the instantiation link to ``vocab_size`` for such a model but reports it as applied, so
        Lightning records it in ``model.hparams``, which ``load_from_checkpoint`` would pass back to ``__init__``.
        """
        model = getattr(self, "model", None)
        if not isinstance(model, LightningModule) or _takes(type(model), "vocab_size"):
            return
        config = self.config.get(str(self.subcommand), self.config).get("model")
        given = config.get("dict_kwargs") if isinstance(config, Namespace) else None
        if "vocab_size" not in (given or {}):
            model.hparams.pop("vocab_size", None)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Lightning's, plus a :class:`~lit_balance.callbacks.BalanceProgressBar` when the progress bar is on and no
        other bar is given: the epoch and optimizer step right, and the monitors' live figures when they run."""
        from lightning.pytorch.callbacks import ProgressBar

        from lit_balance.lightning.callbacks import BalanceProgressBar

        trainer = self.config_init.get(str(self.subcommand), self.config_init).get("trainer") or Namespace()
        given = kwargs.get("callbacks", trainer.get("callbacks")) or []
        given = list(given) if isinstance(given, (list, tuple)) else [given]
        enabled = kwargs.get("enable_progress_bar", trainer.get("enable_progress_bar")) is not False
        if enabled and not any(isinstance(c, ProgressBar) for c in given):
            kwargs["callbacks"] = [*given, BalanceProgressBar()]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """Print the derived budget and the training split's plan (:func:`~lit_balance.report.summary_line`; rank 0),
        in lines of at most 100 columns but for the corpus's description (80 but for the plan line); with ``max_tokens="auto"``, that the budget
        will be measured at fit start (the DataModule logs it then)."""
        from lit_balance.report import summary_line

        trainer, dm = self.trainer, self.datamodule
        self._fit_started = time.time()
        try:
            check_before_launch(dm, trainer)  # here, once, rather than on every rank after they started
        except INPUT_ERRORS as error:
            if input_error(error) is None:
                raise
            exit_on_input_error(self.subcommand, fit_message(error, default=("data", dm)), error)
        if not trainer.is_global_zero:
            return
        tail = f"max_length {dm.max_length} tokens\ncorpus: {dm.corpus_description}"
        if dm.max_tokens == "auto":
            print(f"world size {trainer.world_size} processes | per-rank budget: max_tokens=auto, measured at fit "
                  f"start\n(memory_limit {dm.memory_limit} bytes, memory_fraction {dm.memory_fraction}) | {tail}",
                  flush=True)
            return
        try:
            num_replicas = data_parallel_world(trainer).num_replicas
        except RuntimeError:  # ModelParallelStrategy: the data-parallel size is its device mesh's, built by fit
            num_replicas = None
        unit = "tokens per packed row" if dm.batch_layout.planner.packed_rows else "padded slots"
        if num_replicas is None:
            print(f"world size {trainer.world_size} processes (data-parallel size set when fit builds the mesh)\n"
                  f"per-rank budget {dm.max_tokens} {unit} per micro-batch | {tail}", flush=True)
            return
        try:
            budgets = dm.settings.rank_max_tokens(num_replicas)
        except INPUT_ERRORS as error:
            exit_on_input_error(self.subcommand, fit_message(error), error)
        print(f"data-parallel size {num_replicas} | per-rank budget {dm.max_tokens} {unit} per micro-batch\n"
              f"global budget {sum(budgets) * trainer.accumulate_grad_batches} {unit} per optimizer step | {tail}",
              flush=True)
        # the preview communicates with no other rank
        print(summary_line(dm.plan_summary(num_replicas, trainer.accumulate_grad_batches)), flush=True)

    def after_fit(self) -> None:
        """Name the metrics file, logger directories and checkpoints this fit wrote, and plot the figures (rank 0;
        :func:`lit_balance.lightning.outputs.report_outputs`); with a
        :class:`~lit_balance.callbacks.LastStepCheckpoint`, the command that resumes from its ``last.ckpt`` (the
        command's own arguments, ``--ckpt_path`` and, after a run that reached ``max_steps``, twice the steps). When a
        signal stopped training (Ctrl-C, SIGTERM), say so and exit with ``128 + signal number`` on rank 0."""
        from lit_balance.lightning.callbacks import LastStepCheckpoint
        from lit_balance.lightning.outputs import report_outputs, shown_path

        trainer = self.trainer
        last = next((c for c in trainer.checkpoint_callbacks if isinstance(c, LastStepCheckpoint)), None)
        stopped_by = last.stopped_by if last is not None else None
        if not trainer.is_global_zero:
            return
        if stopped_by:  # stopping: a further Ctrl-C while the last lines print (and the plot is drawn) waits for them
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)
            print(f"stopped by {stopped_by} at optimizer step {trainer.global_step} of {trainer.max_steps}, on every "
                  "rank", flush=True)
        print("\n".join(report_outputs(trainer, since=self._fit_started)), flush=True)
        if last is not None and last.last_model_path:
            more = 2 * trainer.max_steps if not stopped_by and trainer.max_steps > 0 else None
            print(f"resume: {_resume_command(self._argv, shown_path(last.last_model_path), more)}", flush=True)
        if stopped_by:  # the launcher's rank only: Lightning's launcher stops every rank when one exits with an error
            raise SystemExit(128 + signal.Signals[stopped_by].value)


def _resume_command(argv: list[str], ckpt_path: str, max_steps: int | None) -> str:
    """``lit-balance <argv>`` less its ``--ckpt_path`` (and ``--trainer.max_steps`` when ``max_steps`` is given), plus
    ``--ckpt_path=<ckpt_path>`` and ``--trainer.max_steps=<max_steps>``, quoted for a POSIX shell."""
    dropped = {"--ckpt_path"} | ({"--trainer.max_steps"} if max_steps is not None else set())
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in dropped:
            skip = True  # its value follows
        elif arg.split("=", 1)[0] not in dropped:
            kept.append(arg)
    kept.append(f"--ckpt_path={ckpt_path}")
    if max_steps is not None:
        kept.append(f"--trainer.max_steps={max_steps}")
    return shlex.join(["lit-balance", *kept])


@dataclasses.dataclass
class SubcommandRun:
    """What :func:`build_cli` returns after ``plan``, ``configs`` or ``tokenize``.

    Attributes:
        subcommand: ``"plan"``, ``"configs"`` or ``"tokenize"``.
        config: the parsed options, as LightningCLI's ``config``: ``subcommand`` and, under its name, its options.
        plan_summary: after ``plan``, its summary (:func:`~lit_balance.cli.plan.run_plan`), else None.
        tokenize_result: after ``tokenize``, what it wrote (:func:`~lit_balance.cli.tokenize.run_tokenize`), else None.
        ledger_check: after ``ledger check``, the :class:`~lit_balance.lightning.ledger_record.RecordCheck` (all
            matched; a mismatch exits with status 1), else None.
        lines: after ``configs``, the lines it printed (:func:`write_configs`), else None.
    """

    subcommand: str
    config: Namespace
    plan_summary: dict[str, Any] | None = None
    tokenize_result: Any = None
    ledger_check: Any = None
    lines: list[str] | None = None


class _FitParserCLI(LitBalanceCLI):
    """Builds the ``lit-balance fit`` parser alone (the only subcommand) through LightningCLI's hooks, and parses,
    seeds, instantiates and runs nothing: :meth:`parse_arguments` keeps an empty config (no subcommand, no seed), and
    the instantiation hooks do nothing, so the constructor returns with :attr:`fit_parser` set."""

    fit_parser: LightningArgumentParser | None = None

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": LightningCLI.subcommands()["fit"]}

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
                     ) -> None:
        LightningCLI.setup_parser(self, add_subcommands, main_kwargs, subparser_kwargs)  # no plan/configs/tokenize

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        self.fit_parser = parser  # called for each subcommand's parser: here fit's only

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.config = Namespace(subcommand=None, seed_everything=False)  # no subcommand to run, no seed to set

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def after_instantiate_classes(self) -> None:
        pass


def fit_parser() -> LightningArgumentParser:
    """The parser of ``lit-balance fit``, built as :func:`build_cli` builds it (``plan --config`` reads fit configs
    with it)."""
    parser = _FitParserCLI(**_cli_kwargs(), args=[], load_from_checkpoint_support=False).fit_parser
    if parser is None:  # pragma: no cover  (LightningCLI no longer calls add_arguments_to_parser per subcommand)
        raise RuntimeError("LightningCLI built no parser for the fit subcommand")
    return parser


def _cli_kwargs() -> dict[str, Any]:
    """The arguments :func:`build_cli` builds :class:`LitBalanceCLI` with (but ``args``)."""
    return {"model_class": LightningModule, "datamodule_class": BalancedTextDataModule, "subclass_mode_model": True,
            "seed_everything_default": 0, "save_config_kwargs": {"overwrite": True},
            "parser_kwargs": {"prog": "lit-balance"}}


def _run_other(subcommand: str, args: list[str]) -> SubcommandRun:
    """Parse ``args`` with the parser of ``plan``, ``configs`` or ``tokenize`` and run it.

    A bad setting or input file (a lit_balance check raised): one line naming the flag, exit status 2, no traceback
    (``JSONARGPARSE_DEBUG=true`` raises instead); any other error keeps its traceback.
    """
    builders = {"plan": lambda: plan_parser(fit_parser()), "configs": configs_parser, "tokenize": tokenize_parser,
                "ledger": ledger_parser}
    parser = builders[subcommand]()
    parser.prog = f"lit-balance {subcommand}"
    config = parser.parse_args(args)
    run = SubcommandRun(subcommand, Namespace({"subcommand": subcommand, subcommand: config}))
    try:
        if subcommand == "plan":
            run.plan_summary = run_plan(config)
        elif subcommand == "tokenize":
            run.tokenize_result = run_tokenize(config)
        elif subcommand == "ledger":
            run.ledger_check = run_ledger(config)
        else:
            run.lines = write_configs(config.directory, overwrite=config.overwrite)
    except INPUT_ERRORS as error:
        if input_error(error) is None:
            raise
        exit_on_input_error(subcommand, str(error), error)
    except ImportError as error:  # a missing extra: what to install, in one line
        if install_hint(error) is None:
            raise
        exit_on_input_error(subcommand, install_hint(error), error)
    if run.lines is not None:
        print("\n".join(run.lines), flush=True)
    return run


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


def build_cli(args: list[str] | None = None) -> LitBalanceCLI | SubcommandRun:
    """Run the ``lit-balance`` command on ``args`` and return what it built.

    ``plan``, ``configs`` and ``tokenize`` (given first) run with their own parsers and return a
    :class:`SubcommandRun` (``plan_summary`` after ``plan``, ``tokenize_result`` after ``tokenize``); anything else
    goes to :class:`LitBalanceCLI`, returned with ``trainer``, ``model`` and ``datamodule`` after ``fit``. A setting
    that the data module's ``setup`` (or the plan preview printed before ``fit``) rejects exits with status 2 and one
    stderr line naming the flag; other errors keep their traceback.

    Args:
        args: command-line arguments without the program name (default: ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if args is None else args)
    messages.COMMAND_LINE = [str(a) for a in argv]  # a parser error names the config file holding a bad key
    if argv and argv[0] in OTHER_SUBCOMMANDS:
        return _run_other(argv[0], argv[1:])
    subcommand = next((a for a in argv if a in LightningCLI.subcommands()), "fit")
    try:
        return LitBalanceCLI(**_cli_kwargs(), args=args)
    except INPUT_ERRORS as error:
        found = input_error(error)
        if found is None:
            raise
        if not in_data_setup(found):  # the data module's dataset (a store's vocabulary check): its settings
            exit_on_input_error(subcommand, fit_message(error, default=("data", BalancedTextDataModule)), error)
        exit_on_input_error(subcommand, fit_message(error), error)
    except ImportError as error:  # a missing extra: what to install, in one line
        if install_hint(error) is None:
            raise
        exit_on_input_error(subcommand, install_hint(error), error)


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
