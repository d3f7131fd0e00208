"""A tokenized store knows the tokenizer that wrote it: a run with another tokenizer of the same vocabulary size and
pad id is refused naming both (one corpus and a mixture component), ``allow_tokenizer_mismatch=True`` trains, a store
that says nothing is said once; every store kind's way of saying it (datatrove's metadata, ``lit-balance tokenize``'s
sidecar, a Megatron sidecar, Arrow / Parquet schema metadata)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, Mixture
from lit_balance.data.sources import stdlib_docstrings
from lit_balance.data.stores import ArrowSource, DatatroveSource, MegatronSource
from lit_balance.data.tokenizer import resolve_tokenizer
from lit_balance.data.tokenizer_identity import (SCHEMA_NAME_KEY, SCHEMA_SHA256_KEY, SIDECAR_SUFFIX,
                                                 identity_of_adapter, identity_of_file, write_sidecar)
from lit_balance.demo import DemoTransformerLM
from tests.data._stores import documents, write_megatron
from tests.data.test_store_datatrove import PACKAGE_TOKENIZER, _datatrove, _plain_tokenizer, _write_jsonl

datatrove = pytest.importorskip("datatrove")
VOCAB = 30522


def _swapped_tokenizer(path: Path) -> Path:
    """The package's tokenizer with the ids of two frequent words exchanged: same vocabulary size, same pad id,
    other ids for the same text."""
    data = json.loads(PACKAGE_TOKENIZER.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab["the"], vocab["of"] = vocab["of"], vocab["the"]
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    """Two datatrove stores of the same documents: one written with the package's tokenizer, one with the swapped
    one; and the two tokenizer files."""
    root = tmp_path_factory.mktemp("tokenizer_identity")
    docs = [d for d in sorted(stdlib_docstrings(), key=len) if " the " in d][200:260]
    _write_jsonl(root / "input" / "part-00000.jsonl", [{"text": t} for t in docs])
    plain = _plain_tokenizer(root / "plain.json")
    swapped = _swapped_tokenizer(root / "swapped.json")
    return {"plain": plain, "swapped": swapped,
            "store_plain": _datatrove(root / "input", root / "store_plain", plain, tasks=1),
            "store_swapped": _datatrove(root / "input", root / "store_swapped", swapped, tasks=1)}


def test_the_swapped_tokenizer_has_the_same_vocabulary_size_and_pad_id_but_another_identity(stores):
    plain, swapped = resolve_tokenizer(stores["plain"]), resolve_tokenizer(stores["swapped"])
    assert (plain.vocab_size, plain.pad_token_id) == (swapped.vocab_size, swapped.pad_token_id) == (VOCAB, 0)
    assert identity_of_adapter(plain).sha256 != identity_of_adapter(swapped).sha256
    # padding, truncation and the post-processor do not change the identity: the package's file is the plain one's
    assert identity_of_file(PACKAGE_TOKENIZER).sha256 == identity_of_file(stores["plain"]).sha256
    assert identity_of_adapter(resolve_tokenizer(None)).sha256 == identity_of_file(stores["plain"]).sha256


def _dm(corpus, tmp_path, **kwargs):
    return BalancedTextDataModule(corpus, max_tokens=512, max_length=64, val_fraction=0, seed=1,
                                  cache_dir=tmp_path / "cache", **kwargs)


def test_a_store_written_with_another_tokenizer_is_refused_naming_both(stores, tmp_path):
    source = DatatroveSource(stores["store_swapped"])
    with pytest.raises(ValueError) as info:
        _dm(source, tmp_path, tokenizer=str(PACKAGE_TOKENIZER))
    message = str(info.value)
    for word in (str(stores["swapped"]), str(PACKAGE_TOKENIZER), "allow_tokenizer_mismatch=True", "datatrove store"):
        assert word in message, message
    assert getattr(info.value, "parameter", None) == "allow_tokenizer_mismatch"
    _dm(DatatroveSource(stores["store_plain"]), tmp_path, tokenizer=str(PACKAGE_TOKENIZER))  # the same: accepted
    _dm(DatatroveSource(stores["store_swapped"]), tmp_path, tokenizer=str(stores["swapped"]))


def test_a_mixture_component_written_with_another_tokenizer_is_refused(stores, tmp_path):
    mixture = Mixture({"good": (DatatroveSource(stores["store_plain"]), 0.5),
                       "bad": (DatatroveSource(stores["store_swapped"]), 0.5)})
    with pytest.raises(ValueError, match=r"written with the tokenizer .*swapped\.json.* but the run tokenizes with "
                                         r".*tokenizer\.json.*allow_tokenizer_mismatch=True"):
        _dm(mixture, tmp_path, tokenizer=str(PACKAGE_TOKENIZER))


@pytest.mark.parametrize("as_mixture", [False, True], ids=["one corpus", "mixture"])
def test_allow_tokenizer_mismatch_trains_and_says_so(stores, tmp_path, as_mixture):
    source = DatatroveSource(stores["store_swapped"])
    corpus = Mixture({"good": (DatatroveSource(stores["store_plain"]), 0.5), "bad": (source, 0.5)}) if as_mixture \
        else source
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = _dm(corpus, tmp_path, tokenizer=str(PACKAGE_TOKENIZER), allow_tokenizer_mismatch=True)
    said = [str(w.message) for w in caught if "allow_tokenizer_mismatch=True" in str(w.message)]
    assert len(said) == 1 and "swapped.json" in said[0], said
    model = DemoTransformerLM(VOCAB, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2


def test_allow_tokenizer_mismatch_must_be_a_bool(stores, tmp_path):
    with pytest.raises(TypeError, match="allow_tokenizer_mismatch"):
        _dm(DatatroveSource(stores["store_swapped"]), tmp_path, tokenizer=str(PACKAGE_TOKENIZER),
            allow_tokenizer_mismatch="yes")


def test_the_sidecar_of_lit_balance_tokenize_survives_moving_the_folder(stores, tmp_path):
    """The metadata names the tokenizer by its absolute path; once the folder moved (and the file is gone) the
    sidecar ``tokenizer_identity.json`` still says it."""
    moved = tmp_path / "moved"
    shutil.copytree(stores["store_swapped"], moved)
    swapped_copy = tmp_path / "gone.json"
    shutil.copy(stores["swapped"], swapped_copy)
    write_sidecar(moved / "tokenizer_identity.json", swapped_copy)
    swapped_copy.unlink()
    for metadata in moved.glob("*.ds.metadata"):  # name a file that no longer exists
        lines = metadata.read_text().splitlines()
        metadata.write_text("\n".join([f"{swapped_copy}|{lines[0].rpartition('|')[2]}", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"gone\.json"):
        _dm(DatatroveSource(moved), tmp_path, tokenizer=str(PACKAGE_TOKENIZER))


def test_a_store_that_names_no_local_tokenizer_is_said_once_per_datamodule(stores, tmp_path):
    named = tmp_path / "named"
    shutil.copytree(stores["store_swapped"], named)
    for metadata in named.glob("*.ds.metadata"):
        lines = metadata.read_text().splitlines()
        metadata.write_text("\n".join([f"some-org/some-model|{lines[0].rpartition('|')[2]}", *lines[1:]]) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _dm(DatatroveSource(named), tmp_path, tokenizer=str(PACKAGE_TOKENIZER))
    said = [str(w.message) for w in caught if "some-org/some-model" in str(w.message)]
    assert len(said) == 1 and "not on this machine" in said[0], said


def test_a_megatron_store_with_a_sidecar_is_checked_and_one_without_is_said_once_per_datamodule(stores, tmp_path):
    docs = documents(num=40, seed=1, longest=30, empty_every=0)
    prefix = write_megatron(tmp_path / "m" / "corpus", docs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _dm(MegatronSource(prefix), tmp_path, tokenizer=str(PACKAGE_TOKENIZER))
    said = [str(w.message) for w in caught if "does not say which tokenizer wrote it" in str(w.message)]
    assert len(said) == 1 and SIDECAR_SUFFIX in said[0], said
    write_sidecar(str(prefix) + SIDECAR_SUFFIX, stores["swapped"])
    with pytest.raises(ValueError, match=r"Megatron store.*swapped\.json.*allow_tokenizer_mismatch"):
        _dm(MegatronSource(prefix), tmp_path, tokenizer=str(PACKAGE_TOKENIZER))
    _dm(MegatronSource(prefix), tmp_path, tokenizer=str(stores["swapped"]))
    (Path(str(prefix) + SIDECAR_SUFFIX)).write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_identity\.json: expected a tokenizer identity sidecar"):
        _dm(MegatronSource(prefix), tmp_path, tokenizer=str(PACKAGE_TOKENIZER))


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_arrow_and_parquet_schema_metadata_name_the_tokenizer(stores, tmp_path, suffix):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet  # noqa: F401

    swapped = identity_of_file(stores["swapped"])
    table = pa.table({"input_ids": pa.array(documents(num=30, seed=2, longest=20, empty_every=0),
                                            pa.list_(pa.int32()))})
    table = table.replace_schema_metadata({SCHEMA_NAME_KEY: "swapped.json", SCHEMA_SHA256_KEY: swapped.sha256})
    path = tmp_path / f"ids{suffix}"
    if suffix == ".parquet":
        pa.parquet.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    source = ArrowSource(path, cache_dir=tmp_path / "copies")
    with pytest.raises(ValueError, match=r"Arrow store.*swapped\.json.*allow_tokenizer_mismatch"):
        _dm(source, tmp_path, tokenizer=str(PACKAGE_TOKENIZER))
    assert np.array_equal(
        _dm(ArrowSource(path, cache_dir=tmp_path / "copies"), tmp_path, tokenizer=str(stores["swapped"])).vocab_size,
        VOCAB)


def test_lightning_cli_takes_data_allow_tokenizer_mismatch(stores, tmp_path, monkeypatch, capsys):
    from lit_balance.cli.app import LitBalanceCLI

    monkeypatch.chdir(tmp_path)
    corpus = json.dumps({"class_path": "lit_balance.data.stores.DatatroveSource",
                         "init_args": {"paths": str(stores["store_swapped"])}})
    args = ["--data.corpus", corpus, "--data.tokenizer", str(PACKAGE_TOKENIZER), "--data.val_fraction", "0",
            "--data.cache_dir", str(tmp_path / "cache"), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.logger", "false"]
    with pytest.raises((ValueError, SystemExit)) as info:
        LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule, run=False, seed_everything_default=0, args=args)
    said = str(info.value) + capsys.readouterr().err
    assert "swapped.json" in said and "--data.allow_tokenizer_mismatch" in said, said
    cli = LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule, run=False, seed_everything_default=0,
                        args=[*args, "--data.allow_tokenizer_mismatch", "true"])
    assert cli.datamodule.allow_tokenizer_mismatch is True and cli.datamodule.vocab_size == VOCAB


def test_files_of_one_store_written_with_two_tokenizers_are_refused_naming_both(stores):
    with pytest.raises(ValueError, match=r"written with different tokenizers: .*store_plain.*plain\.json.*"
                                         r"store_swapped.*swapped\.json"):
        DatatroveSource([stores["store_plain"], stores["store_swapped"]]).store
