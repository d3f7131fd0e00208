"""Tokenization options: special tokens per document, paragraph documents in .txt files, tokenizer-name errors."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

from lit_balance import BalancedTextDataModule
from lit_balance._fingerprint import sha256_of
from lit_balance.data.cache import cache_key
from lit_balance.data.sources import resolve_corpus
from lit_balance.data.tokenizer import TokenizerAdapter, builtin_tokenizer, resolve_tokenizer

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
    match = r"txt_documents must be one of \('line', 'paragraph'\).*got " + re.escape(repr(bad))
    with pytest.raises(ValueError, match=match):
        resolve_corpus(["a"], txt_documents=bad)
    with pytest.raises(ValueError, match="txt_documents"):
        BalancedTextDataModule(["a"], txt_documents=bad, cache_dir=tmp_path)


# ---------------------------------------------------------------- (a) special tokens per document

_DOCS = ["the cat sat", "a dog ran far away", "hello world"]


def test_special_tokens_builtin_bert(tmp_path):
    tok = builtin_tokenizer()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    plain = _dm(_DOCS, tmp_path)
    special = _dm(_DOCS, tmp_path, add_special_tokens=True)
    assert special.corpus.lengths.tolist() == [n + 2 for n in plain.corpus.lengths.tolist()]
    for i in range(len(_DOCS)):
        ids = special.corpus.document(i).tolist()
        assert ids == [cls_id, *plain.corpus.document(i).tolist(), sep_id]
        assert ids == tok.encode(_DOCS[i]).ids  # what the tokenizer's own post-processor adds
    again = _dm(_DOCS, tmp_path)  # same cache_dir afterwards: the entry with specials is not reused
    assert again.corpus.lengths.tolist() == plain.corpus.lengths.tolist()


def test_special_tokens_change_cache_key(tmp_path):
    source = resolve_corpus(_DOCS)
    plain, special = resolve_tokenizer(), resolve_tokenizer(add_special_tokens=True)
    assert plain.fingerprint == special.fingerprint  # same tokenizer ...
    assert cache_key(source, plain) != cache_key(source, special)  # ... but another entry
    assert resolve_tokenizer(plain, add_special_tokens=True).add_special_tokens is True
    assert resolve_tokenizer(plain).add_special_tokens is False


class _FakeHFTokenizer:
    """Just enough of a Hugging Face tokenizer: prepends BOS=1 when asked for special tokens."""

    pad_token_id = 0

    def __init__(self):
        self.calls = []

    def __len__(self):
        return 50

    def get_vocab(self):
        return {f"w{i}": i for i in range(50)}

    def __call__(self, texts, add_special_tokens, **kwargs):
        self.calls.append(add_special_tokens)
        ids = [[2 + len(word) for word in text.split()] for text in texts]
        return {"input_ids": [[1, *row] if add_special_tokens else row for row in ids]}


def test_special_tokens_hugging_face_tokenizer(tmp_path):
    hf = _FakeHFTokenizer()
    plain = _dm(_DOCS, tmp_path, tokenizer=hf)
    special = _dm(_DOCS, tmp_path, tokenizer=hf, add_special_tokens=True)
    assert hf.calls == [False, True]
    assert special.corpus.document(0).tolist() == [1, *plain.corpus.document(0).tolist()]


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_special_tokens_with_token_ids_is_an_error(with_tokenizer, tmp_path):
    tokenizer = builtin_tokenizer() if with_tokenizer else None
    with pytest.raises(ValueError, match="add_special_tokens=True applies to text corpora only"):
        BalancedTextDataModule([[5, 6], [7]], tokenizer=tokenizer, add_special_tokens=True, cache_dir=tmp_path)
    adapter = TokenizerAdapter.for_token_ids(vocab_size=10)
    with pytest.raises(ValueError, match="add_special_tokens=True applies to text corpora only"):
        cache_key(resolve_corpus([[5, 6], [7]]), resolve_tokenizer(adapter, add_special_tokens=True))
    dm = _dm([[5, 6], [7]], tmp_path, tokenizer=tokenizer)  # the default is fine
    assert dm.corpus.lengths.tolist() == [2, 1]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_add_special_tokens(bad, tmp_path):
    with pytest.raises(TypeError, match="add_special_tokens"):
        BalancedTextDataModule(_DOCS, add_special_tokens=bad, cache_dir=tmp_path)
    with pytest.raises(TypeError, match="add_special_tokens"):
        resolve_tokenizer(add_special_tokens=bad)


# ---------------------------------------------------------------- the defaults are what they were


def test_defaults_give_the_same_cache_as_before(tmp_path):
    """No specials, one document per non-blank line: the lengths and the cache key of before these options."""
    path = tmp_path / "wrapped.txt"
    path.write_text(_WRAPPED, encoding="utf-8")
    dm = _dm(path, tmp_path)
    lines = [line for line in _WRAPPED.split("\n") if line.strip()]
    expected = [len(builtin_tokenizer().encode(line, add_special_tokens=False).ids) for line in lines]
    assert dm.corpus.lengths.tolist() == expected
    # the key formula of before: nothing appended for the default settings
    data = path.read_bytes()
    content = sha256_of("files-content", "text", "text", str(len(data)), hashlib.sha256(data).hexdigest())
    tok = resolve_tokenizer()
    assert cache_key(dm.source, dm.tokenizer) == sha256_of("cache", "1", "files", content, tok.fingerprint)
    assert (tmp_path / "cache" / cache_key(dm.source, dm.tokenizer)).is_dir()


# ---------------------------------------------------------------- lit-balance fit reads the new options


def test_cli_reads_the_options(tmp_path, monkeypatch):
    from lit_balance.cli import LitBalanceCLI
    from lit_balance.demo import DemoTransformerLM

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-balance"])
    config = Path(__file__).resolve().parents[2] / "conf" / "cli" / "fit_cpu.yaml"
    args = ["--config", str(config), "--data.txt_documents=paragraph", "--data.add_special_tokens=true"]
    cli = LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule, args=args, run=False, seed_everything_default=0)
    assert cli.datamodule.txt_documents == "paragraph"
    assert cli.datamodule.add_special_tokens is True
    assert cli.datamodule.tokenizer.add_special_tokens is True
    with pytest.raises(SystemExit):  # the Literal is checked by the parser
        LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule, args=[*args[:2], "--data.txt_documents=lines"],
                      run=False, seed_everything_default=0)
