"""The ``lit-balance`` command: Lightning CLI subcommands (fit, validate, ...) and the ``plan`` dry run.

Run:
    lit-balance fit --config conf/cli/fit_cpu.yaml          # 2 CPU DDP ranks, BalancedTextDataModule + DemoTransformerLM
    lit-balance fit --print_config                          # every option with its default
    lit-balance plan --lengths lit_balance/data/lengths/lengths_fortunes.npy --num-replicas 8 --max-tokens 2048
    lit-balance plan --config conf/cli/fit_cpu.yaml          # the plan that fit config trains on
    lit-balance fit --config conf/cli/fit_cpu.yaml --model.class_path=my_package.MyModule   # any LightningModule
    python -m lit_balance.cli plan --help                   # the same without the console script

``fit``, ``validate``, ``test`` and ``predict`` are :class:`lightning.pytorch.cli.LightningCLI`'s: the model is any
LightningModule (``--model.class_path=my.Module``, its arguments ``--model.*``; default
:class:`~lit_balance.demo.DemoTransformerLM`), the data :class:`~lit_balance.BalancedTextDataModule` (``--data.*``); a
model whose ``__init__`` takes ``vocab_size`` gets the built data module's, and callbacks are set with
``--trainer.callbacks`` (class paths and init args) in the config. ``plan`` plans one epoch without
training and reports it (see :mod:`lit_balance.report`); ``plan --config`` also reads a ``fit`` config and plans
with its data settings, its ranks (``trainer.devices`` x ``trainer.num_nodes``) and its
``trainer.accumulate_grad_batches``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, _InstantiatorFn

from lit_balance._checks import MAX_TOKENS_LIMIT, check_int
from lit_balance.errors import InputError, InputTypeError, InputValueError
from lit_balance.lightning.datamodule import DEFAULT_MAX_TOKENS, BalancedTextDataModule
from lit_balance.plan.cost import CostModel
from lit_balance.plan.settings import BatchingSettings

__all__ = ["LitBalanceCLI", "build_cli", "main", "plan_options_from_fit", "plan_parser", "run_plan"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def plan_parser(fit_parser: ArgumentParser | None = None) -> ArgumentParser:
    """The ``plan`` subcommand's parser (jsonargparse).

    Args:
        fit_parser: the ``fit`` subcommand's parser; with it, ``--config`` also reads a ``lit-balance fit`` config
            (see :func:`plan_options_from_fit`). Without it, ``--config`` reads these options from YAML only.
    """
    parser = ArgumentParser(allow_abbrev=False, description="Plan one epoch without training: per-rank micro-batches, tokens, padding "
                                        "and cost, rank imbalance and useful compute fraction, against "
                                        "DistributedSampler with a fixed batch size; writes a table, a JSON summary "
                                        "and PNG plots.")
    action = type("PlanConfigFile", (_PlanConfigFile,), {"fit_parser": fit_parser})
    parser.add_argument("--config", action=action,
                        help="YAML file holding any of these options, or a lit-balance fit config (its data settings, "
                             "ranks = trainer.devices x trainer.num_nodes, and trainer.accumulate_grad_batches; "
                             "flags after it override them)")
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
    group.add_argument("--data-kwargs", type=dict, default={},
                       help="further BalancedTextDataModule arguments (e.g. add_special_tokens); a fit config's "
                            "data settings that have no flag here land here")
    group = parser.add_argument_group("sampler, as BalancedBatchSampler (see lit_balance.BatchingSettings)")
    group.add_argument("--num-replicas", type=int, default=2, help="ranks (world size)")
    group.add_argument("--epoch", type=int, default=0, help="the epoch to plan (as set_epoch)")
    hints = typing.get_type_hints(BatchingSettings)
    for setting in dataclasses.fields(BatchingSettings):
        default = DEFAULT_MAX_TOKENS if setting.name == "max_tokens" else setting.default
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


class _PlanConfigFile(ActionConfigFile):
    """``plan --config``: a ``lit-balance fit`` config (when the ``fit`` parser accepts it) or a YAML of plan options."""

    fit_parser: ArgumentParser | None = None

    def __call__(self, parser: ArgumentParser, cfg: Namespace, values: Any, option_string: str | None = None) -> None:
        if self.fit_parser is not None:
            fit_cfg, fit_error = _try_parse(self.fit_parser, values)
            if fit_cfg is not None:
                for key, value in plan_options_from_fit(fit_cfg, source=str(values)).items():
                    cfg[key] = value
                return
            _, plan_error = _try_parse(parser, values, defaults=False)
            if plan_error is not None:
                raise InputTypeError(f"--config {values}: neither plan options ({plan_error}) nor a lit-balance fit "
                                f"config ({fit_error})") from plan_error
        super().__call__(parser, cfg, values, option_string)


def _try_parse(parser: ArgumentParser, path: Any, **kwargs: Any) -> tuple[Namespace | None, Exception | None]:
    """``parser.parse_path(path)`` with its checks, returning the error instead of exiting."""
    exit_on_error = parser.exit_on_error
    parser.exit_on_error = False
    try:
        return parser.parse_path(path, env=False, **kwargs), None
    except Exception as error:  # jsonargparse's ArgumentError, or a loader's error
        return None, error
    finally:
        parser.exit_on_error = exit_on_error


def _num_replicas(trainer: Namespace, source: str) -> int:
    """World size of a fit config's Trainer: ``devices`` (a count or a list of device ids) x ``num_nodes``."""
    devices = trainer.get("devices", "auto")
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    elif isinstance(devices, str) and "," in devices:
        devices = len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise InputTypeError(f"--config {source}: trainer.devices is {devices!r}, which names no count of ranks; set "
                        "trainer.devices to a number in that config, or give plan a config of its own with "
                        "num_replicas")
    return devices * int(trainer.get("num_nodes", 1) or 1)


def plan_options_from_fit(fit_cfg: Namespace, source: str = "the fit config") -> dict[str, Any]:
    """The ``plan`` options that plan what a ``lit-balance fit`` config trains on.

    ``data.*`` arguments named like a plan option set it (``max_tokens``, ``corpus``, ``seed``, ...), a
    ``data.cost_model`` sets ``linear``, ``quadratic`` and ``per_batch``, and every other data argument goes to
    ``data_kwargs`` (the data module is built with all of them, so the lengths are the ones ``fit`` plans).
    ``num_replicas`` is ``trainer.devices x trainer.num_nodes`` and ``accumulate_grad_batches`` the Trainer's.

    Args:
        fit_cfg: the fit config as jsonargparse parsed it (the ``fit`` subcommand's namespace).
        source: the config's name, for messages.

    Raises:
        TypeError: ``trainer.devices`` that is not a count or a list of devices (e.g. ``"auto"``).
    """
    data, trainer = fit_cfg.data, fit_cfg.trainer
    options: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in vars(data).items():
        if key == "settings":
            if isinstance(value, Namespace) and "init_args" in value:  # jsonargparse's class_path / init_args
                value = value.init_args
            if value is not None:
                fields = value if isinstance(value, Namespace) else dataclasses.asdict(value)
                options.update({name: fields[name] for name in BatchingSettings.names() if name in fields})
        elif key == "cost_model":
            model = CostModel() if value is None else value
            if isinstance(model, Namespace) and "init_args" in model:  # jsonargparse's class_path / init_args
                model = CostModel(**model.init_args.as_dict())
            options.update({name: getattr(model, name) for name in ("linear", "quadratic", "per_batch")})
        elif key in _PLAN_FLAGS or key in ("corpus", "tokenizer"):
            options[key] = value
        else:
            extra[key] = value.as_dict() if isinstance(value, Namespace) else value
    options["data_kwargs"] = {k: v for k, v in extra.items() if k not in _IGNORED_DATA_KWARGS}
    options["num_replicas"] = _num_replicas(trainer, source)
    options["accumulate_grad_batches"] = int(trainer.get("accumulate_grad_batches", 1) or 1)
    return options


# data module arguments that do not change the plan (loading only)
_IGNORED_DATA_KWARGS = ("num_workers", "pin_memory")

# plan options whose Python names (as in BalancedBatchSampler / BalancedTextDataModule messages) become flags
_PLAN_FLAGS = (*BatchingSettings.names(), "max_length", "num_replicas", "val_fraction", "text_key", "cache_dir",
               "linear", "quadratic", "per_batch", "epoch")
_NAMES = "|".join(_PLAN_FLAGS)
_PATH_RE = re.compile(r"^(corpus|tokenizer) (file|path|glob pattern)\b")
_COST_RE = re.compile(r"\bCostModel\.(?=linear|quadratic|per_batch)")


@functools.lru_cache(maxsize=8)
def _name_patterns(names: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    alternatives = "|".join(sorted(names, key=len, reverse=True))
    return (re.compile(rf"(?<![\w.-])({alternatives})=([\"'])([\w-]+)\2(?: or ([\"'])([\w-]+)\4)?"),
            re.compile(rf"(?<![\w.-])({alternatives})=([^\s,;:()\[\]]*)"),
            re.compile(rf"(?<![\w.-])({alternatives})(?!\w)"))


def _flag_names(message: str, names: Iterable[str] = _PLAN_FLAGS, flag: Callable[[str], str] = _flag,
                sep: str = " ") -> str:
    """Rewrite library messages' Python argument names as flags: ``too_long="skip"`` -> ``--too-long skip``.

    Args:
        message: the library's message.
        names: the argument names to rewrite (``corpus`` and ``tokenizer`` only where a message starts
            with "corpus file", "tokenizer path", ...).
        flag: a name's flag, e.g. ``--too-long`` (``plan``) or ``--data.too_long`` (``fit``).
        sep: between a flag and its value: ``" "`` (``plan``) or ``"="`` (``fit``).
    """
    quoted_re, value_re, name_re = _name_patterns(tuple(names))

    def quoted(m: re.Match) -> str:
        return f"{flag(m[1])}{sep}{m[3]}" + (f" or {flag(m[1])}{sep}{m[5]}" if m[5] else "")

    def valued(m: re.Match) -> str:
        value = {"True": "true", "False": "false", "None": "null"}.get(m[2], m[2])
        return f"{flag(m[1])}{sep}{value}" if value else flag(m[1])

    message = _PATH_RE.sub(lambda m: f"{flag(m[1])} {m[2]}", message)
    if flag is _flag:
        message = _COST_RE.sub("", message)
    message = value_re.sub(valued, quoted_re.sub(quoted, message))
    return name_re.sub(lambda m: flag(m[1]), message)


_INPUT_ERRORS = (FileNotFoundError, TypeError, ValueError)
#: set to "true" to raise library input errors with their traceback instead of the one-line message (as jsonargparse)
_DEBUG_ENV = "JSONARGPARSE_DEBUG"


def _input_error(error: BaseException) -> BaseException | None:
    """The lit_balance check that rejected an input in ``error`` (itself or its ``__cause__``), else None.

    A check raises an :class:`~lit_balance.errors.InputError`; jsonargparse wraps those of classes built from a list
    (``trainer.callbacks``) in its own ValueError, hence the ``__cause__`` chain. A ValueError or TypeError from
    anywhere else (Python, NumPy, torch, or lit_balance code that is not a check) is a bug or an unexpected input,
    and keeps its traceback.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, InputError):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


def _is_input_error(error: BaseException) -> bool:
    """True if a lit_balance check rejected an input (see :func:`_input_error`)."""
    return _input_error(error) is not None


def _frames(error: BaseException) -> Iterable[Any]:
    tb = error.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _component(error: BaseException) -> tuple[str, Any] | None:
    """``("data", the data module)``, ``("model", the model)`` or ``("callback", it)`` whose code raised ``error``."""
    for frame in _frames(error):  # outermost first
        owner = frame.f_locals.get("self")
        if isinstance(owner, LightningDataModule):
            return "data", owner
        if isinstance(owner, LightningModule):
            return "model", owner
        if isinstance(owner, Callback):
            return "callback", owner
    return None


def _in_data_setup(error: BaseException) -> bool:
    """True if ``error`` was raised inside a data module's ``prepare_data`` or ``setup`` (called by the trainer), or
    its ``plan_summary`` (the preview :meth:`LitBalanceCLI.before_fit` prints, which splits the data as ``setup``)."""
    return any(frame.f_code.co_name in ("prepare_data", "setup", "plan_summary")
               and isinstance(frame.f_locals.get("self"), LightningDataModule) for frame in _frames(error))


def _fit_message(error: BaseException) -> str:
    """The message of the check that rejected a setting, with the data module's or model's argument names as
    LightningCLI flags (``max_tokens=0`` -> ``--data.max_tokens=0``) or naming the callback."""
    error = _input_error(error) or error
    message = str(error)
    found = _component(error)
    if found is None:
        return message
    key, owner = found
    if key == "callback":
        return f"{type(owner).__name__} in --trainer.callbacks: {message}"
    names = tuple(name for name, p in inspect.signature(type(owner).__init__).parameters.items()
                  if name not in ("self", "corpus", "tokenizer", "settings")
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if key == "data":
        message = _PATH_RE.sub(lambda m: f"--data.{m[1]} {m[2]}", message)
    return _flag_names(message, names, lambda name: f"--{key}.{name}", "=")


def _exit_on_input_error(subcommand: str, message: str, error: BaseException) -> typing.NoReturn:
    """Print ``lit-balance <subcommand>: error: <message>`` as one line on stderr and exit with status 2."""
    if os.environ.get(_DEBUG_ENV, "").lower() == "true":  # as jsonargparse reads it
        raise error
    message = " ".join(message.split())
    sys.stderr.write(f"lit-balance {subcommand}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def _check_max_length(cfg: Namespace) -> None:
    """``--max-length`` up front: with ``--lengths`` it only clips the array, so nothing downstream names it."""
    if cfg.max_length is not None:
        check_int("--max-length", cfg.max_length, 1, "pass --max-length N (tokens kept per sample) or null for none")


def _load_lengths(path: Path) -> np.ndarray:
    expected = "a .npy file of integer token counts (np.save of a 1-D int array) or a text file of one integer per line"
    if not path.is_file():
        raise InputValueError(f"--lengths {str(path)!r} is not a file; pass {expected}")
    if path.suffix == ".npy":
        try:
            with open(path, "rb") as file:
                head = file.read(6)
        except OSError as error:
            raise InputValueError(f"--lengths {str(path)!r} cannot be read: {error}") from error
        if head != b"\x93NUMPY":
            raise InputValueError(f"--lengths {str(path)!r} must be {expected}; got a file that is not a NumPy .npy "
                             f"array (it starts with {head!r}, not the .npy header)")
        try:
            lengths = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:
            got = ("an array of Python objects (dtype object, e.g. a ragged list)" if "Object arrays" in str(error)
                   else f"a .npy file that cannot be read ({error})")
            raise InputValueError(f"--lengths {str(path)!r} must be {expected}; got {got}") from error
        if not isinstance(lengths, np.ndarray):  # e.g. an .npz archive named .npy
            raise InputValueError(f"--lengths {str(path)!r} must be {expected}; got a {type(lengths).__name__}")
    else:
        try:
            lengths = np.loadtxt(path, dtype=np.int64, ndmin=1)
        except ValueError as error:
            raise InputValueError(_text_lengths_error(path, error)) from error
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise InputValueError(f"--lengths {str(path)!r} must be {expected}; got dtype {lengths.dtype} "
                         f"and shape {lengths.shape}")
    if lengths.size == 0 or lengths.min() < 1:
        got = "no lengths" if lengths.size == 0 else f"the length {int(lengths.min())} at index {int(lengths.argmin())}"
        raise InputValueError(f"--lengths {str(path)!r} must hold token counts >= 1, got {got}; drop empty samples")
    too_long = np.flatnonzero(lengths > MAX_TOKENS_LIMIT)  # uint64 values >= 2**63 compare exactly here
    if too_long.size:
        i = int(too_long[0])
        raise InputValueError(f"--lengths {str(path)!r} must hold token counts <= {MAX_TOKENS_LIMIT} (2**40), got the "
                         f"length {int(lengths[i])} at index {i} ({too_long.size} such); a length counts tokens "
                         "per sample: check the file")
    return lengths.astype(np.int64)


def _text_lengths_error(path: Path, error: ValueError) -> str:
    """The message for a text ``--lengths`` file NumPy cannot read as int64: the first bad line, its index and value."""
    index = 0
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, 1):
            text = line.split("#", 1)[0].strip()  # np.loadtxt skips comments and blank lines
            if not text:
                continue
            try:
                value = int(text)
            except ValueError:
                return (f"--lengths {str(path)!r}: expected one integer per line; line {number} (index {index}) "
                        f"holds {text[:40]!r}")
            if not 1 <= value <= MAX_TOKENS_LIMIT:
                return (f"--lengths {str(path)!r} must hold token counts in [1, {MAX_TOKENS_LIMIT}] (2**40), got "
                        f"the length {value} on line {number} (index {index}); a length counts tokens per sample")
            index += 1
    return f"--lengths {str(path)!r}: expected one integer per line: {error}"


def _check_output_dir(output_dir: Path) -> None:
    """``--output-dir`` up front: it, or the first of its parents that exists, must be a directory."""
    for path in (output_dir, *output_dir.parents):
        if path.is_symlink() or path.exists():
            if not path.is_dir():
                raise InputValueError(f"--output-dir {str(output_dir)!r}: expected a directory (created if missing), "
                                 f"but {str(path)!r} is an existing file; pass a directory path")
            return


def _corpus_lengths(cfg: Namespace, settings: BatchingSettings) -> tuple[np.ndarray, str]:
    dm = BalancedTextDataModule(cfg.corpus, cfg.tokenizer, settings=settings, max_length=cfg.max_length,
                                val_fraction=cfg.val_fraction, text_key=cfg.text_key, cache_dir=cfg.cache_dir,
                                **(cfg.data_kwargs or {}))
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
        ValueError, TypeError: a bad option, ``--lengths`` file or ``--output-dir`` (the message names the
            flag, e.g. ``--max-length``, ``--too-long skip``).
        FileNotFoundError: a ``--corpus`` or ``--tokenizer`` path does not exist.
    """
    from rich.console import Console

    from lit_balance.report import format_report, plan_report, save_plots, write_summary

    _check_max_length(cfg)
    _check_output_dir(Path(cfg.output_dir))
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
    except InputError as error:
        # the library names its Python arguments (max_tokens, too_long="skip"); here they are flags
        raise type(error)(_flag_names(str(error)), parameter=error.parameter) from error
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
    """LightningCLI for any LightningModule on :class:`BalancedTextDataModule`, plus the ``plan`` subcommand.

    Built by :func:`build_cli` with ``subclass_mode_model=True``: ``--model.class_path=my.Module`` (or
    ``model: {class_path: ..., init_args: ...}`` in a config) picks any LightningModule, and the model defaults to
    :class:`~lit_balance.demo.DemoTransformerLM`, whose arguments a config may give without a ``class_path``. When
    the model's ``__init__`` takes ``vocab_size``, it is linked to the instantiated data module's ``vocab_size``
    (``link_arguments(..., apply_on="instantiate")``), so configs never repeat it; other models get no
    ``vocab_size``. Flags cannot be abbreviated. A setting rejected by lit_balance (building the data module or
    model, the data module's ``setup``, or ``plan``) exits with status 2 and one stderr line naming the flag
    (``lit-balance fit: error: --data.max_tokens must be ...``); other errors keep their traceback, and
    ``JSONARGPARSE_DEBUG=true`` raises rejected settings too.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """The parsers of the command and of each subcommand; flags must be spelled out (no abbreviations)."""
        kwargs.setdefault("allow_abbrev", False)  # else --data.max_token=2048 silently sets data.max_tokens
        return super().init_parser(**kwargs)

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
            "plan", plan_parser(fit_parser), help="Plan one epoch without training and report padding, balance and cost")

    def _set_seed(self) -> None:
        if self.subcommand != "plan":
            super()._set_seed()

    def instantiate_classes(self) -> None:
        if self.subcommand == "plan":
            return
        try:
            super().instantiate_classes()
        except _INPUT_ERRORS as error:
            if self.subcommand is None or not _is_input_error(error):
                raise
            _exit_on_input_error(self.subcommand, _fit_message(error), error)

    def before_fit(self) -> None:
        """Print the derived budget and the training split's plan (:func:`~lit_balance.report.summary_line`; rank 0)."""
        from lit_balance.report import summary_line

        trainer, dm = self.trainer, self.datamodule
        if trainer.is_global_zero:
            print(f"world size {trainer.world_size} | per-rank budget {dm.max_tokens} padded slots per micro-batch | "
                  f"global budget {dm.max_tokens * trainer.world_size * trainer.accumulate_grad_batches} padded slots "
                  f"per optimizer step | max_length {dm.max_length} tokens | corpus: {dm.source.description}",
                  flush=True)
            if isinstance(dm, BalancedTextDataModule):  # the preview communicates with no other rank
                print(summary_line(dm.plan_summary(trainer.world_size, trainer.accumulate_grad_batches)), flush=True)

    def _run_subcommand(self, subcommand: str) -> None:
        # a bad setting or input file (a lit_balance check raised): one line naming the flag, exit status 2, no
        # traceback (JSONARGPARSE_DEBUG=true raises instead); any other error keeps its traceback
        if subcommand == "plan":
            try:
                self.plan_summary = run_plan(self.config.plan)
            except _INPUT_ERRORS as error:
                if not _is_input_error(error):
                    raise
                _exit_on_input_error(subcommand, str(error), error)
            return
        try:
            super()._run_subcommand(subcommand)
        except _INPUT_ERRORS as error:
            if not (_is_input_error(error) and _in_data_setup(_input_error(error))):
                raise
            _exit_on_input_error(subcommand, _fit_message(error), error)


def build_cli(args: list[str] | None = None) -> LitBalanceCLI:
    """Run the ``lit-balance`` command on ``args`` and return the :class:`LitBalanceCLI`.

    The returned object holds what the subcommand built: ``trainer``, ``model`` and ``datamodule`` after
    ``fit``, ``plan_summary`` after ``plan``.

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


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lit-balance`` console script (and of ``python -m lit_balance.cli``).

    Args:
        args: command-line arguments without the program name (default: ``sys.argv[1:]``).
    """
    build_cli(args)


if __name__ == "__main__":
    main()
