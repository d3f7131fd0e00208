"""Side-by-side measurements of lit_balance against peer samplers and packers, on the public API only: one script per
benchmark, each writing a dated report (``benchmarks._harness.write_report``); the commands and figures are in
``docs/benchmarks.md``. Run from the repository root: ``python -m benchmarks.<script> --help``."""
