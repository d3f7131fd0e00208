"""Compose Hydra-style YAML configs with omegaconf and instantiate their ``_target_`` nodes.

A small subset of Hydra (https://hydra.cc, ``hydra.compose`` and ``hydra.utils.instantiate``) for projects
that do not install hydra-core (its 1.3 line requires omegaconf < 2.4). The files in ``conf/`` are plain
Hydra configs: with hydra-core installed, ``hydra.compose(config_name="config")`` and
``hydra.utils.instantiate`` give the same objects as :func:`compose` and :func:`instantiate`.

Supported:

* a primary config with a ``defaults:`` list of ``group: option`` entries (an option may be ``null`` or a
  list of options), and ``_self_`` marking where the primary config's own keys are merged (at the end when
  absent, as in Hydra >= 1.1); group files are placed under the group's key, or at the root with a
  ``# @package _global_`` header;
* command-line overrides in Hydra's syntax: ``group=option``, ``group=[a,b]``, ``group=null``,
  ``+group=option`` (a group not in the defaults list), ``key.path=value`` (the key must exist),
  ``+key.path=value`` (a new key), ``++key.path=value`` (set or add), ``~key.path`` (delete);
  values are parsed as YAML (``4``, ``null``, ``[1,2]``, ``true``);
* ``_target_`` (an import path), ``_args_``, ``_partial_``, ``_recursive_`` and ``_convert_`` in
  :func:`instantiate`.

Not supported: defaults lists inside group files (``override /group: option``), config search paths,
structured-config schemas, Hydra's run directories and logging. Containers passed to a target are plain
``dict``/``list`` (Hydra's ``_convert_: all``); configs that need them plain declare ``_convert_: all`` so
that Hydra behaves the same.
"""

from __future__ import annotations

import copy
import functools
import importlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

__all__ = ["compose", "instantiate", "locate"]

_PACKAGE_RE = re.compile(r"^#\s*@package\s+(\S+)\s*$")
_CONVERT_MODES = ("none", "partial", "object", "all")
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _read_yaml(path: Path) -> tuple[dict[str, Any], str | None]:
    """Return a YAML file's mapping and its ``# @package`` header (or None)."""
    text = path.read_text(encoding="utf-8")
    package = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.lstrip().startswith("#"):
            break
        match = _PACKAGE_RE.match(line.strip())
        if match:
            package = match.group(1)
            break
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {error}") from error
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TypeError(f"{path} must hold a mapping of keys, got a YAML {type(data).__name__}")
    return data, package


def _parse_defaults(entries: Any, path: Path) -> list[tuple[str, Any]]:
    """``defaults:`` entries as ``(group, option)`` pairs; ``("_self_", None)`` marks the config itself."""
    if not isinstance(entries, list):
        raise TypeError(f"{path}: defaults must be a list, got {type(entries).__name__}")
    out: list[tuple[str, Any]] = []
    for entry in entries:
        if entry == "_self_":
            out.append(("_self_", None))
        elif isinstance(entry, dict) and len(entry) == 1:
            ((group, option),) = entry.items()
            group = str(group)
            if group.startswith(("override ", "optional ")):
                raise ValueError(f"{path}: defaults entry {entry!r} is not supported here; "
                                 "name the group and option plainly (group: option)")
            out.append((group, option))
        else:
            raise ValueError(f"{path}: a defaults entry must be '_self_' or 'group: option', got {entry!r}")
    if ("_self_", None) not in out:
        out.append(("_self_", None))
    return out


def _split_override(text: str) -> tuple[str, str, str | None]:
    """``(prefix, key, value)`` of one override; prefix is ``""``, ``"+"``, ``"++"`` or ``"~"``."""
    if not isinstance(text, str):
        raise TypeError(f"an override must be a string like 'trainer.devices=4', got {type(text).__name__} {text!r}")
    prefix = ""
    for p in ("++", "+", "~"):
        if text.startswith(p):
            prefix, text = p, text[len(p):]
            break
    key, sep, value = text.partition("=")
    key = key.strip()
    if not key or (not sep and prefix != "~"):
        raise ValueError(f"an override must look like 'key=value', '+key=value' or '~key', got {prefix + text!r}")
    return prefix, key, (value if sep else None)


def _parse_value(text: str) -> Any:
    """An override's value as YAML (``4``, ``null``, ``[a,b]``), with ``3e-4`` a float as in Hydra."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _FLOAT_RE.match(value):
        return float(value)
    return value


def _group_file(config_dir: Path, group: str, option: str) -> Path:
    path = config_dir / group / f"{option}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        raise ValueError(f"no option {option!r} in config group {group!r} (looked for {path}); "
                         f"available: {available}")
    return path


def _at_package(data: dict[str, Any], package: str) -> dict[str, Any]:
    if package == "_global_":
        return data
    for part in reversed(package.split(".")):
        data = {part: data}
    return data


def compose(config_name: str = "config", overrides: Sequence[str] = (), *,
            config_dir: str | Path) -> DictConfig:
    """Compose ``<config_dir>/<config_name>.yaml`` with its defaults list and command-line overrides.

    Args:
        config_name: primary config file name without ``.yaml``.
        overrides: Hydra-style overrides, e.g. ``["trainer=gpu_ddp", "trainer.devices=4"]`` (see the
            module docstring for the syntax).
        config_dir: directory holding the primary config and one sub-directory per config group.

    Returns:
        The composed config (interpolations such as ``${seed}`` are left for :func:`instantiate`).

    Raises:
        ValueError: a missing file or option, a malformed override, an override of a key that does not
            exist (use ``+key=value``) or of a group that is not in the defaults list (use ``+group=option``).
        TypeError: an override that is not a string.

    Example:
        >>> conf = Path(__file__).resolve().parents[1] / "conf"  # the repository's conf/
        >>> cfg = compose("config", ["trainer.max_steps=5", "model.d_model=64"], config_dir=conf)
        >>> cfg.trainer.max_steps, cfg.model.d_model, cfg.data._target_
        (5, 64, 'lit_balance.BalancedTextDataModule')
    """
    config_dir = Path(config_dir)
    primary_path = config_dir / f"{config_name}.yaml"
    if not primary_path.is_file():
        raise ValueError(f"primary config {str(primary_path)!r} not found; check config_dir and config_name")
    primary, _ = _read_yaml(primary_path)
    defaults = _parse_defaults(primary.pop("defaults", []), primary_path)
    groups = {p.name for p in config_dir.iterdir() if p.is_dir()}

    value_overrides: list[tuple[str, str, str | None]] = []
    for text in overrides:
        prefix, key, value = _split_override(text)
        if key in groups and prefix != "~" and "." not in key:
            option = _parse_value(value)
            known = [i for i, (g, _) in enumerate(defaults) if g == key]
            if known and prefix == "+":
                raise ValueError(f"config group {key!r} is already in the defaults list; override it with "
                                 f"{key}={value} (no '+')")
            if not known and prefix == "":
                raise ValueError(f"config group {key!r} is not in the defaults list of {primary_path.name}; "
                                 f"append it with +{key}={value}")
            if known:
                defaults[known[0]] = (key, option)
            else:
                defaults.append((key, option))
        elif key in groups and prefix == "~" and "." not in key:
            defaults = [(g, o) for g, o in defaults if g != key]
        else:
            value_overrides.append((prefix, key, value))

    cfg = OmegaConf.create({})
    for group, option in defaults:
        if group == "_self_":
            cfg = OmegaConf.merge(cfg, primary)
            continue
        options = option if isinstance(option, list) else [option]
        for opt in options:
            if opt is None:
                continue
            path = _group_file(config_dir, group, str(opt))
            data, package = _read_yaml(path)
            if "defaults" in data:
                raise ValueError(f"{path}: defaults lists inside group files are not supported; "
                                 "select groups in the primary config or on the command line")
            package = package or group.replace("/", ".")
            cfg = OmegaConf.merge(cfg, _at_package(data, package))

    for prefix, key, value in value_overrides:
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key, default=None, throw_on_missing=False) if parent_key else cfg
        present = isinstance(parent, DictConfig) and leaf in list(parent.keys())  # ``in parent`` is False for ???
        if prefix == "~":
            if not present:
                raise ValueError(f"cannot delete {key!r}: no such key in the config")
            del parent[leaf]
            continue
        if prefix == "" and not present:
            raise ValueError(f"cannot override {key!r}: no such key in the config (a typo?); "
                             f"add a new key with +{key}={value}")
        if prefix == "+" and present:
            raise ValueError(f"cannot add {key!r}: the key exists; override it with {key}={value}")
        OmegaConf.update(cfg, key, _parse_value(value), merge=True, force_add=True)
    return cfg


def locate(path: str) -> Any:
    """Import the object named by a dotted path, e.g. ``"lit_balance.TransformerLM"`` or ``"lightning.Trainer"``.

    Raises:
        TypeError: ``path`` is not a non-empty string.
        ImportError: no module prefix of ``path`` imports, or the object is not found in it.
    """
    if not isinstance(path, str) or not path:
        raise TypeError(f"_target_ must be a non-empty dotted import path string, got {path!r}")
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attr in parts[i:]:
            try:
                obj = getattr(obj, attr)
            except AttributeError as error:
                raise ImportError(f"cannot locate {path!r}: module {module_name!r} has no attribute "
                                  f"{'.'.join(parts[i:])!r}") from error
        return obj
    raise ImportError(f"cannot locate {path!r}: no module named {parts[0]!r}; check _target_")


def _is_target(node: Any) -> bool:
    return isinstance(node, Mapping) and "_target_" in node


def _build(node: Any, recursive: bool) -> Any:
    """Instantiate ``node`` (plain containers), children first when ``recursive``."""
    if isinstance(node, Mapping):
        if _is_target(node):
            return _call(dict(node), recursive)
        return {k: _build(v, recursive) for k, v in node.items()}
    if isinstance(node, list):
        return [_build(v, recursive) for v in node]
    return node


def _call(node: dict[str, Any], parent_recursive: bool) -> Any:
    target = node.pop("_target_")
    args = node.pop("_args_", [])
    partial = node.pop("_partial_", False)
    recursive = node.pop("_recursive_", parent_recursive)
    convert = node.pop("_convert_", "none")
    for name, value in (("_partial_", partial), ("_recursive_", recursive)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} of {target!r} must be true or false, got {value!r}")
    if str(convert).lower() not in _CONVERT_MODES:
        raise ValueError(f"_convert_ of {target!r} must be one of {_CONVERT_MODES}, got {convert!r}")
    if not isinstance(args, list):
        raise TypeError(f"_args_ of {target!r} must be a list, got {type(args).__name__}")
    obj = target if callable(target) else locate(target)
    if recursive:
        args = [_build(a, True) for a in args]
        node = {k: _build(v, True) for k, v in node.items()}
    if partial:
        return functools.partial(obj, *args, **node)
    try:
        return obj(*args, **node)
    except (TypeError, ValueError) as error:
        raise type(error)(f"while instantiating {target!r}: {error}") from error


def instantiate(config: Any, *args: Any, **kwargs: Any) -> Any:
    """Build the object a config node describes, with Hydra's ``instantiate`` semantics.

    ``_target_`` names the callable (an import path); the node's other keys are its keyword arguments,
    ``_args_`` its positional ones, and ``kwargs`` given here override keys of the node (e.g. a value known
    only at run time: ``instantiate(cfg.model, vocab_size=dm.vocab_size)``). Nested ``_target_`` nodes are
    built first (``_recursive_: false`` passes them on as plain dicts); ``_partial_: true`` returns a
    :func:`functools.partial`. A node without ``_target_`` is returned with its children built: a dict of
    callbacks becomes a dict of callback objects. Interpolations (``${seed}``) resolve against the whole
    config the node belongs to.

    Args:
        config: a ``DictConfig``/``ListConfig`` node, a dict or list, or None (returned as is).
        *args: positional arguments passed before the node's ``_args_``.
        **kwargs: keyword arguments that override or add keys of the node.

    Returns:
        The built object (or container of objects).

    Raises:
        ImportError: a ``_target_`` that cannot be imported.
        TypeError, ValueError: bad special keys, or the target rejected its arguments (the message names
            the target).

    Example:
        >>> instantiate({"_target_": "lit_balance.cost.CostModel", "linear": 2.0}).batch_cost(3, 10)
        60.0
    """
    if config is None:
        return None
    if OmegaConf.is_config(config):
        node = copy.deepcopy(config)
        node._set_parent(config._get_parent())  # keeps ${...} interpolations pointing at the whole config
        plain = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    elif isinstance(config, (Mapping, list)):
        plain = OmegaConf.to_container(OmegaConf.create(dict(config) if isinstance(config, Mapping) else config),
                                       resolve=True, throw_on_missing=False)
    else:
        raise TypeError(f"instantiate expects a config node, dict or list, got {type(config).__name__}")
    if isinstance(plain, dict):
        plain.update(kwargs)
        if args:
            plain["_args_"] = [*args, *plain.get("_args_", [])]
    elif args or kwargs:
        raise TypeError("extra arguments can only be passed when instantiating a mapping node")
    _check_no_missing(plain, "")
    return _build(plain, plain.get("_recursive_", True) if isinstance(plain, dict) else True)


def _check_no_missing(node: Any, where: str) -> None:
    """Raise on a mandatory value (``???``) left unset."""
    if isinstance(node, str) and node == "???":
        raise ValueError(f"the config value {where or '<root>'} is mandatory (???) and was not set; "
                         "set it in the config, on the command line, or as a keyword of instantiate()")
    if isinstance(node, dict):
        for k, v in node.items():
            _check_no_missing(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_no_missing(v, f"{where}[{i}]")
