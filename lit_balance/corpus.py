"""Corpus sources, tokenizers and the on-disk cache of tokenized corpora.

A corpus is resolved into a :class:`CorpusSource` (built-in docstrings, in-memory texts, text/JSONL
files or pre-tokenized id sequences) and a tokenizer into a :class:`TokenizerAdapter`. Both carry a
fingerprint; together they key a cache entry holding the whole corpus as flat arrays
(:class:`TokenizedCorpus`). Entries are written atomically, so concurrent processes never see a
half-written one, and stale or corrupt entries are detected and rebuilt.
"""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import importlib.resources
import inspect
import itertools
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

BUILTIN_CORPUS = "stdlib_docstrings"

_BUILTIN_VERSION = 1  # bump when the extraction rules of stdlib_docstrings change
_CACHE_FORMAT = 1  # bump when the layout of a cache entry changes
_ENCODE_CHUNK = 1024
_KINDS = ("builtin", "texts", "files", "token_ids")
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_DOC_NODES = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_ARRAYS = {"token_ids": np.int32, "offsets": np.int64, "source_index": np.int64}
_UTF8_BOM = b"\xef\xbb\xbf"


def _sha256(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Tokenizers


@functools.lru_cache(maxsize=1)
def _builtin_tokenizer_json() -> str:
    return (importlib.resources.files("lit_balance") / "data/tokenizer/tokenizer.json").read_text("utf-8")


def _plain_copy(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    copy = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def builtin_tokenizer() -> tokenizers.Tokenizer:
    """Return the vendored BERT-uncased WordPiece tokenizer, truncation and padding disabled.

    Returns:
        A fresh ``tokenizers.Tokenizer`` (30,522 tokens, ``[PAD]`` = 0); callers may mutate it.

    Example:
        >>> builtin_tokenizer().encode("hello world", add_special_tokens=False).ids
        [7592, 2088]
    """
    return _plain_copy(tokenizers.Tokenizer.from_str(_builtin_tokenizer_json()))


@dataclass(frozen=True)
class TokenizerAdapter:
    """A tokenizer reduced to what the cache needs: ids, vocabulary size, padding id, fingerprint.

    Build one with :func:`resolve_tokenizer` (or :meth:`for_token_ids` for pre-tokenized corpora).

    Attributes:
        vocab_size: number of token ids, added tokens included; every id is in ``[0, vocab_size)``.
        pad_token_id: id used for padding, in ``[0, vocab_size)``.
        fingerprint: sha256 hex identifying the tokenizer's behaviour (and the two numbers above).
        backend: the wrapped ``tokenizers.Tokenizer`` or Hugging Face tokenizer, or None when the
            adapter only describes pre-tokenized ids.

    Example:
        >>> adapter = resolve_tokenizer()
        >>> adapter.vocab_size, adapter.pad_token_id, adapter.encode_batch(["hello world"])
        (30522, 0, [[7592, 2088]])
    """

    vocab_size: int
    pad_token_id: int
    fingerprint: str
    backend: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "pad_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))
        if not 1 <= self.vocab_size <= 2**31:
            raise ValueError(f"vocab_size must be in [1, 2**31], got {self.vocab_size}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id must be in [0, vocab_size={self.vocab_size}), got {self.pad_token_id}; "
                "pass a pad_token_id inside the vocabulary"
            )
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise TypeError(f"fingerprint must be a non-empty str, got {self.fingerprint!r}")

    @classmethod
    def for_token_ids(cls, vocab_size: int, pad_token_id: int = 0) -> TokenizerAdapter:
        """Describe pre-tokenized ids that come with no tokenizer.

        Args:
            vocab_size: number of token ids; every id in the corpus must be below it.
            pad_token_id: padding id, in ``[0, vocab_size)``.

        Returns:
            An adapter with no backend; its :meth:`encode_batch` raises.

        Example:
            >>> TokenizerAdapter.for_token_ids(vocab_size=100).pad_token_id
            0
        """
        return cls(vocab_size, pad_token_id, _sha256("token_ids", str(vocab_size), str(pad_token_id)))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Tokenize texts without special tokens, truncation or padding.

        Args:
            texts: the documents.

        Returns:
            One list of token ids per text (possibly empty).

        Raises:
            TypeError: the adapter has no tokenizer (it was made for pre-tokenized ids).

        Example:
            >>> resolve_tokenizer().encode_batch(["hello", ""])
            [[7592], []]
        """
        if self.backend is None:
            raise TypeError("this TokenizerAdapter describes pre-tokenized ids and cannot encode text; "
                            "pass a tokenizer to resolve_tokenizer()")
        texts = list(texts)
        if isinstance(self.backend, tokenizers.Tokenizer):
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
        out = self.backend(texts, add_special_tokens=False, truncation=False, padding=False,
                           return_attention_mask=False, return_token_type_ids=False)
        return [list(ids) for ids in out["input_ids"]]


def _looks_like_hf(obj: Any) -> bool:
    return callable(obj) and hasattr(obj, "get_vocab") and hasattr(obj, "pad_token_id") and hasattr(obj, "__len__")


def resolve_tokenizer(tokenizer: Any = None, *, pad_token_id: int | None = None) -> TokenizerAdapter:
    """Wrap a tokenizer into a :class:`TokenizerAdapter`.

    The padding id is, in order: the ``pad_token_id`` argument; the tokenizer's own (for
    ``tokenizers.Tokenizer``: its padding ``pad_id`` if padding is configured, else the id of
    ``[PAD]`` or ``<pad>``; for Hugging Face tokenizers: ``pad_token_id``).

    Args:
        tokenizer: None for :func:`builtin_tokenizer`; a ``tokenizers.Tokenizer`` (copied, never
            mutated); a Hugging Face ``transformers`` tokenizer, fast or slow; a path (str or
            ``os.PathLike``) to a ``tokenizer.json``; or a :class:`TokenizerAdapter` (returned as is).
        pad_token_id: padding id to use; required when the tokenizer defines none.

    Returns:
        The adapter.

    Raises:
        FileNotFoundError: the tokenizer path does not exist.
        ValueError: the file is not a valid tokenizer, no padding id is known, or ``pad_token_id``
            conflicts with a given adapter or lies outside the vocabulary.
        TypeError: the tokenizer is of an unsupported type.

    Example:
        >>> resolve_tokenizer(None).vocab_size
        30522
    """
    if isinstance(tokenizer, TokenizerAdapter):
        if pad_token_id is not None and pad_token_id != tokenizer.pad_token_id:
            raise ValueError(f"pad_token_id={pad_token_id!r} conflicts with the given TokenizerAdapter's "
                             f"pad_token_id={tokenizer.pad_token_id}; drop one of them")
        return tokenizer
    if tokenizer is None:
        tokenizer = builtin_tokenizer()
    elif isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if path.is_dir():
            raise ValueError(f"tokenizer path {str(path)!r} is a directory; pass the tokenizer.json inside it")
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist (expected a tokenizer.json)")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:
            raise ValueError(f"tokenizer file {str(path)!r} is not a valid tokenizer.json: {error}") from error
    if isinstance(tokenizer, tokenizers.Tokenizer):
        backend = _plain_copy(tokenizer)
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        found = tokenizer.padding["pad_id"] if tokenizer.padding else None
        for token in ("[PAD]", "<pad>"):
            found = backend.token_to_id(token) if found is None else found
        identity = ["tokenizers", backend.to_str()]
    elif _looks_like_hf(tokenizer):
        backend = tokenizer
        vocab_size = len(tokenizer)
        found = tokenizer.pad_token_id
        inner = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(inner, tokenizers.Tokenizer):
            identity = ["hf-fast", type(tokenizer).__name__, _plain_copy(inner).to_str()]
        else:
            vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
            identity = ["hf-slow", type(tokenizer).__name__, vocab]
    else:
        raise TypeError(
            f"tokenizer must be None, a tokenizers.Tokenizer, a Hugging Face tokenizer, a path to a "
            f"tokenizer.json or a TokenizerAdapter, got {type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
        )
    pad = pad_token_id if pad_token_id is not None else found
    if pad is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) defines no padding token; pass pad_token_id=")
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)):
        raise TypeError(f"pad_token_id must be an int, got {type(pad).__name__} {pad!r}")
    fingerprint = _sha256(*identity, str(vocab_size), str(int(pad)))
    return TokenizerAdapter(vocab_size, int(pad), fingerprint, backend)


# --------------------------------------------------------------------------------------------------
# Built-in corpus


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


# --------------------------------------------------------------------------------------------------
# Corpus sources


def _read_utf8(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"corpus file {str(path)!r} cannot be read: {error}") from error
    skip = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"corpus file {str(path)!r} is not valid UTF-8 at byte {error.start + skip}; re-encode it as UTF-8"
        ) from None


def _file_documents(path: Path, text_key: str) -> list[str]:
    lines = _read_utf8(path).split("\n")
    docs = []
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if path.suffix.lower() != ".jsonl":
            docs.append(line)
            continue
        where = f"corpus file {str(path)!r}, line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if text_key not in obj:
            raise ValueError(f"{where}: no key {text_key!r} (keys: {sorted(obj)[:10]}); set text_key=")
        if not isinstance(obj[text_key], str):
            raise ValueError(f"{where}: {text_key!r} is {type(obj[text_key]).__name__}, expected a string")
        docs.append(obj[text_key])
    return docs


@dataclass(frozen=True)
class CorpusSource:
    """Where the documents of a corpus come from; build one with :func:`resolve_corpus`.

    Attributes:
        kind: ``"builtin"``, ``"texts"``, ``"files"`` or ``"token_ids"``.
        fingerprint: sha256 hex identifying the content (for files: resolved paths, sizes, mtimes).
        description: human-readable summary, e.g. ``"2 files: a.txt, b.jsonl"``.

    Example:
        >>> source = resolve_corpus(["first document", "second one"])
        >>> source.kind, source.description, source.load_texts()
        ('texts', '2 text documents', ['first document', 'second one'])
    """

    kind: str
    fingerprint: str
    description: str
    _payload: tuple = field(default=(), repr=False, compare=False)
    _text_key: str = field(default="text", repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")

    def load_texts(self) -> list[str]:
        """Read the documents as strings.

        Returns:
            The documents in corpus order (blank lines of text files are not documents).

        Raises:
            TypeError: the corpus is pre-tokenized (use :meth:`load_token_ids`).
            ValueError: a file cannot be read, is not UTF-8, has a bad JSONL line, or the corpus is empty.

        Example:
            >>> resolve_corpus(["a", "b"]).load_texts()
            ['a', 'b']
        """
        if self.kind == "token_ids":
            raise TypeError("this corpus holds token ids, not texts; call load_token_ids()")
        if self.kind == "builtin":
            return stdlib_docstrings()
        if self.kind == "texts":
            return list(self._payload)
        docs = [doc for path in self._payload for doc in _file_documents(path, self._text_key)]
        if not docs:
            raise ValueError(f"corpus is empty: no non-blank lines in {', '.join(map(str, self._payload))}")
        return docs

    def load_token_ids(self) -> list[np.ndarray]:
        """Return the pre-tokenized documents.

        Returns:
            One read-only int64 1-D array per document.

        Raises:
            TypeError: the corpus holds texts (use :meth:`load_texts`).

        Example:
            >>> resolve_corpus([[5, 6], [7]]).load_token_ids()[0].tolist()
            [5, 6]
        """
        if self.kind != "token_ids":
            raise TypeError(f"this corpus holds texts ({self.kind}), not token ids; call load_texts()")
        return list(self._payload)


def _as_ids(item: Any, index: int) -> np.ndarray:
    if hasattr(item, "detach") and hasattr(item, "numpy"):  # a torch tensor, without importing torch
        item = item.detach().cpu().numpy()
    if isinstance(item, (list, tuple)) and not item:
        item = np.zeros(0, dtype=np.int64)
    if isinstance(item, (list, tuple)) and any(isinstance(v, bool) for v in item):
        raise TypeError(f"document {index} of the token-id corpus holds a bool "
                        f"({next(v for v in item if isinstance(v, bool))!r}); token ids must be ints")
    try:
        array = np.asarray(item)
    except (ValueError, OverflowError) as error:
        raise TypeError(f"document {index} of the token-id corpus is not a sequence of ints: {error}") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        bad = ""
        if isinstance(item, (list, tuple)):
            value = next((v for v in item
                          if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))), None)
            bad = f" (first non-int value: {value!r})"
        raise TypeError(f"document {index} of the token-id corpus must be a 1-D sequence of ints, "
                        f"got shape {array.shape} dtype {array.dtype}{bad}")
    if array.size and array.min() < 0:
        raise ValueError(f"document {index} of the token-id corpus holds the negative id {int(array.min())}; "
                         "token ids must be >= 0")
    if array.size and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"document {index} of the token-id corpus holds the id {int(array.max())}, too large")
    array = np.array(array, dtype=np.int64)
    array.flags.writeable = False
    return array


def _item_kind(item: Any, index: int) -> str:
    if isinstance(item, str):
        return "texts"
    if isinstance(item, os.PathLike):
        return "files"
    if isinstance(item, (list, tuple, np.ndarray)) or (hasattr(item, "detach") and hasattr(item, "numpy")):
        return "token_ids"
    raise TypeError(f"corpus item {index} is a {type(item).__name__}; expected str (a document), "
                    "os.PathLike (a file) or a sequence of ints (token ids)")


def _files_source(paths: list[Any], text_key: str) -> CorpusSource:
    resolved, parts, sizes = [], [], []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"corpus file {str(path)!r} does not exist "
                                    "(a list of str is read as documents; a single str must be a file)")
        if path.is_dir():
            raise ValueError(f"corpus path {str(path)!r} is a directory; pass the files inside it, "
                             f"e.g. sorted(Path({str(path)!r}).glob('*.txt'))")
        if path.suffix.lower() == ".json":
            raise ValueError(f"corpus file {str(path)!r}: .json is not supported; use .jsonl "
                             "(one JSON object per line) or plain text (one document per line)")
        try:
            with open(path, "rb"):
                pass
            stat = path.stat()
        except OSError as error:
            raise ValueError(f"corpus file {str(path)!r} cannot be read: {error}") from error
        path = path.resolve()
        resolved.append(path)
        parts += [str(path), str(stat.st_size), str(stat.st_mtime_ns)]
        sizes.append(stat.st_size)
    if not any(sizes):
        raise ValueError(f"corpus is empty: every file is empty ({', '.join(map(str, resolved))})")
    names = [path.name for path in resolved]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    description = f"{len(names)} file{'s' if len(names) != 1 else ''}: {shown}"
    return CorpusSource("files", _sha256("files", text_key, *parts), description, tuple(resolved), text_key)


def resolve_corpus(corpus: Any = None, *, text_key: str = "text") -> CorpusSource:
    """Turn a corpus argument into a :class:`CorpusSource`.

    Rules, in order:

    * ``None`` or ``"stdlib_docstrings"``: the built-in corpus (:func:`stdlib_docstrings`).
    * A single ``str`` or ``os.PathLike``: one file, which must exist.
    * A list/tuple of ``str``: in-memory documents (never paths, even if they name files).
    * A list/tuple of ``os.PathLike`` (e.g. ``pathlib.Path``): files.
    * A list/tuple of int sequences (lists, tuples, 1-D integer numpy arrays or torch tensors):
      pre-tokenized documents, every id ``>= 0``.

    Files ending in ``.jsonl`` hold one JSON object per non-blank line, the document being
    ``obj[text_key]``; ``.json`` is rejected; any other file is UTF-8 text, one document per
    non-blank line. File contents are read (and checked) by :meth:`CorpusSource.load_texts`.

    Args:
        corpus: the corpus, as above.
        text_key: key of the document text in JSONL objects.

    Returns:
        The source.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a directory or ``.json`` file, an unreadable file, a negative token id, or an
            empty corpus.
        TypeError: an unsupported type, or a list mixing item kinds.

    Example:
        >>> resolve_corpus().kind, resolve_corpus([[1, 2], [3]]).kind
        ('builtin', 'token_ids')
    """
    if not isinstance(text_key, str):
        raise TypeError(f"text_key must be a str, got {type(text_key).__name__} {text_key!r}")
    if isinstance(corpus, CorpusSource):
        return corpus
    if corpus is None or (isinstance(corpus, str) and corpus == BUILTIN_CORPUS):
        stdlib = sysconfig.get_paths()["stdlib"]
        parts = ("builtin", str(_BUILTIN_VERSION), sys.implementation.name, sys.version, stdlib)
        description = f"Python {platform.python_version()} standard library docstrings"
        return CorpusSource("builtin", _sha256(*parts), description)
    if isinstance(corpus, (str, os.PathLike)):
        return _files_source([corpus], text_key)
    if not isinstance(corpus, (list, tuple)):
        raise TypeError(f"corpus must be None, {BUILTIN_CORPUS!r}, a path, or a list/tuple of documents, "
                        f"paths or token-id sequences; got {type(corpus).__name__}")
    if not corpus:
        raise ValueError("corpus is empty: the list holds no documents")
    kinds = [_item_kind(item, index) for index, item in enumerate(corpus)]
    if len(set(kinds)) > 1:
        first = kinds.index(next(k for k in kinds if k != kinds[0]))
        raise TypeError(f"corpus items must all be of one kind; item 0 is {kinds[0]} but item {first} is "
                        f"{kinds[first]} ({type(corpus[first]).__name__})")
    if kinds[0] == "files":
        return _files_source(list(corpus), text_key)
    if kinds[0] == "texts":
        texts = tuple(corpus)
        return CorpusSource("texts", _sha256("texts", *texts), f"{len(texts)} text documents", texts)
    arrays = tuple(_as_ids(item, index) for index, item in enumerate(corpus))
    digest = hashlib.sha256(b"token_ids")
    for array in arrays:
        digest.update(len(array).to_bytes(8, "little"))
        digest.update(np.ascontiguousarray(array, dtype="<i8").tobytes())
    total = sum(len(array) for array in arrays)
    return CorpusSource("token_ids", digest.hexdigest(), f"{len(arrays)} pre-tokenized documents ({total} tokens)",
                        arrays)


# --------------------------------------------------------------------------------------------------
# Tokenized corpus and cache


@dataclass(frozen=True, eq=False)
class TokenizedCorpus:
    """A tokenized corpus as flat arrays: document ``i`` is ``token_ids[offsets[i]:offsets[i + 1]]``.

    Arrays loaded from the cache are read-only memory maps.

    Attributes:
        token_ids: int32 ``[num_tokens]``, all kept documents concatenated.
        offsets: int64 ``[num_docs + 1]``, non-decreasing, from 0 to ``num_tokens``.
        source_index: int64 ``[num_docs]``, index of each kept document in the source corpus.
        num_empty: documents dropped because they were empty after tokenization.
        vocab_size: number of token ids of the tokenizer.
        pad_token_id: the tokenizer's padding id.

    Raises:
        ValueError: the arrays have the wrong dtype or shape, or inconsistent offsets.

    Example:
        >>> corpus = TokenizedCorpus(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]),
        ...                          np.array([0, 2]), num_empty=1, vocab_size=10, pad_token_id=0)
        >>> len(corpus), corpus.lengths.tolist(), corpus.document(1).tolist()
        (2, [2, 1], [7])
    """

    token_ids: np.ndarray
    offsets: np.ndarray
    source_index: np.ndarray
    num_empty: int
    vocab_size: int
    pad_token_id: int

    def __post_init__(self) -> None:
        for name, dtype in _ARRAYS.items():
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
                got = (f"{array.dtype} with shape {array.shape}" if isinstance(array, np.ndarray)
                       else type(array).__name__)
                raise ValueError(f"{name} must be a 1-D {np.dtype(dtype)} array, got {got}")
        offsets = self.offsets
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(self.token_ids):
            raise ValueError(f"offsets must run from 0 to len(token_ids)={len(self.token_ids)}, "
                             f"got {offsets[:1].tolist()}..{offsets[-1:].tolist()}")
        if np.any(np.diff(offsets) < 0):
            raise ValueError("offsets must be non-decreasing")
        if len(self.source_index) != len(offsets) - 1:
            raise ValueError(f"source_index has {len(self.source_index)} entries, expected {len(offsets) - 1}")
        if self.num_empty < 0:
            raise ValueError(f"num_empty must be >= 0, got {self.num_empty}")

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]``: tokens per document."""
        return np.diff(np.asarray(self.offsets))

    @property
    def num_tokens(self) -> int:
        """Total number of tokens."""
        return len(self.token_ids)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        """Return the token ids of document ``i`` (a view; negative indices count from the end).

        Raises:
            IndexError: ``i`` is outside ``[-len, len)``.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document index {i} is out of range for {n} documents")
        i %= n
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]]


def cache_key(source: CorpusSource, tokenizer: TokenizerAdapter) -> str:
    """Return the sha256 hex key of the cache entry for a corpus and tokenizer.

    Example:
        >>> len(cache_key(resolve_corpus(["a"]), resolve_tokenizer()))
        64
    """
    _check_types(source, tokenizer)
    return _sha256("cache", str(_CACHE_FORMAT), source.kind, source.fingerprint, tokenizer.fingerprint)


def default_cache_dir() -> Path:
    """Return ``$LIT_BALANCE_CACHE``, else ``$XDG_CACHE_HOME/lit_balance``, else ``~/.cache/lit_balance``.

    Example:
        >>> isinstance(default_cache_dir(), Path)
        True
    """
    if os.environ.get("LIT_BALANCE_CACHE"):
        return Path(os.environ["LIT_BALANCE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lit_balance"
    return Path.home() / ".cache" / "lit_balance"


def _check_types(source: Any, tokenizer: Any) -> None:
    if not isinstance(source, CorpusSource):
        raise TypeError(f"source must be a CorpusSource (from resolve_corpus), got {type(source).__name__}")
    if not isinstance(tokenizer, TokenizerAdapter):
        raise TypeError(f"tokenizer must be a TokenizerAdapter (from resolve_tokenizer), "
                        f"got {type(tokenizer).__name__}")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _tokenize(source: CorpusSource, tokenizer: TokenizerAdapter, progress: bool) -> tuple[list[np.ndarray], int]:
    if source.kind == "token_ids":
        docs: list[Any] = source.load_token_ids()
        chunks: Any = (docs[i:i + _ENCODE_CHUNK] for i in range(0, len(docs), _ENCODE_CHUNK))
    else:
        docs = source.load_texts()
        chunks = (tokenizer.encode_batch(docs[i:i + _ENCODE_CHUNK]) for i in range(0, len(docs), _ENCODE_CHUNK))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(docs), unit="doc", desc=f"Tokenizing {source.description}")
    lengths, flats, start = [], [], 0
    try:
        for chunk in chunks:
            sizes = np.fromiter((len(ids) for ids in chunk), dtype=np.int64, count=len(chunk))
            if source.kind == "token_ids":
                flat = np.concatenate(chunk) if chunk else np.zeros(0, dtype=np.int64)
            else:
                flat = np.fromiter(itertools.chain.from_iterable(chunk), dtype=np.int64, count=int(sizes.sum()))
            if flat.size and (flat.min() < 0 or flat.max() >= tokenizer.vocab_size):
                bad = flat[(flat < 0) | (flat >= tokenizer.vocab_size)][0]
                doc = start + int(np.searchsorted(np.cumsum(sizes), np.flatnonzero(flat == bad)[0], side="right"))
                raise ValueError(f"document {doc} holds the token id {int(bad)}, outside [0, vocab_size="
                                 f"{tokenizer.vocab_size}); pass a tokenizer or vocab_size that covers it")
            lengths.append(sizes)
            flats.append(flat.astype(np.int32))
            start += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return [np.concatenate(lengths), np.concatenate(flats)], len(docs)


def build_cache(source: CorpusSource, tokenizer: TokenizerAdapter, cache_dir: str | os.PathLike,
                *, progress: bool = False) -> Path:
    """Tokenize a corpus and write it atomically as the cache entry ``<cache_dir>/<key>/``.

    The entry (``token_ids.npy``, ``offsets.npy``, ``source_index.npy``, ``meta.json``) is written to
    a temporary directory inside ``cache_dir`` and renamed into place; if another process placed a
    valid entry first, this one is discarded. Documents empty after tokenization are dropped and
    counted.

    Args:
        source: the corpus, from :func:`resolve_corpus`.
        tokenizer: the tokenizer, from :func:`resolve_tokenizer` (for token-id corpora it only
            supplies ``vocab_size`` and ``pad_token_id``).
        cache_dir: directory holding cache entries (created if missing).
        progress: show a progress bar over documents.

    Returns:
        The entry directory.

    Raises:
        ValueError: every document is empty after tokenization, a token id is outside the
            vocabulary, or the corpus cannot be read.
        TypeError: ``source`` or ``tokenizer`` is not a resolved object.

    Example:
        >>> entry = build_cache(resolve_corpus(["hello world"]), resolve_tokenizer(), getfixture("tmp_path"))
        >>> sorted(p.name for p in entry.iterdir())
        ['meta.json', 'offsets.npy', 'source_index.npy', 'token_ids.npy']
    """
    key = cache_key(source, tokenizer)
    (all_lengths, token_ids), num_docs = _tokenize(source, tokenizer, progress)
    source_index = np.flatnonzero(all_lengths > 0).astype(np.int64)
    if not len(source_index):
        raise ValueError(f"all {num_docs} documents of the corpus ({source.description}) are empty after tokenization")
    offsets = np.zeros(len(source_index) + 1, dtype=np.int64)
    np.cumsum(all_lengths[source_index], out=offsets[1:])
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / key
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=cache_dir))
    try:
        digests = {}
        for name, array in (("token_ids", token_ids), ("offsets", offsets), ("source_index", source_index)):
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
            digests[f"{name}.npy"] = _file_sha256(tmp / f"{name}.npy")
        meta = {"key": key, "format": _CACHE_FORMAT, "num_docs": len(source_index), "num_tokens": len(token_ids),
                "num_empty": num_docs - len(source_index), "vocab_size": tokenizer.vocab_size,
                "pad_token_id": tokenizer.pad_token_id, "description": source.description, "sha256": digests}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        for _ in range(3):
            try:
                os.replace(tmp, target)
                return target
            except OSError:
                try:
                    inode = target.stat().st_ino
                except OSError:
                    continue  # removed meanwhile: try again
                if _read_entry(target, key, tokenizer) is not None:
                    return target  # another process won the race with a valid entry
                _discard(target, inode)
        raise RuntimeError(f"could not place the cache entry {str(target)!r}; check permissions of {str(cache_dir)!r}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(entry: Path, inode: int) -> None:
    # Move the entry aside first so that a valid entry placed meanwhile by another process survives.
    trash = entry.with_name(f".trash-{entry.name[:16]}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return
    try:
        moved = trash.stat().st_ino
    except OSError:
        return
    if moved != inode:
        try:
            os.rename(trash, entry)  # not the entry found broken: put it back
            return
        except OSError:
            pass
    shutil.rmtree(trash, ignore_errors=True)


def _read_entry(entry: Path, key: str, tokenizer: TokenizerAdapter) -> TokenizedCorpus | None:
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        if meta["key"] != key or meta["format"] != _CACHE_FORMAT:
            return None
        if (meta["vocab_size"], meta["pad_token_id"]) != (tokenizer.vocab_size, tokenizer.pad_token_id):
            return None
        arrays = {}
        for name in _ARRAYS:
            path = entry / f"{name}.npy"
            if _file_sha256(path) != meta["sha256"][f"{name}.npy"]:
                return None
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        corpus = TokenizedCorpus(num_empty=int(meta["num_empty"]), vocab_size=tokenizer.vocab_size,
                                 pad_token_id=tokenizer.pad_token_id, **arrays)
        if (len(corpus), corpus.num_tokens) != (meta["num_docs"], meta["num_tokens"]):
            return None
        return corpus
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_cache(source: CorpusSource, tokenizer: TokenizerAdapter,
               cache_dir: str | os.PathLike | None) -> TokenizedCorpus | None:
    """Load the cache entry of a corpus and tokenizer, or None if it is missing or broken.

    Broken entries (unreadable or mismatching ``meta.json``, checksum mismatch, arrays of the wrong
    dtype or shape, inconsistent offsets) are removed.

    Args:
        source: the corpus, from :func:`resolve_corpus`.
        tokenizer: the tokenizer, from :func:`resolve_tokenizer`.
        cache_dir: directory holding cache entries (None: :func:`default_cache_dir`).

    Returns:
        The tokenized corpus (read-only memory-mapped arrays), or None.

    Raises:
        TypeError: ``source`` or ``tokenizer`` is not a resolved object.

    Example:
        >>> load_cache(resolve_corpus(["never built"]), resolve_tokenizer(), getfixture("tmp_path")) is None
        True
    """
    key = cache_key(source, tokenizer)
    entry = Path(cache_dir if cache_dir is not None else default_cache_dir()) / key
    try:
        inode = entry.stat().st_ino
    except OSError:
        return None
    corpus = _read_entry(entry, key, tokenizer)
    if corpus is None:
        _discard(entry, inode)
    return corpus


def load_or_build(source: CorpusSource, tokenizer: TokenizerAdapter, cache_dir: str | os.PathLike | None = None,
                  *, progress: bool = False) -> TokenizedCorpus:
    """Load the cached tokenized corpus, building the entry first if needed.

    Args:
        source: the corpus, from :func:`resolve_corpus`.
        tokenizer: the tokenizer, from :func:`resolve_tokenizer`.
        cache_dir: directory holding cache entries (None: :func:`default_cache_dir`).
        progress: show a progress bar while tokenizing.

    Returns:
        The tokenized corpus.

    Raises:
        ValueError: see :func:`build_cache`.
        RuntimeError: the entry cannot be read back after building it.

    Example:
        >>> corpus = load_or_build(resolve_corpus(["hello world", ""]), resolve_tokenizer(), getfixture("tmp_path"))
        >>> corpus.document(0).tolist(), corpus.num_empty
        ([7592, 2088], 1)
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = load_cache(source, tokenizer, cache_dir)
    for _ in range(2):
        if corpus is not None:
            return corpus
        build_cache(source, tokenizer, cache_dir, progress=progress)
        corpus = load_cache(source, tokenizer, cache_dir)
    if corpus is None:
        raise RuntimeError(f"the cache entry for {source.description} in {str(cache_dir)!r} "
                           "cannot be read back after building it; check the disk and permissions")
    return corpus
