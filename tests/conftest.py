"""Settings for the whole test suite."""

import os
import sys
from pathlib import Path

# Two pytest-xdist workers share the machine's cores, and the processes a test starts (ranks, recipes) run beside the
# other worker: one intra-op thread per process, unless set otherwise, so that OpenMP threads of several processes do
# not spin against each other (on 2 cores, two 2-thread ranks beside a worker took 5x the CPU time of 1-thread ones).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# tests/ddp's fit scripts and helpers are imported by tests in other folders too: on the path however few tests are
# selected (the launcher that starts processes, launch.py, is at the repository's root: pyproject's pytest pythonpath)
sys.path.append(str(Path(__file__).with_name("ddp")))

# No test may depend on this machine's speed: Hypothesis neither times examples out (deadline) nor fails a test
# whose data generation is slow on a busy machine (too_slow). A test's own @settings only overrides what it names.
settings.register_profile("lit_balance", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lit_balance")

# Two conftest.py files share the module name "conftest": keep --doctest-modules from importing them as modules
# (pytest still loads both as conftests).
collect_ignore = ["conftest.py", "lightning/callbacks/conftest.py"]


def _weight(item) -> int:
    """0 for real multi-process runs, 1 for other tests that start processes or take long, 2 for the rest."""
    return 0 if item.get_closest_marker("ddp") else 1 if item.get_closest_marker("slow") else 2


def pytest_collection_modifyitems(config, items):
    """Modules with multi-process runs first, then the other slow ones, then the rest (stable otherwise).

    With ``-n 2 --dist loadscope --no-loadscope-reorder`` (pyproject.toml) the workers take whole modules in this
    order, so the long modules start first and the many short ones fill both workers up to the end; pytest-xdist's
    own order (most tests first) left the few-test multi-process modules for last, one worker idle beside the other.
    """
    module_weight = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        module_weight[module] = min(module_weight.get(module, 2), _weight(item))
    items.sort(key=lambda item: module_weight[item.nodeid.split("::", 1)[0]])
