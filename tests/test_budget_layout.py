"""The automatic budget is one unit the DataModule consumes: the settling arithmetic pure in
``plan/budget_search.py``, and no stand-in ``max_tokens`` in the Lightning layer."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_balance"


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
