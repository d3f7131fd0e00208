"""The ``lit-balance`` command's messages for rejected settings: one line naming the flag, exit status 2.

A setting lit_balance rejects raises an :class:`~lit_balance.errors.InputError` (jsonargparse may wrap it, as the
cause of its own error); its message names the library's Python argument (``too_long="skip"``), which becomes the flag
the user typed (``--too-long skip`` for ``plan``, ``--data.too_long=skip`` for ``fit``). Any other error is a bug or
an unexpected input, and keeps its traceback.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import re
import sys
import tempfile
import typing
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from jsonargparse import ArgumentParser
from lightning.pytorch import Callback, LightningDataModule, LightningModule

from lit_balance.errors import InputError

__all__ = ["DEBUG_ENV", "HYDRA_DEBUG_ENV", "INPUT_ERRORS", "RUN_ID_ENV", "ErrorFirstMixin", "ErrorFirstParser",
           "check_before_launch", "close_flags", "exit_on_input_error", "fit_message", "flag_names", "in_data_setup",
           "input_error", "install_hint", "mark_run", "plan_flag"]

#: the built-in errors an InputError also is (what a subcommand catches before telling them apart)
INPUT_ERRORS = (FileNotFoundError, TypeError, ValueError)
#: set to "true" to raise library input errors with their traceback instead of the one-line message (as jsonargparse)
DEBUG_ENV = "JSONARGPARSE_DEBUG"
#: the Hydra recipes' equivalent (Hydra's own): set to 1 for the traceback
HYDRA_DEBUG_ENV = "HYDRA_FULL_ERROR"
#: set by a front end before its ranks start (they inherit it): the run whose first error report is printed
RUN_ID_ENV = "LIT_BALANCE_RUN_ID"
PATH_RE = re.compile(r"^(corpus|tokenizer) (file|path|glob pattern)\b")
_COST_RE = re.compile(r"\bCostModel\.(?=linear|quadratic|per_batch)")
_OPTION_RE = re.compile(r"(?<![\w.-])--[A-Za-z][\w.-]*[\w]")


def plan_flag(name: str) -> str:
    """The ``plan`` subcommand's flag of a Python argument name: ``too_long`` -> ``--too-long``."""
    return "--" + name.replace("_", "-")


@functools.lru_cache(maxsize=8)
def _name_patterns(names: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    alternatives = "|".join(sorted(names, key=len, reverse=True))
    return (re.compile(rf"(?<![\w.-])({alternatives})=([\"'])([\w-]+)\2(?: or ([\"'])([\w-]+)\4)?"),
            re.compile(rf"(?<![\w.-])({alternatives})=([^\s,;:()\[\]]*)"),
            re.compile(rf"(?<![\w.-])({alternatives})(?!\w)"))


def flag_names(message: str, names: Iterable[str], flag: Callable[[str], str] | None = None, sep: str = " ",
               parameter: str | None = None) -> str:
    """Rewrite library messages' Python argument names as flags: ``too_long="skip"`` -> ``--too-long skip``.

    A name with a value (``name=value``) is always rewritten; a bare name only when it is a Python identifier no
    sentence would hold (it has an underscore, e.g. ``max_tokens``), is compared (``linear > 0``) or is the
    ``parameter`` the error names, so that a word such as "epoch" in a sentence stays a word.

    Args:
        message: the library's message.
        names: the argument names to rewrite (``corpus`` and ``tokenizer`` only where a message starts
            with "corpus file", "tokenizer path", ...).
        flag: a name's flag, e.g. ``--too-long`` (``plan``) or ``--data.too_long`` (``fit``).
        sep: between a flag and its value: ``" "`` (``plan``) or ``"="`` (``fit``).
        parameter: the setting the error names (:attr:`lit_balance.errors.InputError.parameter`), or None.
    """
    flag = flag or plan_flag
    quoted_re, value_re, name_re = _name_patterns(tuple(names))

    def quoted(m: re.Match) -> str:
        return f"{flag(m[1])}{sep}{m[3]}" + (f" or {flag(m[1])}{sep}{m[5]}" if m[5] else "")

    def valued(m: re.Match) -> str:
        value = {"True": "true", "False": "false", "None": "null"}.get(m[2], m[2])
        return f"{flag(m[1])}{sep}{value}" if value else flag(m[1])

    message = PATH_RE.sub(lambda m: f"{flag(m[1])} {m[2]}", message)
    if flag is plan_flag:
        message = _COST_RE.sub("", message)
    message = value_re.sub(valued, quoted_re.sub(quoted, message))
    def bare(m: re.Match) -> str:
        compared = re.match(r"\s*[<>]=?\s", message[m.end():])  # "linear > 0": a setting, not a word
        return flag(m[1]) if "_" in m[1] or m[1] == parameter or compared else m[0]

    return name_re.sub(bare, message)


def input_error(error: BaseException) -> BaseException | None:
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


def in_data_setup(error: BaseException) -> bool:
    """True if ``error`` was raised inside a data module's ``prepare_data`` or ``setup`` (called by the trainer), or
    its ``plan_summary`` (the preview :meth:`LitBalanceCLI.before_fit` prints, which splits the data as ``setup``)."""
    return any(frame.f_code.co_name in ("prepare_data", "setup", "plan_summary")
               and isinstance(frame.f_locals.get("self"), LightningDataModule) for frame in _frames(error))


def fit_message(error: BaseException, hydra: bool = False, default: tuple[str, Any] | None = None) -> str:
    """The message of the check that rejected a setting, with the data module's or model's argument names as
    LightningCLI flags (``max_tokens=0`` -> ``--data.max_tokens=0``) or, with ``hydra``, as a Hydra recipe's keys
    (``data.max_tokens=0``), or naming the callback.

    Args:
        error: the error (or one whose ``__cause__`` chain holds the check's).
        hydra: the keys of a Hydra recipe's config (``data.``, ``model.``) instead of LightningCLI flags.
        default: ``(key, class or object)`` whose argument names to use when no data module, model or callback raised
            it (e.g. ``("data", BalancedTextDataModule)`` for a store read by the data module's dataset).
    """
    error = input_error(error) or error
    message = str(error)
    found = _component(error) or default
    if found is None:
        return message
    key, owner = found
    if key == "callback":
        return f"{type(owner).__name__} in {'callbacks' if hydra else '--trainer.callbacks'}: {message}"
    cls = owner if isinstance(owner, type) else type(owner)
    names = tuple(name for name, p in inspect.signature(cls.__init__).parameters.items()
                  if name not in ("self", "corpus", "tokenizer", "settings")
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    prefix = f"{key}." if hydra else f"--{key}."
    if key == "data":
        message = PATH_RE.sub(lambda m: f"{prefix}{m[1]} {m[2]}", message)
    return flag_names(message, names, lambda name: f"{prefix}{name}", "=", getattr(error, "parameter", None))


def install_hint(error: BaseException) -> str | None:
    """The message of an ImportError that says what to install (``pip install ...``: a missing extra), else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ImportError) and "pip install" in str(error):
            return str(error)
        seen.add(id(error))
        error = error.__cause__
    return None


_marked_pid: int | None = None  # the process that gave the run its id (:func:`mark_run`)


def mark_run() -> None:
    """Give this run a new id that the ranks it starts inherit (:data:`RUN_ID_ENV`), so that an error every rank meets
    is printed once (:func:`exit_on_input_error`). Call before the ranks start; a rank that a launcher started
    (``LOCAL_RANK`` set) keeps its launcher's."""
    global _marked_pid
    _marked_pid = os.getpid()
    if os.environ.get("LOCAL_RANK") is not None and os.environ.get(RUN_ID_ENV):
        return
    os.environ[RUN_ID_ENV] = uuid.uuid4().hex


def _first_report() -> bool:
    """True in the first process of a multi-process run (on this node) to report an error, else False: it creates a
    file named after the run's id with ``O_EXCL`` and writes its pid in it (so that the process that reported first
    reports its later errors too). Always True in a process that is not a rank of a run: one that started no ranks,
    or one that only inherited a run's id and ``MASTER_PORT`` (e.g. a command started from inside a training
    script)."""
    run = os.environ.get(RUN_ID_ENV)
    if not run or "MASTER_PORT" not in os.environ:  # no ranks started (the error came before launching them)
        return True
    if os.environ.get("LOCAL_RANK") is None and _marked_pid != os.getpid():  # not a rank of the run named
        return True
    path, pid = os.path.join(tempfile.gettempdir(), f"lit_balance_error_{run}"), str(os.getpid())
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            with open(path, encoding="ascii") as handle:
                return handle.read() == pid
        except OSError:
            return False
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(pid)
    return True


def exit_on_input_error(subcommand: str, message: str, error: BaseException, prog: str | None = None,
                        debug_env: str = DEBUG_ENV) -> typing.NoReturn:
    """Print ``<prog>: error: <message>`` as one line on stderr and exit with status 2; ``prog`` defaults to
    ``lit-balance <subcommand>``. Under several ranks, only the first rank to meet an error prints it (the others'
    errors are the same setting's; they exit with status 2 too). With ``debug_env`` set to true or 1 (as jsonargparse
    and Hydra read theirs), raise ``error`` with its traceback instead."""
    if os.environ.get(debug_env, "").lower() in ("true", "1"):
        raise error
    if _first_report():
        message = " ".join(message.split())
        sys.stderr.write(f"{prog or f'lit-balance {subcommand}'}: error: {message}\n")
        sys.stderr.flush()
    raise SystemExit(2)


def check_before_launch(datamodule: Any, trainer: Any) -> None:
    """What can be checked before the ranks start and would otherwise fail on every rank after they started: a
    ``max_tokens="auto"`` on a CPU without ``memory_limit`` (the probe measures the process's resident memory
    against it).

    Args:
        datamodule: the :class:`~lit_balance.BalancedTextDataModule` the command or the recipe built.
        trainer: its ``Trainer``.

    Raises:
        ValueError: (an :class:`~lit_balance.errors.InputValueError`) the case above; its message names
            ``memory_limit``.
    """
    from lightning.pytorch.accelerators import CPUAccelerator

    from lit_balance.errors import InputValueError

    if (datamodule.max_tokens == "auto" and datamodule.memory_limit is None
            and isinstance(trainer.accelerator, CPUAccelerator)):
        raise InputValueError("max_tokens='auto' on a CPU needs memory_limit: the bytes of resident memory one rank's "
                              "process may use, e.g. memory_limit=8589934592 for 8 GiB", parameter="memory_limit")


def close_flags(message: str, parser: ArgumentParser) -> list[str]:
    """Flags or subcommands of ``parser`` close to those an argparse error ``message`` rejects (``difflib``).

    Reads "unrecognized arguments: --trainer.max_step=3 ..." (each rejected flag, without its value) and
    "invalid choice: 'fitt' (choose from ...)"; returns, for each, the closest of the spelled-out ``--`` flags that
    ``parser``'s help lists (similarity >= 0.75), or the closest choice. Empty when nothing is close.
    """
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        choices = re.findall(r"'([^']*)'", choice[2])
        return difflib.get_close_matches(choice[1], choices, n=1, cutoff=0.6)
    rejected = re.search(r"unrecognized arguments: (.*)", message)
    if not rejected:
        return []
    options = list(dict.fromkeys(_OPTION_RE.findall(parser.format_help())))  # argparse lists them in no public field
    found: list[str] = []
    for arg in rejected[1].split():
        if arg.startswith("-"):
            for match in difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.75):
                if match not in found:
                    found.append(match)
    return found


class ErrorFirstMixin:
    """A jsonargparse parser's ``error`` as one line: ``lit-balance fit: error: ...``, then "; did you mean
    --trainer.max_steps?" where a flag or subcommand of the (sub)command is close (:func:`close_flags`; for a key of
    a config file, the file that holds it and the key it may mean), then where every option is listed.

    Exits with status 2, as argparse; with ``JSONARGPARSE_DEBUG=true`` (or ``exit_on_error=False``) it raises as
    jsonargparse does.
    """

    def error(self, message: str, ex: Exception | None = None) -> typing.NoReturn:
        if not self.exit_on_error or os.environ.get(DEBUG_ENV, "").lower() == "true":  # as jsonargparse reads it
            super().error(message, ex)  # type: ignore[misc]
        parser = getattr(ex, "subcommand_parser", None) or self
        if getattr(ex, "default_config_file", None):
            parser.default_config_files = []
        prog = parser.prog.replace(" [options]", "")
        message = " ".join(message.split())
        key = re.search(r"does not accept option '([^']+)'|Key '([^']+)' is not expected", message)
        if key:  # a key of a config file: name the file that holds it
            name = key[1] or key[2]
            where = _config_files_with(name)
            if where:
                message += f" (in {', '.join(where)})"
            close = close_flags(f"unrecognized arguments: --{name}", parser)
            close = [c.lstrip("-") if where else c for c in close]
        else:
            close = close_flags(message, parser)
        line = f"{prog}: error: {message}"
        if close:
            line += f"; did you mean {' or '.join(close)}?"
        sys.stderr.write(f"{line} (every option: {prog} --help)\n")
        sys.stderr.flush()
        self.exit(2)  # type: ignore[attr-defined]


def _config_files_with(key: str) -> list[str]:
    """The ``--config`` / ``-c`` files of this command line whose YAML holds the dotted ``key``."""
    import yaml

    argv, files = COMMAND_LINE or sys.argv[1:], []
    for i, arg in enumerate(argv):
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else (
            argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None)
        if path is None or not os.path.isfile(path):
            continue
        try:
            node: Any = yaml.safe_load(open(path, encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        for part in key.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            files.append(path)
    return files


_MISSING = object()
#: the arguments the ``lit-balance`` command parses (set by :func:`lit_balance.cli.build_cli`; None: ``sys.argv``)
COMMAND_LINE: list[str] | None = None


class ErrorFirstParser(ErrorFirstMixin, ArgumentParser):
    """A jsonargparse ``ArgumentParser`` whose errors come first (:class:`ErrorFirstMixin`)."""
