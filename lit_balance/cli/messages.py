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
import typing
from collections.abc import Callable, Iterable
from typing import Any

from jsonargparse import ArgumentParser
from lightning.pytorch import Callback, LightningDataModule, LightningModule

from lit_balance.errors import InputError

__all__ = ["DEBUG_ENV", "INPUT_ERRORS", "ErrorFirstMixin", "ErrorFirstParser", "close_flags", "exit_on_input_error",
           "fit_message", "flag_names", "in_data_setup", "input_error", "plan_flag"]

#: the built-in errors an InputError also is (what a subcommand catches before telling them apart)
INPUT_ERRORS = (FileNotFoundError, TypeError, ValueError)
#: set to "true" to raise library input errors with their traceback instead of the one-line message (as jsonargparse)
DEBUG_ENV = "JSONARGPARSE_DEBUG"
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


def fit_message(error: BaseException) -> str:
    """The message of the check that rejected a setting, with the data module's or model's argument names as
    LightningCLI flags (``max_tokens=0`` -> ``--data.max_tokens=0``) or naming the callback."""
    error = input_error(error) or error
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
        message = PATH_RE.sub(lambda m: f"--data.{m[1]} {m[2]}", message)
    return flag_names(message, names, lambda name: f"--{key}.{name}", "=", getattr(error, "parameter", None))


def exit_on_input_error(subcommand: str, message: str, error: BaseException) -> typing.NoReturn:
    """Print ``lit-balance <subcommand>: error: <message>`` as one line on stderr and exit with status 2."""
    if os.environ.get(DEBUG_ENV, "").lower() == "true":  # as jsonargparse reads it
        raise error
    message = " ".join(message.split())
    sys.stderr.write(f"lit-balance {subcommand}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)


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
    """A jsonargparse parser's ``error``, with the error printed first: ``lit-balance fit: error: ...``, then "did you
    mean --trainer.max_steps?" where a flag or subcommand of the (sub)command is close (:func:`close_flags`), then
    the usage.

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
        sys.stderr.write(f"{prog}: error: {message}\n")
        close = close_flags(message, parser)
        if close:
            sys.stderr.write(f"did you mean {' or '.join(close)}?\n")
        sys.stderr.write("\n")
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"every option with its help: {prog} --help\n")
        sys.stderr.flush()
        self.exit(2)  # type: ignore[attr-defined]


class ErrorFirstParser(ErrorFirstMixin, ArgumentParser):
    """A jsonargparse ``ArgumentParser`` whose errors come first (:class:`ErrorFirstMixin`)."""
