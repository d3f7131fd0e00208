"""``python -m lit_balance.cli``: the ``lit-balance`` command."""

from lit_balance.cli import main

main()
