"""A source of one's own: the worked example of the docs runs as written, trains through the DataModule on exactly its
documents, and a subclass that breaks the protocol is refused with a clear error."""

from __future__ import annotations

import ast
import contextlib
import csv
import io
import re
import runpy
from pathlib import Path

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule
from lit_balance._fingerprint import sha256_of
from lit_balance.data import CorpusSource, PromptCompletion, TokenIds, load_or_build, resolve_corpus
from lit_balance.data.cache import cache_key
from lit_balance.data.tokenizer import TokenizerAdapter, resolve_tokenizer

ROOT = Path(__file__).resolve().parents[2]
#: where the section "An input source" lives (the first page holding it is read)
PAGES = [ROOT / "docs" / "extending.md", ROOT / "docs" / "_extending_source.md"]
HEADING = "## An input source"


def _section() -> str:
    for page in PAGES:
        if page.exists() and HEADING in (text := page.read_text("utf-8")):
            section = text[text.index(HEADING) + len(HEADING):]
            return re.split(r"^## ", section, maxsplit=1, flags=re.MULTILINE)[0]
    raise AssertionError(f"no page of {[str(p.relative_to(ROOT)) for p in PAGES]} holds {HEADING!r}")


@pytest.fixture(scope="module")
def tok() -> TokenizerAdapter:
    return resolve_tokenizer()


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> tuple[dict, str]:
    """The section's one python block run as a script: its globals and what it printed."""
    blocks = re.findall(r"^```python\n(.*?)^```", _section(), flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"the section holds {len(blocks)} python blocks, expected one"
    script = tmp_path_factory.mktemp("example") / "custom_source.py"
    script.write_text(blocks[0], encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        namespace = runpy.run_path(str(script), run_name="__main__")
    return namespace, out.getvalue()


def test_the_documented_example_tokenizes_the_csv_column_into_the_cache(example, tok):
    namespace, printed = example
    summary, documents, token_ids = printed.splitlines()
    documents = ast.literal_eval(documents.removeprefix("documents: "))
    token_ids = ast.literal_eval(token_ids.removeprefix("token ids: "))
    # the rows of the 'review' column, one of them quoted by the csv module for its comma
    assert documents == ["great little lamp", "arrived broken, sent back", "works as described"]
    assert token_ids == tok.encode_batch(documents)
    assert summary == (f"column 'review' of reviews.csv: {len(documents)} documents, "
                       f"{sum(map(len, token_ids))} tokens")
    assert issubclass(namespace["CsvColumnSource"], CorpusSource)


def _csv(path: Path, texts: list[str]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "text"])
        writer.writerows(enumerate(texts))
    return path


def test_the_data_module_trains_on_exactly_the_documents_of_a_custom_source(example, tok, tmp_path):
    source_class = example[0]["CsvColumnSource"]
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "a, b", "naïve", "\"quoted\"", "x\ny"]
    texts = [" ".join(rng.choice(words, size=rng.integers(1, 12))) for _ in range(60)]
    texts[7] = texts[31] = ""  # documents empty after tokenization: dropped and counted
    source = source_class(_csv(tmp_path / "corpus.csv", texts), "text")
    assert resolve_corpus(source) is source
    dm = BalancedTextDataModule(corpus=source, max_tokens=256, max_length=None, val_fraction=0.25,
                                cache_dir=tmp_path / "cache")
    dm.prepare_data()
    dm.setup("fit")
    assert dm.source is source and dm.num_empty_documents == 2
    train, val = dm.train_dataset.doc_ids.tolist(), dm.val_dataset.doc_ids.tolist()
    assert val and not set(train) & set(val)
    assert sorted(train + val) == list(range(len(dm.corpus)))
    kept = [i for i, text in enumerate(texts) if text]
    assert dm.corpus.source_index.tolist() == kept
    expected = tok.encode_batch(texts)
    for dataset in (dm.train_dataset, dm.val_dataset):
        for i in range(len(dataset)):
            doc = int(dataset.doc_ids[i])
            assert dataset[i]["input_ids"].tolist() == expected[kept[doc]]
    seen = [i for batch in dm.train_dataloader() for i in batch["indices"].tolist()]
    assert sorted(seen) == list(range(len(dm.train_dataset)))
    # the key follows the file's content, as the class's identity() says
    key = cache_key(source, tok)
    _csv(tmp_path / "corpus.csv", texts[::-1])
    assert cache_key(source, tok) != key


class _NoRead(CorpusSource):
    def identity(self):
        return ["nothing"]


class _NoIdentity(CorpusSource):
    def read_records(self):
        return iter(["a"])


def test_a_subclass_without_the_read_method_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"_NoRead cannot be created: a CorpusSource subclass must define "
                                        r"read_records\(self\) yielding one record per document") as info:
        _NoRead()
    assert "identity" not in str(info.value)
    with pytest.raises(TypeError, match=r"_NoIdentity cannot be created: .* must define identity\(self\) returning"):
        _NoIdentity()


class _Records(CorpusSource):
    """Yields the records it is given (a token-id source when told so)."""

    def __init__(self, records, holds_token_ids=False, identity=("records",)):
        self.records, self._holds, self._identity = records, holds_token_ids, identity

    def read_records(self):
        return iter(self.records)

    def identity(self):
        return self._identity

    @property
    def holds_token_ids(self):
        return self._holds


def test_records_of_each_form_reach_the_chunks(tmp_path, tok):
    source = _Records(["plain text", PromptCompletion("ask", " reply"), "more"])
    chunks = list(source.iter_chunks())
    assert [(c.start, c.texts, c.pairs) for c in chunks] == [
        (0, ["plain text"], None), (1, None, [("ask", " reply")]), (2, ["more"], None)]
    corpus = load_or_build(source, tok, tmp_path)
    full, prompt = tok.encode_batch(["ask reply", "ask"])
    assert corpus.labels.tolist()[corpus.offsets[1]:corpus.offsets[2]] == [-100] * len(prompt) + full[len(prompt):]

    ids = _Records([np.array([3, 4, 5]), TokenIds([6, 7], labels=[-100, 7]), TokenIds(np.array([], np.int64))],
                   holds_token_ids=True)
    corpus = load_or_build(ids, TokenizerAdapter.for_token_ids(vocab_size=10), tmp_path)
    assert corpus.token_ids.tolist() == [3, 4, 5, 6, 7] and corpus.labels.tolist() == [3, 4, 5, -100, 7]
    assert corpus.num_empty == 1 and [a.tolist() for a in ids.load_token_ids()] == [[3, 4, 5], [6, 7], []]


@pytest.mark.parametrize(("records", "holds", "error", "pattern"), [
    (["a", ("p", "c")], False, TypeError, (r"read_records\(\), document 1 is a tuple .*wrap a \(prompt, "
                                           r"completion\) tuple in PromptCompletion")),
    (["a", PromptCompletion("p", 3)], False, TypeError, r"document 1: the PromptCompletion's completion is int 3"),
    (["a", np.array([1, 2])], False, TypeError, r"yielded token ids at document 1, but its holds_token_ids is False"),
    ([np.array([1]), "b"], True, TypeError, r"yielded a text at document 1, but its holds_token_ids is True"),
    ([TokenIds([1.5])], True, TypeError, r"document 0: TokenIds.ids must be a 1-D sequence of ints"),
    ([TokenIds([1, 2], labels=[1])], True, ValueError, r"document 0: 1 labels for 2 token ids"),
    ([], False, ValueError, r"corpus is empty: _Records.read_records\(\) yielded no document"),
])
def test_a_bad_record_is_refused_naming_the_document(records, holds, error, pattern):
    with pytest.raises(error, match=pattern):
        list(_Records(records, holds_token_ids=holds).iter_chunks())


def test_the_identity_keys_the_cache_with_the_kind(tok):
    source = _Records(["a"], identity=("one", b"two"))
    assert source.kind == f"{__name__}._Records"  # no kind declared: the class's own name
    assert source.fingerprint == sha256_of(source.kind, "one", b"two") == source.content_fingerprint()
    assert _Records(["a"], identity="one").fingerprint == sha256_of(source.kind, "one")
    assert cache_key(_Records(["b"], identity=("other",)), tok) != cache_key(source, tok)

    class Renamed(_Records):
        kind = "renamed"

    assert cache_key(Renamed(["a"], identity=("one", b"two")), tok) != cache_key(source, tok)
    with pytest.raises(TypeError, match=r"identity\(\) must return str or bytes parts, got int 3 at position 1"):
        _ = _Records(["a"], identity=("one", 3)).fingerprint
