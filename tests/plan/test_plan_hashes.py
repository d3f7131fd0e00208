"""The planner's output is bit-identical to the recorded one for every case of ``plan_hashes.py``, and the mixture
planner's for every case of ``mixture_hashes.py``.

``plan_hashes.json`` was written by ``python tests/plan/plan_hashes.py > tests/plan/plan_hashes.json`` at commit
7d17127; a change of the planner that changes a plan on purpose rewrites it in the same commit, saying why.
Rewritten when packed plans gained their exchange stage (stage 5 of ``lit_balance.plan.packed``): 174 packed cases
of one micro-batch per rank and step changed, no padded case and no case with accumulation.
``mixture_hashes.json`` was written by ``python tests/plan/mixture_hashes.py > tests/plan/mixture_hashes.json`` at
commit 0d59b4e (mixture plans with steps rounded to whole micro-batches per component).
"""

import json
from pathlib import Path

import pytest

from mixture_hashes import hashes as mixture_hashes  # tests/plan/mixture_hashes.py
from plan_hashes import hashes  # tests/plan/plan_hashes.py

pytestmark = pytest.mark.slow  # about 20 s: 960 plans, their figures and reports; mixtures about 15 s more


def test_plans_are_bit_identical_to_the_recorded_ones():
    recorded = json.loads(Path(__file__).with_name("plan_hashes.json").read_text())
    now = hashes()
    assert set(now) == set(recorded)
    changed = sorted(k for k in now if now[k] != recorded[k])
    assert not changed, f"{len(changed)} of {len(now)} plans changed, e.g. {changed[:3]}"


def test_mixture_plans_are_bit_identical_to_the_recorded_ones():
    recorded = json.loads(Path(__file__).with_name("mixture_hashes.json").read_text())
    now = mixture_hashes()
    assert set(now) == set(recorded)
    changed = sorted(k for k in now if now[k] != recorded[k])
    assert not changed, f"{len(changed)} of {len(now)} mixture plans changed, e.g. {changed[:3]}"
