"""Tokenization options: special tokens per document, paragraph documents in .txt files, tokenizer-name errors."""

from __future__ import annotations

import re

import pytest

from lit_balance import BalancedTextDataModule
from lit_balance.tokenizer import resolve_tokenizer


# ---------------------------------------------------------------- (c) a tokenizer name that is not a file


@pytest.mark.parametrize("name", ["bert-base-uncased", "openai-community/gpt2"])
def test_tokenizer_name_error_says_how_to_load_offline(name):
    with pytest.raises(FileNotFoundError) as info:
        resolve_tokenizer(name)
    message = str(info.value)
    assert repr(name) in message
    assert f"transformers.AutoTokenizer.from_pretrained({name!r}, local_files_only=True)" in message
    assert "tokenizer.json" in message


def test_tokenizer_name_error_from_datamodule(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("local_files_only=True")):
        BalancedTextDataModule(["a b c"], tokenizer="bert-base-uncased", cache_dir=tmp_path)
