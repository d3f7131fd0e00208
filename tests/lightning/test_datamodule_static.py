"""BalancedTextDataModule with static shapes: every training and validation batch has the declared shape."""

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, BatchingSettings


def corpus(n=80, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, size=int(k)).tolist() for k in rng.integers(1, 30, size=n)]


@pytest.mark.parametrize("settings", [BatchingSettings(max_tokens=64, packing=True, static_packing=True),
                                      BatchingSettings(max_tokens=64, padded_shapes=3)])
@pytest.mark.parametrize("how", ["settings", "keywords"])
def test_every_batch_has_a_declared_shape_and_every_document_comes_once(tmp_path, settings, how):
    docs = corpus()
    docs += [[7] * 29] * 10  # the longest length in both splits: the shapes chosen from training hold validation's
    given = {"settings": settings} if how == "settings" else settings.to_dict()
    dm = BalancedTextDataModule(docs, max_length=None, val_fraction=0.2, cache_dir=tmp_path,
                                **{k: v for k, v in given.items() if k not in ("accumulate_grad_batches",
                                                                               "plan_window")})
    dm.prepare_data()
    dm.setup("fit")
    planned = dm.train_sampler.settings
    for loader, dataset in ((dm.train_dataloader(), dm.train_dataset), (dm.val_dataloader()[0], dm.val_dataset)):
        seen = []
        for batch in loader:
            if settings.packing:
                assert batch["input_ids"].shape == (1, 64)
                assert batch["cu_seq_lens_q"].shape == (planned.max_batch_size + 1,)
            else:
                assert tuple(batch["input_ids"].shape) in planned.padded_shapes
            seen += batch["indices"][~batch["is_fill"]].tolist()
        assert sorted(seen) == list(range(len(dataset)))
