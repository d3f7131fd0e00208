"""Tokenization options: special tokens per document, paragraph documents in .txt files, tokenizer-name errors."""

from __future__ import annotations

import re

import pytest

from lit_balance import BalancedTextDataModule
from lit_balance.cache import cache_key
from lit_balance.corpus import resolve_corpus
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


# ---------------------------------------------------------------- (b) paragraph documents in .txt files

_WRAPPED = "First paragraph,\nwrapped over\nthree lines.\n\n  \nSecond one.\n\n\n\tThird,\nindented.\n"


def _dm(corpus, tmp_path, **kwargs):
    dm = BalancedTextDataModule(corpus, max_tokens=256, val_fraction=0, cache_dir=tmp_path / "cache", **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_paragraph_documents(tmp_path):
    path = tmp_path / "wrapped.txt"
    path.write_text(_WRAPPED.replace("\n", "\r\n"), encoding="utf-8")
    source = resolve_corpus(path, txt_documents="paragraph")
    assert source.load_texts() == ["First paragraph,\nwrapped over\nthree lines.", "Second one.", "\tThird,\nindented."]
    assert resolve_corpus(path).load_texts() == ["First paragraph,", "wrapped over", "three lines.", "Second one.",
                                                 "\tThird,", "indented."]
    assert len(_dm(path, tmp_path, txt_documents="paragraph").corpus) == 3
    assert len(_dm(path, tmp_path).corpus) == 6  # same cache_dir: the paragraph entry is not reused


def test_paragraph_mode_changes_cache_key_only_for_files(tmp_path):
    path = tmp_path / "wrapped.txt"
    path.write_text(_WRAPPED, encoding="utf-8")
    tok = resolve_tokenizer()
    line, paragraph = resolve_corpus(path), resolve_corpus(path, txt_documents="paragraph")
    assert cache_key(line, tok) != cache_key(paragraph, tok)
    assert line.fingerprint != paragraph.fingerprint
    texts = ["a b", "c"]
    assert cache_key(resolve_corpus(texts), tok) == cache_key(resolve_corpus(texts, txt_documents="paragraph"), tok)


def test_paragraph_mode_leaves_jsonl_alone(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n', encoding="utf-8")
    assert resolve_corpus(path, txt_documents="paragraph").load_texts() == ["one", "two"]


@pytest.mark.parametrize("bad", ["paragraphs", "lines", "", None, 1])
def test_bad_txt_documents_is_named(bad, tmp_path):
    with pytest.raises(ValueError, match=r"txt_documents must be one of \('line', 'paragraph'\).*got " + re.escape(repr(bad))):
        resolve_corpus(["a"], txt_documents=bad)
    with pytest.raises(ValueError, match="txt_documents"):
        BalancedTextDataModule(["a"], txt_documents=bad, cache_dir=tmp_path)
