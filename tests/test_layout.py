"""The layering of the package: each subpackage imports only those below it, no import cycle, no heavy import.

The layers, bottom up (``LAYERS``): the base modules (``errors``, ``_checks``, ``_fingerprint``, ``schedule``: NumPy
only; ``world``: torch), ``plan`` (NumPy only), ``sampler`` (torch, no Lightning), ``data`` (torch, no Lightning),
``report`` (no Lightning) and ``stream`` (torch, no Lightning), ``lightning``, ``demo``, then the ``callbacks``
re-export and ``cli`` on top. The static
check reads every ``import`` statement of every module (also those inside functions; not those under
``if TYPE_CHECKING:``) and every import by a literal name (``importlib.import_module("lit_balance.x")``,
``import_module(...)``, ``__import__(...)``) with :mod:`ast`, so a cycle hidden behind ``importlib`` counts; the runtime
checks import a subpackage in a fresh interpreter and list what it loaded. ``test_the_checker_*`` plant a broken rule in
a copy of the sources and show the check fails. Beside the package: the benchmarks use the public API only, one
launcher starts every rank, and no code outside the stores tests a store's type. The rules on kinds, the layout flag,
Lightning overrides and stack frames are in ``tests/test_rules.py``. No rule here is a size.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_balance"

BASE = {"errors": set(), "_checks": {"errors"}, "_fingerprint": set(), "world": {"errors", "_checks"},
        "schedule": {"errors", "_fingerprint"}}
#: top-level part of lit_balance -> the parts it may import (besides itself); a base module may import base modules
LAYERS = {
    **BASE,
    "plan": {"errors", "schedule", "_checks", "_fingerprint"},
    "sampler": {"errors", "schedule", "_checks", "_fingerprint", "world", "plan"},
    "data": {"errors", "schedule", "_checks", "_fingerprint", "world", "plan", "sampler"},
    "report": {"errors", "schedule", "_checks", "_fingerprint", "plan", "sampler"},
    "stream": {"errors", "schedule", "_checks", "_fingerprint", "world", "plan", "sampler", "data"},
    "lightning": {"errors", "schedule", "_checks", "_fingerprint", "world", "plan", "sampler", "data", "report",
                  "stream"},
    "demo": {"errors", "schedule", "_checks", "_fingerprint", "world", "plan", "lightning"},
    "callbacks": {"lightning"},
    "ledger": {"lightning"},
    "cli": {"errors", "schedule", "_checks", "_fingerprint", "world", "plan", "sampler", "data", "report", "lightning",
            "demo"},
    "__init__": set(),
}
#: within a part: module (or prefix) -> lit_balance modules (or prefixes) it must not import
INNER = {
    "lit_balance.lightning.loss": ("lit_balance.lightning.callbacks",),  # callbacks sit on top of the loss
    "lit_balance.lightning.metrics": ("lit_balance.lightning.callbacks",),
    "lit_balance.lightning.datamodule": ("lit_balance.lightning.callbacks",),
    "lit_balance.plan.padded": ("lit_balance.plan.packed", "lit_balance.plan.epoch"),  # planners do not know each other
    "lit_balance.plan.packed": ("lit_balance.plan.padded", "lit_balance.plan.epoch"),
}
#: part -> third-party packages it may not import (anywhere, also lazily)
FORBIDDEN = {
    "errors": {"torch", "lightning", "pytorch_lightning"},
    "_checks": {"torch", "lightning", "pytorch_lightning"},
    "_fingerprint": {"torch", "lightning", "pytorch_lightning"},
    "schedule": {"torch", "lightning", "pytorch_lightning"},
    "world": {"lightning", "pytorch_lightning"},
    "plan": {"torch", "lightning", "pytorch_lightning", "torchmetrics", "matplotlib", "rich"},
    "sampler": {"lightning", "pytorch_lightning", "torchmetrics", "matplotlib", "rich"},
    "data": {"lightning", "pytorch_lightning", "torchmetrics", "matplotlib", "rich"},
    "report": {"lightning", "pytorch_lightning", "torchmetrics"},
    "stream": {"lightning", "pytorch_lightning", "torchmetrics", "matplotlib", "rich"},
}


def _sources(root: Path = PACKAGE) -> dict[str, str]:
    """``{module name: source}`` of every module of the package under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text(encoding="utf-8")
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


#: functions that import a module named by their first argument
IMPORT_FUNCTIONS = {"import_module", "__import__"}


def _literal_import(node: ast.AST) -> str | None:
    """The module a call ``importlib.import_module("x")``, ``import_module("x")`` or ``__import__("x")`` imports, when
    its first argument is a literal string (a relative name resolved against a literal ``package=``), else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    first = node.args[0]
    if name not in IMPORT_FUNCTIONS or not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    target = first.value
    if target.startswith("."):
        package = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "package"),
                                                               None)
        if not (isinstance(package, ast.Constant) and isinstance(package.value, str)):
            return None
        level = len(target) - len(target.lstrip("."))
        base = package.value.split(".")[:len(package.value.split(".")) - level + 1]
        target = ".".join(base + [target.lstrip(".")]) if target.lstrip(".") else ".".join(base)
    return target


def _imports(source: str, module: str, modules: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import statement outside ``if TYPE_CHECKING:``, and of every import by a
    literal name (:func:`_literal_import`); a name imported from a package that is one of its submodules counts as
    that submodule."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if (literal := _literal_import(node)) is not None:
            found.append((literal, node.lineno))
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")[:-node.level] if not _is_package(module, modules) or node.level > 1 \
                    else module.split(".")
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _is_package(module: str, modules: set[str]) -> bool:
    return any(m.startswith(module + ".") for m in modules)


def _part(module: str) -> str:
    """The top-level part of a lit_balance module: ``lit_balance.plan.cost`` -> ``plan``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> imported modules), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)) is not None:
            return found
    return None


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken rule of the package whose modules are ``sources``: upward imports, forbidden third-party imports,
    import cycles; one line each."""
    modules = set(sources)
    out, graph = [], {}
    for module, source in sources.items():
        part = _part(module)
        graph[module] = set()
        for imported, line in _imports(source, module, modules):
            top = imported.split(".")[0]
            if top == "lit_balance":
                target = imported if imported in modules else imported.rsplit(".", 1)[0]
                if target != module:
                    graph[module].add(target)
                inner = [m for prefix, banned in INNER.items() if module.startswith(prefix)
                         for m in banned if imported == m or imported.startswith(m + ".")]
                if inner:
                    out.append(f"{module}:{line} imports {imported} ({module} must not import {inner[0]})")
                other = _part(imported)
                if other != part and other not in LAYERS.get(part, set()) and imported != "lit_balance":
                    out.append(f"{module}:{line} imports {imported} ({part} may import {sorted(LAYERS.get(part, ()))})")
            elif top in FORBIDDEN.get(part, set()):
                out.append(f"{module}:{line} imports {imported} ({part} must not import {top})")
    cycle = _cycle(graph)
    if cycle:
        out.append("import cycle: " + " -> ".join(cycle))
    return out


def test_every_module_belongs_to_a_layer():
    assert {_part(m) for m in _sources()} <= set(LAYERS)


def test_no_upward_import_no_forbidden_import():
    assert [v for v in violations(_sources()) if not v.startswith("import cycle:")] == []


def test_no_import_cycle():
    assert [v for v in violations(_sources()) if v.startswith("import cycle:")] == []


@pytest.mark.parametrize(("module", "line", "expected"), [
    ("lit_balance.plan.cost", "from lit_balance.sampler import BalancedBatchSampler", "imports lit_balance.sampler"),
    ("lit_balance.sampler.state", "import lightning", "sampler must not import lightning"),
    ("lit_balance.plan.types", "import torch", "plan must not import torch"),
    ("lit_balance.data.dataset", "from lit_balance.lightning import loss", "imports lit_balance.lightning"),
    ("lit_balance.report", "from lit_balance.lightning.datamodule import BalancedTextDataModule",
     "imports lit_balance.lightning.datamodule"),
    ("lit_balance.lightning.loss", "from lit_balance.lightning.callbacks import StragglerMonitor",
     "must not import lit_balance.lightning.callbacks"),
    ("lit_balance.plan.packed", "from lit_balance.plan.padded import plan_padded",
     "must not import lit_balance.plan.padded"),
])
def test_the_checker_reports_an_upward_or_forbidden_import(module, line, expected):
    sources = _sources()
    sources[module] = sources[module] + f"\n\ndef _planted():\n    {line}\n"
    found = violations(sources)
    assert any(expected in v and v.startswith(module) for v in found), found


def test_the_checker_reports_a_cycle():
    sources = _sources()
    sources["lit_balance.plan.types"] += "\nfrom lit_balance.plan.epoch import plan_epoch\n"
    assert any(v.startswith("import cycle:") and "lit_balance.plan.epoch" in v for v in violations(sources))


@pytest.mark.parametrize("call", [
    'importlib.import_module("lit_balance.plan.epoch")',
    'import_module("lit_balance.plan.epoch")',
    '__import__("lit_balance.plan.epoch")',
    'importlib.import_module(".epoch", package="lit_balance.plan")',
])
def test_the_checker_reports_a_cycle_hidden_behind_importlib(call):
    sources = _sources()
    sources["lit_balance.plan.types"] += f"\n\ndef _planted():\n    return {call}\n"
    assert any(v.startswith("import cycle:") and "lit_balance.plan.epoch" in v and "lit_balance.plan.types" in v
               for v in violations(sources)), violations(sources)


def test_an_import_by_a_name_not_known_before_running_is_not_read():
    sources = _sources()
    before = violations(sources)
    sources["lit_balance.plan.types"] += "\n\ndef _planted(name):\n    return importlib.import_module(name)\n"
    assert violations(sources) == before


def test_imports_under_type_checking_do_not_count():
    sources = _sources()
    before = violations(sources)
    sources["lit_balance.plan.types"] += ("\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from lit_balance.sampler import BalancedBatchSampler\n")
    assert violations(sources) == before


# Runtime: what importing a part loads, in a fresh interpreter. Lightning itself imports rich and matplotlib (its
# progress bar, torchmetrics' plotting), so plot and table libraries are checked on who runs the import statement.
# One interpreter runs the steps below in turn and lists what is loaded after each (imports only add, so a module
# absent after a step is absent after that step's statement alone) and which import statements each step ran.
WATCHED = ("matplotlib", "rich", "lightning", "pytorch_lightning", "torch", "datasets")
STEPS = {
    "planner": "import lit_balance.plan\nfrom lit_balance import plan_epoch, BatchingSettings, CostModel",
    "sampler and data": "import lit_balance.sampler, lit_balance.data, lit_balance.report\n"
                        "from lit_balance import BalancedBatchSampler, TokenDataset, PadCollator",
    "plain PyTorch loop": "from lit_balance import TokenMeanLoss, StepTokenLoss, token_loss_sum, balanced_dataloader",
    "package": "import lit_balance\nfrom lit_balance import BalancedTextDataModule, BalancedBatchSampler\n"
               "import lit_balance.lightning, lit_balance.sampler, lit_balance.callbacks, lit_balance.cli\n"
               "import lit_balance.lightning.datamodule, lit_balance.data.sources, lit_balance.data.cache",
    "table": "import numpy as np\nfrom lit_balance.report import format_report, plan_report\n"
             "format_report(plan_report(np.arange(1, 60), 128, num_replicas=2))",
}
PROBE = """
import builtins, json, sys
_import = builtins.__import__
steps = []
for name, statement in STEPS.items():
    importers = []
    def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in WATCHED:
            importers.append([(globals or {}).get("__name__", "?"), name])
        return _import(name, globals, locals, fromlist, level)
    builtins.__import__ = _recording_import
    exec(statement)
    builtins.__import__ = _import
    steps.append({"modules": sorted(sys.modules), "importers": importers})
print(json.dumps(steps))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, dict]:
    """Each step of ``STEPS``: ``{"modules": loaded after it, "importers": [[importing module, name], ...] of its
    import statements of ``WATCHED`` packages}``."""
    code = f"WATCHED = {WATCHED!r}\nSTEPS = {STEPS!r}\n{PROBE}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip(STEPS, json.loads(proc.stdout.strip().splitlines()[-1])))


def _loaded(result: dict, package: str) -> list[str]:
    return [m for m in result["modules"] if m == package or m.startswith(package + ".")]


@pytest.mark.slow
def test_importing_the_planner_loads_numpy_only(imported):
    result = imported["planner"]
    assert {p: _loaded(result, p)[:3] for p in ("torch", "lightning", "matplotlib", "rich")} == {
        "torch": [], "lightning": [], "matplotlib": [], "rich": []}


@pytest.mark.slow
def test_importing_the_sampler_and_the_data_layer_loads_no_lightning(imported):
    result = imported["sampler and data"]
    assert _loaded(result, "torch")  # the step ran
    assert {p: _loaded(result, p)[:3] for p in ("lightning", "pytorch_lightning", "matplotlib", "rich", "datasets")} \
        == {"lightning": [], "pytorch_lightning": [], "matplotlib": [], "rich": [], "datasets": []}


@pytest.mark.slow
def test_a_plain_pytorch_loop_imports_the_loss_and_the_metric_without_lightning(imported):
    result = imported["plain PyTorch loop"]
    assert _loaded(result, "lit_balance.lightning.metrics") and _loaded(result, "lit_balance.lightning.loss")
    assert {p: _loaded(result, p)[:3] for p in ("lightning", "pytorch_lightning")} == {"lightning": [],
                                                                                      "pytorch_lightning": []}


def test_a_submodule_not_imported_yet_is_an_attribute_of_the_lazy_package(monkeypatch):
    import lit_balance.lightning
    from lit_balance.lightning import budget

    monkeypatch.delattr(lit_balance.lightning, "budget")  # as in a process that has not imported it yet
    assert lit_balance.lightning.budget is budget and lit_balance.lightning.TokenMeanLoss.__name__ == "TokenMeanLoss"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        lit_balance.lightning.no_such_name


@pytest.mark.slow
def test_no_plot_or_table_library_is_imported_by_the_package_on_import(imported):
    result = imported["package"]
    assert _loaded(result, "lightning") and _loaded(result, "lit_balance.cli")  # the step ran
    by_us = [[who, name] for who, name in result["importers"]
             if who.split(".")[0] == "lit_balance" and name.split(".")[0] in ("matplotlib", "rich")]
    assert by_us == []


@pytest.mark.slow
def test_importing_the_package_and_the_data_module_does_not_import_datasets(imported):
    # Hugging Face datasets (and its pyarrow) is an optional extra, imported where a dataset is read
    result = imported["package"]
    assert _loaded(result, "lit_balance.data.sources") and _loaded(result, "lit_balance.lightning.datamodule")
    assert _loaded(result, "datasets") + _loaded(result, "pyarrow") == []


@pytest.mark.slow
def test_drawing_a_table_is_where_rich_is_imported(imported):
    # the probe sees the import where the rule allows it (so the check above can fail)
    assert any(who.startswith("lit_balance.report") and name == "rich" for who, name in imported["table"]["importers"])


# Lightning's public API only: no private attribute (``._name``, or ``getattr(obj, "_name")``) of a Trainer, strategy,
# loop, LightningModule or other Lightning object, nor a private member a Lightning subclass inherits.
#: names that hold Lightning objects in the package's code (a variable, a parameter or the last attribute of a chain)
LIGHTNING_OBJECTS = {
    "trainer", "_trainer", "strategy", "loop", "fit_loop", "epoch_loop", "val_loop", "lightning_module", "pl_module",
    "precision_plugin", "accelerator", "profiler", "progress_bar_callback", "checkpoint_callback", "datamodule",
    "launcher", "cluster_environment", "fabric", "parser",
}


def _object_name(node: ast.AST) -> str | None:
    """The name an expression is reached by: ``trainer`` for ``trainer`` and ``self.trainer``, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
        return "super()"
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _lightning_bases(tree: ast.Module) -> set[str]:
    """Names bound to Lightning classes in a module: ``from lightning... import X`` and the ``L``/``pl`` aliases."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "pytorch_lightning"):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name for alias in node.names
                         if alias.name.split(".")[0] in ("lightning", "pytorch_lightning"))
    return names


def private_lightning_uses(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every use of a private attribute of a Lightning object in ``source``."""
    tree = ast.parse(source)
    bases = _lightning_bases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _object_name(node.value)
            if owner in LIGHTNING_OBJECTS or owner == "super()":
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and _object_name(node.args[0]) in LIGHTNING_OBJECTS):
            found.append((node.lineno, ast.unparse(node)))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        roots = {ast.unparse(b).split(".")[0] for b in cls.bases}
        if not roots & bases:
            continue
        own = {n.name for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        targets = [t for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
        targets += [e for t in targets if isinstance(t, (ast.Tuple, ast.List)) for e in t.elts]  # a, b = ...
        own |= {t.attr for t in targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and _private(node.attr) and node.attr not in own):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_no_private_lightning_attribute_in_the_package():
    uses = {module: found for module, source in _sources().items() if (found := private_lightning_uses(source))}
    assert uses == {}


@pytest.mark.parametrize("planted", [
    "trainer._logger_connector._callback_metrics",
    "self.trainer.fit_loop._data_fetcher",
    'getattr(trainer, "_logger_connector", None)',
    "trainer.strategy._launcher",
])
def test_the_checker_reports_a_private_lightning_attribute(planted):
    assert private_lightning_uses(f"def f(trainer, self):\n    return {planted}\n")


def test_the_checker_reports_a_private_member_a_lightning_subclass_inherits():
    source = ("from lightning.pytorch.callbacks import RichProgressBar\n\n"
              "class Bar(RichProgressBar):\n    def __init__(self):\n        self._mine = 1\n\n"
              "    def f(self):\n        return self._mine, self._stop_progress()\n")
    assert [expr for _, expr in private_lightning_uses(source)] == ["self._stop_progress"]


# Beside the package: the benchmarks are scripts that measure through the public API, and one launcher (``launch.py``
# at the repository root, the rig) starts the processes and ranks of the tests, the benchmarks and research/, each with
# a time limit.
LAUNCHER = ROOT / "launch.py"


def private_package_imports(source: str) -> list[str]:
    """The imports of a private name or module of lit_balance (``_x``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                 if isinstance(node, ast.Import) else [])
        found += [n for n in names if n.split(".")[0] == "lit_balance" and any(_private(p) for p in n.split("."))]
    return found


def test_benchmarks_and_research_use_the_public_api_only():
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
               for folder in ("benchmarks", "research") for p in sorted((ROOT / folder).rglob("*.py"))}
    assert len(sources) > 10 and {f: found for f, source in sources.items()
                                  if (found := private_package_imports(source))} == {}
    assert private_package_imports("from lit_balance.data.stores.megatron import _Index\nimport lit_balance._checks\n"
                                   "from lit_balance import plan_stats") == ["lit_balance.data.stores.megatron._Index",
                                                                             "lit_balance._checks"]


def _starters(roots: tuple[str, ...] = ("tests", "benchmarks", "research", "recipes")) -> dict[str, tuple[bool, bool]]:
    """``{file: (forks itself, imports the launcher)}`` of the Python files under ``roots`` that fork a process or
    pass ``torch.distributed.run`` to a process they start."""
    out = {}
    for path in sorted(p for root in roots for p in (ROOT / root).rglob("*.py") if p != Path(__file__).resolve()):
        source = path.read_text(encoding="utf-8")
        starts = "os.fork(" in source or '"torch.distributed.run"' in source
        if starts:
            out[str(path.relative_to(ROOT))] = ("os.fork(" in source, "from launch import" in source)
    return out


def test_one_launcher_starts_every_rank():
    assert LAUNCHER.exists()
    assert not (ROOT / "tests" / "ddp" / "_procs.py").exists() and not (ROOT / "research" / "_launch.py").exists()
    starters = _starters()
    assert starters, "no file starts torchrun: the check below checks nothing"
    # nothing forks but the launcher; whatever starts torchrun waits for it with the launcher's limit (finish)
    assert {path: how for path, how in starters.items() if how != (False, True)} == {}


def test_the_launcher_check_finds_a_second_launcher(tmp_path, monkeypatch):
    (tmp_path / "research").mkdir()
    (tmp_path / "research" / "own.py").write_text('import os, subprocess\nos.fork()\n'
                                                   'subprocess.run(["python", "-m", "torch.distributed.run"])\n')
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert _starters(("research",)) == {"research/own.py": (True, False)}


# One corpus interface: code outside lit_balance/data/stores/ asks a source, store or corpus what it can do (methods
# and properties) instead of testing its type.
STORES = "lit_balance.data.stores"


def store_classes(sources: dict[str, str]) -> set[str]:
    """Names of the classes defined in lit_balance/data/stores/ (the store types)."""
    return {node.name for module, source in sources.items() if module == STORES or module.startswith(STORES + ".")
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)}


def _type_names(node: ast.AST) -> list[str]:
    """The class names an ``isinstance`` second argument names: ``X``, ``mod.X``, a tuple of them."""
    if isinstance(node, ast.Tuple):
        return [n for element in node.elts for n in _type_names(element)]
    if isinstance(node, ast.Name):
        return [node.id]
    return [node.attr] if isinstance(node, ast.Attribute) else []


def store_type_tests(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(module, line, class)`` of every ``isinstance``/``issubclass`` test of a store type, and every comparison of
    a ``__name__`` with a store type's name (or ``"Mixture"``), outside lit_balance/data/stores/."""
    names, found = store_classes(sources), []
    for module, source in sources.items():
        if module == STORES or module.startswith(STORES + "."):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "isinstance", "issubclass") and len(node.args) == 2:
                found += [(module, node.lineno, n) for n in _type_names(node.args[1]) if n in names]
            elif isinstance(node, ast.Compare) and any(isinstance(part, ast.Attribute) and part.attr == "__name__"
                                                       for part in [node.left, *node.comparators]):
                found += [(module, node.lineno, part.value) for part in [node.left, *node.comparators]
                          if isinstance(part, ast.Constant) and part.value in names | {"Mixture"}]
    return found


def test_no_store_type_is_tested_outside_the_stores():
    assert store_type_tests(_sources()) == []


@pytest.mark.parametrize("planted", [
    "isinstance(source, StoreSource)", "isinstance(d, (list, stores.StoreDataset))", "issubclass(k, TokenStore)",
    'type(corpus).__name__ == "Mixture"',
])
def test_the_checker_reports_a_store_type_test(planted):
    sources = {**_sources(), "lit_balance.data.loader": f"def f(source, d, k, corpus):\n    return {planted}\n",
               "lit_balance.data.stores.old": "class StoreDataset:\n    pass\n"}
    assert [line for _, line, _ in store_type_tests(sources)] == [2]

