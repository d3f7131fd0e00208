"""The data flow before the sampler (torch, no Lightning): sources, tokenizer, records, cache, datasets, collators,
loaders."""

from lit_balance.data.cache import TokenizedCorpus, load_or_build
from lit_balance.data.collate import PackedCollator, PadCollator, collator_for
from lit_balance.data.dataset import KnownLengths, TokenDataset
from lit_balance.data.loader import (
    BalancedDataLoader,
    MicroBatchDataset,
    PadFieldsCollator,
    balanced_dataloader,
    item_lengths,
)
from lit_balance.data.records import IGNORE_INDEX
from lit_balance.data.sources import (
    CorpusChunk,
    CorpusSource,
    PromptCompletion,
    TokenIds,
    resolve_corpus,
    stdlib_docstrings,
)
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer
from lit_balance.data.training_sampler import use_training_sampler
from lit_balance.data.workers import ignore_stop_signals_in_workers

__all__ = ["IGNORE_INDEX", "BalancedDataLoader", "CorpusChunk", "CorpusSource", "KnownLengths", "MicroBatchDataset",
           "PackedCollator", "PadCollator", "PadFieldsCollator", "PromptCompletion", "TokenDataset", "TokenIds",
           "TokenizedCorpus", "TokenizerAdapter", "balanced_dataloader", "collator_for",
           "ignore_stop_signals_in_workers", "item_lengths", "load_or_build", "resolve_corpus", "resolve_tokenizer",
           "stdlib_docstrings", "use_training_sampler"]
