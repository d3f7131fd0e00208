"""BalancedTextDataModule(packing=True): packed batches of whole documents, every document once, both splits."""

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, BatchingSettings, PackedCollator
from lit_balance.data.collate import IGNORE_INDEX


def corpus(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, size=int(k)).tolist() for k in rng.integers(1, 30, size=n)]


@pytest.mark.parametrize("how", ["keyword", "settings"])
def test_packed_batches_hold_every_training_document_once_within_the_budget(tmp_path, how):
    kwargs = ({"packing": True, "max_tokens": 64} if how == "keyword"
              else {"settings": BatchingSettings(max_tokens=64, packing=True)})
    dm = BalancedTextDataModule(corpus(), max_length=None, val_fraction=0.2, cache_dir=tmp_path, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.packing and isinstance(dm.collator, PackedCollator)
    lengths = dm.train_dataset.lengths
    seen = []
    for batch in dm.train_dataloader():
        assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
        assert batch["num_real_tokens"] == batch["num_padded_tokens"] <= 64
        docs = batch["indices"].tolist()
        cu = batch["cu_seq_lens_q"].tolist()
        assert [b - a for a, b in zip(cu, cu[1:])] == [int(lengths[d]) for d in docs]
        assert (batch["labels"][0, cu[:-1]] == IGNORE_INDEX).all()
        seen += batch["indices"][~batch["is_fill"]].tolist()
    assert sorted(seen) == list(range(len(dm.train_dataset)))
    val = [i for b in dm.val_dataloader()[0] for i in b["indices"][~b["is_fill"]].tolist()]
    assert sorted(val) == list(range(len(dm.val_dataset)))


def test_a_document_longer_than_the_packed_row_is_a_clear_error(tmp_path):
    docs = corpus(10) + [list(range(1, 41))]
    dm = BalancedTextDataModule(docs, max_tokens=32, max_length=None, val_fraction=0, packing=True, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="longer than max_tokens=32"):
        dm.setup("fit")
