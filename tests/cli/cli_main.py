"""``python -m lit_balance.cli`` as a script with a ``__main__`` block, for runs forked from a process that imported
the package once (``launch.py`` runs a script's module body once before its runs)."""

from lit_balance.cli import main

if __name__ == "__main__":
    main()
