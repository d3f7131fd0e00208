"""SHA-256 of mixture plans over many settings, to compare two versions of :func:`~lit_balance.plan.mixture.plan_mixture`.

Run: ``python tests/plan/mixture_hashes.py`` prints one JSON object ``{case: sha256}``.
``tests/plan/test_plan_hashes.py`` compares it with ``mixture_hashes.json``, written by this script at the commit the
mixture planner must keep matching. Each case hashes, for two epochs, every array of the epoch plan (all ranks), the
chosen samples and the units per step and component. The cases cross two to five components (steps are rounded to
whole micro-batches for two to four), padded and packed layouts, 2 to 64 ranks, accumulation 1 and 4, shuffle,
``pad_to_multiple_of``, ``max_batch_size``, ``largest_first``, the units, ``max_repetition``, per-rank budgets and a
weight schedule (two epochs in a row, the second starting where the first ended).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from lit_balance import BatchingSettings, CostModel, Schedule
from lit_balance.plan.mixture import MixtureLayout, MixtureSettings, plan_mixture
from lit_balance.plan.mixture_schedule import StepShares
from plan_hashes import digest  # tests/plan/plan_hashes.py

LENGTHS = Path(__file__).resolve().parents[2] / "lit_balance" / "data" / "lengths"


def _components() -> list[np.ndarray]:
    """Five components of different scales (three synthetic, medians 30 / 300 / 2,000; two real)."""
    rng = np.random.default_rng(23)
    synthetic = [np.clip(rng.lognormal(np.log(m), 0.7, n), 8, 4096).astype(np.int64)
                 for m, n in ((30, 2500), (300, 1500), (2000, 600))]
    fortunes = np.load(LENGTHS / "lengths_fortunes.npy").astype(np.int64)[:1200]
    docs = np.minimum(np.load(LENGTHS / "lengths_stdlib_docstrings.npy").astype(np.int64), 4096)
    return synthetic + [np.maximum(fortunes, 1), np.maximum(docs[rng.permutation(docs.size)[:900]], 1)]


_MIXTURES = {  # component indices and weights
    "two": ((0, 2), (0.6, 0.4)),
    "three": ((0, 1, 2), (0.5, 0.2, 0.3)),
    "three_skewed": ((0, 1, 2), (0.05, 0.05, 0.9)),
    "four": ((3, 0, 4, 2), (0.3, 0.2, 0.2, 0.3)),
    "five": ((0, 1, 2, 3, 4), (0.3, 0.1, 0.3, 0.2, 0.1)),
}


def _cases():
    for (name, packing, (num_replicas, acc), shuffle, extra) in itertools.product(
            _MIXTURES, (False, True), ((2, 1), (8, 1), (8, 4), (64, 1), (3, 4)), (True, False),
            ("plain", "pad8_cap16", "largest_first", "documents_rep2", "per_rank", "schedule")):
        if packing and extra == "pad8_cap16":
            continue
        if extra != "plain" and (num_replicas == 64 or name in ("two", "five")):
            continue  # the variants on the middle settings: the run stays short
        if extra == "per_rank" and (name != "three" or num_replicas != 3):
            continue  # a planner call per step: a few cases
        if extra == "schedule" and num_replicas == 2:
            continue
        yield name, packing, num_replicas, acc, shuffle, extra


def _plan(components, name, packing, num_replicas, acc, shuffle, extra, epoch, step_shares=None):
    picks, weights = _MIXTURES[name]
    parts = [components[i] for i in picks]
    reps = 2 if extra == "documents_rep2" else 1
    layout = MixtureLayout(np.array([p.size for p in parts], dtype=np.int64), reps)
    mixture = MixtureSettings(tuple(f"c{i}" for i in range(len(parts))), weights,
                              unit="documents" if extra == "documents_rep2" else "tokens", max_repetition=reps)
    budget = 8192 if num_replicas != 64 else 4096
    settings = BatchingSettings(
        max_tokens=[budget] * (num_replicas - 1) + [budget // 2] if extra == "per_rank" else budget,
        accumulate_grad_batches=acc, packing=packing, shuffle=shuffle, seed=7,
        pad_to_multiple_of=8 if extra == "pad8_cap16" else 1,
        max_batch_size=16 if extra == "pad8_cap16" else None, largest_first=extra == "largest_first")
    lengths = layout.tile(np.minimum(np.concatenate(parts), budget // 2))
    return plan_mixture(lengths, layout, mixture, settings, num_replicas=num_replicas, epoch=epoch,
                        cost_model=CostModel(), step_shares=step_shares)


def _schedule(name: str) -> Schedule:
    """Weights from a component's first weight to uniform over the first 20 steps, linear."""
    names = tuple(f"c{i}" for i in range(len(_MIXTURES[name][1])))
    return Schedule([(0, dict(zip(names, _MIXTURES[name][1]))), (20, dict.fromkeys(names, 1.0))],
                    interpolation="linear", name="weights_schedule")


def hashes() -> dict[str, str]:
    components = _components()
    out = {}
    for case in _cases():
        parts = []
        first, tokens, carry = 0, 0, None
        for epoch in (0, 1):
            shares = None
            if case[-1] == "schedule":
                names = tuple(f"c{i}" for i in range(len(_MIXTURES[case[0]][1])))
                shares = StepShares(_schedule(case[0]), names, first_step=first, tokens_before=tokens, carry=carry)
            mp = _plan(components, *case, epoch, shares)
            p = mp.plan
            parts += [p.assignment, p.rows, p.batch_offsets, p.is_fill, p.dropped, mp.chosen, mp.step_units]
            if shares is not None:
                parts += [mp.step_targets, mp.carry]
                first, tokens = first + mp.step_units.shape[0], tokens + int(mp.step_units.sum())
                carry = tuple(mp.carry.tolist())
        out["|".join(str(v) for v in case)] = digest(*parts)
    return out


if __name__ == "__main__":
    print(json.dumps(hashes(), indent=1, sort_keys=True))
