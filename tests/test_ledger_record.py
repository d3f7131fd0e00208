"""LedgerCheck(record=DIR) and ``lit-balance ledger check``: the record of what each rank received equals the ledger
of the plan for a fit of it (one corpus and a mixture, padded and packed), and a fit whose loader swapped a document is
named by step, rank and document, with exit status 1; a ledger of other settings is refused naming the setting."""

import lightning as L
import numpy as np
import pytest

from lit_balance import BalancedTextDataModule
from lit_balance.callbacks import LedgerCheck
from lit_balance.cli.app import build_cli
from lit_balance.demo import DemoTransformerLM
from lit_balance.ledger import read_ledger, write_datamodule_ledger
from lit_balance.lightning.ledger_record import check_record, micro_batch_hash, read_record

TEXTS = [" ".join(["word"] * (1 + (i * 7) % 23)) for i in range(60)]


class _SwappingDataModule(BalancedTextDataModule):
    """Its training dataset hands one planned sample's item in place of another (a loader bug)."""

    swap = None

    def setup(self, stage=None):
        super().setup(stage)
        if self.swap is not None:
            dataset, (planned, delivered) = self.train_dataset, self.swap
            item = dataset._item
            dataset._item = lambda i, is_fill=False: item(delivered if i == planned else i, is_fill)


def _fit(tmp_path, dm, callbacks, acc=2, max_epochs=1, max_steps=-1):
    L.seed_everything(0, verbose=False)
    model = DemoTransformerLM(vocab_size=dm.vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, accumulate_grad_batches=acc,
                        callbacks=callbacks, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    return trainer


def _dm(tmp_path, packing, mixture, cls=BalancedTextDataModule):
    corpus = TEXTS if not mixture else {"components": {"a": {"corpus": TEXTS[:35], "weight": 3.0},
                                                       "b": {"corpus": TEXTS[35:], "weight": 1.0}}}
    return cls(corpus, max_tokens=64, val_fraction=0.1, packing=packing, cache_dir=tmp_path / "cache", seed=2)


def test_the_hash_of_a_micro_batch_depends_on_its_indices_their_order_and_fill_flags():
    base = micro_batch_hash(np.array([3, 5]), np.array([False, False]))
    assert base == micro_batch_hash(np.array([3, 5], dtype=np.int32), np.array([0, 0]))
    others = {micro_batch_hash(np.array([5, 3]), np.array([False, False])),
              micro_batch_hash(np.array([3, 5]), np.array([False, True])),
              micro_batch_hash(np.array([3]), np.array([False])), base}
    assert len(others) == 4


@pytest.mark.parametrize(("packing", "mixture"), [(False, False), (True, False), (False, True), (True, True)])
def test_the_record_of_a_fit_equals_its_ledger_and_a_swapped_document_is_named(tmp_path, packing, mixture, capsys):
    dm = _dm(tmp_path, packing, mixture)
    dm.prepare_data()
    dm.setup("fit")
    ledger = tmp_path / "ledger.parquet"
    write_datamodule_ledger(ledger, dm, num_replicas=1, accumulate_grad_batches=2)
    record = tmp_path / "received"
    trainer = _fit(tmp_path, _dm(tmp_path, packing, mixture), [LedgerCheck(record=record)])
    table, header = read_ledger(ledger)
    received, rheader = read_record(next(record.glob("*.parquet")))
    assert rheader["complete"] and trainer.global_step == header["optimizer_steps"]
    assert received.column("micro_step").to_pylist() == sorted(set(table.column("micro_step").to_pylist()))
    flat = [i for mb in received.column("sample").to_pylist() for i in mb]
    assert flat == table.column("sample").to_pylist()
    assert check_record([record], ledger).ok
    run = build_cli(["ledger", "check", str(record), "--ledger", str(ledger)])
    assert run.ledger_check.ok and "received exactly what the ledger" in capsys.readouterr().out

    # plant: the first row of micro-step 3 (optimizer step 1, its second micro-batch) reads another document
    micro, sample = table.column("micro_step").to_numpy(), table.column("sample").to_numpy()
    row = int(np.flatnonzero(micro == 3)[0])
    planned, delivered = int(sample[row]), int(sample[micro == 0][0])
    component, document = table.column("component")[row].as_py(), table.column("document")[row].as_py()
    swapped = _dm(tmp_path, packing, mixture, _SwappingDataModule)
    swapped.swap = (planned, delivered)
    bad = tmp_path / "bad"
    _fit(tmp_path, swapped, [LedgerCheck(record=bad)])  # recording alone never stops the run
    result = check_record([bad], ledger)
    assert not result.ok
    first = result.mismatches[0]
    assert (first.optimizer_step, first.micro_step, first.rank, first.row) == (1, 3, 0, 0)
    assert (first.expected, first.received, first.document) == (planned, delivered, (component, document))
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["ledger", "check", str(bad), "--ledger", str(ledger)])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert (f"optimizer step 1 (epoch 0, micro-step 3, micro-batch 1 of the step), rank 0, row 0: received sample "
            f"{delivered} where the ledger has sample {planned} (component {component!r}, document {document})") in out


def test_a_pass_cut_short_is_compared_as_far_as_it_ran_and_a_complete_one_that_missed_steps_is_not(tmp_path):
    dm = _dm(tmp_path, False, False)
    dm.prepare_data()
    dm.setup("fit")
    ledger = tmp_path / "ledger.parquet"
    header = write_datamodule_ledger(ledger, dm, num_replicas=1, accumulate_grad_batches=2)
    record = tmp_path / "received"
    _fit(tmp_path, _dm(tmp_path, False, False), [LedgerCheck(record=record)], max_steps=2)
    path = next(record.glob("*.parquet"))
    table, rheader = read_record(path)
    assert not rheader["complete"] and table.num_rows == 4 and header["micro_steps"] > 4
    assert check_record([record], ledger).ok
    # the same rows, said to be a whole pass: the ledger's later micro-steps never ran
    import json

    import pyarrow.parquet as pq
    pq.write_table(table.replace_schema_metadata({b"lit_balance.ledger_record": json.dumps(
        {**rheader, "complete": True}).encode()}), path)
    result = check_record([record], ledger)
    assert [m.micro_step for m in result.mismatches] == list(range(4, header["micro_steps"]))
    assert "never ran this micro-step" in result.mismatches[0].message


def test_a_ledger_of_other_settings_is_refused_naming_the_setting(tmp_path, capsys):
    dm = _dm(tmp_path, False, False)
    dm.prepare_data()
    dm.setup("fit")
    ledger = tmp_path / "ledger.parquet"
    write_datamodule_ledger(ledger, dm, num_replicas=1, accumulate_grad_batches=1)
    record = tmp_path / "received"
    _fit(tmp_path, _dm(tmp_path, False, False), [LedgerCheck(record=record)], acc=2, max_steps=1)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches: ledger 1, run 2") as info:
        check_record([record], ledger)
    assert info.value.parameter == "accumulate_grad_batches"
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["ledger", "check", str(record), "--ledger", str(ledger)])
    assert exit_info.value.code == 2
    assert "accumulate_grad_batches: ledger 1, run 2" in capsys.readouterr().err


def test_bad_record_paths_and_a_callback_with_nothing_to_do_are_refused(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        LedgerCheck()
    dm = _dm(tmp_path, False, False)
    dm.prepare_data()
    dm.setup("fit")
    ledger = tmp_path / "ledger.parquet"
    write_datamodule_ledger(ledger, dm, num_replicas=1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_record([tmp_path / "nowhere"], ledger)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="found none"):
        check_record([tmp_path / "empty"], ledger)
    with pytest.raises(ValueError, match="is not a record"):
        check_record([ledger], ledger)
