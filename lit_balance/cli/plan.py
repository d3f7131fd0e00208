"""``lit-balance plan``: plan one epoch without training and report it (:mod:`lit_balance.report`).

``plan`` reads a lengths file, or a corpus and tokenizer as :class:`~lit_balance.BalancedTextDataModule` does, plans
epoch ``--epoch`` with the sampler's settings and ``--num-replicas`` ranks, and writes a table, a JSON summary and PNG
plots; ``plan --config`` also reads a ``lit-balance fit`` config (:func:`plan_options_from_fit`) or a Hydra recipe's
composed config (:func:`plan_options_from_hydra`). A mixture corpus (:class:`~lit_balance.Mixture`, or its mapping) is
planned with its own sampler, and the report adds each component's share of every optimizer step against its target.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import typing
from pathlib import Path
from typing import Any

import numpy as np
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from lit_balance._checks import MAX_TOKENS_LIMIT, check_int
from lit_balance.cli.messages import ErrorFirstParser, flag_names, plan_flag
from lit_balance.data.sources import CorpusSource
from lit_balance.errors import InputError, InputTypeError, InputValueError
from lit_balance.lightning.datamodule import DEFAULT_MAX_TOKENS, BalancedTextDataModule
from lit_balance.plan.cost import CostModel
from lit_balance.plan.settings import BatchingSettings

__all__ = ["PLAN_FLAGS", "plan_options_from_fit", "plan_options_from_hydra", "plan_parser", "run_plan"]


def plan_parser(fit_parser: ArgumentParser | None = None) -> ArgumentParser:
    """The ``plan`` subcommand's parser (jsonargparse).

    Args:
        fit_parser: the ``fit`` subcommand's parser; with it, ``--config`` also reads a ``lit-balance fit`` config
            (see :func:`plan_options_from_fit`). Without it, ``--config`` reads these options from YAML only.
    """
    parser = ErrorFirstParser(allow_abbrev=False,
                              description="Plan one epoch without training: per-rank micro-batches, tokens, padding "
                                          "and cost, rank imbalance and useful compute fraction, against "
                                          "DistributedSampler with a fixed batch size; writes a table, a JSON summary "
                                          "and PNG plots.")
    action = type("PlanConfigFile", (_PlanConfigFile,), {"fit_parser": fit_parser})
    parser.add_argument("--config", action=action,
                        help="YAML file holding any of these options, or a lit-balance fit config, or a Hydra recipe's "
                             "composed config (python recipes/train.py ... --cfg job > run.yaml, or a run's "
                             ".hydra/config.yaml): its data settings, ranks = trainer.devices x trainer.num_nodes, and "
                             "trainer.accumulate_grad_batches; flags after it override them")
    group = parser.add_argument_group("input: a lengths file, or a corpus and tokenizer as for BalancedTextDataModule")
    group.add_argument("--lengths", type=Path | None, default=None,
                       help="a .npy array or a text file (one integer per line) of tokens per sample; "
                            "when given, the corpus options are not used")
    group.add_argument("--corpus", type=str | dict | None, default=None,
                       help="null = the built-in corpus; or a path or glob of .txt / .jsonl files; or a source as "
                            "{class_path: lit_balance.data.stores.MegatronSource, init_args: {prefixes: [...]}} "
                            "(vocab_size and pad_token_id in --data-kwargs); or a mixture: {components: {web: {corpus: "
                            "..., weight: 0.7}, ...}, unit: tokens}")
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
        kind, text = hints[setting.name], setting.metadata["help"]
        if setting.name == "max_tokens":
            kind = kind | typing.Literal["auto"]
            text += ('; a list gives one budget per rank; "auto": measured with the fit config\'s model (--config) on worst-case micro-batches, '
                     "see --memory-limit")
        group.add_argument(plan_flag(setting.name), type=kind, default=default, help=text)
    group = parser.add_argument_group("--max-tokens auto: the token budget probe (docs/token_budget.md)")
    group.add_argument("--memory-limit", type=int | None, default=None,
                       help="bytes the process may use (CPU: peak resident memory, required; CUDA: optional cap)")
    group.add_argument("--memory-fraction", type=float, default=0.9,
                       help="share of that capacity the budget may use")
    group.add_argument("--device", type=typing.Literal["cpu", "cuda"], default="cpu",
                       help="where the model runs during the probe")
    group.add_argument("--model", type=dict | None, default=None,
                       help="the model: {class_path: ..., init_args: {...}}; set by a fit --config (its model)")
    group = parser.add_argument_group("cost model: cost = per_batch + rows * (linear * L + quadratic * L**2)")
    group.add_argument("--linear", type=float, default=1.0, help="cost per padded token slot")
    group.add_argument("--quadratic", type=float, default=0.0, help="cost per squared padded length, per row")
    group.add_argument("--per-batch", type=float, default=0.0, help="cost per micro-batch")
    parser.add_argument("--output-dir", type=Path, default=Path("plan_report"),
                        help="where plan_table.txt, plan_summary.json and the PNG plots go")
    parser.add_argument("--plots", type=bool, default=True, help="write the PNG plots")
    parser.add_argument("--ledger", type=Path | None, default=None,
                        help="also write the epoch's ledger to this Parquet file: one row per document per micro-batch "
                             "(optimizer step, rank, component, document, store file and row, tokens; "
                             "docs/ledger.md)")
    return parser


class _PlanConfigFile(ActionConfigFile):
    """``plan --config``: a ``lit-balance fit`` config (when the ``fit`` parser accepts it), or plan options."""

    fit_parser: ArgumentParser | None = None

    def __call__(self, parser: ArgumentParser, cfg: Namespace, values: Any, option_string: str | None = None) -> None:
        try:
            hydra_cfg = _hydra_config(values)
            options = None if hydra_cfg is None else plan_options_from_hydra(hydra_cfg, source=str(values))
        except InputError as error:
            parser.error(str(error))  # one line, exit status 2
        if options is not None:
            for key, value in options.items():
                cfg[key] = value
            return
        if self.fit_parser is not None:
            fit_cfg, fit_error = _try_parse(self.fit_parser, values)
            if fit_cfg is not None:
                for key, value in plan_options_from_fit(fit_cfg, source=str(values)).items():
                    cfg[key] = value
                model = fit_cfg.get("model")
                if isinstance(model, Namespace) and "class_path" in model:
                    cfg["model"] = model.as_dict()
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
        elif key in BatchingSettings.names() and value is None and key != "max_batch_size":
            continue  # a DataModule batching keyword left unset (None): the plan's default, as the fit's
        elif key in PLAN_FLAGS or key in ("corpus", "tokenizer", "memory_limit", "memory_fraction"):
            options[key] = value.as_dict() if isinstance(value, Namespace) and "class_path" in value else value
        else:
            extra[key] = value.as_dict() if isinstance(value, Namespace) else value
    options["data_kwargs"] = {k: v for k, v in extra.items() if k not in _IGNORED_DATA_KWARGS}
    options["num_replicas"] = _num_replicas(trainer, source)
    options["accumulate_grad_batches"] = int(trainer.get("accumulate_grad_batches", 1) or 1)
    return options


def _hydra_config(path: Any) -> dict[str, Any] | None:
    """A Hydra recipe's composed config at ``path`` (a mapping whose ``data`` node has a ``_target_``), resolved, or
    None when the file is not one.

    Raises:
        ValueError: a Hydra group file of its own (a ``_target_`` at the top: its interpolations need the whole config),
            or a composed config whose values cannot be resolved or are missing (``???``).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = str(path)
    if not os.path.isfile(path):
        return None
    try:
        raw = OmegaConf.load(path)
    except (OmegaConfBaseException, OSError, ValueError, TypeError):
        return None  # not YAML OmegaConf reads: the other readers say what is wrong
    if not OmegaConf.is_dict(raw):
        return None
    compose = ("compose the whole config: python recipes/train.py data=<group> <overrides> --cfg job > run.yaml, "
               "then lit-balance plan --config run.yaml (or pass a run's .hydra/config.yaml)")
    if "_target_" in raw and "data" not in raw:
        raise InputValueError(f"--config {path} is a Hydra group file (_target_: {raw['_target_']}); {compose}")
    data = raw.get("data")
    if not OmegaConf.is_dict(data) or "_target_" not in data:
        return None
    trainer = raw.get("trainer")
    keys = [k for k in ("devices", "num_nodes", "accumulate_grad_batches") if OmegaConf.is_dict(trainer) and k in trainer]
    missing = sorted({f"data.{k}" for k in OmegaConf.missing_keys(data)}
                     | {f"trainer.{k}" for k in keys if OmegaConf.is_missing(trainer, k)})
    if missing:
        raise InputValueError(f"--config {path}: the Hydra config leaves {missing} mandatory (???); set them in the "
                              "recipe's overrides before composing it")
    try:  # the trainer's keys the plan reads only (others may use Hydra's run-time resolvers, ${hydra:...})
        return {"data": OmegaConf.to_container(data, resolve=True), "trainer": {k: trainer[k] for k in keys}}
    except OmegaConfBaseException as error:
        raise InputValueError(f"--config {path}: the Hydra config cannot be resolved ({str(error).splitlines()[0]}); "
                              f"{compose}") from error


def plan_options_from_hydra(hydra_cfg: dict[str, Any], source: str = "the Hydra config") -> dict[str, Any]:
    """The ``plan`` options that plan what a Hydra recipe's composed config (``recipes/train.py``) trains on.

    The ``data`` node's keys set the plan options of their name (``max_tokens``, ``corpus``, ``seed``, ...); a
    ``corpus`` node with a ``_target_`` (a :class:`~lit_balance.Mixture`, a store) is built as the recipe builds it
    (``hydra.utils.instantiate``); a ``cost_model`` node sets ``linear``, ``quadratic`` and ``per_batch``; every other
    data key goes to ``data_kwargs``. ``num_replicas`` is ``trainer.devices x trainer.num_nodes`` and
    ``accumulate_grad_batches`` the trainer's, as :func:`plan_options_from_fit`.

    Args:
        hydra_cfg: the composed config, resolved, as plain Python containers.
        source: the config's name, for messages.

    Raises:
        TypeError: ``trainer.devices`` that is not a count or a list of devices.
    """
    data = dict(hydra_cfg["data"])
    options: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if key.startswith("_"):  # Hydra's own keys (_target_, _convert_, ...)
            continue
        if key == "cost_model":
            fields = {k: v for k, v in (value or {}).items() if not k.startswith("_")}
            model = CostModel(**fields)
            options.update({name: getattr(model, name) for name in ("linear", "quadratic", "per_batch")})
        elif key in BatchingSettings.names() and value is None and key != "max_batch_size":
            continue  # left unset (None): the plan's default, as the fit's
        elif key in PLAN_FLAGS or key in ("corpus", "tokenizer", "memory_limit", "memory_fraction"):
            options[key] = value
        else:
            extra[key] = value
    options["data_kwargs"] = {k: v for k, v in extra.items() if k not in _IGNORED_DATA_KWARGS}
    trainer = hydra_cfg.get("trainer") or {}
    options["num_replicas"] = _num_replicas(trainer, source)
    options["accumulate_grad_batches"] = int(trainer.get("accumulate_grad_batches", 1) or 1)
    return options


# data module arguments that do not change the plan (loading only)
_IGNORED_DATA_KWARGS = ("num_workers", "pin_memory")

#: plan options whose Python names (as in BalancedBatchSampler / BalancedTextDataModule messages) become flags
PLAN_FLAGS = (*BatchingSettings.names(), "max_length", "num_replicas", "val_fraction", "text_key", "cache_dir",
              "linear", "quadratic", "per_batch", "epoch")


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


def _probe_model(spec: Any, vocab_size: int) -> Any:
    """The LightningModule of a fit config's ``model`` (``class_path`` and ``init_args``), with the data's
    ``vocab_size`` when it takes one and none is given."""
    import importlib

    if not isinstance(spec, dict) or "class_path" not in spec:
        raise InputValueError("--max-tokens auto measures the budget with a model: pass --config with a lit-balance "
                              "fit config (its model section), or --model '{class_path: ..., init_args: {...}}'",
                              parameter="max_tokens")
    module_name, _, class_name = str(spec["class_path"]).rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    kwargs = dict(spec.get("init_args") or {})
    if _takes(cls, "vocab_size") and kwargs.get("vocab_size") is None:
        kwargs["vocab_size"] = vocab_size
    return cls(**kwargs)


def _corpus(spec: Any) -> Any:
    """The ``--corpus`` as BalancedTextDataModule takes it: a source built from ``class_path`` and ``init_args``
    (e.g. a tokenized store) or from a Hydra ``_target_`` node (``hydra.utils.instantiate``, e.g. a
    :class:`~lit_balance.Mixture`); a mixture's mapping with each component's corpus built so; else the value
    itself."""
    import importlib

    if isinstance(spec, dict) and "_target_" in spec:
        from hydra.utils import instantiate

        return instantiate(spec, _convert_="all")
    if isinstance(spec, dict) and isinstance(spec.get("components"), dict):
        components = {name: {**c, "corpus": _corpus(c["corpus"])} if isinstance(c, dict) and "corpus" in c else c
                      for name, c in spec["components"].items()}
        return {**spec, "components": components}
    if not isinstance(spec, dict) or "class_path" not in spec:
        return spec
    module_name, _, class_name = str(spec["class_path"]).rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)(**dict(spec.get("init_args") or {}))


def _takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def _datamodule(cfg: Namespace, values: dict[str, Any]) -> BalancedTextDataModule:
    """The one DataModule of the plan (set up, the corpus tokenized into the cache): with ``max_tokens="auto"``,
    built as a fit builds it (its budget then measured by :func:`_probe`), else with the settings planned."""
    extra = {k: v for k, v in dict(cfg.data_kwargs or {}).items() if k not in ("memory_limit", "memory_fraction")}
    taken = set(inspect.signature(BalancedTextDataModule.__init__).parameters) - {"self", "settings"}
    unknown = sorted(set(extra) - taken)
    if unknown:
        raise InputTypeError(f"--data-kwargs names {unknown}, which BalancedTextDataModule does not take (its "
                             "arguments: lit-balance fit --print_config, under data)", parameter="data_kwargs")
    common = {"max_length": cfg.max_length, "val_fraction": cfg.val_fraction, "text_key": cfg.text_key,
              "cache_dir": cfg.cache_dir, **extra}
    corpus = _corpus(cfg.corpus)
    if isinstance(corpus, CorpusSource) and corpus.streamed:
        raise InputValueError(f"lit-balance plan previews the plan of a finite corpus before training, and the corpus "
                              f"is a stream ({corpus.description}), planned window by window while training "
                              "(docs/streams.md): plan a finite part of it instead (--corpus with its files)",
                              parameter="corpus")
    if values["max_tokens"] == "auto":
        batching = {k: v for k, v in values.items() if k in taken}  # the layout the probe measures
        dm = BalancedTextDataModule(corpus, cfg.tokenizer, **batching, memory_limit=cfg.memory_limit,
                                    memory_fraction=cfg.memory_fraction, **common)
    else:
        settings = BatchingSettings.from_dict(values)
        if settings.per_rank:  # the split does not depend on the budgets; only documents no rank holds are refused
            settings = settings.replace(max_tokens=settings.largest_max_tokens)
        dm = BalancedTextDataModule(corpus, cfg.tokenizer, settings=settings, **common)
    dm.prepare_data()  # tokenizes into the cache, with a progress bar, unless cached
    dm.setup("fit")
    return dm


def _probe(cfg: Namespace, dm: BalancedTextDataModule) -> Any:
    """Run the token budget probe (``--max-tokens auto``) on the DataModule with the config's model: one rank."""
    model = _probe_model(cfg.model, dm.vocab_size).to(cfg.device)
    return dm.find_max_tokens(model)


def _write_ledger(cfg: Namespace, dm: BalancedTextDataModule | None, sampler: Any, lengths: np.ndarray,
                  settings: BatchingSettings, cost_model: CostModel) -> dict[str, Any]:
    """Write ``--ledger``: the plan's epoch as :func:`lit_balance.ledger.write_ledger` lays it out; the header."""
    from lit_balance.lightning.ledger import write_ledger
    from lit_balance.lightning.resume_checks import data_identity
    from lit_balance.sampler.sampler import BalancedBatchSampler

    if dm is None:
        sampler = BalancedBatchSampler(lengths, settings=settings, num_replicas=cfg.num_replicas, rank=0,
                                       cost_model=cost_model)
    sampler.set_epoch(cfg.epoch)
    Path(cfg.ledger).parent.mkdir(parents=True, exist_ok=True)
    return write_ledger(cfg.ledger, sampler, dataset=None if dm is None else dm.train_dataset,
                        data=None if dm is None else data_identity(dm))


def run_plan(cfg: Namespace) -> dict[str, Any]:
    """Run the ``plan`` subcommand on parsed options; print the report and write it to ``--output-dir``.

    Returns:
        The report's summary (see :meth:`lit_balance.report.PlanReport.summary`); with ``--max-tokens auto`` also
        ``"token_budget"``: :meth:`lit_balance.lightning.budget.TokenBudget.to_dict` (also in token_budget.json).

    Raises:
        ValueError, TypeError: a bad option, ``--lengths`` file or ``--output-dir`` (the message names the
            flag, e.g. ``--max-length``, ``--too-long skip``).
        FileNotFoundError: a ``--corpus`` or ``--tokenizer`` path does not exist.
    """
    from rich.console import Console

    from lit_balance.report import format_report, plan_report, save_plots, write_summary

    _check_max_length(cfg)
    _check_output_dir(Path(cfg.output_dir))
    budget = None
    dm = None
    try:
        values = {name: cfg[name] for name in BatchingSettings.names()}
        if values["max_tokens"] == "auto" and cfg.lengths is not None:
            raise InputValueError("--max-tokens auto measures the budget on the corpus' documents with a model: "
                                  "pass --corpus (or a fit --config), not --lengths", parameter="max_tokens")
        if cfg.lengths is not None:
            lengths = _load_lengths(Path(cfg.lengths))
            if cfg.max_length is not None:
                lengths = np.minimum(lengths, cfg.max_length)
            source = f"{cfg.lengths} ({lengths.size} samples, max_length={cfg.max_length})"
        else:
            dm = _datamodule(cfg, values)
            if values["max_tokens"] == "auto":
                budget = _probe(cfg, dm)
                values["max_tokens"] = budget.max_tokens
            lengths = np.asarray(dm.train_dataset.lengths, dtype=np.int64)
            described = dm.corpus_description
            source = (f"{described}, training split: {len(dm.train_dataset)} documents "
                      f"(val_fraction={dm.val_fraction}, max_length={dm.max_length})")
        settings = BatchingSettings.from_dict(values)
        cost_model = CostModel(linear=cfg.linear, quadratic=cfg.quadratic, per_batch=cfg.per_batch)
        # the DataModule's own training sampler (one corpus or a blend of several); from --lengths, one corpus
        sampler = None if dm is None else dm.training_sampler(settings, cfg.num_replicas, cost_model=cost_model)
        report = plan_report(lengths, settings=settings, num_replicas=cfg.num_replicas, epoch=cfg.epoch,
                             cost_model=cost_model, sampler=sampler)
        ledger = None if cfg.ledger is None else _write_ledger(cfg, dm, sampler, lengths, settings, cost_model)
    except InputError as error:
        # the library names its Python arguments (max_tokens, too_long="skip"); here they are flags
        raise type(error)(flag_names(str(error), PLAN_FLAGS, parameter=error.parameter),
                          parameter=error.parameter) from error
    console = Console(record=True, width=max(Console().width, 120))
    if budget is not None:
        console.print(f"token budget probe (--max-tokens auto, on {cfg.device}): {budget.describe()}",
                      highlight=False, soft_wrap=True)
    console.print(f"plan of {source}: {cfg.num_replicas} ranks, max_tokens={settings.max_tokens} padded slots per "
                  f"micro-batch per rank, epoch {cfg.epoch}", highlight=False, soft_wrap=True)
    for renderable in format_report(report):
        console.print(renderable)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = [write_summary(report, output_dir)]
    summary = report.summary()
    if budget is not None:
        summary["token_budget"] = budget.to_dict()
        budget_path = output_dir / "token_budget.json"
        budget_path.write_text(json.dumps(summary["token_budget"], indent=1), encoding="utf-8")
        written.append(budget_path)
    if cfg.plots:
        written += save_plots(report, output_dir)
    table_path = output_dir / "plan_table.txt"
    table_path.write_text(console.export_text(), encoding="utf-8")
    if ledger is not None:
        written.append(Path(cfg.ledger))
        console.print(f"ledger: {ledger['rows']} rows, {ledger['optimizer_steps']} optimizer steps of "
                      f"{ledger['num_replicas']} ranks x {ledger['accumulate_grad_batches']} micro-batches",
                      highlight=False, soft_wrap=True)
    console.print("wrote " + ", ".join(str(p) for p in [table_path, *written]), highlight=False, soft_wrap=True)
    return summary
