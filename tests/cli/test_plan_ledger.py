"""``lit-balance plan --ledger PATH``: the epoch's ledger of the plan the command reports, from a lengths file and from
a mixture corpus (with where each document lives)."""

import json
import sys

import numpy as np
import pytest

from lit_balance import BalancedBatchSampler, BalancedTextDataModule, Mixture
from lit_balance.cli import main
from lit_balance.ledger import ledger_columns, read_ledger


@pytest.fixture(autouse=True)
def _program_name_only(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-balance"])


def test_plan_ledger_of_a_lengths_file_is_the_samplers_plan(tmp_path, capsys):
    lengths = np.random.default_rng(0).integers(1, 300, size=500)
    np.save(tmp_path / "l.npy", lengths)
    path = tmp_path / "out" / "ledger.parquet"
    assert main(["plan", "--lengths", str(tmp_path / "l.npy"), "--num-replicas", "3", "--max-tokens", "512",
                 "--accumulate-grad-batches", "2", "--epoch", "1", "--plots", "false", "--output-dir",
                 str(tmp_path / "o"), "--ledger", str(path)]) is None
    table, header = read_ledger(path)
    summary = json.loads((tmp_path / "o" / "plan_summary.json").read_text())
    assert header["optimizer_steps"] == summary["balanced"]["optimizer_steps"]
    assert header["epoch"] == 1 and header["num_replicas"] == 3 and header["accumulate_grad_batches"] == 2
    sampler = BalancedBatchSampler(np.minimum(lengths, 512), max_tokens=512, num_replicas=3, rank=0,
                                   accumulate_grad_batches=2)
    sampler.set_epoch(1)
    columns, _ = ledger_columns(sampler)
    assert table.column("sample").to_pylist() == columns["sample"].tolist()
    assert table.column("rank").to_pylist() == columns["rank"].tolist()
    assert f"ledger: {table.num_rows} rows" in capsys.readouterr().out


def test_plan_ledger_of_a_mixture_names_components_and_documents(tmp_path):
    words = "the cat sat on a mat while dogs ran far away".split()
    for name, n in (("web", 70), ("code", 40)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"text": " ".join(words[(i + j) % 11] for j in range(2 + (i * 5) % 30))}) + "\n"
            for i in range(n)))
    components = {"web": {"corpus": str(tmp_path / "web.jsonl"), "weight": 0.6},
                  "code": {"corpus": str(tmp_path / "code.jsonl"), "weight": 0.4}}
    path = tmp_path / "ledger.parquet"
    assert main(["plan", "--corpus", json.dumps({"components": components}), "--cache-dir", str(tmp_path / "cache"),
                 "--max-tokens", "128", "--max-length", "24", "--num-replicas", "2", "--plots", "false",
                 "--output-dir", str(tmp_path / "o"), "--ledger", str(path)]) is None
    table, header = read_ledger(path)
    assert header["mixture"]["names"] == ["web", "code"] and header["data"] is not None
    dm = BalancedTextDataModule(Mixture(components), max_tokens=128, max_length=24, val_fraction=0.05,
                                cache_dir=tmp_path / "cache")
    dm.prepare_data()
    dm.setup("fit")
    names = table.column("component").to_pylist()
    documents = table.column("document").to_pylist()
    corpus_documents = table.column("corpus_document").to_pylist()
    assert set(names) == {"web", "code"}
    for name, document, corpus_document in zip(names, documents, corpus_documents):
        split = dm._train_splits[dm.mixture.names.index(name)]
        assert int(split.doc_ids[document]) == corpus_document
    truncated = np.array(table.column("truncated").to_pylist())
    tokens = np.array(table.column("tokens").to_pylist())
    assert truncated.any() and (tokens[truncated] == 24).all()
