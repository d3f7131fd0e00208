"""Streams of unknown length: token-budgeted, rank-balanced micro-batches planned window by window.

:class:`StreamCorpus` reads the documents (an iterable, a ``datasets.IterableDataset``, text or JSONL files) with no
pass before training; :class:`StreamBatches` reads a window on every rank, exchanges its lengths, plans it with the
planner of every corpus (:func:`plan_window`), moves the token ids to the ranks that train them, and yields this rank's
micro-batches; it resumes exactly on any number of ranks. See ``docs/streams.md``.
"""

from lit_balance.stream.batches import StreamBatches, StreamLoader, StreamRankError
from lit_balance.stream.plan import plan_window, reader_of, trained_by, window_seed
from lit_balance.stream.source import StreamCorpus, StreamReader

__all__ = ["StreamBatches", "StreamCorpus", "StreamLoader", "StreamRankError", "StreamReader", "plan_window",
           "reader_of", "trained_by", "window_seed"]
