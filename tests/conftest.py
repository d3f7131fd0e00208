"""Settings for the whole test suite."""

from hypothesis import HealthCheck, settings

# No test may depend on this machine's speed: Hypothesis neither times examples out (deadline) nor fails a test
# whose data generation is slow on a busy machine (too_slow). A test's own @settings only overrides what it names.
settings.register_profile("lit_balance", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lit_balance")

# Two conftest.py files share the module name "conftest": keep --doctest-modules from importing them as modules
# (pytest still loads both as conftests).
collect_ignore = ["conftest.py", "lightning/callbacks/conftest.py"]
