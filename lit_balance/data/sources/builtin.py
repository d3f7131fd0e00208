"""The built-in corpus: the docstrings of the running interpreter's standard library (no download, no data files)."""

from __future__ import annotations

import ast
import gc
import inspect
import os
import platform
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from lit_balance.data.sources.base import CorpusSource

__all__ = ["BUILTIN_CORPUS", "StdlibDocstringsSource", "stdlib_docstrings"]

BUILTIN_CORPUS = "stdlib_docstrings"

_BUILTIN_VERSION = 1  # bump when the extraction rules of stdlib_docstrings change
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_DOC_NODES = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).parts)


def _collect_docstrings(statements: list[ast.AST], out: list[str]) -> None:
    # Docstring owners are statements, so only statement lists are visited (expressions are skipped).
    for node in statements:
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=False)
            if doc and (doc := inspect.cleandoc(doc)):
                out.append(doc)
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            child = getattr(node, name, None)
            if child:
                _collect_docstrings(child, out)


def stdlib_docstrings() -> list[str]:
    """Extract the docstrings of the running interpreter's standard library (the built-in corpus).

    Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` is parsed with :mod:`ast` (nothing is
    imported), in sorted path order, skipping ``site-packages``/``dist-packages``, test directories
    (``test``, ``tests``, ``idle_test``) and files that fail to read or parse. Module, class and
    (async) function docstrings are kept in source order, cleaned with :func:`inspect.cleandoc`;
    empty ones are dropped. The result is deterministic for a given interpreter (about 8.6k
    documents on CPython 3.11, ~2 s).

    Returns:
        The docstrings, all non-empty.

    Example:
        >>> docs = stdlib_docstrings()
        >>> len(docs) > 1000 and all(docs)
        True
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    collecting = gc.isenabled()
    gc.disable()  # the parse trees are short-lived; collection passes over them only cost time
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escape sequences; must not depend on filters
            for path in _stdlib_files(root):
                try:
                    tree = ast.parse(path.read_bytes(), filename=str(path))
                except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
                    continue
                doc = ast.get_docstring(tree, clean=False)
                if doc and (doc := inspect.cleandoc(doc)):
                    docs.append(doc)
                _collect_docstrings(tree.body, docs)
    finally:
        if collecting:
            gc.enable()
    return docs


class StdlibDocstringsSource(CorpusSource):
    """The built-in corpus, :func:`stdlib_docstrings`: ``resolve_corpus(None)`` or ``"stdlib_docstrings"``.

    Its identity is the extraction rules' version, the interpreter (implementation and full version) and the
    standard library's path; the docstrings are extracted when the corpus is read (about 2 s).

    Example:
        >>> source = StdlibDocstringsSource()
        >>> source.kind, "standard library docstrings" in source.description
        ('builtin', True)
    """

    kind = "builtin"

    def read_records(self) -> Iterator[str]:
        """The docstrings (:func:`stdlib_docstrings`), extracted now."""
        return iter(stdlib_docstrings())

    def identity(self) -> tuple[str, ...]:
        """The extraction rules' version, ``sys.implementation.name``, ``sys.version`` and the stdlib path."""
        return (str(_BUILTIN_VERSION), sys.implementation.name, sys.version, sysconfig.get_paths()["stdlib"])

    @property
    def description(self) -> str:
        """E.g. ``"Python 3.11.7 standard library docstrings"``."""
        return f"Python {platform.python_version()} standard library docstrings"
