"""research/ is no part of the package's test tiers (pyproject's testpaths are tests and lit_balance): run these tests
by hand, ``python -m pytest research/tests -p no:cacheprovider``; they need the ``bench`` extra (scipy, transformers)."""
