"""Import rules: the dependency direction of the package, checked in fresh interpreters.

* ``lit_balance.plan.padded`` (the pure planner) does not import Lightning.
* ``lit_balance.lightning.loss`` does not import ``lit_balance.callbacks`` (callbacks sit on top of the loss, not under it).
* matplotlib and rich are imported only where a plot or a table is drawn: no ``lit_balance`` module imports
  them while the package, the sampler or the DataModule is imported. Lightning itself imports both (its
  rich progress bar, torchmetrics' plotting), so for anything built on Lightning the rule is checked on
  who executes the import statement; the sampler needs no Lightning and loads neither.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLOT_AND_TABLE = ("matplotlib", "rich")
WATCHED = (*PLOT_AND_TABLE, "lightning", "pytorch_lightning")

# Runs STATEMENT in a fresh interpreter and prints the loaded modules and, for every import statement of a
# WATCHED package (cached or not), the module that executed it.
PROBE = """
import builtins, json, sys
importers = []
_import = builtins.__import__
def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] in WATCHED:
        importers.append([(globals or {}).get("__name__", "?"), name])
    return _import(name, globals, locals, fromlist, level)
builtins.__import__ = _recording_import
exec(STATEMENT)
builtins.__import__ = _import
print(json.dumps({"modules": sorted(sys.modules), "importers": importers}))
"""


def _probe(statement: str) -> dict:
    code = f"WATCHED = {WATCHED!r}\nSTATEMENT = {statement!r}\n{PROBE}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _loaded(result: dict, package: str) -> list[str]:
    return [m for m in result["modules"] if m == package or m.startswith(package + ".")]


def _by_lit_balance(result: dict, packages: tuple[str, ...]) -> list[list[str]]:
    """``[lit_balance module, imported name]`` of every import statement of ``packages`` run by lit_balance."""
    return [[who, name] for who, name in result["importers"]
            if (who == "lit_balance" or who.startswith("lit_balance.")) and name.split(".")[0] in packages]


def test_the_planner_does_not_import_lightning():
    result = _probe("import lit_balance.plan.padded")
    loaded = _loaded(result, "lightning") + _loaded(result, "pytorch_lightning")
    assert loaded == [], f"imported by {_by_lit_balance(result, WATCHED[2:])}"


def test_the_loss_does_not_import_the_callbacks():
    result = _probe("import lit_balance.lightning.loss")
    assert _loaded(result, "lit_balance.callbacks") == []


def test_no_plot_or_table_library_is_imported_by_the_package_on_import():
    # one interpreter: each module's body runs once, whichever of these statements loads it first
    result = _probe("import lit_balance\nfrom lit_balance import BalancedTextDataModule, BalancedBatchSampler\n"
                    "import lit_balance.lightning.datamodule, lit_balance.sampler.sampler, lit_balance.callbacks")
    assert _by_lit_balance(result, PLOT_AND_TABLE) == []


def test_the_sampler_loads_neither_lightning_nor_a_plot_or_table_library():
    result = _probe("from lit_balance.sampler.sampler import BalancedBatchSampler")
    loaded = {p: _loaded(result, p)[:3] for p in ("lightning", *PLOT_AND_TABLE)}
    assert loaded == {"lightning": [], "matplotlib": [], "rich": []}, (
        f"lightning imported by {_by_lit_balance(result, WATCHED[2:])}")


def test_drawing_a_table_is_where_rich_is_imported():
    # the probe sees the import where the rule allows it (so the checks above can fail)
    result = _probe("import numpy as np\nfrom lit_balance.report.figures import format_report, plan_report\n"
                    "format_report(plan_report(np.arange(1, 60), 128, num_replicas=2))")
    assert ["lit_balance.report.figures", "rich"] in _by_lit_balance(result, PLOT_AND_TABLE)
