"""The lit-balance command with any LightningModule (--model.class_path) and `plan --config <a fit config>`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from lit_balance import BalancedTextDataModule
from lit_balance.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIT_CPU = ROOT / "conf" / "cli" / "fit_cpu.yaml"
#: the installed console script (pip install -e . puts it beside the interpreter)
CONSOLE = Path(sys.executable).with_name("lit-balance")

MODELS = '''
import lightning as L
import torch

from lit_balance import StepTokenLoss, token_loss_sum


class CountingLM(L.LightningModule):
    """A model without vocab_size: hashes token ids into a fixed table."""

    def __init__(self, buckets: int = 64, hidden: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.buckets = buckets
        self.embed = torch.nn.Embedding(buckets, hidden)
        self.head = torch.nn.Linear(hidden, buckets)
        self.step_loss = StepTokenLoss()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"] % self.buckets
        labels = batch["labels"].where(batch["labels"] < 0, batch["labels"] % self.buckets)
        loss_sum, n = token_loss_sum(self.head(self.embed(ids)), labels)
        self.steps += 1
        return self.step_loss.micro_batch(self, batch, loss_sum, n)

    def on_before_optimizer_step(self, optimizer):
        self.step_loss.finish_step(self)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class VocabLM(CountingLM):
    """A model that takes vocab_size: it gets the data module's."""

    def __init__(self, vocab_size: int, hidden: int = 8):
        super().__init__(buckets=vocab_size, hidden=hidden)
        self.save_hyperparameters()
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """A user's module on sys.path, as `my_models.CountingLM` would be."""
    (tmp_path / "my_models.py").write_text(MODELS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-balance"])
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(f"line {i} " + "some words here " * (i % 7 + 1) for i in range(60)), encoding="utf-8")
    yield corpus
    sys.modules.pop("my_models", None)


def _fit(corpus: Path, *args: str):
    from lit_balance.cli import build_cli

    bar = [] if any(a.startswith("--trainer.enable_progress_bar") for a in args) else [
        "--trainer.enable_progress_bar=false"]
    return build_cli(["fit", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=2",
                      "--trainer.logger=false", "--trainer.enable_checkpointing=false", *bar,
                      "--trainer.limit_val_batches=0", f"--data.corpus={corpus}", "--data.max_tokens=256",
                      "--data.val_fraction=0.1", *args])


@pytest.mark.parametrize("takes_vocab_size", [False, True])
def test_fit_trains_any_lightning_module_and_links_vocab_size_only_when_it_is_taken(user_models, tmp_path,
                                                                                    takes_vocab_size):
    name = "VocabLM" if takes_vocab_size else "CountingLM"
    cli = _fit(user_models, f"--model.class_path=my_models.{name}", "--model.hidden=4")
    model = cli.model
    assert type(model).__name__ == name and model.steps == 2 and cli.trainer.global_step == 2
    assert model.hparams["hidden"] == 4
    if takes_vocab_size:
        assert model.hparams["vocab_size"] == cli.datamodule.vocab_size == model.embed.num_embeddings == 30522
    else:
        assert "vocab_size" not in model.hparams and model.embed.num_embeddings == 64
    # the checkpoint's hyperparameters rebuild the model (a stray vocab_size would be an unexpected argument)
    path = tmp_path / "last.ckpt"
    cli.trainer.save_checkpoint(path)
    again = type(model).load_from_checkpoint(path)
    assert again.embed.num_embeddings == model.embed.num_embeddings and again.hparams["hidden"] == 4


def test_a_config_picks_the_model_by_class_path_and_the_saved_config_names_it(user_models, tmp_path):
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({"model": {"class_path": "my_models.CountingLM", "init_args": {"buckets": 32}}}))
    cli = _fit(user_models, "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'logs'}")
    assert type(cli.model).__name__ == "CountingLM" and cli.model.hparams["buckets"] == 32
    saved = yaml.safe_load((tmp_path / "logs" / "config.yaml").read_text())
    assert saved["model"] == {"class_path": "my_models.CountingLM", "init_args": {"buckets": 32, "hidden": 8}}


@pytest.mark.slow
def test_the_installed_console_script_finds_a_model_module_in_the_working_directory(tmp_path):
    """`lit-balance fit --model.class_path=my_models.CountingLM` with my_models.py in the working directory only."""
    assert CONSOLE.is_file(), f"no console script at {CONSOLE}: install the package (pip install -e .)"
    (tmp_path / "my_models.py").write_text(MODELS, encoding="utf-8")
    (tmp_path / "docs.txt").write_text("\n".join(f"line {i} " + "some words here " * (i % 7 + 1) for i in range(60)),
                                       encoding="utf-8")
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != tmp_path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path), "LIT_BALANCE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([str(CONSOLE), "fit", "--model.class_path=my_models.CountingLM", "--trainer.accelerator=cpu",
                           "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
                           "--trainer.logger=false",  # (TensorBoard's or CSV's, by what is installed: not the point)
                           "--data.corpus=docs.txt", "--data.max_tokens=256", "--data.val_fraction=0.1"],
                          check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "`max_steps=2` reached" in proc.stderr + proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    assert re.search(r"^checkpoint: checkpoints/epoch=0-step=2\.ckpt$", proc.stdout,
                     flags=re.MULTILINE), proc.stdout[-2000:]
    assert "no metrics file: the Trainer has no logger (set trainer.logger)" in proc.stdout
    bar = " ".join(proc.stdout[proc.stdout.rindex("Epoch "):].split())  # the bar's last frame
    assert bar.startswith("Epoch 0 ") and "/-2" not in bar and "step: 2/2" in bar, bar[:600]


def test_an_argument_the_chosen_model_lacks_is_an_error(user_models, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["fit", "--model.class_path=my_models.CountingLM", "--model.d_model=16", "--print_config"])
    assert excinfo.value.code == 2 and "d_model" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- plan --config
def _fit_config(tmp_path: Path, corpus: Path, devices, accumulate: int = 2) -> Path:
    config = tmp_path / "my_fit.yaml"
    config.write_text(textwrap.dedent(f"""\
        trainer:
          accelerator: cpu
          devices: {devices}
          num_nodes: 1
          accumulate_grad_batches: {accumulate}
        model:
          class_path: my_models.CountingLM
        data:
          corpus: {corpus}
          max_tokens: 128
          max_length: 24
          val_fraction: 0.1
          seed: 3
          shuffle_window: 0.0
          add_special_tokens: true
          cost_model:
            linear: 1.0
            quadratic: 0.01
        """), encoding="utf-8")
    return config


def test_plan_with_a_fit_config_plans_what_that_fit_trains_on(user_models, tmp_path, capsys):
    config = _fit_config(tmp_path, user_models, devices=3)
    summary = main_plan(["--config", str(config)], tmp_path)
    # the data module the fit config builds (every data argument, add_special_tokens included), 3 ranks,
    # accumulation 2: the preview a user gets from Python
    dm = BalancedTextDataModule(str(user_models), max_tokens=128, max_length=24, val_fraction=0.1, seed=3,
                                shuffle_window=0.0, add_special_tokens=True,
                                cost_model=__import__("lit_balance").CostModel(linear=1.0, quadratic=0.01))
    expected = dm.plan_summary(num_replicas=3, accumulate_grad_batches=2)
    assert summary == expected
    assert summary["balanced"]["micro_batches_per_rank"] > 1
    without_bos = BalancedTextDataModule(str(user_models), max_tokens=128, max_length=24, val_fraction=0.1, seed=3,
                                         shuffle_window=0.0).plan_summary(num_replicas=3, accumulate_grad_batches=2)
    assert summary != without_bos  # add_special_tokens reached the plan
    out = capsys.readouterr().out
    assert "3 ranks, max_tokens=128" in out
    # a flag after the config overrides it
    assert main_plan(["--config", str(config), "--num-replicas", "2"], tmp_path) == dm.plan_summary(2, 2)


def main_plan(args: list[str], tmp_path: Path) -> dict:
    from lit_balance.cli import build_cli

    return build_cli(["plan", *args, "--plots", "false", "--output-dir", str(tmp_path / "report")]).plan_summary


def test_plan_with_a_fit_config_of_devices_auto_says_what_to_set(user_models, tmp_path, capsys):
    config = _fit_config(tmp_path, user_models, devices="auto")
    with pytest.raises(SystemExit) as excinfo:
        main_plan(["--config", str(config)], tmp_path)
    err = capsys.readouterr().err
    assert excinfo.value.code == 2 and "trainer.devices is 'auto'" in err and "set trainer.devices to a number" in err


def test_plan_with_the_shipped_fit_config_reads_its_data_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-balance"])
    from lit_balance.cli import build_cli

    cli = build_cli(["plan", "--config", str(FIT_CPU), "--lengths", str(_lengths(tmp_path)), "--plots", "false",
                     "--output-dir", str(tmp_path / "r")])
    plan = cli.config.plan
    assert (plan.num_replicas, plan.max_tokens, plan.max_length, plan.val_fraction, plan.accumulate_grad_batches) == (
        2, 1024, 256, 0.02, 1)
    assert plan.shuffle_window == 0.25 and plan.seed == 0 and plan.too_long == "error"
    # data arguments without a plan flag reach the data module; loading-only ones (num_workers) do not
    assert plan.data_kwargs["add_special_tokens"] is False and plan.data_kwargs["txt_documents"] == "line"
    assert "num_workers" not in plan.data_kwargs and "max_tokens" not in plan.data_kwargs


def _lengths(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.npy"
    np.save(path, np.arange(1, 300, dtype=np.int64))
    return path


def test_plan_config_that_is_neither_names_both_readings(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-balance"])
    config = tmp_path / "bad.yaml"
    config.write_text("max_tokenz: 5\n", encoding="utf-8")
    with pytest.raises(SystemExit) as excinfo:
        main(["plan", "--config", str(config)])
    err = capsys.readouterr().err
    assert excinfo.value.code == 2 and "neither plan options" in err and "nor a lit-balance fit config" in err
    assert "max_tokenz" in err


@pytest.mark.parametrize("bar", [True, False])
def test_fit_without_a_config_gets_the_balance_progress_bar_unless_the_bar_is_off(user_models, bar):
    from lightning.pytorch.callbacks import ProgressBar

    from lit_balance.callbacks import BalanceProgressBar

    cli = _fit(user_models, "--model.class_path=my_models.CountingLM", f"--trainer.enable_progress_bar={bar}")
    bars = [c for c in cli.trainer.callbacks if isinstance(c, ProgressBar)]
    assert [type(b) for b in bars] == ([BalanceProgressBar] if bar else [])


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.e2e
def test_fit_with_max_tokens_auto_trains_on_two_ranks_and_resumes_without_probing_again(tmp_path):
    """`lit-balance fit --data.max_tokens=auto` with a model module of the working directory, 2 CPU ranks: the probe
    runs at fit start (the banner before says so, with no made-up budget), and a resume plans with the saved budget."""
    assert CONSOLE.is_file(), f"no console script at {CONSOLE}: install the package (pip install -e .)"
    (tmp_path / "my_models.py").write_text(MODELS, encoding="utf-8")
    (tmp_path / "docs.txt").write_text("\n".join(f"line {i} " + "some words here " * (i % 7 + 1) for i in range(60)),
                                       encoding="utf-8")
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != tmp_path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(python_path), "LIT_BALANCE_CACHE": str(tmp_path / "cache")}
    common = [str(CONSOLE), "fit", "--model.class_path=my_models.CountingLM", "--trainer.accelerator=cpu",
              "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.limit_val_batches=0",
              "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--data.corpus=docs.txt",
              "--data.max_tokens=auto", f"--data.memory_limit={2 * 2**30}", "--data.val_fraction=0.1",
              "--data.max_length=64"]

    def run(*args):
        proc = subprocess.run([*common, *args], check=False, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout + proc.stderr

    first = run("--trainer.max_epochs=1")
    assert "per-rank budget: max_tokens=auto, measured at fit start" in first, first[-3000:]
    assert "budget 8192" not in first and "budget 4096" not in first
    measured = re.search(r"token budget: max_tokens=(\d+) padded token slots per micro-batch, every rank \(probe;",
                         first)
    assert measured, first[-3000:]
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    second = run("--trainer.max_epochs=2", f"--ckpt_path={checkpoint}")
    restored = re.search(r"token budget: max_tokens=(\d+) padded token slots per micro-batch, every rank "
                         r"\(checkpoint;", second)
    assert restored and restored.group(1) == measured.group(1), second[-3000:]
    assert "(probe;" not in second  # no probe on resume
    assert "max_epochs=2` reached" in second, second[-2000:]
