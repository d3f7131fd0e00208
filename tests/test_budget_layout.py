"""The automatic budget is one unit the DataModule consumes: the probe and the owner each in a file of at most 350
lines, the settling arithmetic pure in ``plan/budget_search.py``, and no stand-in ``max_tokens`` in the Lightning
layer."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_balance"


@pytest.mark.parametrize("name", ["lightning/probe.py", "lightning/budget.py"])
def test_the_probe_and_the_owner_are_files_of_at_most_350_lines(name):
    lines = len((PACKAGE / name).read_text().splitlines())
    assert lines <= 350, f"{name} has {lines} lines"


def test_no_module_of_the_lightning_layer_uses_the_max_tokens_limit_as_a_stand_in():
    users = [str(p.relative_to(PACKAGE)) for p in (PACKAGE / "lightning").rglob("*.py")
             if "MAX_TOKENS_LIMIT" in p.read_text()]
    assert users == []


def test_the_settling_arithmetic_is_in_the_pure_search_module():
    tree = ast.parse((PACKAGE / "plan/budget_search.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"settled_budget", "next_budget", "chosen_budget", "RankOutcome", "ProbeLayout"} <= defined
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in ([ast.alias(n.module or "")] if isinstance(n, ast.ImportFrom) else n.names)}
    assert not imported & {"torch", "lightning"}, imported
