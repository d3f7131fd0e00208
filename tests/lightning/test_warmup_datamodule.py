"""BalancedTextDataModule(max_length_schedule=...): the length warm-up through the DataModule's own sampler, loader,
state and fingerprint; the settings it cannot be crossed with are refused naming both."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, Mixture, PieceDataset, Schedule
from lit_balance.data.collate import IGNORE_INDEX

SCHEDULE = [[0, 32], [6, 96], [12, 256]]


def _docs(n=160, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, size=int(k)).tolist() for k in rng.integers(1, 600, n)]


def _dm(tmp_path, docs=None, **kwargs):
    kwargs = {"max_tokens": 256, "max_length": None, "val_fraction": 0, "vocab_size": 500,
              "max_length_schedule": SCHEDULE, **kwargs}
    return BalancedTextDataModule(_docs() if docs is None else docs, cache_dir=tmp_path / "cache", **kwargs)


def _limit(schedule: Schedule, step: int) -> int:
    return int(schedule.value_at(step))


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("acc, num_replicas", [(1, 3), (2, 2)])
def test_plans_and_collated_batches_lose_no_token_and_keep_each_step_within_its_length(tmp_path, packing, acc,
                                                                                      num_replicas):
    dm = _dm(tmp_path, packing=packing)
    dm.setup("fit")
    settings = dm.settings.replace(accumulate_grad_batches=acc)
    samplers = [dm.training_sampler(settings, num_replicas, rank=r) for r in range(num_replicas)]
    assert len({len(s) for s in samplers}) == 1  # equal counts
    pieces = PieceDataset(dm.train_dataset)
    lengths = dm.train_dataset.lengths
    covered = np.zeros((lengths.size, int(lengths.max())), dtype=np.int64)
    trained = 0
    for sampler in samplers:
        for i, mb in enumerate(sampler):
            batch = dm.collator(pieces[mb])
            limit = _limit(dm.max_length_schedule, i // acc)
            assert int(batch["num_padded_tokens"]) <= 256  # the budget, per rank
            for doc, start, n, fill in zip(mb, mb.piece_start, mb.piece_length, mb.is_fill):
                assert n <= limit  # every piece within its optimizer step's max_length
                if not fill:
                    covered[doc, start:start + n] += 1
                    want = dm.train_dataset[int(doc)]["input_ids"][start:start + n]
                    assert any(np.array_equal(item["input_ids"], want) for item in pieces[mb])
            if packing:
                cu = batch["cu_seq_lens_q"]
                assert int(cu.diff().max()) <= limit
                for a in cu[:-1].tolist():
                    assert int(batch["position_ids"][0, a]) == 0 and int(batch["labels"][0, a]) == IGNORE_INDEX
            else:
                assert int(batch["attention_mask"].sum(1).max()) <= limit
            trained += int(batch["num_real_tokens"])
    assert trained == int(lengths.sum())  # 0 tokens lost
    for d, n in enumerate(lengths.tolist()):
        assert (covered[d, :n] == 1).all() and (covered[d, n:] == 0).all()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_training_loader_reads_pieces_and_the_state_saves_the_schedule(tmp_path, num_workers):
    dm = _dm(tmp_path, num_workers=num_workers)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == len(dm.train_sampler)
    assert sum(int(b["num_real_tokens"]) for b in batches) == int(dm.train_dataset.lengths.sum())
    assert int(batches[0]["attention_mask"].sum(1).max()) <= 32  # step 0: pieces of at most 32 tokens
    state = dm.train_sampler.state_dict(3)
    assert Schedule.from_dict(state["max_length_schedule"]).points_as_given() == [(0, 32), (6, 96), (12, 256)]
    assert state["first_optimizer_step"] == 0


def test_the_fingerprint_names_the_schedule_only_when_set(tmp_path):
    plain = _dm(tmp_path, max_length_schedule=None, max_tokens=1024)
    warm = _dm(tmp_path, max_tokens=1024)
    plain.setup("fit")
    warm.setup("fit")
    fields = dict((name, value) for name, value, _ in warm._fingerprint())
    plain_fields = dict((name, value) for name, value, _ in plain._fingerprint())
    assert fields.keys() == plain_fields.keys()
    assert [k for k in fields if fields[k] != plain_fields[k]] == ["batching settings"]


@pytest.mark.parametrize("kwargs, match", [
    ({"max_length": 128}, r"max_length=128.*max_length=None.*max_length_schedule"),
    ({"static_packing": True, "packing": True}, r"static_packing=True.*max_length_schedule"),
    ({"padded_shapes": 3}, r"padded_shapes=3.*max_length_schedule"),
    ({"drop_last": True}, r"drop_last=True.*max_length_schedule"),
    ({"too_long": "truncate"}, r"too_long='truncate'.*max_length_schedule"),
    ({"max_length_schedule": {"points": [[0, 64]], "unit": "tokens"}}, r"max_length_schedule.*unit='steps'"),
    ({"max_length_schedule": [[5, 64], [2, 128]]}, r"max_length_schedule"),
])
def test_settings_that_cannot_be_crossed_with_a_warm_up_are_refused_before_any_token_is_read(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _dm(tmp_path, **kwargs)
    assert not (tmp_path / "cache").exists()  # refused before the corpus is tokenized


def test_a_mixture_is_refused_naming_both(tmp_path):
    docs = _docs(40)
    mixture = Mixture({"a": {"corpus": docs[:20], "weight": 0.5}, "b": {"corpus": docs[20:], "weight": 0.5}})
    with pytest.raises(ValueError, match=r"max_length_schedule.*mixture of components \['a', 'b'\]"):
        _dm(tmp_path, docs=mixture)


def test_a_schedule_above_the_budget_is_refused_naming_it(tmp_path):
    dm = _dm(tmp_path, max_length_schedule=[[0, 64], [4, 512]])
    with pytest.raises(ValueError, match=r"max_length_schedule \(at optimizer step 4\).*512.*max_tokens=256"):
        dm.setup("fit")


class _Pieces(L.Callback):
    """Each epoch's real rows as ``(document, first token id, length, optimizer step of the run)``."""

    def __init__(self) -> None:
        self.epochs: dict[int, list] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows = self.epochs.setdefault(trainer.current_epoch, [])
        for i, (doc, fill) in enumerate(zip(batch["indices"].tolist(), batch["is_fill"].tolist())):
            if not fill:
                rows.append((doc, int(batch["input_ids"][i, 0]) - 1, int(batch["attention_mask"][i].sum()),
                             trainer.global_step - 1))  # the step this micro-batch was just trained in


def _trainer(tmp_path, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **kwargs)


def test_a_fit_of_two_epochs_trains_every_token_once_per_epoch_each_epoch_cut_at_its_own_steps(tmp_path):
    from lit_balance.demo import DemoTransformerLM

    docs = [np.arange(1, n + 1).tolist() for n in np.random.default_rng(4).integers(1, 300, 40).tolist()]
    dm = _dm(tmp_path, docs=docs, vocab_size=301, max_length_schedule=[[0, 16], [12, 64], [24, 256]])
    model = DemoTransformerLM(vocab_size=301, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    record = _Pieces()
    trainer = _trainer(tmp_path, max_epochs=2, reload_dataloaders_every_n_epochs=1, callbacks=[record])
    trainer.fit(model, datamodule=dm)
    lengths = dm.train_dataset.lengths
    for epoch in (0, 1):
        covered = np.zeros((lengths.size, int(lengths.max())), dtype=np.int64)
        for doc, start, n, step in record.epochs[epoch]:
            covered[doc, start:start + n] += 1
            assert n <= int(dm.max_length_schedule.value_at(step)), (epoch, step, n)
        for d, n in enumerate(lengths.tolist()):
            assert (covered[d, :n] == 1).all() and (covered[d, n:] == 0).all(), (epoch, d)
    steps = [[step for *_, step in record.epochs[e]] for e in (0, 1)]
    assert steps[1][0] == steps[0][-1] + 1  # the schedule goes on across the epochs
    assert max(n for _, _, n, _ in record.epochs[1]) > 64  # past step 24: longer pieces


def test_a_run_of_several_epochs_without_reloading_the_loader_is_refused_naming_both(tmp_path):
    dm = _dm(tmp_path)
    dm.trainer = _trainer(tmp_path, max_epochs=3)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"max_length_schedule.*reload_dataloaders_every_n_epochs=0.*max_epochs=3"):
        dm.train_dataloader()


def test_the_plan_summary_plans_the_pieces_and_names_the_schedule(tmp_path):
    dm = _dm(tmp_path)
    summary = dm.plan_summary(num_replicas=2)
    assert summary["max_length_schedule"]["points"] == [[0, 32], [6, 96], [12, 256]]
    sampler = dm.training_sampler(dm.settings, 2) if dm.train_dataset is not None else None
    assert sampler is None  # plan_summary changes nothing on the DataModule
    dm.setup("fit")
    pieces = dm.training_sampler(dm.settings, 2).plan_pieces()[0].size
    assert summary["num_samples"] == pieces > len(dm.train_dataset)
