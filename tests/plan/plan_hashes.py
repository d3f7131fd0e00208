"""SHA-256 of the plans, figures and reports of many batching settings, to compare two versions of the planner.

Run: ``python tests/plan/plan_hashes.py`` prints one JSON object ``{case: sha256}``. ``tests/plan/test_plan_hashes.py``
compares it with ``plan_hashes.json``, written by this script at the commit the planner must keep matching. Each case
hashes every array of the epoch plan (all ranks), the sampler's rank-0 micro-batches, ``plan_stats``' figures and
``plan_report``'s summary.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np

from lit_balance import BalancedBatchSampler, BatchingSettings, CostModel
from lit_balance.plan import plan_epoch, plan_stats, planner_for
from lit_balance.report import plan_report

LENGTHS = Path(__file__).resolve().parents[2] / "lit_balance" / "data" / "lengths"


def _corpora() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    fortunes = np.load(LENGTHS / "lengths_fortunes.npy").astype(np.int64)
    docs = np.minimum(np.load(LENGTHS / "lengths_stdlib_docstrings.npy").astype(np.int64), 512)
    return {"fortunes800": np.minimum(fortunes[:800], 500), "docstrings600": docs[rng.permutation(docs.size)[:600]],
            "uniform300": rng.integers(1, 200, 300)}


def digest(*parts) -> str:
    """sha256 of arrays (dtype, shape and bytes) and JSON-able values, in order."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(str(part.dtype).encode() + str(part.shape).encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _cases():
    for packing, pad, cap, shuffle, window, first, drop, accumulate in itertools.product(
            (False, True), (1, 8), (None, 16), (True, False), (0.25, 0.0), (False, True), (False, True), (1, 3)):
        if packing and cap is not None:
            continue
        yield dict(packing=packing, pad_to_multiple_of=pad, max_batch_size=cap, shuffle=shuffle, shuffle_window=window,
                   largest_first=first, drop_last=drop, accumulate_grad_batches=accumulate)


def hashes() -> dict[str, str]:
    out = {}
    quadratic = CostModel(quadratic=1e-3)
    for name, lengths in _corpora().items():
        for i, kw in enumerate(_cases()):
            for budget, num_replicas in ((1024, 2), (600, 3), ([1024, 512], 2), (2048, 4)):
                if i % 3 and num_replicas == 4:  # the 4-rank cases on a third of the settings: the run stays short
                    continue
                s = BatchingSettings(max_tokens=budget, seed=5, **kw)
                key = f"{name}|{json.dumps(kw, sort_keys=True)}|{budget}|{num_replicas}"
                parts = []
                for epoch, cost in ((0, None), (1, quadratic)):
                    plan = plan_epoch(lengths, s, num_replicas=num_replicas, epoch=epoch, cost_model=cost)
                    stats = plan_stats(plan, lengths, cost, pad_to_multiple_of=s.pad_to_multiple_of,
                                       accumulate_grad_batches=s.accumulate_grad_batches, planner=planner_for(s),
                                       max_tokens=s.largest_max_tokens)
                    parts += [plan.assignment, plan.rows, plan.batch_offsets, plan.is_fill, plan.dropped,
                              stats.rank_cost, stats.rank_padded_tokens, stats.rank_real_tokens,
                              float(stats.padding_ratio), float(stats.useful_fraction)]
                sampler = BalancedBatchSampler(lengths, settings=s, num_replicas=num_replicas, rank=0,
                                               rank_speeds=None if num_replicas != 2 else [1.0, 0.6])
                parts.append([list(b) for b in sampler])
                if i % 4 == 0:
                    parts.append(plan_report(lengths, settings=s, num_replicas=num_replicas, epoch=1).summary())
                out[key] = digest(*parts)
    return out


if __name__ == "__main__":
    print(json.dumps(hashes(), indent=0, sort_keys=True))
