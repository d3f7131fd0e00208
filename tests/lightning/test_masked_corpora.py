"""Masked-label corpora through the DataModule: records that truncation leaves without a target are reported, and a
corpus larger than plan_window (planned in windows) keeps the exact plan divisor."""

import json
import warnings

import numpy as np
import pytest

from lit_balance import BalancedBatchSampler, BalancedTextDataModule, BatchingSettings


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _dm(tmp_path, records, **kwargs):
    kwargs = {"max_tokens": 64, "val_fraction": 0, "cache_dir": tmp_path / "cache", **kwargs}
    return BalancedTextDataModule(_jsonl(tmp_path / "pc.jsonl", records), **kwargs)


LONG_PROMPT = "explain in detail " * 6  # 18 words: fills max_length=8


def test_records_truncated_to_no_target_are_reported_once(tmp_path):
    records = [{"prompt": LONG_PROMPT if i in (2, 5, 7) else "say", "completion": " yes indeed"} for i in range(10)]
    dm = _dm(tmp_path, records, max_length=8)
    dm.prepare_data()
    with pytest.warns(UserWarning) as caught:
        dm.setup("fit")
    messages = [str(w.message) for w in caught if "no next-token target" in str(w.message)]
    assert len(messages) == 1
    assert "3 of 10 training records" in messages[0] and "corpus records 2, 5, 7" in messages[0]
    assert "max_length=8" in messages[0] and "raise max_length" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second setup (e.g. validate after fit) does not repeat it
        dm.setup("validate")


def test_a_corpus_without_any_target_is_refused(tmp_path):
    records = [{"prompt": LONG_PROMPT, "completion": " yes"} for _ in range(6)]
    dm = _dm(tmp_path, records, max_length=8)
    dm.prepare_data()
    with pytest.raises(ValueError, match=r"no training record has a next-token target.*raise max_length") as refused:
        dm.setup("fit")
    assert refused.value.parameter == "max_length"


def test_a_masked_corpus_above_plan_window_trains_with_the_exact_plan_divisor(tmp_path):
    rng = np.random.default_rng(3)
    records = [{"prompt": "word " * int(p), "completion": " answer" * int(c)}
               for p, c in zip(rng.integers(1, 12, 90), rng.integers(1, 6, 90))]
    accumulate = 2
    dm = _dm(tmp_path, records, settings=BatchingSettings(max_tokens=64, plan_window=16,
                                                          accumulate_grad_batches=accumulate))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_sampler.windows is not None  # 90 records > plan_window=16: planned in windows
    batches = list(dm.train_dataloader())
    total = 0
    for start in range(0, len(batches), accumulate):  # one rank: an optimizer step is `accumulate` micro-batches
        step = batches[start:start + accumulate]
        targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in step)  # what token_loss_sum counts
        assert [b["step_supervised_tokens"] for b in step] == [targets] * len(step)  # the plan counts them exactly
        assert targets < sum(b["num_real_tokens"] for b in step) - sum(b["labels"].shape[0] for b in step)
        total += targets
    assert total == int(dm.train_sampler.supervised_lengths.sum())


@pytest.mark.parametrize(("world", "resumed_world"), [(2, 2), (2, 3)])
def test_windowed_step_supervised_tokens_count_every_target_once_across_a_resume(world, resumed_world):
    rng = np.random.default_rng(5)
    lengths = rng.integers(2, 40, 300)
    supervised = (lengths - 1) // 3  # masked labels: a third of the targets kept
    settings = BatchingSettings(max_tokens=96, plan_window=70, accumulate_grad_batches=2, seed=1)

    def samplers(n):
        return [BalancedBatchSampler(lengths, settings=settings, num_replicas=n, rank=r, supervised_lengths=supervised)
                for r in range(n)]

    before = samplers(world)
    cut = 5
    seen = [[mb for _, mb in zip(range(cut), iter(s))] for s in before]
    state = before[0].state_dict()
    after = samplers(resumed_world)
    for s in after:
        s.load_state_dict(state)
    rest = [list(s) for s in after]
    steps = [mb.step_supervised_tokens for mb in seen[0]] + [mb.step_supervised_tokens for mb in rest[0]]
    assert len(steps) == len(after[0])
    trained = sum(int(supervised[i]) for ranks in (seen, rest) for batches in ranks for mb in batches
                  for i, fill in zip(mb, mb.is_fill) if not fill)
    assert trained == int(supervised.sum())  # every sample once (fill rows excluded)
    # each Lightning window (2 micro-steps from the epoch start) counts once, read at its last micro-step (one the
    # resumed ranks ran, when the cut falls inside the window)
    windows = [steps[min(k + 1, len(steps) - 1)] for k in range(0, len(steps), 2)]
    assert sum(windows) == trained  # the plan's divisors add up to exactly the targets trained
