"""The ledger of an epoch (lit_balance.ledger): its rows are what every rank's sampler yields, in order; its header
names the settings; the Parquet file round-trips; a DataModule's ledger says where each document lives; LedgerCheck
stops a fit that trains on another document than the ledger's, naming the step and rank."""

import json
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance import BalancedBatchSampler, BalancedTextDataModule, Mixture
from lit_balance.callbacks import LedgerCheck, LedgerMismatchError
from lit_balance.demo import DemoTransformerLM
from lit_balance.ledger import (LEDGER_KEY, check_ledger_header, ledger_columns, ledger_header, read_ledger,
                                write_datamodule_ledger, write_ledger)
from lit_balance.plan.mixture import MixtureSettings
from lit_balance.sampler.mixture import MixtureBatchSampler

ROOT = Path(__file__).resolve().parents[1]


def _yielded(samplers):
    """Rows as the samplers yield them, in the ledger's order: micro-step, rank, row."""
    per_rank = [list(s) for s in samplers]
    out = []
    for step in range(len(per_rank[0])):
        for rank, batches in enumerate(per_rank):
            mb = batches[step]
            out += [(step, rank, row, int(i), bool(f)) for row, (i, f) in enumerate(zip(mb, mb.is_fill))]
    return out


def _rows(columns):
    keys = ("micro_step", "rank", "row", "sample", "fill")
    return list(zip(*(columns[k].tolist() for k in keys)))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=80), num_replicas=st.integers(1, 4),
       acc=st.integers(1, 3), packing=st.booleans(), epoch=st.integers(0, 3), seed=st.integers(0, 5))
def test_the_ledger_holds_exactly_what_each_rank_yields_step_by_step(lengths, num_replicas, acc, packing, epoch, seed):
    kwargs = dict(max_tokens=64, accumulate_grad_batches=acc, packing=packing, seed=seed)
    samplers = [BalancedBatchSampler(lengths, num_replicas=num_replicas, rank=r, **kwargs) for r in range(num_replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    columns, dictionaries = ledger_columns(samplers[0])
    assert _rows(columns) == _yielded(samplers)
    # steps of the run: the epochs before count theirs (equal ranks: every epoch has as many micro-steps)
    first = samplers[0].first_optimizer_step
    assert first == epoch * -(-len(samplers[0]) // acc)
    assert (columns["optimizer_step"] == first + columns["micro_step"] // acc).all()
    assert (columns["micro_batch"] == columns["micro_step"] % acc).all()
    assert (columns["epoch"] == epoch).all()
    assert columns["tokens"].tolist() == [lengths[i] for i in columns["sample"].tolist()]
    fill = columns["fill"]
    assert (columns["supervised_tokens"][~fill] == columns["tokens"][~fill] - 1).all()
    assert (columns["supervised_tokens"][fill] == 0).all()
    assert (columns["repeated"] == fill).all()  # one corpus: a fill row is the only repeat
    assert dictionaries == {"component": ("train",)} and (columns["component"] == 0).all()
    assert (columns["document"] == columns["sample"]).all()


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("max_repetition", [1, 2])
def test_a_mixtures_ledger_names_each_component_document_and_its_copy(packing, max_repetition):
    rng = np.random.default_rng(3)
    sizes = [40, 25]
    lengths = rng.integers(1, 50, size=sum(sizes))
    mix = MixtureSettings(("web", "code"), (3, 1), max_repetition=max_repetition,
                          units_per_epoch=None if max_repetition == 1 else int(lengths.sum() * 1.5))
    samplers = [MixtureBatchSampler(lengths, sizes=sizes, mixture=mix, max_tokens=96, num_replicas=2, rank=r,
                                    accumulate_grad_batches=2, packing=packing, seed=1) for r in range(2)]
    columns, dictionaries = ledger_columns(samplers[0])
    assert _rows(columns) == _yielded(samplers)
    assert dictionaries["component"] == ("web", "code")
    sample = columns["sample"]
    n = sum(sizes)
    concatenated = np.where(columns["component"] == 0, 0, sizes[0]) + columns["document"]
    assert (concatenated == sample % n).all()
    assert (columns["copy"] == sample // n).all()
    assert (columns["tokens"] == lengths[sample % n]).all()
    if max_repetition == 2:
        assert columns["copy"].max() == 1 and columns["repeated"][columns["copy"] > 0].all()


def test_parquet_round_trip_keeps_columns_dictionaries_and_the_header(tmp_path):
    sampler = BalancedBatchSampler(list(range(1, 50)), max_tokens=64, num_replicas=3, rank=0, accumulate_grad_batches=2,
                                   seed=4)
    sampler.set_epoch(2)
    path = tmp_path / "ledger.parquet"
    header = write_ledger(path, sampler, first_optimizer_step=10)
    table, read = read_ledger(path)
    assert read == {k: v for k, v in header.items()}
    assert read["epoch"] == 2 and read["num_replicas"] == 3 and read["accumulate_grad_batches"] == 2
    assert read["micro_steps"] == len(sampler) and read["rows"] == table.num_rows
    assert read["settings"] == sampler.settings.to_dict() and read["lengths_sha256"] == sampler.lengths_sha256
    columns, _ = ledger_columns(sampler, first_optimizer_step=10)
    for name, values in columns.items():
        got = table.column(name)
        want = ["train"] * len(values) if name == "component" else values.tolist()
        assert got.to_pylist() == want, name
    assert table.column("optimizer_step").to_numpy().min() == 10
    rank1, _ = read_ledger(path, rank=1)
    assert set(rank1.column("rank").to_pylist()) == {1}
    assert rank1.num_rows == int((columns["rank"] == 1).sum())
    assert json.loads(pq.read_metadata(path).metadata[LEDGER_KEY])["version"] == 1


def test_a_parquet_file_without_the_header_is_refused_naming_the_file(tmp_path):
    import pyarrow as pa

    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), path)
    with pytest.raises(ValueError, match=r"other\.parquet is not a ledger"):
        read_ledger(path)


def test_a_header_of_other_settings_is_refused_naming_each_setting():
    a = BalancedBatchSampler(list(range(1, 40)), max_tokens=64, num_replicas=2, rank=0)
    b = BalancedBatchSampler(list(range(1, 40)), max_tokens=64, num_replicas=3, rank=0, accumulate_grad_batches=2)
    check_ledger_header(ledger_header(a), ledger_header(a))
    with pytest.raises(ValueError, match=r"num_replicas: ledger 2, run 3.*accumulate_grad_batches: ledger 1, run 2") \
            as error:
        check_ledger_header(ledger_header(a), ledger_header(b))
    assert error.value.parameter == "num_replicas"
    c = BalancedBatchSampler(list(range(1, 40)), max_tokens=64, num_replicas=2, rank=0, seed=9)
    with pytest.raises(ValueError, match=r"settings: ledger .*'seed': 0.*run .*'seed': 9"):
        check_ledger_header(ledger_header(a), ledger_header(c))


def _store_mixture(tmp_path):
    sys.path.insert(0, str(ROOT))
    from tests.data._stores import documents, write_arrow_ipc_file, write_megatron

    write_megatron(tmp_path / "mega" / "a", documents(30, seed=1, longest=30, empty_every=0))
    write_megatron(tmp_path / "mega" / "b", documents(20, seed=2, longest=30, empty_every=0))
    write_arrow_ipc_file(tmp_path / "docs.arrow", documents(40, seed=3, longest=30, empty_every=7), batch_rows=9)
    from lit_balance.data.stores import ArrowSource, MegatronSource

    return Mixture({"mega": {"corpus": MegatronSource([str(tmp_path / "mega" / "a"), str(tmp_path / "mega" / "b")]),
                             "weight": 1},
                    "arrow": {"corpus": ArrowSource(tmp_path / "docs.arrow"), "weight": 1}})


def test_a_datamodules_ledger_says_where_each_document_lives_in_its_store(tmp_path):
    mixture = _store_mixture(tmp_path)
    dm = BalancedTextDataModule(mixture, max_tokens=96, max_length=20, val_fraction=0.2, seed=5, vocab_size=500, pad_token_id=0,
                                cache_dir=tmp_path / "cache")
    dm.prepare_data()
    dm.setup("fit")
    path = tmp_path / "ledger.parquet"
    header = write_datamodule_ledger(path, dm, num_replicas=2, accumulate_grad_batches=2)
    table, _ = read_ledger(path)
    assert header["data"]["seed"] == 5 and header["mixture"]["names"] == ["mega", "arrow"]
    files = table.column("store_file").to_pylist()
    rows = zip(table.column("component").to_pylist(), table.column("document").to_pylist(),
               table.column("store_document").to_pylist(), files, table.column("file_document").to_pylist(),
               table.column("tokens").to_pylist(), table.column("document_tokens").to_pylist(),
               table.column("truncated").to_pylist(), table.column("fill").to_pylist())
    seen = 0
    for component, document, store_document, file, file_document, tokens, full, truncated, fill in rows:
        c = dm.mixture.names.index(component)
        split = dm._train_splits[c]
        store = split.store
        assert store_document == split.store_document(document)
        # the store's own words for the document name the same file and number
        assert store.where(store_document).endswith(f"{file_document} of {file}")
        ids, _ = store.read(store_document, tokens)
        assert np.array_equal(ids, dm.train_dataset.datasets[c][document]["input_ids"])
        assert truncated == (full > 20) and tokens == min(full, 20)
        seen += not fill
    assert seen == len(set(zip(table.column("component").to_pylist(),
                               table.column("document").to_pylist())))
    assert {Path(f).name for f in set(files)} == {"a.bin", "b.bin", "docs.arrow"}


class _SwappingDataModule(BalancedTextDataModule):
    """Its training dataset hands one planned sample's item in place of another (a loader bug)."""

    swap: tuple[int, int] | None = None

    def setup(self, stage=None):
        super().setup(stage)
        if self.swap is not None:
            dataset, (planned, delivered) = self.train_dataset, self.swap
            item = dataset._item
            dataset._item = lambda i, is_fill=False: item(delivered if i == planned else i, is_fill)


class _Steps(L.Callback):
    def __init__(self):
        self.micro_steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.micro_steps.append(batch_idx)


def _fit(tmp_path, dm, callbacks, acc=2):
    L.seed_everything(0, verbose=False)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, accumulate_grad_batches=acc, callbacks=callbacks,
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    return trainer


@pytest.mark.parametrize(("packing", "every_n_steps"), [(False, 1), (True, 1), (True, 3)])
def test_ledger_check_passes_a_fit_of_the_plan_and_stops_one_with_a_swapped_document(tmp_path, packing,
                                                                                     every_n_steps):
    texts = [" ".join(["word"] * (1 + (i * 7) % 23)) for i in range(60)]
    kwargs = dict(max_tokens=64, val_fraction=0.1, packing=packing, cache_dir=tmp_path / "cache", seed=2)
    dm = _SwappingDataModule(texts, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    path = tmp_path / "ledger.parquet"
    write_datamodule_ledger(path, dm, num_replicas=1, accumulate_grad_batches=2)
    table, _ = read_ledger(path)
    trainer = _fit(tmp_path, _SwappingDataModule(texts, **kwargs), [LedgerCheck(path)])
    assert trainer.global_step == table.column("optimizer_step").to_numpy().max() + 1
    # plant: the first row of micro-step 3 (optimizer step 1, its second micro-batch) reads another document
    micro, sample = table.column("micro_step").to_numpy(), table.column("sample").to_numpy()
    planned = int(sample[micro == 3][0])
    swapped = _SwappingDataModule(texts, **kwargs)
    swapped.swap = (planned, int(sample[micro == 0][0]))
    recorder = _Steps()
    with pytest.raises(LedgerMismatchError, match=rf"optimizer step 1 \(epoch 0, micro-step 3, micro-batch 1 of the "
                                                  rf"step\), rank 0, row 0: the rank received sample "
                                                  rf"{swapped.swap[1]} where the ledger has sample {planned}"):
        _fit(tmp_path, swapped, [recorder, LedgerCheck(path, every_n_steps=every_n_steps)])
    # stopped at the first gather after the difference: the end of optimizer step every_n_steps - 1 (at least 1)
    assert recorder.micro_steps == list(range(2 * max(every_n_steps, 2)))


def test_ledger_check_refuses_a_ledger_of_other_settings(tmp_path):
    texts = [" ".join(["word"] * (1 + (i * 7) % 23)) for i in range(40)]
    dm = BalancedTextDataModule(texts, max_tokens=64, val_fraction=0.1, cache_dir=tmp_path / "cache")
    dm.prepare_data()
    dm.setup("fit")
    path = tmp_path / "ledger.parquet"
    write_datamodule_ledger(path, dm, num_replicas=1, accumulate_grad_batches=1)
    dm2 = BalancedTextDataModule(texts, max_tokens=64, val_fraction=0.1, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"accumulate_grad_batches: ledger 1, run 2"):
        _fit(tmp_path, dm2, [LedgerCheck(path)], acc=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_ledger_check_rejects_a_bad_interval(bad):
    with pytest.raises(ValueError, match="every_n_steps"):
        LedgerCheck("x.parquet", every_n_steps=bad)
