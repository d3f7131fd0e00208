"""The train/validation split of a tokenized corpus: a permutation seeded by ``seed``, or the corpus' own split.

NumPy and the data layer only. :class:`lit_balance.BalancedTextDataModule` resolves ``val_fraction`` with
:func:`resolve_val_fraction` at construction and splits with :func:`split_corpus` at ``setup`` (and in its plan
preview); every rank computes the same split from the same corpus and ``seed``, without communication.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from lit_balance._checks import check_number
from lit_balance.data.dataset import TokenDataset
from lit_balance.data.stores.corpus import TokenizedCorpus
from lit_balance.errors import InputValueError
from lit_balance.plan.epoch import too_long

__all__ = ["DEFAULT_VAL_FRACTION", "check_supervised_targets", "check_too_long", "resolve_val_fraction", "split_corpus",
           "split_documents"]

#: Share of documents held out for validation when ``val_fraction=None`` and the corpus has no validation split.
DEFAULT_VAL_FRACTION = 0.05

_SPLIT_SALT = 0x5EED  # the split's seed sequence is [seed, _SPLIT_SALT]: apart from the samplers' streams


def resolve_val_fraction(val_fraction: Any, split_sizes: tuple[int, int] | None = None) -> float:
    """The share of documents to hold out for validation, checked.

    Args:
        val_fraction: a number in ``[0, 1)``, or None: :data:`DEFAULT_VAL_FRACTION`, or 0.0 for a corpus with its
            own validation split (nothing is held out of its training split).
        split_sizes: ``(training rows, validation rows)`` of a corpus with its own validation split (a Hugging Face
            ``DatasetDict``'s ``train`` and ``validation``), or None.

    Returns:
        ``val_fraction`` as a float in ``[0, 1)``.

    Raises:
        TypeError: ``val_fraction`` neither a real number nor None (bools too).
        ValueError: ``val_fraction`` outside ``[0, 1)`` or NaN; a number beside the corpus' own validation split.

    Example:
        >>> resolve_val_fraction(None), resolve_val_fraction(None, split_sizes=(90, 10)), resolve_val_fraction(0.2)
        (0.05, 0.0, 0.2)
    """
    if val_fraction is not None:
        val_fraction = check_number("val_fraction", val_fraction, 0, 1, "set the share of documents held out for "
                                    "validation (0: no validation), or None for the default", high_open=True)
    if split_sizes is not None and val_fraction is not None:
        raise InputValueError(
            f"val_fraction={val_fraction!r} conflicts with the corpus' own validation split "
            f"({split_sizes[1]} rows of the DatasetDict's 'validation'); leave val_fraction=None to "
            "validate on that split, or pass corpus=dataset_dict['train'] to hold out val_fraction of the "
            "training split instead (val_fraction=0: no validation)", parameter="val_fraction")
    if val_fraction is None:
        return 0.0 if split_sizes is not None else DEFAULT_VAL_FRACTION
    return float(val_fraction)


def split_documents(num_documents: int, *, val_fraction: float, seed: int, source_index: Any = None,
                    split_sizes: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Which documents train and which validate.

    With ``split_sizes`` (a corpus with its own validation split), a document validates when its index in the
    source (``source_index``) is at or past the training split's row count. Otherwise ``round(val_fraction *
    num_documents)`` documents (at least 1 when ``val_fraction > 0``) validate, drawn by a permutation seeded by
    ``seed`` (``numpy.random.default_rng(SeedSequence([seed, 0x5EED]))``): the same on every rank and run.

    Args:
        num_documents: documents of the tokenized corpus (empty ones already dropped).
        val_fraction: share held out for validation, in ``[0, 1)`` (see :func:`resolve_val_fraction`).
        seed: seed of the permutation (>= 0).
        source_index: int ``[num_documents]``: each document's index in the source; needed with ``split_sizes``.
        split_sizes: ``(training rows, validation rows)`` of the source, or None.

    Returns:
        ``(train_docs, val_docs)``: sorted int64 document indices, disjoint, together every document once.

    Raises:
        ValueError: ``val_fraction`` leaves no document for training; with ``split_sizes``, every document of
            one split was empty after tokenization (or ``source_index`` is missing).

    Example:
        >>> train, val = split_documents(10, val_fraction=0.2, seed=0)
        >>> len(train), len(val), sorted([*train, *val]) == list(range(10))
        (8, 2, True)
    """
    if split_sizes is not None:  # a DatasetDict's train split, then its validation split
        if source_index is None or len(source_index) != num_documents:
            raise InputValueError(f"split_sizes={split_sizes} needs source_index, each document's index in the source "
                                  f"({num_documents} documents), got {source_index!r}", parameter="source_index")
        is_val = np.asarray(source_index) >= split_sizes[0]
        train_docs, val_docs = np.flatnonzero(~is_val), np.flatnonzero(is_val)
        if not train_docs.size or not val_docs.size:
            which = "training" if not train_docs.size else "validation"
            raise InputValueError(f"every document of the corpus' {which} split is empty after tokenization "
                                  f"({train_docs.size} training and {val_docs.size} validation documents are left); "
                                  "check that split's rows")
        return train_docs.astype(np.int64), val_docs.astype(np.int64)
    num_val = round(val_fraction * num_documents)
    if val_fraction > 0:
        num_val = max(num_val, 1)
    if num_documents - num_val < 1:
        raise InputValueError(
            f"the corpus has {num_documents} document(s); val_fraction={val_fraction} leaves none for training; "
            "lower val_fraction or add documents", parameter="val_fraction")
    perm = np.random.default_rng(np.random.SeedSequence([int(seed), _SPLIT_SALT])).permutation(num_documents)
    return np.sort(perm[num_val:]).astype(np.int64), np.sort(perm[:num_val]).astype(np.int64)


def split_corpus(corpus: TokenizedCorpus, *, val_fraction: float, seed: int, max_length: int | None,
                 split_sizes: tuple[int, int] | None = None) -> tuple[TokenDataset, TokenDataset | None]:
    """The training and validation datasets of ``corpus`` (:func:`split_documents`), truncated to ``max_length``.

    Args:
        corpus: the tokenized corpus (of the cache or any store; its labels, if any, are read with the ids).
        val_fraction, seed, split_sizes: as :func:`split_documents`.
        max_length: keep at most this many tokens of each document, or None.

    Returns:
        ``(train_dataset, val_dataset)``; ``val_dataset`` is None when no document validates.

    Raises:
        ValueError: as :func:`split_documents`; ``split_sizes`` that are not two ints >= 1 adding up to the
            documents the corpus read (empty ones included).

    Example:
        >>> corpus = TokenizedCorpus(np.arange(1, 7, dtype=np.int32), np.array([0, 1, 3, 6]), np.arange(3),
        ...                          num_empty=0, vocab_size=10, pad_token_id=0)
        >>> train, val = split_corpus(corpus, val_fraction=0.0, seed=0, max_length=2)
        >>> train.lengths.tolist(), val
        ([1, 2, 2], None)
    """
    if split_sizes is not None:
        _check_split_sizes(split_sizes, len(corpus) + corpus.num_empty)
    if split_sizes is None and val_fraction == 0:
        return TokenDataset.of(corpus, None, max_length), None  # every document trains: no index array at all
    train_docs, val_docs = split_documents(len(corpus), val_fraction=val_fraction, seed=seed,
                                           source_index=corpus.source_index, split_sizes=split_sizes)
    return (TokenDataset.of(corpus, train_docs, max_length),
            TokenDataset.of(corpus, val_docs, max_length) if len(val_docs) else None)


def _check_split_sizes(split_sizes: Any, num_read: int) -> None:
    """Raise unless ``split_sizes`` is two ints >= 1 that add up to ``num_read``, the documents a corpus yielded."""
    ok = (isinstance(split_sizes, (tuple, list)) and len(split_sizes) == 2
          and all(isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) and n >= 1
                  for n in split_sizes))
    if not ok or sum(int(n) for n in split_sizes) != num_read:
        raise InputValueError(f"the corpus' split_sizes must be (training documents, validation documents), two ints "
                              f">= 1 that add up to the {num_read} documents it yielded (training first), got "
                              f"{split_sizes!r}; check the source's split_sizes", parameter="split_sizes")


def check_supervised_targets(corpus: TokenizedCorpus, dataset: TokenDataset, supervised: np.ndarray,
                             cut: int | None, max_length: int | None, *, warn: bool = True) -> bool:
    """Report training records whose labels leave no next-token target: warn (count, first corpus records, the
    setting to change), or raise when no record has one.

    Args:
        corpus: the tokenized corpus.
        dataset: the training split.
        supervised: int ``[len(dataset)]``: next-token targets of each record as planned.
        cut: the truncation of ``too_long="truncate"`` (tokens), or None.
        max_length: the DataModule's truncation (tokens), or None.
        warn: warn when some records have none (False: only raise when all have none).

    Returns:
        True when some records have no target (whether or not it warned).

    Raises:
        ValueError: no record has a next-token target.
    """
    zero = np.flatnonzero(supervised == 0)
    if zero.size == 0:
        return False
    lost = int(np.count_nonzero(dataset.supervised_lengths(items=zero, full=True) > 0))
    shown = ", ".join(str(int(corpus.source_index[d])) for d in dataset.doc_ids[zero[:5]])
    shown += ", ..." if zero.size > 5 else ""
    cutting = [f"max_length={max_length}"] if max_length is not None else []  # what cuts tokens now
    if cut is not None:
        cutting.append(f"too_long='truncate' at {cut} tokens")
    parts = []
    if lost:
        parts.append(f"{lost} of them lose every target to truncation ({' and '.join(cutting)}: the prompt fills the "
                     "tokens kept)")
    if zero.size - lost:
        parts.append(f"{zero.size - lost} have none to begin with (a completion of at most one token, or labels "
                     "all -100)")
    why = ", ".join(parts)
    settings = [f"max_length={max_length}"] if max_length is not None else []  # advice: only what cuts tokens now
    if cut is not None:
        settings.append(f"max_tokens (too_long='truncate' cuts at {cut} tokens)")
    fix = "shorten those prompts, or drop those records"
    if lost and settings:
        fix = f"raise {' and '.join(settings)} so that completions survive truncation, {fix}"
    if zero.size == len(dataset):
        raise InputValueError(f"no training record has a next-token target: all {zero.size} records' labels are "
                              f"-100 after the shift, so the loss would be 0 and the gradients zero; {why}; "
                              f"{fix}", parameter="max_tokens" if max_length is None and cut is not None
                              else "max_length")
    if warn:
        warnings.warn(
            f"{zero.size} of {len(dataset)} training records have no next-token target (corpus records {shown}) "
            f"and train nothing; {why}; {fix}", UserWarning, stacklevel=3)
    return True


def check_too_long(corpus: TokenizedCorpus, max_length: int | None, pad_to_multiple_of: int, max_tokens: int) -> None:
    """Raise naming the corpus documents (source indices) longer than ``max_tokens`` padded slots after ``max_length``
    truncation (``too_long="error"``; per-rank budgets: pass the largest, a document goes to a rank that holds it).

    Raises:
        ValueError: such documents exist (the first five named, with the settings to change).
    """
    m = pad_to_multiple_of
    lengths = np.asarray(corpus.lengths)
    if (max_length is not None and not too_long(max_length, max_tokens, m)) or not lengths.size \
            or not too_long(lengths.max(), max_tokens, m):
        return  # one pass, no copy: nothing is too long (the usual case)
    bad = np.flatnonzero(too_long(lengths, max_tokens, m))
    if bad.size:
        shown = ", ".join(f"document {corpus.source_index[d]}: "
                          f"{lengths[d] if max_length is None else min(int(lengths[d]), max_length)} tokens"
                          for d in bad[:5])
        raise InputValueError(
            f"{bad.size} corpus document(s) are longer than max_tokens={max_tokens} padded token slots "
            f"(max_length={max_length}, pad_to_multiple_of={m}): {shown}{', ...' if bad.size > 5 else ''}; "
            f"set max_length <= {(max_tokens // m) * m} to truncate documents, raise max_tokens, or pass "
            'too_long="skip" or "truncate"', parameter="max_length"
        )
