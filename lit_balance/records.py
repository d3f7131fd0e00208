"""How each form of document becomes token ids and labels, and how many next-token targets labels leave.

A corpus is read as chunks of consecutive documents of one form (:class:`lit_balance.corpus.CorpusChunk`):
plain texts, prompt–completion pairs, or pre-tokenized ids with optional labels. The tokenization cache
(:mod:`lit_balance.cache`) encodes them chunk by chunk with :func:`encode_chunk`.

Labels follow the Hugging Face convention for causal language models: one label per token, *unshifted* (the
model shifts them), ``-100`` (:data:`lit_balance.IGNORE_INDEX`) where a token has no target. A prompt–completion
record (the convention of TRL's ``SFTTrainer``: fields ``prompt`` and ``completion``) is tokenized as the text
``prompt + completion`` and labelled ``-100`` on the prompt's tokens, so only completion tokens carry loss.
:func:`supervised_counts` counts, per document, exactly the targets that
:func:`lit_balance.loss.token_loss_sum` counts after the shift.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["encode_chunk", "supervised_counts"]

IGNORE_INDEX = -100  # the same value as lit_balance.collate.IGNORE_INDEX (kept import-free of torch here)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def encode_chunk(chunk: Any, tokenizer: Any) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Token ids (and labels, when the chunk has any masked token) of every document of a chunk.

    * ``texts``: ``tokenizer.encode_batch(texts)``; no labels (every token is a target).
    * ``pairs`` (prompt–completion): the ids of ``prompt + completion`` (one text, as TRL tokenizes it, special
      tokens included when the tokenizer adds them); labels equal the ids except ``-100`` on the longest common
      prefix of these ids and the prompt's own ids. When the prompt's last token merges with the completion's
      first (a BPE merge across the boundary), the merged token carries loss.
    * ``token_ids``: as given; labels as given (a document without them: its ids), or None when no document
      of the chunk has labels.

    Args:
        chunk: a :class:`lit_balance.corpus.CorpusChunk`.
        tokenizer: a :class:`lit_balance.tokenizer.TokenizerAdapter` (unused for ``token_ids``).

    Returns:
        ``(ids, labels)``: one int64 array per document, and one int64 array of the same length per document
        or None for "every token is a target".

    Example:
        >>> from lit_balance.corpus import CorpusChunk
        >>> from lit_balance.tokenizer import resolve_tokenizer
        >>> ids, labels = encode_chunk(CorpusChunk(0, pairs=[("hello", " world")]), resolve_tokenizer())
        >>> [a.tolist() for a in ids], [a.tolist() for a in labels]
        ([[7592, 2088]], [[-100, 2088]])
    """
    if chunk.texts is not None:
        return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(list(chunk.texts))], None
    if chunk.pairs is not None:
        joined = tokenizer.encode_batch([p + c for p, c in chunk.pairs])
        alone = tokenizer.encode_batch([p for p, _ in chunk.pairs])
        ids, labels = [], []
        for full, prompt in zip(joined, alone):
            full = np.asarray(full, dtype=np.int64)
            label = full.copy()
            label[: _common_prefix(full.tolist(), list(prompt))] = IGNORE_INDEX
            ids.append(full)
            labels.append(label)
        return ids, labels
    ids = [np.asarray(i, dtype=np.int64) for i in chunk.token_ids]
    if chunk.labels is None:
        return ids, None
    return ids, [i.copy() if lab is None else np.asarray(lab, dtype=np.int64) for i, lab in zip(ids, chunk.labels)]


def supervised_counts(labels: np.ndarray | None, offsets: np.ndarray, doc_ids: np.ndarray,
                      lengths: np.ndarray) -> np.ndarray:
    """Next-token targets per document as a causal LM counts them: labels ``1 .. length-1`` that are not ``-100``.

    :func:`lit_balance.loss.token_loss_sum` shifts: position ``t`` predicts label ``t + 1``, so a row's first label
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
