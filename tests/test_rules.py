"""Rules of the package's code that state properties, each read from the sources with :mod:`ast` and each shown to
catch a planted violation (a small source string) and to pass a planted allowed case.

- No module decides the kind of a DataModule, sampler, dataset or loader by its attributes or its class
  (:func:`kind_tests`): it asks the object (a method, a property) or is handed what it needs.
- The layout (padded or packed) is asked of the planner object: the ``packing`` flag is read only where the planner is
  chosen, :func:`lit_balance.plan.epoch.planner_for` (:func:`packing_reads`).
- No class overrides a private method of a Lightning class it derives from (:func:`private_overrides`).
- No module walks the call stack (:func:`frame_walks`): what code needs from its caller is handed to it.

The import rules (layering, no import cycle, ``importlib`` strings included) are in ``tests/test_layout.py``.

Where the package still breaks a rule while other work removes the violation, the check of the real tree is marked
``xfail(strict=True)`` with the reason naming what is pending: once that work lands the check passes, pytest reports
the strict xfail as failed, and the mark is removed.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_balance"


def _sources(root: Path = PACKAGE) -> dict[str, str]:
    """``{module name: source}`` of every module of the package under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text(encoding="utf-8")
    return out


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def _call_name(node: ast.AST) -> str | None:
    """``f`` for a call ``f(...)`` of a plain name."""
    return node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None


def _imported_modules(tree: ast.Module) -> set[str]:
    """Names bound to modules by ``import x`` / ``import x as y`` (the first part of a dotted import)."""
    return {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names}


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain starts from: ``datasets`` for ``datasets.arrow_dataset``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_guard(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` is (part of) the test of an ``if`` whose only statements raise, with no ``else``: a check of
    an argument that refuses what is not of the expected type, not a choice between kinds."""
    parent = parents.get(node)
    while isinstance(parent, (ast.UnaryOp, ast.BoolOp)):
        node, parent = parent, parents.get(parent)
    return (isinstance(parent, ast.If) and parent.test is node and not parent.orelse
            and all(isinstance(statement, ast.Raise) for statement in parent.body))


# Rule (a): kinds are not decided by attributes or classes.
#: names (a variable, a parameter or the last attribute of a chain) that hold a DataModule, sampler, dataset or loader
KIND_OBJECT = re.compile(r"(^|_)(datamodule|data_module|dm|sampler|samplers|dataset|datasets|ds|loader|dataloader)$",
                         re.IGNORECASE)
#: lit_balance classes whose instances are DataModules, samplers, datasets or loaders
KIND_CLASS = re.compile(r"(DataModule|Sampler|Dataset|Loader)$")


def _kind_object(node: ast.AST, modules: set[str]) -> bool:
    """Whether the expression ``node`` names a DataModule, sampler, dataset or loader (not an attribute of an imported
    module, such as ``datasets.arrow_dataset``): a name, an attribute, or a call of a function or method so named,
    such as ``train_sampler(trainer)`` or ``self.val_dataloader()``."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name is None or not KIND_OBJECT.search(name):
        return False
    return not (isinstance(node, ast.Attribute) and _root(node) in modules)


def kind_classes(sources: dict[str, str]) -> set[str]:
    """Names of the DataModule, sampler, dataset and loader classes the package defines."""
    return {node.name for source in sources.values() for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and KIND_CLASS.search(node.name)}


def _class_names(node: ast.AST) -> list[str]:
    """The class names an ``isinstance`` second argument names: ``X``, ``mod.X``, a tuple of them."""
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _class_names(element)]
    if isinstance(node, ast.Name):
        return [node.id]
    return [node.attr] if isinstance(node, ast.Attribute) else []


def _attribute_name(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def kind_tests(sources: dict[str, str], classes: set[str] | None = None) -> list[tuple[str, int, str]]:
    """``(module, line, expression)`` of every place that decides what kind of DataModule, sampler, dataset or loader
    an object is by its attributes or its class.

    Reported: ``hasattr(x, name)``; ``getattr(x, name, default)`` (the default stands for "not of the kind that has
    it"); ``callable(getattr(x, ...))``; where ``x`` names a DataModule, sampler, dataset or loader
    (:data:`KIND_OBJECT`); and ``isinstance`` / ``issubclass`` against a DataModule, sampler, dataset or loader class
    of the package (``classes``, by default :func:`kind_classes`). Not reported: a check of an argument that only
    refuses (``if not isinstance(x, C): raise ...``); Python's own protocols (a dunder name such as
    ``__getitems__``, which ``torch.utils.data.DataLoader`` asks for the same way); attributes of an imported module
    (``datasets.arrow_dataset``).
    """
    classes = kind_classes(sources) if classes is None else classes
    found = []
    for module, source in sources.items():
        tree = ast.parse(source)
        parents, modules = _parents(tree), _imported_modules(tree)
        for node in ast.walk(tree):
            call = _call_name(node)
            if call is None or _is_guard(node, parents):
                continue
            args = node.args
            if call == "getattr" and _call_name(parents.get(node)) == "callable":
                continue  # callable(getattr(x, ...)) is one decision: reported as the callable(...) below
            if call in ("hasattr", "getattr") and len(args) >= 2 and _kind_object(args[0], modules):
                name = _attribute_name(args[1])
                if (call == "hasattr" or len(args) == 3) and not (name and name.startswith("__")
                                                                   and name.endswith("__")):
                    found.append((module, node.lineno, ast.unparse(node)))
            elif call == "callable" and args and _call_name(args[0]) == "getattr" and args[0].args \
                    and _kind_object(args[0].args[0], modules):
                found.append((module, node.lineno, ast.unparse(node)))
            elif call in ("isinstance", "issubclass") and len(args) == 2 and set(_class_names(args[1])) & classes:
                found.append((module, node.lineno, ast.unparse(node)))
    return sorted(found)


def test_no_module_decides_a_kind_by_attributes_or_class():
    sources = _sources()
    assert kind_tests(sources, kind_classes(sources)) == []


KIND_CLASSES = {"BalancedBatchSampler", "TokenDataset", "BalancedTextDataModule"}


@pytest.mark.parametrize("planted", [
    'hasattr(dm, "training_sampler")',
    'getattr(self.trainer.datamodule, "val_names", None)',
    'callable(getattr(sampler, "component_of", None))',
    'getattr(loader, "sampler", None)',
    "isinstance(dataset, TokenDataset)",
    "isinstance(self.sampler, (list, lit_balance.BalancedBatchSampler))",
    "issubclass(type(data_module), BalancedTextDataModule)",
    "sampler.plan(0) if hasattr(train_sampler, 'plan') else None",
    'getattr(train_sampler(trainer), "cost_model", None)',
    'hasattr(self.trainer.datamodule.val_dataloader(), "sampler")',
])
def test_the_kind_checker_reports_a_planted_kind_decision(planted):
    source = f"def f(self, dm, sampler, loader, dataset, data_module, train_sampler, trainer):\n    return {planted}\n"
    found = kind_tests({"lit_balance.planted": source}, KIND_CLASSES)
    assert [line for _, line, _ in found] == [2], found


@pytest.mark.parametrize("allowed", [
    # a check that refuses the wrong type is not a choice between kinds
    "if not isinstance(sampler, BalancedBatchSampler):\n        raise TypeError('a BalancedBatchSampler')",
    "if not (isinstance(dataset, TokenDataset) or callable(dataset)):\n        raise TypeError('x')",
    # asking the object, reading an attribute every such object has, a protocol, a module's attribute
    "return sampler.component_of(3), getattr(sampler, 'epoch'), dm.layout",
    "return getattr(self.dataset, '__getitems__', None)",
    "return getattr(datasets.arrow_dataset, 'Column', None)",
    # other objects, other classes; a call whose result is no DataModule, sampler, dataset or loader
    "return hasattr(trainer, 'x'), getattr(cost_class, 'fit', None), isinstance(batch, dict)",
    "return getattr(cost_of(sampler), 'linear', None), hasattr(trainer.fit_loop.state(), 'fn')",
    "return isinstance(trainer.accelerator, CPUAccelerator)",
])
def test_the_kind_checker_passes_a_planted_allowed_case(allowed):
    source = (f"import datasets\n\ndef f(self, dm, sampler, dataset, trainer, cost_class, batch):\n"
              f"    {allowed}\n")
    assert kind_tests({"lit_balance.planted": source}, KIND_CLASSES) == []


def test_the_kind_classes_are_the_packages_datamodules_samplers_datasets_and_loaders():
    classes = kind_classes(_sources())
    assert {"BalancedTextDataModule", "BalancedBatchSampler", "TokenDataset", "MicroBatchDataset",
            "BalancedDataLoader"} <= classes
    assert not classes & {"BatchingSettings", "Mixture", "CostModel"}


# Rule (b): the layout is asked of the planner object.
#: where the flag may be read: the settings that define and check it, and the one place the planner is chosen
PACKING_READERS = {("lit_balance.plan.settings", None), ("lit_balance.plan.epoch", "planner_for")}


def packing_reads(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(module, line, expression)`` of every read of the ``packing`` flag (``x.packing``, ``getattr(x,
    "packing", ...)``, ``x["packing"]``) outside :data:`PACKING_READERS`: the settings' own module, and
    ``planner_for``, where the planner is chosen. Passing it on (``packing=True``) and storing it are not reads."""
    found = []
    for module, source in sources.items():
        if (module, None) in PACKING_READERS:
            continue
        tree = ast.parse(source)
        allowed = {id(inner) for node in ast.walk(tree)
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (module, node.name) in PACKING_READERS
                   for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in allowed:
                continue
            read = (isinstance(node, ast.Attribute) and node.attr == "packing" and isinstance(node.ctx, ast.Load)) or (
                isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                and _attribute_name(node.slice) == "packing") or (
                _call_name(node) == "getattr" and len(node.args) >= 2 and _attribute_name(node.args[1]) == "packing")
            if read:
                found.append((module, node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_packing_flag_is_read_only_where_the_planner_is_chosen():
    assert packing_reads(_sources()) == []


def test_the_packing_flag_is_read_where_the_planner_is_chosen():
    # the rule reads the real planner_for (so the allowed place exists and reads the flag)
    source = _sources()["lit_balance.plan.epoch"]
    body = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "planner_for")
    assert any(isinstance(n, ast.Attribute) and n.attr == "packing" for n in ast.walk(body))


@pytest.mark.parametrize("planted", [
    "rows = fill(lengths) if settings.packing else pad(lengths)",
    'unit = "tokens per row" if getattr(dm, "packing", False) else "slots"',
    'layout = ProbeLayout(packing=saved["packing"])',
])
def test_the_packing_checker_reports_a_planted_read(planted):
    sources = {"lit_balance.plan.stats": f"def f(settings, dm, saved, lengths):\n    {planted}\n"}
    assert [line for _, line, _ in packing_reads(sources)] == [2]


def test_the_packing_checker_passes_the_planner_choice_and_passing_the_flag_on():
    sources = {
        "lit_balance.plan.epoch": "def planner_for(settings):\n    return PACKED if settings.packing else PADDED\n",
        "lit_balance.plan.settings": "class S:\n    def check(self):\n        return bool(self.packing)\n",
        "lit_balance.lightning.dm": "def f(planner):\n    s = S(packing=True)\n    s.packing = False\n"
                                    "    return planner.name, {'packing': True}\n",
    }
    assert packing_reads(sources) == []
    sources["lit_balance.plan.epoch"] += "\n\ndef other(settings):\n    return settings.packing\n"
    assert packing_reads(sources) == [("lit_balance.plan.epoch", 6, "settings.packing")]


# Rule (d): no private Lightning method is overridden.
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning")


def private_overrides(classes: list[type]) -> list[str]:
    """``Class._name`` for every private method (``_name``, not a dunder) a class defines that a Lightning class in
    its bases also defines: an override of Lightning's internals, which change between releases."""
    found = []
    for cls in classes:
        lightning = [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] in LIGHTNING_PACKAGES]
        for name, value in vars(cls).items():
            if not (name.startswith("_") and not name.endswith("__")) or not callable(value) and not isinstance(
                    value, (property, staticmethod, classmethod)):
                continue
            if any(name in vars(base) for base in lightning):
                found.append(f"{cls.__qualname__}.{name}")
    return sorted(found)


def _lightning_subclasses() -> list[type]:
    """The classes of the package that derive from a Lightning class: every module that imports Lightning (or the
    package's Lightning layer) is imported and its own classes are read."""
    out = []
    for module, source in _sources().items():
        if not re.search(r"^\s*(import|from)\s+(lightning|pytorch_lightning|lit_balance\.lightning)\b", source, re.M):
            continue
        loaded = importlib.import_module(module)
        out += [c for _, c in inspect.getmembers(loaded, inspect.isclass) if c.__module__ == module
                and any(b.__module__.split(".")[0] in LIGHTNING_PACKAGES for b in c.__mro__[1:])]
    return out


@pytest.mark.slow  # imports every module of the package that uses Lightning
def test_no_private_lightning_method_is_overridden():
    classes = _lightning_subclasses()
    assert {"BalanceProgressBar", "StragglerMonitor", "BalancedTextDataModule"} <= {c.__name__ for c in classes}
    assert private_overrides(classes) == []


def _planted_classes(source: str) -> list[type]:
    module = types.ModuleType("planted")
    exec(compile(source, "planted.py", "exec"), module.__dict__)
    return [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == "planted"]


def test_the_override_checker_reports_a_planted_private_override_and_passes_own_helpers():
    source = ("from lightning.pytorch.callbacks import RichProgressBar\n\n"
              "class Bar(RichProgressBar):\n"
              "    def _get_train_description(self, current_epoch):\n        return 'Epoch'\n\n"
              "    def _own_helper(self):\n        return 1\n\n"
              "    def get_metrics(self, trainer, pl_module):\n        return {}\n\n"
              "class Sub(Bar):\n    def _stop_progress(self):\n        pass\n\n"
              "class Plain:\n    def _get_train_description(self):\n        pass\n")
    assert private_overrides(_planted_classes(source)) == ["Bar._get_train_description", "Sub._stop_progress"]


# Rule (e): no stack-frame walking.
#: calls and attributes that read the live call stack
FRAME_CALLS = {"currentframe", "_getframe", "stack", "getouterframes", "getframeinfo"}
FRAME_ATTRIBUTES = {"f_back"}


def frame_walks(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(module, line, expression)`` of every read of the live call stack: ``inspect.currentframe()``,
    ``inspect.stack()``, ``inspect.getouterframes()``, ``sys._getframe()`` (also imported by name) and ``.f_back``.
    Reading the traceback of an exception that was caught (``error.__traceback__``) is not a walk of the callers."""
    found = []
    for module, source in sources.items():
        tree = ast.parse(source)
        by_name = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module in ("inspect", "sys") for alias in node.names if alias.name in FRAME_CALLS}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (node.attr in FRAME_ATTRIBUTES or (
                    node.attr in FRAME_CALLS and _root(node) in ("inspect", "sys"))):
                found.append((module, node.lineno, ast.unparse(node)))
            elif isinstance(node, ast.Name) and node.id in by_name and isinstance(node.ctx, ast.Load):
                found.append((module, node.lineno, node.id))
    return sorted(found)


def test_no_module_walks_the_call_stack():
    assert frame_walks(_sources()) == []


@pytest.mark.parametrize("planted", [
    "frame = sys._getframe(1)",
    "frame = inspect.currentframe().f_back",
    "callers = inspect.stack()",
    "frame = frame.f_back",
])
def test_the_frame_checker_reports_a_planted_walk(planted):
    source = f"import inspect\nimport sys\n\ndef f(frame):\n    {planted}\n"
    assert {line for _, line, _ in frame_walks({"lit_balance.planted": source})} == {5}


def test_the_frame_checker_reports_a_walk_imported_by_name_and_passes_a_caught_traceback():
    walk = "from sys import _getframe as caller\n\ndef f():\n    return caller(1).f_locals\n"
    assert frame_walks({"lit_balance.planted": walk}) == [("lit_balance.planted", 4, "caller")]
    caught = ("import traceback\n\ndef f(error):\n    tb = error.__traceback__\n"
              "    return traceback.format_tb(tb), tb.tb_frame.f_code.co_name\n")
    assert frame_walks({"lit_balance.planted": caught}) == []
