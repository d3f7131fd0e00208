"""The errors lit_balance raises when a value it was given is wrong.

Each is a subclass of the built-in error a caller already catches (``ValueError``, ``TypeError``,
``FileNotFoundError``) and of :class:`InputError`, so code that catches ``ValueError`` keeps working and a front end
(the ``lit-balance`` command) can tell a rejected input, to be reported in one line, from a bug, which keeps its
traceback. Messages say what was expected, what arrived (with values) and which setting to change.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InputError", "InputFileNotFoundError", "InputTypeError", "InputValueError"]


class InputError(Exception):
    """A value given to lit_balance was rejected (a setting, an argument, a file, a batch).

    Attributes:
        parameter: the name of the argument or setting at fault (e.g. ``"max_tokens"``), or None when the message
            names it only in words.
    """

    def __init__(self, *args: Any, parameter: str | None = None) -> None:
        super().__init__(*args)
        self.parameter = parameter

    def __reduce__(self) -> tuple:  # pickles with its parameter (errors cross process boundaries in DDP runs)
        return _rebuild, (type(self), self.args, self.parameter)


def _rebuild(cls: type[InputError], args: tuple, parameter: str | None) -> InputError:
    return cls(*args, parameter=parameter)


class InputValueError(InputError, ValueError):
    """A value of the right type but out of range, inconsistent or unusable."""


class InputTypeError(InputError, TypeError):
    """A value of the wrong type."""


class InputFileNotFoundError(InputError, FileNotFoundError):
    """A path that names no file."""
