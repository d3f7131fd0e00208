"""How each form of document becomes token ids and labels, and how many next-token targets labels leave.

A corpus is read as chunks of consecutive documents of one form (:class:`lit_balance.data.sources.CorpusChunk`):
plain texts, prompt–completion pairs, or pre-tokenized ids with optional labels. The tokenization cache
(:mod:`lit_balance.data.cache`) encodes them chunk by chunk with :func:`encode_chunk_deferred` (one flat array of
ids per chunk, as :func:`encode_chunk_flat` gives; :func:`encode_chunk` gives one array per document).

Labels follow the Hugging Face convention for causal language models: one label per token, *unshifted* (the
model shifts them), ``-100`` (:data:`lit_balance.IGNORE_INDEX`) where a token has no target. A prompt–completion
record (the convention of TRL's ``SFTTrainer``: fields ``prompt`` and ``completion``) is tokenized as the text
``prompt + completion`` and labelled ``-100`` on the prompt's tokens, so only completion tokens carry loss.
:func:`supervised_counts` counts, per document, exactly the targets that
:func:`lit_balance.lightning.loss.token_loss_sum` counts after the shift.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from lit_balance.errors import InputValueError

__all__ = ["IGNORE_INDEX", "encode_chunk", "encode_chunk_deferred", "encode_chunk_flat", "supervised_counts"]

#: Label of a token with no target: ignored by :func:`torch.nn.functional.cross_entropy` (its default
#: ``ignore_index``) and by :func:`lit_balance.lightning.loss.token_loss_sum`.
IGNORE_INDEX = -100


def _encode_deferred(tokenizer: Any, texts: list[str]) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """``tokenizer.encode_batch_deferred(texts)``, or the same built from ``encode_batch`` for a tokenizer without
    it."""
    if hasattr(tokenizer, "encode_batch_deferred"):
        return tokenizer.encode_batch_deferred(texts)
    from lit_balance.data.tokenizer import flat_ids

    rows = tokenizer.encode_batch(texts)
    return lambda: flat_ids(rows)


def _starts(sizes: np.ndarray) -> np.ndarray:
    """int64 ``[len(sizes)]``: where each document begins in the flat array (exclusive cumulative sum)."""
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return starts


def _within(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every position of a flat array of documents of ``sizes`` tokens: its document and its index in it."""
    doc = np.repeat(np.arange(len(sizes)), sizes)
    return doc, np.arange(len(doc), dtype=np.int64) - _starts(sizes)[doc]


def _prompt_labels(full_sizes: np.ndarray, full: np.ndarray, prompt_sizes: np.ndarray,
                   prompt: np.ndarray) -> np.ndarray:
    """Labels of ``prompt + completion`` ids: the ids, ``-100`` on each document's longest common prefix with its
    prompt's own ids (all documents at once: the first position where the two differ, per document)."""
    common = np.minimum(full_sizes, prompt_sizes)
    doc, index = _within(common)
    differ = full[_starts(full_sizes)[doc] + index] != prompt[_starts(prompt_sizes)[doc] + index]
    prefix = common.copy()
    first_docs, first = np.unique(doc[differ], return_index=True)  # positions are in document order
    prefix[first_docs] = index[differ][first]
    labels = full.copy()
    doc, index = _within(full_sizes)
    labels[index < prefix[doc]] = IGNORE_INDEX
    return labels


def encode_chunk_flat(chunk: Any, tokenizer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Token ids (and labels, when the chunk has any masked token) of every document of a chunk, as flat arrays.

    * ``texts``: the tokenizer's ids (``encode_batch_deferred``, else ``encode_batch``); no labels (every token is
      a target).
    * ``pairs`` (prompt–completion): the ids of ``prompt + completion`` (one text, as TRL tokenizes it, special
      tokens included when the tokenizer adds them); labels equal the ids except ``-100`` on the longest common
      prefix of these ids and the prompt's own ids. When the prompt's last token merges with the completion's
      first (a BPE merge across the boundary), the merged token carries loss.
    * ``token_ids``: as given; labels as given (a document without them: its ids), or None when no document
      of the chunk has labels.

    Document ``i`` of the chunk is ``ids[starts[i]:starts[i] + sizes[i]]`` with ``starts`` the exclusive
    cumulative sum of ``sizes``; labels are aligned with ``ids``.

    Args:
        chunk: a :class:`lit_balance.data.sources.CorpusChunk`.
        tokenizer: a :class:`lit_balance.data.tokenizer.TokenizerAdapter` (unused for ``token_ids``), or any object
            with ``encode_batch(texts) -> list of id lists``.

    Returns:
        ``(sizes, ids, labels)``: int64 ``[len(chunk)]`` tokens per document; the ids concatenated (int32 from a
        tokenizer, int64 for ``token_ids`` chunks, which are used as given); labels of the same shape, or None
        for "every token is a target".

    Raises:
        ValueError: a ``token_ids`` document has another number of labels than tokens (naming its index in the
            corpus).

    Example:
        >>> from lit_balance.data.sources import CorpusChunk
        >>> from lit_balance.data.tokenizer import resolve_tokenizer
        >>> sizes, ids, labels = encode_chunk_flat(CorpusChunk(0, pairs=[("hello", " world"), ("a", "b")]),
        ...                                        resolve_tokenizer())
        >>> sizes.tolist(), ids.tolist(), labels.tolist()  # "ab" is one token, so it carries loss
        ([2, 1], [7592, 2088, 11113], [-100, 2088, 11113])
    """
    return encode_chunk_deferred(chunk, tokenizer)()


def encode_chunk_deferred(chunk: Any, tokenizer: Any
                          ) -> Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Tokenize a chunk now; return a function giving :func:`encode_chunk_flat`'s arrays from the tokenizer's output.

    The tokenizer runs in the calling thread (a ``tokenizers`` tokenizer with the GIL released); the returned
    function turns its output into flat arrays (holding the GIL), in whichever thread calls it. The cache encodes
    the next chunk in one thread while it converts and writes this one in another
    (:meth:`lit_balance.data.tokenizer.TokenizerAdapter.encode_batch_deferred`).

    Args:
        chunk: as for :func:`encode_chunk_flat`.
        tokenizer: as for :func:`encode_chunk_flat`.

    Returns:
        A function of no arguments returning ``(sizes, ids, labels)`` as :func:`encode_chunk_flat` does.

    Raises:
        ValueError: see :func:`encode_chunk_flat` (raised by the returned function).
    """
    if chunk.texts is not None:
        texts = _encode_deferred(tokenizer, list(chunk.texts))
        return lambda: (*texts(), None)
    if chunk.pairs is not None:
        full = _encode_deferred(tokenizer, [p + c for p, c in chunk.pairs])
        prompts = _encode_deferred(tokenizer, [p for p, _ in chunk.pairs])

        def finish() -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
            sizes, ids = full()
            return sizes, ids, _prompt_labels(sizes, ids, *prompts())

        return finish
    return lambda: _given_ids(chunk)


def _given_ids(chunk: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`encode_chunk_flat` of a ``token_ids`` chunk."""
    docs = [np.asarray(i, dtype=np.int64) for i in chunk.token_ids]
    sizes = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    ids = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    if chunk.labels is None:
        return sizes, ids, None
    for i, (a, lab) in enumerate(zip(docs, chunk.labels)):
        if lab is not None and len(lab) != len(a):
            raise InputValueError(f"document {chunk.start + i} has {len(lab)} labels for {len(a)} tokens; give one "
                                  "(unshifted) label per token, -100 where a token has no target")
    labels = [a if lab is None else np.asarray(lab, dtype=np.int64) for a, lab in zip(docs, chunk.labels)]
    return sizes, ids, (np.concatenate(labels) if labels else np.zeros(0, np.int64))


def encode_chunk(chunk: Any, tokenizer: Any) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Token ids (and labels, when the chunk has any masked token) of every document of a chunk, one array each.

    The same ids and labels as :func:`encode_chunk_flat` (see there for each form of document), split per
    document.

    Args:
        chunk: a :class:`lit_balance.data.sources.CorpusChunk`.
        tokenizer: a :class:`lit_balance.data.tokenizer.TokenizerAdapter` (unused for ``token_ids``), or any object
            with ``encode_batch(texts) -> list of id lists``.

    Returns:
        ``(ids, labels)``: one int64 array per document, and one int64 array of the same length per document
        or None for "every token is a target".

    Raises:
        ValueError: see :func:`encode_chunk_flat`.

    Example:
        >>> from lit_balance.data.sources import CorpusChunk
        >>> from lit_balance.data.tokenizer import resolve_tokenizer
        >>> ids, labels = encode_chunk(CorpusChunk(0, pairs=[("hello", " world")]), resolve_tokenizer())
        >>> [a.tolist() for a in ids], [a.tolist() for a in labels]
        ([[7592, 2088]], [[-100, 2088]])
    """
    sizes, ids, labels = encode_chunk_flat(chunk, tokenizer)
    cuts = np.cumsum(sizes)[:-1]
    split = np.split(ids.astype(np.int64), cuts) if len(sizes) else []
    return split, (None if labels is None else (np.split(labels.astype(np.int64), cuts) if len(sizes) else []))


def supervised_counts(labels: np.ndarray | None, offsets: np.ndarray, doc_ids: np.ndarray,
                      lengths: np.ndarray) -> np.ndarray:
    """Next-token targets per document as a causal LM counts them: labels ``1 .. length-1`` that are not ``-100``.

    :func:`lit_balance.token_loss_sum` shifts: position ``t`` predicts label ``t + 1``, so a row's first label
    never counts. Without labels every token but the first is a target (``length - 1``).

    Args:
        labels: int ``[num_tokens]`` aligned with the corpus' token ids, or None (no masked token).
        offsets: int ``[num_docs + 1]``: document ``d`` is ``[offsets[d], offsets[d + 1])``.
        doc_ids: int ``[n]``, the documents counted.
        lengths: int ``[n]``, tokens kept of each (after truncation), ``<=`` the document's length.

    Returns:
        int64 ``[n]``, each in ``[0, max(length - 1, 0)]``.

    Example:
        >>> supervised_counts(np.array([-100, -100, 7, 8, 9]), np.array([0, 5]), np.array([0]), np.array([4])).tolist()
        [2]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if labels is None:
        return np.maximum(lengths - 1, 0)
    starts = np.asarray(offsets, dtype=np.int64)[np.asarray(doc_ids, dtype=np.int64)]
    cumulative = np.zeros(len(labels) + 1, dtype=np.int64)
    np.cumsum(np.asarray(labels) != IGNORE_INDEX, out=cumulative[1:])
    counts = cumulative[starts + lengths] - cumulative[np.minimum(starts + 1, starts + lengths)]
    return np.where(lengths > 0, counts, 0).astype(np.int64)
