"""BalancedTextDataModule with weights_schedule, simulated ranks in one process: each step within one document of its
scheduled shares (padded and packed), the schedule saved in the DataModule's state and resumed exactly (on 2 ranks
and on 3), a past edit refused naming its point, and the settings refused before any token is read."""

from types import SimpleNamespace

import numpy as np
import pytest

from lit_balance import BalancedTextDataModule, Schedule

SCHEDULE = {"points": [[0, {"short": 0.8, "long": 0.2}], [3, {"short": 0.3, "long": 0.7}]], "unit": "steps"}


def _docs(num, low, high, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 90, size=int(rng.integers(low, high))).tolist() for _ in range(num)]


def _corpus():
    return {"components": {"short": {"corpus": _docs(160, 4, 20, 0), "weight": 1},
                           "long": {"corpus": _docs(80, 30, 60, 1), "weight": 1}}}


def _ranks(world, root, schedule=SCHEDULE, state=None, **kwargs):
    modules = []
    for rank in range(world):
        dm = BalancedTextDataModule(_corpus(), vocab_size=100, pad_token_id=0, max_tokens=256, max_length=64,
                                    val_fraction=0.0, cache_dir=root, seed=3, weights_schedule=schedule, **kwargs)
        dm.trainer = SimpleNamespace(world_size=world, global_rank=rank, current_epoch=0, accumulate_grad_batches=1,
                                     strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world,
                                                                                          "rank": rank}),
                                     state=SimpleNamespace(fn=None), lightning_module=None)
        dm.setup("fit")
        if state is not None:
            dm.load_state_dict(state)
        modules.append(dm)
    return modules


def _run(modules, steps=None, loaders=None):
    out = []
    for dm in modules:
        loader = dm.train_dataloader()
        if loaders is not None:
            loaders.append(loader)
        rows = []
        for batch in loader:
            rows.append(batch["indices"].numpy()[~batch["is_fill"].numpy()].tolist())
            if steps is not None and len(rows) == steps:
                break
        out.append(rows)
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_every_step_follows_the_schedule_and_a_resume_continues_it(tmp_path, packing):
    full_ranks = _ranks(2, tmp_path, packing=packing)
    full = _run(full_ranks)
    assert len({len(r) for r in full}) == 1
    sampler = full_ranks[0].train_sampler
    lengths = np.asarray(sampler.lengths, dtype=np.int64)
    targets = sampler.step_targets()
    units = np.zeros((len(full[0]), 2))
    for rows in full:
        for step, real in enumerate(rows):
            np.add.at(units[step], sampler.component_of(np.asarray(real, dtype=np.int64)), lengths[real])
    schedule = Schedule.of(SCHEDULE, name="weights_schedule")
    assert len(full[0]) > 3  # the transition at step 3 is inside the epoch
    for step in range(len(full[0])):
        w = np.asarray(schedule.vector_at(step, ("short", "long")))
        np.testing.assert_allclose(targets[step], w / w.sum())
        assert np.abs(units[step] - targets[step] * units[step].sum()).max() <= lengths.max()
    seen = [i for rows in full for real in rows for i in real]
    assert len(seen) == len(set(seen))
    # the plan summary measures each step's share against the step's scheduled share
    mix = full_ranks[0].plan_summary(num_replicas=2)["mixture"]
    assert mix["step_targets"] == targets.tolist()
    assert max(mix["max_deviation_pp"]) <= 100 * lengths.max() / units.sum(axis=1).min()
    # stopped after 2 micro-batches, resumed on the same ranks: the rest of the epoch exactly
    running = []
    stopped = _run(full_ranks, steps=2, loaders=running)
    state = full_ranks[0].state_dict()
    assert state["train_sampler"]["weights_schedule"]["points"][1][0] == 3
    resumed = _run(_ranks(2, tmp_path, state=state, packing=packing))
    assert [a + b for a, b in zip(stopped, resumed)] == full
    # an edit of a step already trained is refused, naming the point
    past = {"points": [[0, {"short": 0.8, "long": 0.2}], [1, {"short": 0.5, "long": 0.5}]]}
    with pytest.raises(ValueError, match=r"weights_schedule.*is at 1 steps.*point \(1, \{'short': 0.5"):
        _run(_ranks(2, tmp_path, schedule=past, state=state, packing=packing))  # refused where the sampler loads it
    # resumed on 3 ranks: exactly the rest of the uninterrupted epoch's documents, each step on its schedule
    three = _ranks(3, tmp_path, state=state, packing=packing)
    rest = _run(three)
    assert len({len(r) for r in rest}) == 1
    trained = sorted(i for rows in stopped + rest for real in rows for i in real)
    assert trained == sorted(seen)
    targets = three[0].train_sampler.step_targets()
    units = np.zeros((len(rest[0]), 2))
    for rows in rest:
        for step, real in enumerate(rows):
            np.add.at(units[step], sampler.component_of(np.asarray(real, dtype=np.int64)), lengths[real])
    for step in range(len(rest[0])):
        w = np.asarray(schedule.vector_at(2 + step, ("short", "long")))
        np.testing.assert_allclose(targets[step], w / w.sum())
        assert np.abs(units[step] - targets[step] * units[step].sum()).max() <= lengths.max()


def test_weights_schedule_settings_are_refused_before_any_token_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"names the component\(s\) \['books'\]"):
        BalancedTextDataModule(_corpus(), vocab_size=100, pad_token_id=0, cache_dir=tmp_path,
                               weights_schedule=[[0, {"short": 1, "long": 1, "books": 1}]])
    with pytest.raises(ValueError, match="the corpus is one component"):
        BalancedTextDataModule(_docs(10, 4, 20, 0), vocab_size=100, pad_token_id=0, cache_dir=tmp_path,
                               weights_schedule=[[0, {"train": 1}]])
    with pytest.raises(ValueError, match="largest_first=True"):
        BalancedTextDataModule(_corpus(), vocab_size=100, pad_token_id=0, cache_dir=tmp_path, largest_first=True,
                               weights_schedule=SCHEDULE)
    with pytest.raises(ValueError, match="point 1 is at 2 steps, not after point 0 at 5"):
        BalancedTextDataModule(_corpus(), vocab_size=100, pad_token_id=0, cache_dir=tmp_path,
                               weights_schedule=[[5, {"short": 1, "long": 1}], [2, {"short": 1, "long": 0}]])
    assert not any(tmp_path.glob("**/*.npy"))  # nothing tokenized
