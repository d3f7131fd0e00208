"""Real 2-process CPU DDP fits (gloo) of the demo LM compiled as Lightning documents
(``torch.compile(model, dynamic=False)`` handed to ``Trainer.fit``), counting compiled graphs with a
``CompileCounter`` backend: static packing compiles once per rank for training and once more for validation;
``padded_shapes=K`` at most once per shape for each."""

from pathlib import Path

import numpy as np
import pytest

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("fit_compiled.py")
LAYOUTS = ("static", "shapes3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both layouts side by side (2 ranks each; about 60 s on an idle 2-core machine); {layout: [rank records]}."""
    cache = tmp_path_factory.mktemp("cache")
    return run_ranks(SCRIPT, {name: (tmp_path_factory.mktemp(name), [str(cache / name), name]) for name in LAYOUTS},
                     600)


def test_static_packing_compiles_once_per_rank_for_training_and_once_more_for_validation(runs):
    for r in runs["static"]:
        epochs = np.array([e for e, *_ in r["train_frames"]])
        frames = [f for _, f, *_ in r["train_frames"]]
        assert {(s0, s1) for _, _, s0, s1 in r["train_frames"]} == {(1, 256)}
        assert r["val_shapes"] == [[1, 256]]
        assert set(frames[:int((epochs == 0).sum())]) == {1}  # one graph from the first micro-batch on
        assert r["val_frames"] == [2, 2] and set(frames[int((epochs == 0).sum()):]) == {2} and r["frames"] == 2
        assert r["graph_breaks"] == 0 and r["mode"] == "plan"  # the plan divisor, read outside the graph
    assert runs["static"][0]["val_loss"] == runs["static"][1]["val_loss"] and np.isfinite(runs["static"][0]["val_loss"])


def test_padded_shapes_compile_at_most_once_per_shape(runs):
    for r in runs["shapes3"]:
        declared = {tuple(s) for s in r["declared"]}
        train = {(s0, s1) for _, _, s0, s1 in r["train_frames"]}
        epoch0 = [(f, (s0, s1)) for e, f, s0, s1 in r["train_frames"] if e == 0]
        assert len(declared) <= 3 and train <= declared and {tuple(s) for s in r["val_shapes"]} <= declared
        # a graph per shape met so far, never more: the frames counted after each micro-batch of the first epoch
        assert all(f == len({s for _, s in epoch0[:i + 1]}) for i, (f, _) in enumerate(epoch0))
        assert r["val_frames"][0] == len({s for _, s in epoch0}) + len(r["val_shapes"])
        assert r["frames"] == len(train) + len(r["val_shapes"]) and r["graph_breaks"] == 0
