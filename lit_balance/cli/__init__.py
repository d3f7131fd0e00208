"""The ``lit-balance`` command: Lightning CLI subcommands (fit, validate, ...) and the ``plan`` dry run.

Run:
    lit-balance fit --config conf/cli/fit_cpu.yaml          # 2 CPU DDP ranks, the demo model, the built-in corpus
    lit-balance fit --print_config                          # every option with its default
    lit-balance plan --lengths lit_balance/data/lengths/lengths_fortunes.npy --num-replicas 8 --max-tokens 2048
    lit-balance plan --config conf/cli/fit_cpu.yaml          # the plan that fit config trains on
    lit-balance fit --config conf/cli/fit_cpu.yaml --model.class_path=my_package.MyModule   # any LightningModule
    python -m lit_balance.cli plan --help                   # the same without the console script
    lit-balance tokenize corpus/ --output-folder tokens      # JSONL to a datatrove token store (datatrove's executor)

``fit``, ``validate``, ``test`` and ``predict`` are :class:`lightning.pytorch.cli.LightningCLI`'s: the model is any
LightningModule (``--model.class_path=my.Module``, its arguments ``--model.*``; default
:class:`~lit_balance.demo.DemoTransformerLM`), the data :class:`~lit_balance.BalancedTextDataModule` (``--data.*``); a
model whose ``__init__`` takes ``vocab_size`` gets the built data module's, and callbacks are set with
``--trainer.callbacks`` (class paths and init args) in the config. ``plan`` plans one epoch without
training and reports it (see :mod:`lit_balance.report`); ``plan --config`` also reads a ``fit`` config and plans
with its data settings, its ranks (``trainer.devices`` x ``trainer.num_nodes``) and its
``trainer.accumulate_grad_batches``. ``tokenize`` runs datatrove's tokenizer on a corpus
(:mod:`lit_balance.cli.tokenize`); training then reads its output in place
(:class:`~lit_balance.data.stores.datatrove.DatatroveSource`).
"""

from lit_balance.cli.app import LitBalanceCLI, build_cli, main
from lit_balance.cli.plan import plan_options_from_fit, plan_parser, run_plan

__all__ = ["LitBalanceCLI", "build_cli", "main", "plan_options_from_fit", "plan_parser", "run_plan"]
