"""datatrove token stores read in place: the output folder of datatrove's ``DocumentTokenizer``.

The format is datatrove's own (``datatrove.pipeline.tokens.tokenizer.TokenizedFile``; read by
``datatrove.utils.dataset.DatatroveFileDataset``). Each task of the tokenizing pipeline writes:

* ``NAME.ds``: the documents' token ids back to back, little-endian ``uint16`` (token size 2, vocabularies of at
  most 65,536 ids) or ``uint32`` (token size 4);
* ``NAME.ds.index``: one little-endian ``uint64`` per document, the token offset of its end (cumulative);
* ``NAME.ds.loss`` (with ``save_loss_metadata=True``): one byte per token, 1 when it is a target, 0 when not;
* ``NAME.ds.metadata`` (with ``save_final_metadata=True``, datatrove's default): three lines, ``TOKENIZER|TOKEN_SIZE``,
  the token count, and the same count for humans.

:class:`DatatroveStore` reads one or many such files (several tasks' output, one corpus, in sorted file order): the
lengths come from the ``.ds.index`` files alone (8 bytes per document) and the file sizes; the tokens of a document
are read from its ``.ds`` file (and ``.ds.loss``) with ``os.pread`` when a micro-batch holding it is built; a file
that changed on disk since the store was opened (size or modification time) is refused then, naming it.
:class:`DatatroveSource` is the :class:`~lit_balance.data.sources.CorpusSource` that gives it to the DataModule:
``BalancedTextDataModule(corpus=DatatroveSource("data/tokens"))``.

Raw text becomes such a folder with ``lit-balance tokenize`` (:mod:`lit_balance.cli.tokenize`) or any datatrove
pipeline ending in ``DocumentTokenizer`` (``docs/store_datatrove.md``).
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.stores._files import FileStamp, TokenFile
from lit_balance.data.stores.base import StoreSource, TokenStore
from lit_balance.errors import InputFileNotFoundError, InputTypeError, InputValueError

__all__ = ["DatatroveSource", "DatatroveStore", "read_metadata"]

_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_INDEX_DTYPE = np.dtype("<u8")


def read_metadata(path: str | os.PathLike) -> tuple[str, int, int]:
    """Parse a ``.ds.metadata`` file: ``(tokenizer name or path, token size in bytes, token count)``.

    Raises:
        ValueError: the file is not three lines ``NAME|SIZE``, ``COUNT``, ``...`` with SIZE 2 or 4 (naming it).
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    name, bar, size = lines[0].rpartition("|") if lines else ("", "", "")
    try:
        token_size, count = int(size), int(lines[1])
    except (IndexError, ValueError):
        token_size = count = -1
    if not bar or token_size not in _DTYPES or count < 0:
        raise InputValueError(f"{path}: expected datatrove's .ds.metadata (a line 'TOKENIZER|TOKEN_SIZE' with "
                              f"TOKEN_SIZE 2 or 4, then the token count), got {text[:120]!r}")
    return name, token_size, count


def _check_orphans(folder: Path, found: list[Path]) -> None:
    """Raise when a ``.ds.index``, ``.ds.loss`` or ``.ds.metadata`` in ``folder`` names a ``.ds`` that is not there (a
    copy or a run interrupted halfway: its documents would silently not train)."""
    present = {p.name for p in found}
    for suffix in (".ds.index", ".ds.metadata", ".ds.loss"):
        orphans = sorted(p for p in folder.glob(f"*{suffix}") if p.name[: -len(suffix)] + ".ds" not in present)
        if orphans and found:
            names = ", ".join(p.name for p in orphans[:3]) + (f" and {len(orphans) - 3} more" if len(orphans) > 3
                                                                else "")
            missing = orphans[0].name[: -len(suffix)] + ".ds"
            verb = "names" if len(orphans) == 1 else "name"
            raise InputFileNotFoundError(f"datatrove store folder {str(folder)!r}: {names} {verb} a token file "
                                         f"that is missing ({missing}); the store is incomplete (an interrupted "
                                         "copy or tokenization). Copy or tokenize it again, or remove "
                                         "the leftover files to train on the other files only", parameter="paths")


def _ds_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The ``.ds`` files named by ``paths`` (files, folders, glob patterns), in the order given, each folder's and
    pattern's sorted by name."""
    files: list[Path] = []
    for given in paths:
        text = os.path.expanduser(os.fspath(given))
        if glob.has_magic(text):
            found = sorted(Path(p) for p in glob.glob(text) if p.endswith(".ds") and os.path.isfile(p))
            if not found:
                raise InputFileNotFoundError(f"datatrove store pattern {text!r} matches no .ds file", parameter="paths")
        elif os.path.isdir(text):
            found = sorted(Path(text).glob("*.ds"))
            _check_orphans(Path(text), found)
            if not found:
                index = sorted(Path(text).glob("*.ds.index"))
                hint = (f": {index[0].name} has no .ds file beside it" if index else
                        "; pass the DocumentTokenizer's output_folder")
                raise InputFileNotFoundError(f"datatrove store folder {text!r} holds no .ds file{hint}",
                                             parameter="paths")
        elif os.path.isfile(text):
            if not text.endswith(".ds"):
                raise InputValueError(f"datatrove store file {text!r} does not end in .ds; pass a .ds token file or "
                                      "the folder holding them", parameter="paths")
            found = [Path(text)]
        else:
            raise InputFileNotFoundError(f"datatrove store path {text!r} does not exist", parameter="paths")
        files.extend(found)
    names = [str(f.resolve()) for f in files]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise InputValueError(f"datatrove store file {twice} is named twice by paths={list(map(str, paths))!r}; "
                              "each file once", parameter="paths")
    return files


class DatatroveStore(TokenStore):
    """The ``.ds`` files of datatrove's ``DocumentTokenizer``, read in place as one corpus.

    Opening reads each ``.ds.index`` (8 bytes per document) and ``.ds.metadata``, and the sizes of the ``.ds`` and
    ``.ds.loss`` files; no token byte. :meth:`read` memory-maps a file on first use in a process (the maps are not
    pickled) and copies ``length`` tokens.

    Args:
        paths: ``.ds`` files, folders (their ``*.ds`` files, sorted) or glob patterns, in corpus order.
        token_size: bytes per token (2 or 4) for files without ``.ds.metadata``; a metadata file's value wins and
            must agree when both are given.
        vocab_size: number of token ids; default: the vocabulary of the tokenizer the metadata names when it is a
            local ``tokenizer.json`` (``lit-balance tokenize`` writes one beside the store), else unknown (None).
            A read id ``>= vocab_size`` raises.
        pad_token_id: padding id; default: the tokenizer's (see ``vocab_size``), else None.
        labels: read the ``.ds.loss`` label masks (default: when every file has one).

    Raises:
        FileNotFoundError: a path that does not exist, a folder or pattern without ``.ds`` files, a ``.ds`` without
            its ``.ds.index``, ``labels=True`` and a ``.ds`` without its ``.ds.loss``.
        ValueError: sizes that disagree (an index whose size is not a multiple of 8, decreasing document ends, a
            ``.ds`` whose size is not the index's last end times the token size, a ``.ds.loss`` of another length,
            a metadata token count or token size that disagrees), files of different token sizes, some files with a
            ``.ds.loss`` and some without, no token size known; each naming the file.
    """

    process_local: ClassVar[tuple[str, ...]] = ("_tokens", "_masks")

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *, token_size: int | None = None,
                 vocab_size: int | None = None, pad_token_id: int | None = None,
                 labels: bool | None = None) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not isinstance(paths, Sequence) or not paths:
            raise InputValueError(f"paths must name at least one .ds file or folder, got {paths!r}", parameter="paths")
        for name, value in (("token_size", token_size), ("vocab_size", vocab_size), ("pad_token_id", pad_token_id)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise InputTypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}",
                                     parameter=name)
        if labels is not None and not isinstance(labels, (bool, np.bool_)):
            raise InputTypeError(f"labels must be True, False or None, got {type(labels).__name__} {labels!r}",
                                 parameter="labels")
        if token_size is not None and token_size not in _DTYPES:
            raise InputValueError(f"token_size must be 2 or 4 (bytes per token), got {token_size}",
                                  parameter="token_size")
        files = _ds_files(paths)
        ends, sizes, tokenizer_names, loss, stamps = [], [], set(), [], []
        for ds in files:
            index = Path(f"{ds}.index")
            if not index.is_file():
                raise InputFileNotFoundError(f"{ds} has no index: expected {index.name} beside it (datatrove writes "
                                             "it with save_index=True, its default)", parameter="paths")
            index_bytes = index.stat().st_size
            if index_bytes % _INDEX_DTYPE.itemsize:
                raise InputValueError(f"{index}: expected a multiple of 8 bytes (one uint64 document end each), got "
                                      f"{index_bytes} bytes", parameter="paths")
            doc_ends = np.fromfile(index, dtype=_INDEX_DTYPE)
            if len(doc_ends) and np.any(np.diff(doc_ends.astype(np.int64), prepend=0) < 0):
                bad = int(np.argmax(np.diff(doc_ends.astype(np.int64), prepend=0) < 0))
                raise InputValueError(f"{index}: document ends must not decrease, got {int(doc_ends[bad])} after "
                                      f"{int(doc_ends[bad - 1]) if bad else 0} at document {bad}", parameter="paths")
            size = self._token_size(ds, token_size, doc_ends, tokenizer_names)
            num_tokens = int(doc_ends[-1]) if len(doc_ends) else 0
            ds_stamp = FileStamp(ds)
            ds_bytes = ds_stamp.size
            if ds_bytes != num_tokens * size:
                raise InputValueError(f"{ds}: expected {num_tokens} tokens x {size} bytes = {num_tokens * size} bytes "
                                      f"as {index.name} says, got {ds_bytes} bytes (truncated, or another token "
                                      "size)", parameter="paths")
            loss_file = Path(f"{ds}.loss")
            loss_stamp = FileStamp(loss_file) if loss_file.is_file() else None
            if loss_stamp is not None and loss_stamp.size != num_tokens:
                raise InputValueError(f"{loss_file}: expected {num_tokens} bytes (one per token, as {index.name} "
                                      f"says), got {loss_stamp.size}", parameter="paths")
            stamps.append((ds_stamp, loss_stamp))
            ends.append(doc_ends)
            sizes.append(size)
            loss.append(loss_file.is_file())
        if len(set(sizes)) > 1:
            first = sizes.index(next(s for s in sizes if s != sizes[0]))
            raise InputValueError(f"the .ds files of one corpus must share a token size: {files[0]} has {sizes[0]} "
                                  f"bytes per token, {files[first]} {sizes[first]}", parameter="paths")
        if labels is None:
            if any(loss) and not all(loss):
                with_, without = files[loss.index(True)], files[loss.index(False)]
                raise InputValueError(f"{with_} has a .ds.loss label mask but {without} has none; pass labels=False "
                                      "to train on every token of every file, or give files of one kind",
                                      parameter="labels")
            labels = all(loss)
        elif labels and not all(loss):
            raise InputFileNotFoundError(f"labels=True but {files[loss.index(False)]} has no .ds.loss beside it "
                                         "(datatrove writes it with save_loss_metadata=True)", parameter="labels")
        self._files = [str(f) for f in files]
        self._stamps = stamps
        self._dtype = _DTYPES[sizes[0]]
        self.has_labels = bool(labels)
        self._file_docs = np.cumsum([0, *(len(e) for e in ends)], dtype=np.int64)  # first document of each file
        self._ends = np.concatenate([e.astype(np.int64) for e in ends]) if ends else np.zeros(0, np.int64)
        starts = [np.concatenate([[0], e[:-1].astype(np.int64)]) if len(e) else np.zeros(0, np.int64) for e in ends]
        self._starts = np.concatenate(starts)
        self._lengths = self._ends - self._starts
        self._lengths.flags.writeable = False
        digest = hashlib.sha256()
        for e in ends:
            digest.update(len(e).to_bytes(8, "little"))
            digest.update(np.ascontiguousarray(e, dtype=_INDEX_DTYPE).tobytes())
        self._index_digest = digest.hexdigest()
        self._tokenizer = next(iter(tokenizer_names)) if len(tokenizer_names) == 1 else None
        self.vocab_size, self.pad_token_id = self._vocabulary(vocab_size, pad_token_id)
        self._tokens: list[TokenFile | None] | None = None
        self._masks: list[TokenFile | None] | None = None

    @staticmethod
    def _token_size(ds: Path, given: int | None, doc_ends: np.ndarray, names: set[str]) -> int:
        metadata = Path(f"{ds}.metadata")
        if not metadata.is_file():
            if given is None:
                raise InputValueError(f"{ds} has no {metadata.name} saying its token size; pass token_size=2 "
                                      "(vocabularies up to 65,536 ids) or 4", parameter="token_size")
            return int(given)
        name, size, count = read_metadata(metadata)
        if given is not None and given != size:
            raise InputValueError(f"token_size={given} but {metadata} says {size} bytes per token; leave "
                                  "token_size out", parameter="token_size")
        num_tokens = int(doc_ends[-1]) if len(doc_ends) else 0
        if count != num_tokens:
            raise InputValueError(f"{metadata} counts {count} tokens but {ds.name}.index ends at {num_tokens}; the "
                                  "files come from different runs", parameter="paths")
        names.add(name)
        return size

    def _vocabulary(self, vocab_size: int | None, pad_token_id: int | None) -> tuple[int | None, int | None]:
        """The vocabulary size and padding id: given, else the metadata's tokenizer file's, else None."""
        if vocab_size is not None and vocab_size < 1:
            raise InputValueError(f"vocab_size must be >= 1, got {vocab_size}", parameter="vocab_size")
        if (vocab_size is None or pad_token_id is None) and self._tokenizer and os.path.isfile(self._tokenizer):
            from lit_balance.data.tokenizer import resolve_tokenizer

            try:
                adapter = resolve_tokenizer(self._tokenizer, pad_token_id=pad_token_id)
            except (ValueError, TypeError):
                adapter = None  # a tokenizer without a padding token: vocab_size alone
                import tokenizers

                try:
                    found = tokenizers.Tokenizer.from_file(self._tokenizer).get_vocab_size(with_added_tokens=True)
                except Exception:
                    found = None
                vocab_size = vocab_size if vocab_size is not None else found
            if adapter is not None:
                vocab_size = vocab_size if vocab_size is not None else adapter.vocab_size
                pad_token_id = adapter.pad_token_id
        limit = 1 << (8 * self._dtype.itemsize)
        if vocab_size is not None and vocab_size > limit:
            raise InputValueError(f"vocab_size={vocab_size} does not fit the store's {self._dtype.itemsize}-byte "
                                  f"tokens (at most {limit} ids); the store was written for another tokenizer",
                                  parameter="vocab_size")
        if pad_token_id is not None and vocab_size is not None and not 0 <= pad_token_id < vocab_size:
            raise InputValueError(f"pad_token_id={pad_token_id} lies outside the vocabulary [0, {vocab_size})",
                                  parameter="pad_token_id")
        return (None if vocab_size is None else int(vocab_size)), (None if pad_token_id is None else int(pad_token_id))

    # -- TokenStore ---------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_docs]`` (read-only): tokens per document, from the ``.ds.index`` files."""
        return self._lengths

    @property
    def dtype(self) -> np.dtype:
        """``uint16`` (token size 2) or ``uint32`` (token size 4), little-endian."""
        return self._dtype

    @property
    def files(self) -> tuple[str, ...]:
        """The ``.ds`` files, in corpus order."""
        return tuple(self._files)

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer name or path the ``.ds.metadata`` files name (None without metadata, or if they differ)."""
        return self._tokenizer

    @property
    def description(self) -> str:
        """E.g. ``"datatrove store (2 files, 1,000 documents, 51,200 tokens)"``."""
        return (f"datatrove store ({len(self._files)} file{'s' * (len(self._files) != 1)}, {len(self):,} documents, "
                f"{int(self._lengths.sum()):,} tokens)")

    def _locate(self, doc: int) -> tuple[int, int]:
        """``(file number, document number within the file)``."""
        file = int(np.searchsorted(self._file_docs, doc, side="right")) - 1
        return file, doc - int(self._file_docs[file])

    def where(self, doc: int) -> str:
        """E.g. ``"document 3 of /data/00000_unshuffled.ds"`` (numbered within the file)."""
        file, local = self._locate(doc)
        return f"document {local} of {self._files[file]}"

    def _map(self, kind: str, file: int) -> TokenFile:
        """The ``.ds`` (``kind="_tokens"``) or ``.ds.loss`` (``"_masks"``) of ``file``, read by slices with
        ``os.pread``: checked against its size and modification time at the store's opening when a process first
        reads it and before every read (:class:`~lit_balance.data.stores._files.TokenFile`)."""
        maps = getattr(self, kind)
        if maps is None:
            maps = [None] * len(self._files)
            setattr(self, kind, maps)
        if maps[file] is None:
            ds_stamp, loss_stamp = self._stamps[file]
            if kind == "_masks":
                maps[file] = TokenFile(loss_stamp, np.uint8)
            else:
                maps[file] = TokenFile(ds_stamp, self._dtype)
        return maps[file]

    def read(self, doc: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``length`` tokens of document ``doc`` (``length`` x token size bytes of its ``.ds``; with
        labels, ``length`` bytes of its ``.ds.loss``).

        Returns:
            ``(ids, labels)``: ``ids`` int64 ``[length]``; ``labels`` int32 ``[length]`` (the id where the loss
            mask is 1, ``-100`` where it is 0) or None without labels.

        Raises:
            IndexError: ``doc`` or ``length`` out of range.
            StoreChangedError: a file's size or modification time changed since the store was opened (naming it).
            ValueError: an id ``>= vocab_size`` (naming the file, the document and the id).
        """
        doc, length = self._check_read(doc, length)
        file, _ = self._locate(doc)
        start = int(self._starts[doc])
        ids = np.array(self._map("_tokens", file)[start:start + length], dtype=np.int64)
        if self.vocab_size is not None and length and int(ids.max()) >= self.vocab_size:
            raise InputValueError(f"{self.where(doc)} holds the id {int(ids.max())}, beyond the vocabulary of "
                                  f"{self.vocab_size} ids: the store was tokenized with another tokenizer; pass the "
                                  "model's vocab_size and a store made with its tokenizer", parameter="vocab_size")
        if not self.has_labels:
            return ids, None
        mask = np.asarray(self._map("_masks", file)[start:start + length])
        labels = np.where(mask != 0, ids, IGNORE_INDEX).astype(np.int32)
        return ids, labels

    def supervised_lengths(self, lengths: np.ndarray, docs: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[n]``: targets at positions ``1 .. length-1`` of each document, read from the ``.ds.loss`` masks
        (one byte per token; no token byte) when the store has labels, else ``length - 1``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if not self.has_labels:
            return np.maximum(lengths - 1, 0)
        docs = np.arange(len(self), dtype=np.int64) if docs is None else np.asarray(docs, dtype=np.int64)
        out = np.zeros(len(lengths), dtype=np.int64)
        for i, (doc, length) in enumerate(zip(docs.tolist(), lengths.tolist())):
            doc, length = self._check_read(doc, length)
            if length > 1:
                start = int(self._starts[doc])
                out[i] = int(np.count_nonzero(self._map("_masks", self._locate(doc)[0])[start + 1:start + length]))
        return out

    def identity(self) -> list[str]:
        """The files' names and sizes, the token size, whether labels are read, and a sha256 of the index files'
        document ends (never the tokens)."""
        parts = ["datatrove", f"token_size={self._dtype.itemsize}", f"labels={self.has_labels}",
                 f"index={self._index_digest}"]
        for name, (stamp, _) in zip(self._files, self._stamps):
            parts.append(f"{os.path.basename(name)}:{stamp.size}")
        return parts


class DatatroveSource(StoreSource):
    """A datatrove ``DocumentTokenizer`` output folder as a corpus, read in place (:class:`DatatroveStore`).

    Args:
        paths: the output folder(s), ``.ds`` files or glob patterns, in corpus order.
        token_size: bytes per token for files without ``.ds.metadata`` (see :class:`DatatroveStore`).
        vocab_size: number of token ids; default: from the tokenizer file the metadata names, else unknown.
        pad_token_id: padding id; default: the tokenizer's, else unknown.
        labels: read the ``.ds.loss`` label masks (default: when every file has one).

    Example:
        >>> source = DatatroveSource("data/tokens", vocab_size=30522)  # doctest: +SKIP
        >>> BalancedTextDataModule(corpus=source, max_tokens=4096)  # doctest: +SKIP
    """

    kind = "datatrove"

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *, token_size: int | None = None,
                 vocab_size: int | None = None, pad_token_id: int | None = None,
                 labels: bool | None = None) -> None:
        self.paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        self.token_size = token_size
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.labels = labels

    def open_store(self) -> DatatroveStore:
        """Read the index files (:class:`DatatroveStore`)."""
        return DatatroveStore(self.paths, token_size=self.token_size, vocab_size=self.vocab_size,
                              pad_token_id=self.pad_token_id, labels=self.labels)

    def __repr__(self) -> str:
        return f"DatatroveSource({self.paths!r})"
