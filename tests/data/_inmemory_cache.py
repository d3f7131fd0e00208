"""The whole-corpus-in-memory tokenization the streaming cache builder replaced, kept as the tests' oracle.

It reads every file whole (universal newlines, BOM skipped), keeps every document and every token array in
memory, and concatenates them at the end, exactly as the cache builder did before it streamed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lit_balance.data.sources import CorpusSource, stdlib_docstrings
from lit_balance.data.tokenizer import TokenizerAdapter

_UTF8_BOM = b"\xef\xbb\xbf"


def whole_file_documents(path: Path, text_key: str = "text", txt_documents: str = "line") -> list[str]:
    """The documents of one file, read whole."""
    data = Path(path).read_bytes()
    data = data[len(_UTF8_BOM):] if data.startswith(_UTF8_BOM) else data
    lines = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    jsonl = Path(path).suffix.lower() == ".jsonl"
    if not jsonl and txt_documents == "paragraph":
        docs, current = [], []
        for line in lines + [""]:
            if line.strip():
                current.append(line)
            elif current:
                docs.append("\n".join(current))
                current = []
        return docs
    docs = []
    for line in lines:
        if line.strip():
            docs.append(json.loads(line)[text_key] if jsonl else line)
    return docs


def in_memory_arrays(source: CorpusSource, tokenizer: TokenizerAdapter) -> dict[str, np.ndarray]:
    """``token_ids`` (int32), ``offsets`` and ``source_index`` (int64) of a corpus, all built in memory."""
    if source.kind == "token_ids":
        docs = [np.asarray(d, dtype=np.int64) for d in source.load_token_ids()]
    else:
        if source.kind == "builtin":
            texts = stdlib_docstrings()
        elif source.kind == "texts":
            texts = list(source.texts)
        else:
            texts = [doc for path in source.paths
                     for doc in whole_file_documents(path, source.text_key, source.txt_documents)]
        docs = [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    source_index = np.flatnonzero(lengths > 0).astype(np.int64)
    offsets = np.zeros(len(source_index) + 1, dtype=np.int64)
    np.cumsum(lengths[source_index], out=offsets[1:])
    token_ids = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, np.int32)
    return {"token_ids": token_ids, "offsets": offsets, "source_index": source_index}
