"""The lit-balance command: LightningCLI fit on 2 CPU ranks, --print_config, and the plan report."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from launch import run_script  # launch.py (the repository root)
from lightning.pytorch.loggers import CSVLogger

from lit_balance.plan import PLANNERS
from lit_balance import BalancedBatchSampler, BalancedTextDataModule
from lit_balance.callbacks import BalanceProgressBar, PaddingRatioMonitor, RunSummary, StragglerMonitor
from lit_balance.cli import LitBalanceCLI, build_cli, main, plan_parser, run_plan
from lit_balance.demo import DemoTransformerLM
from lit_balance.plan.cost import CostModel
from lit_balance.plan.stats import plan_stats

ROOT = Path(__file__).resolve().parents[2]
FIT_CPU = ROOT / "conf" / "cli" / "fit_cpu.yaml"
LENGTHS = ROOT / "lit_balance" / "data" / "lengths"


@pytest.fixture(autouse=True)
def _program_name_only(monkeypatch):
    """In-process main(args) sees no pytest arguments in sys.argv (as when run from the shell)."""
    monkeypatch.setattr(sys, "argv", ["lit-balance"])


def _env(tmp_path: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "LIT_BALANCE_CACHE": str(tmp_path / "cache")}


def _run(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "lit_balance.cli", *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _forked_cli(args: list[str], tmp_path: Path) -> tuple[int, str]:
    """``python -m lit_balance.cli *args`` in ``tmp_path``, forked from a process that imported torch, Lightning and
    the package once (launch.py); its exit status and output (stdout with stderr merged)."""
    return run_script(Path(__file__).with_name("cli_main.py"), args, 180, cwd=tmp_path,
                      env={"LIT_BALANCE_CACHE": str(tmp_path / "cache")})


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["scripts"]["lit-balance"] == "lit_balance.cli:main"
    try:
        scripts = metadata.entry_points(group="console_scripts", name="lit-balance")
    except metadata.PackageNotFoundError:  # pragma: no cover - not installed
        pytest.skip("lit_balance is not installed")
    if scripts:  # installed with pip install -e . (an older install may predate the script)
        assert next(iter(scripts)).value == "lit_balance.cli:main"


@pytest.mark.slow
def test_console_script_exits_zero(tmp_path):
    script = shutil.which("lit-balance")
    if script is None:
        pytest.skip("the lit-balance console script is not installed (pip install -e .)")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in range(1, 200)), encoding="utf-8")
    proc = subprocess.run([script, "plan", "--lengths", str(lengths), "--max-tokens", "512", "--plots", "false",
                           "--output-dir", str(tmp_path / "out")], check=False, capture_output=True, text=True,
                          timeout=180, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "useful compute fraction" in proc.stdout and "LitBalanceCLI" not in proc.stdout + proc.stderr
    assert main(["plan", "--lengths", str(lengths), "--plots", "false", "--output-dir", str(tmp_path / "o")]) is None


def test_print_config_with_no_other_argument(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as excinfo:
        main(["fit", "--print_config"])
    assert excinfo.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["data"]["max_tokens"] == 4096 and cfg["data"]["corpus"] is None
    assert cfg["model"]["class_path"] == "lit_balance.demo.DemoTransformerLM"  # the default of any LightningModule
    model = cfg["model"]["init_args"]
    assert model["d_model"] == 128 and "vocab_size" not in model  # linked from the data module
    assert "devices" in cfg["trainer"] and cfg["seed_everything"] == 0


def test_fit_cpu_yaml_builds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule, args=["--config", str(FIT_CPU)], run=False,
                        seed_everything_default=0)
    assert isinstance(cli.datamodule, BalancedTextDataModule) and cli.datamodule.max_tokens == 1024
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size == 30522
    assert cli.model.hparams.d_model == 128
    assert cli.trainer.world_size == 2 and cli.trainer.max_steps == 40
    # the live figures: the monitors log them, the bar shows them; a metrics file and a checkpoint
    assert isinstance(cli.trainer.progress_bar_callback, BalanceProgressBar)
    assert {RunSummary, PaddingRatioMonitor, StragglerMonitor} <= {type(c) for c in cli.trainer.callbacks}
    assert isinstance(cli.trainer.logger, CSVLogger) and cli.trainer.checkpoint_callback is not None


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.e2e
def test_fit_two_steps_on_two_cpu_ranks(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(f"line {i} " + "some words here " * (i % 11 + 1) for i in range(120)), encoding="utf-8")
    args = ["fit", "--config", str(FIT_CPU), "--trainer.max_steps=2", "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1", "--model.d_model=32", "--model.num_heads=2", "--model.num_layers=1",
            "--model.dim_feedforward=64", f"--data.corpus={corpus}", "--data.max_tokens=256",
            "--data.val_fraction=0.1"]
    out = _run(args, tmp_path, timeout=300).stdout
    assert "data-parallel size 2" in out and "per-rank budget 256" in out
    assert re.search(r"^plan for 2 ranks: padding ratio 0\.\d{4} \| useful compute fraction [01]\.\d{4} \| "
                     r"micro-batches per rank \d+$", out, flags=re.MULTILINE), out[:2000]
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\s*(0|1|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)$",
        out, flags=re.MULTILINE)}
    assert set(rows) == {"0", "1", "total"}
    for rank in ("0", "1"):
        micro, real, padded = (int(x) for x in rows[rank][:3])
        assert micro == 2 and 0 < real <= padded <= 2 * 256
    run_dir = tmp_path / "lightning_logs" / "fit_cpu" / "version_0"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 2 and saved["data"]["corpus"] == str(corpus)
    # the output names the metrics file, the checkpoint and the plot, and they exist
    named = dict(re.findall(r"^(metrics file|checkpoint|training figures)[^:]*: (\S+)$", out, flags=re.MULTILINE))
    assert set(named) == {"metrics file", "checkpoint", "training figures"}, out[-2000:]
    assert Path(named["metrics file"]) == Path("lightning_logs/fit_cpu/version_0/metrics.csv")
    assert all((tmp_path / path).is_file() for path in named.values())
    assert "balance/straggler_ratio" in (tmp_path / named["metrics file"]).read_text().splitlines()[0]
    bar = " ".join(out[out.rindex("Epoch "):].split())  # the bar's last frame (wrapped at 80 columns)
    assert bar.startswith("Epoch 0 ") and "step: 2/2" in bar and "/-2" not in bar, bar[:600]
    assert re.search(r"window: steps 0-1 tokens/s: [\d,]+ straggler: \d\.\d\d .*padding \(epoch\): 0\.\d{3}",
                     bar), bar[:600]

    # the shipped config keeps the last step; the printed line resumes from it, and the resumed fit names what it wrote
    resume = re.search(r"^resume: (.*)$", out, flags=re.MULTILINE)
    assert resume, out[-2000:]
    command = shlex.split(resume[1])
    assert command[0] == "lit-balance" and command[1:-2] == [a for a in args if a != "--trainer.max_steps=2"], command
    assert command[-2:] == ["--ckpt_path=lightning_logs/fit_cpu/version_0/checkpoints/last.ckpt",
                            "--trainer.max_steps=4"], command
    started = time.time()
    out = _run(command[1:], tmp_path, timeout=300).stdout
    checkpoints = re.findall(r"^checkpoint: (\S+)$", out, flags=re.MULTILINE)
    assert sorted(Path(c).name for c in checkpoints) == ["epoch=0-step=4.ckpt", "last.ckpt"], out[-2000:]
    assert all(Path(c).parts[:3] == ("lightning_logs", "fit_cpu", "version_1") for c in checkpoints), checkpoints
    assert all((tmp_path / c).stat().st_mtime >= started for c in checkpoints)
    last = next(tmp_path / c for c in checkpoints if c.endswith("last.ckpt"))
    assert torch.load(last, weights_only=False)["global_step"] == 4


def test_plan_on_a_shipped_lengths_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    lengths_file = LENGTHS / "lengths_fortunes.npy"
    out_dir = tmp_path / "report"
    assert main(["plan", "--lengths", str(lengths_file), "--num-replicas", "4", "--max-tokens", "2048",
                 "--output-dir", str(out_dir)]) is None
    table = (out_dir / "plan_table.txt").read_text(encoding="utf-8")
    assert "BalancedBatchSampler" in table and "DistributedSampler, batch_size=" in table
    assert "useful compute fraction" in table and "useful compute fraction" in capsys.readouterr().out
    for png in ("lengths_histogram.png", "step_cost.png"):
        data = (out_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 400_000
    summary = json.loads((out_dir / "plan_summary.json").read_text(encoding="utf-8"))
    lengths = np.minimum(np.load(lengths_file), 512)  # --max-length defaults to 512
    for key in ("balanced", "distributed_sampler"):
        fig = summary[key]
        assert len(fig["ranks"]) == 4 and fig["max_batch_tokens"] <= 2048
        assert sum(r["real_tokens"] for r in fig["ranks"]) == int(lengths.sum())  # nothing lost or duplicated
        assert len({r["micro_batches"] for r in fig["ranks"]}) == 1
    bal, base = summary["balanced"], summary["distributed_sampler"]
    assert summary["baseline_batch_size"] == 2048 // int(lengths.max())
    assert bal["padding_ratio"] < 0.05 < base["padding_ratio"]
    assert bal["useful_fraction"] > base["useful_fraction"]
    assert bal["micro_batches_per_rank"] < base["micro_batches_per_rank"]
    # the per-rank table rows of the balanced plan, as printed
    first = table.split("DistributedSampler, batch_size=")[0]
    printed = re.findall(r"^\s*([0-3])\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.e+]+)\s*$", first, flags=re.MULTILINE)
    assert [int(r[2]) for r in printed] == [r["real_tokens"] for r in bal["ranks"]]


def test_plan_reports_the_bound_of_padded_shapes_beside_the_real_token_fraction(tmp_path):
    out_dir = tmp_path / "report"
    assert main(["plan", "--lengths", str(LENGTHS / "lengths_fortunes.npy"), "--num-replicas", "2", "--max-tokens",
                 "2048", "--padded-shapes", "8", "--plots", "false", "--output-dir", str(out_dir)]) is None
    shapes = json.loads((out_dir / "plan_summary.json").read_text(encoding="utf-8"))["shapes"]
    assert shapes["distinct_shapes"] <= 8 and 0 < shapes["real_token_fraction"] <= shapes["real_token_fraction_bound"]
    # the bound: every planned sample padded to the shortest of the 8 lengths that holds it
    lengths = np.minimum(np.load(LENGTHS / "lengths_fortunes.npy").astype(np.int64), 512)
    edges = np.array(sorted({int(k.split("x")[1]) for k in shapes["shapes"]}))
    assert shapes["real_token_fraction_bound"] >= lengths.sum() / edges[np.searchsorted(edges, lengths)].sum() - 1e-12
    table = " ".join((out_dir / "plan_table.txt").read_text(encoding="utf-8").split())  # the title wraps
    assert f"real-token fraction {shapes['real_token_fraction']:.4f} (bound of the shapes' lengths " \
           f"{shapes['real_token_fraction_bound']:.4f}" in table


def test_plan_matches_plan_stats_and_the_cost_model(tmp_path):
    lengths = np.load(LENGTHS / "lengths_stdlib_docstrings.npy")[:3000]
    np.savetxt(tmp_path / "lengths.txt", lengths, fmt="%d")
    cli = build_cli(["plan", "--lengths", str(tmp_path / "lengths.txt"), "--num-replicas", "3", "--max-tokens", "1024",
                "--max-length", "1000", "--quadratic", "0.001", "--per-batch", "50", "--seed", "7", "--epoch", "2",
                "--plots", "false", "--output-dir", str(tmp_path / "out")])
    summary = cli.plan_summary
    cost_model = CostModel(linear=1.0, quadratic=0.001, per_batch=50.0)
    sampler = BalancedBatchSampler(np.minimum(lengths, 1000), 1024, num_replicas=3, rank=0, seed=7,
                                   cost_model=cost_model)  # the sampler balances the same cost
    sampler.set_epoch(2)
    stats = plan_stats(sampler.plan(), sampler.lengths, cost_model)
    assert summary["balanced"]["useful_fraction"] == pytest.approx(stats.useful_fraction)
    assert [r["cost"] for r in summary["balanced"]["ranks"]] == pytest.approx(stats.rank_cost.sum(axis=0).tolist())
    assert summary["cost_unit"] == "cost units" and summary["settings"]["cost_model"]["per_batch"] == 50.0
    assert not (tmp_path / "out" / "step_cost.png").exists()


def test_plan_packed_on_a_shipped_lengths_file(tmp_path):
    lengths = np.minimum(np.load(LENGTHS / "lengths_fortunes.npy")[:4000], 512)
    np.save(tmp_path / "lengths.npy", lengths)
    out = tmp_path / "out"
    cli = build_cli(["plan", "--lengths", str(tmp_path / "lengths.npy"), "--num-replicas", "4", "--max-tokens", "2048",
                     "--packing", "true", "--quadratic", "0.001", "--seed", "3", "--plots", "false",
                     "--output-dir", str(out)])
    summary = cli.plan_summary
    bal = summary["balanced"]
    assert summary["settings"]["packing"] is True and bal["padding_ratio"] == 0.0 and bal["max_batch_tokens"] <= 2048
    cost_model = CostModel(quadratic=0.001)
    sampler = BalancedBatchSampler(lengths, 2048, num_replicas=4, rank=0, seed=3, packing=True, cost_model=cost_model)
    stats = plan_stats(sampler.plan(), sampler.lengths, cost_model, planner=PLANNERS["packed"], max_tokens=2048)
    assert bal["useful_fraction"] == pytest.approx(stats.useful_fraction) and bal["useful_fraction"] > 0.99
    assert bal["useful_fraction_bound"] == pytest.approx(stats.useful_fraction_bound)
    assert sum(r["real_tokens"] for r in bal["ranks"]) == int(lengths.sum())
    assert bal["micro_batches_per_rank"] == len(sampler)
    assert "useful compute fraction" in (out / "plan_table.txt").read_text(encoding="utf-8")


def test_plan_on_a_corpus(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "word " * (i % 50 + 1)}) for i in range(200)), encoding="utf-8")
    cli = build_cli(["plan", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--val-fraction", "0.1",
                "--max-tokens", "256", "--num-replicas", "2", "--plots", "false", "--output-dir", str(tmp_path / "o")])
    assert cli.plan_summary["num_samples"] == 180


def _plan_error(args: list[str], capsys) -> str:
    """Run ``plan`` in-process on bad input: it must exit with status 2 and print the message, no traceback."""
    with pytest.raises(SystemExit) as excinfo:
        main(["plan", "--plots", "false", *args])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: " in err
    return err.split("error: ", 1)[1]


@pytest.mark.parametrize("args,match", [
    (["--lengths", "missing.npy"], "--lengths 'missing.npy' is not a file"),
    (["--max-tokens", "100"], "exceed --max-tokens 100 .*or pass --too-long skip or --too-long truncate"),
    (["--linear", "0"], "--linear > 0 or --quadratic > 0"),
    (["--linear", "-1"], r"^--linear must be a finite number >= 0, got -1.0"),
    (["--accumulate-grad-batches", "0"], "--accumulate-grad-batches must be in \\[1, 1099511627776\\], got 0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--epoch", "-1"], "--epoch must be >= 0, got -1"),
    (["--max-length", "0"], "--max-length must be >= 1, got 0"),
    (["--max-length", "-5"], "--max-length must be >= 1, got -5"),
    (["--num-replicas", "0"], "--num-replicas must be >= 1, got 0"),
    (["--pad-to-multiple-of", "9000"], r"--pad-to-multiple-of \(9000\) exceeds --max-tokens \(4096\)"),
    (["--plan-window", "0"], r"^--plan-window must be in .*; a larger epoch is planned in windows$"),  # a word stays
])
def test_plan_errors_name_the_option(tmp_path, monkeypatch, capsys, args, match):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "l.npy", np.array([5, 120, 30], dtype=np.int32))
    base = ["--lengths", str(tmp_path / "l.npy")]
    message = _plan_error([*base, *args] if args[0] != "--lengths" else args, capsys)
    assert re.search(match, message), message
    assert "max_tokens" not in message and 'too_long="' not in message and "every length" not in message


def test_plan_data_kwargs_a_data_module_does_not_take_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    message = _plan_error(["--corpus", "missing.txt", "--data-kwargs", '{"bogus": 1}'], capsys)
    assert message.startswith("--data-kwargs names ['bogus'], which BalancedTextDataModule does not take")


def test_plan_run_plan_raises_with_flag_names(tmp_path):
    np.save(tmp_path / "l.npy", np.array([5, 120, 30], dtype=np.int32))
    cfg = plan_parser().parse_args(["--lengths", str(tmp_path / "l.npy"), "--max-tokens", "100", "--plots", "false"])
    with pytest.raises(ValueError, match="--max-tokens 100.*--too-long skip"):
        run_plan(cfg)
    with pytest.raises(ValueError, match="--max-length must be >= 1, got 0"):
        run_plan(plan_parser().parse_args(["--lengths", str(tmp_path / "l.npy"), "--max-length", "0"]))


def test_plan_rejects_a_bad_lengths_text_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "l.txt").write_text("12\nfoo\n")
    assert "one integer per line" in _plan_error(["--lengths", str(tmp_path / "l.txt")], capsys)


@pytest.mark.parametrize("kind,got", [
    ("not_numpy", "not a NumPy .npy array"),
    ("object", "array of Python objects"),
    ("float", "dtype float64"),
    ("zero", "token counts >= 1, got the length 0 at index 1"),
])
def test_plan_rejects_a_bad_npy_file_naming_lengths(tmp_path, monkeypatch, capsys, kind, got):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.npy"
    if kind == "not_numpy":
        path.write_bytes(b"\x80\x04K\x05.")  # a pickle, not a .npy
    elif kind == "object":
        np.save(path, np.array([3, "a"], dtype=object), allow_pickle=True)
    elif kind == "float":
        np.save(path, np.array([3.5, 2.0]))
    else:
        np.save(path, np.array([3, 0, 2]))
    message = _plan_error(["--lengths", str(path)], capsys)
    assert f"--lengths {str(path)!r}" in message and got in message
    if kind != "zero":
        assert "integer token counts" in message
    assert "allow_pickle" not in message and "pickled" not in message


def test_plan_corpus_errors_name_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": "a b c"}) + "\n", encoding="utf-8")
    base = ["--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache")]
    assert "set --text-key" in _plan_error([*base, "--text-key", "body"], capsys)
    assert "--val-fraction 0.5 leaves none" in _plan_error([*base, "--val-fraction", "0.5"], capsys)
    assert "--corpus file" in _plan_error(["--corpus", str(tmp_path / "missing.txt")], capsys)


@pytest.mark.slow
def test_plan_bad_max_length_exits_without_traceback_in_a_process(tmp_path):
    code, out = _forked_cli(["plan", "--lengths", str(LENGTHS / "lengths_fortunes.npy"), "--max-length", "0",
                             "--plots", "false"], tmp_path)
    assert code == 2, out[-3000:]
    assert "Traceback" not in out and "--max-length must be >= 1, got 0" in out
    assert "every length" not in out and not (tmp_path / "plan_report").exists()


def _fit_error(args: list[str], capsys) -> str:
    """Run ``fit`` in-process on a bad setting: exit status 2 and the message as the last stderr line, no traceback.

    Lightning's own lines ("Seed set to 0") and the tokenizing progress bar may come before it.
    """
    with pytest.raises(SystemExit) as excinfo:
        main(["fit", "--config", str(FIT_CPU), *args])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines[-1].startswith("lit-balance fit: error: "), err[-3000:]
    assert sum("error" in line for line in lines) == 1, err[-3000:]
    return lines[-1].split("error: ", 1)[1]


@pytest.mark.parametrize("arg,match", [
    ("--data.max_tokens=0", r"^--data\.max_tokens must be .*got 0\b"),
    ("--data.too_long=bogus", r"^--data\.too_long must be .*'bogus'"),
    ("--data.val_fraction=2", r"^--data\.val_fraction must be .*got 2\.0"),
    ("--data.pad_to_multiple_of=0", r"--data\.pad_to_multiple_of must be .*got 0\b"),
])
def test_fit_setting_errors_are_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, arg, match):
    monkeypatch.chdir(tmp_path)
    message = _fit_error([arg], capsys)
    assert re.search(match, message), message
    name = arg[len("--data."):].split("=")[0]
    assert re.search(rf"(?<![\w.-]){name}\b", message) is None, message  # every mention is the flag


def test_fit_callback_setting_error_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "callbacks.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: lit_balance.callbacks.PaddingRatioMonitor\n"
                      "      init_args:\n        log_every_n_micro_batches: 0\n", encoding="utf-8")
    message = _fit_error(["--config", str(config)], capsys)  # jsonargparse wraps the callback's ValueError
    assert message.startswith("PaddingRatioMonitor in --trainer.callbacks: log_every_n_micro_batches must be >= 1, "
                              "got 0"), message


def test_fit_setup_error_names_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIT_BALANCE_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "docs.txt"
    corpus.write_text("one short line\nanother line\n", encoding="utf-8")
    message = _fit_error([f"--data.corpus={corpus}", "--data.val_fraction=0.9", "--trainer.devices=1",
                          "--trainer.strategy=auto"], capsys)  # raised in the data module's setup, not __init__
    assert "--data.val_fraction=0.9" in message and "leaves none for training" in message, message
    assert re.search(r"(?<![\w.-])val_fraction\b", message) is None, message


def test_fit_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """An error that is not a library input check (here a TypeError outside lit_balance) is not turned into a line."""
    monkeypatch.chdir(tmp_path)

    def broken(*args, **kwargs):
        return None + 1

    monkeypatch.setattr("lit_balance.lightning.datamodule.resolve_corpus", broken)  # called in BalancedTextDataModule()
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["fit", "--config", str(FIT_CPU)])


def test_fit_debug_env_raises_the_setting_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(ValueError, match="^max_tokens must be in"):
        main(["fit", "--config", str(FIT_CPU), "--data.max_tokens=0"])


@pytest.mark.slow
def test_fit_bad_setting_exits_without_traceback_in_a_process(tmp_path):
    code, out = _forked_cli(["fit", "--config", str(FIT_CPU), "--data.max_tokens=0"], tmp_path)
    assert code == 2, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert "Traceback" not in out and lines[-1].startswith("lit-balance fit: error: "), out[-3000:]
    assert sum("error" in line for line in lines) == 1, out[-3000:]
    assert "--data.max_tokens" in lines[-1] and "got 0" in lines[-1]
    assert not (tmp_path / "lightning_logs").exists()  # failed before training started


def test_abbreviated_flags_are_rejected(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as excinfo:
        main(["fit", "--config", str(FIT_CPU), "--data.max_token=2048", "--print_config"])
    assert excinfo.value.code == 2 and "--data.max_token=2048" in capsys.readouterr().err
    np.save(tmp_path / "l.npy", np.array([5, 120, 30], dtype=np.int32))
    with pytest.raises(SystemExit) as excinfo:
        main(["plan", "--lengths", str(tmp_path / "l.npy"), "--max-token", "2048", "--plots", "false"])
    assert excinfo.value.code == 2 and "--max-token" in capsys.readouterr().err
    assert not (tmp_path / "plan_report").exists()


@pytest.mark.parametrize("args,error,close", [
    (["fit", "--trainer.max_step=3"], "lit-balance fit: error: unrecognized arguments: --trainer.max_step=3",
     "did you mean --trainer.max_steps?"),
    (["fit", "--data.max_tokenz", "3"], "lit-balance fit: error: unrecognized arguments: --data.max_tokenz 3",
     "did you mean --data.max_tokens?"),
    (["plan", "--max-tokenz=3"], "lit-balance plan: error: unrecognized arguments: --max-tokenz=3",
     "did you mean --max-tokens?"),
    (["fitt"], ("lit-balance: error: argument subcommand: invalid choice: 'fitt' (choose from 'fit', 'validate', "
                "'test', 'predict', 'plan', 'configs', 'tokenize', 'ledger')"), "did you mean fit?"),
    (["fit", "--xyzzy=1"], "lit-balance fit: error: unrecognized arguments: --xyzzy=1", None),
])
def test_a_mistyped_flag_is_one_line_with_a_suggestion(capsys, args, error, close):
    with pytest.raises(SystemExit) as excinfo:
        main(args)
    lines = capsys.readouterr().err.splitlines()
    assert excinfo.value.code == 2 and len(lines) == 1, lines
    prog = error.split(": error:")[0]
    assert lines[0] == error + (f"; {close}" if close else "") + f" (every option: {prog} --help)", lines


def test_a_mistyped_key_in_a_config_file_names_the_file_and_the_key_it_may_mean(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("mine.yaml").write_text("trainer:\n  max_step: 3\n")
    with pytest.raises(SystemExit) as excinfo:
        main(["fit", "--config", str(FIT_CPU), "--config", "mine.yaml"])
    lines = capsys.readouterr().err.splitlines()
    assert excinfo.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("lit-balance fit: error: ") and "'trainer.max_step' (in mine.yaml)" in lines[0], lines
    assert "did you mean trainer.max_steps?" in lines[0], lines


def test_fit_max_tokens_auto_on_cpu_without_memory_limit_is_one_line_before_ranks_start(tmp_path, monkeypatch,
                                                                                        capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as excinfo:
        main(["fit", "--config", str(FIT_CPU), "--data.max_tokens=auto"])
    lines = capsys.readouterr().err.splitlines()
    assert excinfo.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("lit-balance fit: error: --data.max_tokens=auto on a CPU needs --data.memory_limit"), lines
    assert "--data.memory_limit=8589934592" in lines[0] and "2**30" not in lines[0], lines
    assert not (tmp_path / "lightning_logs").exists()  # no rank started


def test_configs_writes_the_shipped_configs_and_recipes(tmp_path, capsys):
    main(["configs", str(tmp_path / "mine")])
    out = capsys.readouterr().out
    written = sorted(p.relative_to(tmp_path / "mine").as_posix() for p in (tmp_path / "mine").rglob("*") if p.is_file())
    shipped = sorted([p.relative_to(ROOT).as_posix() for p in (ROOT / "conf").rglob("*.yaml")]
                     + [p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").glob("*.py")])
    assert written == shipped and "conf/cli/fit_cpu.yaml" in written and "recipes/train.py" in written
    for rel in written:
        assert (tmp_path / "mine" / rel).read_bytes() == (ROOT / rel).read_bytes()
    assert f"wrote {len(written) - 2} configs" in out and "python recipes/train.py" in out
    # a second time it refuses to overwrite, naming the option
    (tmp_path / "mine" / "conf" / "config.yaml").write_text("mine: 1  # edited\n")
    with pytest.raises(SystemExit) as excinfo:
        main(["configs", str(tmp_path / "mine")])
    err = capsys.readouterr().err
    assert excinfo.value.code == 2 and "--overwrite true" in err and "existing files" in err
    assert (tmp_path / "mine" / "conf" / "config.yaml").read_text() == "mine: 1  # edited\n"
    main(["configs", str(tmp_path / "mine"), "--overwrite", "true"])
    assert (tmp_path / "mine" / "conf" / "config.yaml").read_bytes() == (ROOT / "conf" / "config.yaml").read_bytes()


def test_configs_and_recipes_are_package_data():
    # lit_balance/conf and lit_balance/recipes link to the repository's conf/ and recipes/; the package-data globs
    # of pyproject.toml take every config and recipe through them into a built wheel
    import glob

    assert (ROOT / "lit_balance" / "conf").resolve() == (ROOT / "conf").resolve()
    assert (ROOT / "lit_balance" / "recipes").resolve() == (ROOT / "recipes").resolve()
    line = next(line for line in (ROOT / "pyproject.toml").read_text(encoding="utf-8").splitlines()
                if line.startswith("lit_balance = ["))
    patterns = re.findall(r'"([^"]+)"', line)
    assert {"conf/**/*.yaml", "recipes/*.py"} <= set(patterns)
    packaged = {Path(p).relative_to(ROOT / "lit_balance").as_posix() for pattern in patterns
                for p in glob.glob(str(ROOT / "lit_balance" / pattern), recursive=True)}
    shipped = {p.relative_to(ROOT).as_posix()
               for p in [*(ROOT / "conf").rglob("*.yaml"), *(ROOT / "recipes").glob("*.py")]}
    assert shipped <= packaged and "conf/cli/fit_cpu.yaml" in shipped


def test_plan_output_dir_must_be_a_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "l.npy", np.array([5, 120, 30], dtype=np.int32))
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        message = _plan_error(["--lengths", str(tmp_path / "l.npy"), "--output-dir", str(out)], capsys)
        assert f"--output-dir {str(out)!r}" in message and "expected a directory" in message, message
        assert str(tmp_path / "afile") + "' is an existing file" in message, message
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("kind", ["npy", "txt"])
def test_plan_lengths_beyond_int64_name_index_and_value(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.chdir(tmp_path)
    huge = 2**63 + 5
    path = tmp_path / f"l.{kind}"
    if kind == "npy":
        np.save(path, np.array([5, huge, 7], dtype=np.uint64))
    else:
        path.write_text(f"5\n{huge}\n7\n", encoding="utf-8")
    message = _plan_error(["--lengths", str(path)], capsys)
    assert f"--lengths {str(path)!r}" in message and "index 1" in message and str(huge) in message, message
    assert "-9223372036854775" not in message and "int64 at row" not in message


def test_plan_with_per_rank_budgets(tmp_path, monkeypatch, capsys):
    """``--max-tokens`` takes a list, one budget per rank: each rank's micro-batches stay within its own."""
    lengths = np.minimum(np.load(LENGTHS / "lengths_fortunes.npy")[:3000], 512)
    np.save(tmp_path / "lengths.npy", lengths)
    cli = build_cli(["plan", "--lengths", str(tmp_path / "lengths.npy"), "--num-replicas", "3", "--max-tokens",
                     "[1024, 512, 1024]", "--plots", "false", "--output-dir", str(tmp_path / "out")])
    summary = cli.plan_summary
    assert summary["settings"]["max_tokens"] == [1024, 512, 1024]
    bal = summary["balanced"]
    assert sum(r["real_tokens"] for r in bal["ranks"]) == int(lengths.sum())
    assert len({r["micro_batches"] for r in bal["ranks"]}) == 1
    sampler = BalancedBatchSampler(lengths, [1024, 512, 1024], num_replicas=3, rank=0)
    plan = sampler.plan()
    slots = np.array([len(plan.batch(b)[0]) * int(lengths[plan.batch(b)[0]].max()) for b in range(plan.num_batches)])
    assert (slots[plan.assignment] <= np.array([1024, 512, 1024])).all()
    assert bal["micro_batches_per_rank"] == len(sampler)
    monkeypatch.chdir(tmp_path)
    message = _plan_error(["--lengths", str(tmp_path / "lengths.npy"), "--num-replicas", "3", "--max-tokens",
                           "[1024, 512]"], capsys)
    assert message.startswith("--max-tokens holds 2 per-rank budgets [1024, 512], but the data-parallel world has "
                              "--num-replicas 3 ranks; pass one budget per rank (a list of 3 ints)"), message


@pytest.mark.slow  # the probe runs real forward and backward passes of a model
def test_plan_max_tokens_auto_runs_the_probe_and_shows_its_budget(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "word " * (i % 60 + 1)}) for i in range(200)), encoding="utf-8")
    with open("/proc/self/status") as handle:
        rss = int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) * 1024
    model = json.dumps({"class_path": "lit_balance.demo.DemoTransformerLM",
                        "init_args": {"d_model": 16, "num_heads": 2, "num_layers": 1, "dim_feedforward": 32}})
    out = tmp_path / "o"
    cli = build_cli(["plan", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--val-fraction", "0",
                     "--max-tokens", "auto", "--memory-limit", str(rss + 300 * 2**20), "--model", model,
                     "--num-replicas", "2", "--plots", "false", "--output-dir", str(out)])
    budget = cli.plan_summary["token_budget"]
    assert json.loads((out / "token_budget.json").read_text()) == budget
    assert budget["per_rank"] == [budget["max_tokens"]] and budget["max_tokens"] >= 61  # one longest row at least
    table = (out / "plan_table.txt").read_text()
    assert "token budget probe (--max-tokens auto, on cpu): max_tokens=" in table
    assert f"max_tokens={budget['max_tokens']} padded slots per micro-batch per rank" in table


def test_plan_max_tokens_auto_without_a_model_names_what_to_pass(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join("word " * (i % 9 + 1) for i in range(40)), encoding="utf-8")
    message = _plan_error(["--corpus", str(corpus), "--cache-dir", str(tmp_path / "c"), "--max-tokens", "auto",
                           "--memory-limit", "1000000000", "--output-dir", str(tmp_path / "o")], capsys)
    assert "--max-tokens auto measures the budget with a model" in message and "--config" in message


def test_fit_with_per_rank_budgets_of_another_length_than_the_world_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    message = _fit_error(["--data.max_tokens=[512, 256, 256]"], capsys)  # fit_cpu.yaml: 2 ranks
    assert "holds 3 per-rank budgets [512, 256, 256]" in message and "num_replicas=2" in message, message


def test_plan_of_a_corpus_with_per_rank_budgets_plans_for_num_replicas(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join("word " * (i % 90 + 1) for i in range(300)), encoding="utf-8")
    cli = build_cli(["plan", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--num-replicas", "3",
                     "--max-tokens", "[512, 256, 256]", "--plots", "false", "--output-dir", str(tmp_path / "out")])
    summary = cli.plan_summary
    assert summary["settings"]["max_tokens"] == [512, 256, 256] and len(summary["balanced"]["ranks"]) == 3


def test_the_resume_command_keeps_the_arguments_and_replaces_the_checkpoint_and_steps():
    from lit_balance.cli.app import _resume_command

    argv = ["fit", "--config", "my conf.yaml", "--ckpt_path", "old.ckpt", "--trainer.max_steps", "5", "--data.seed=3"]
    assert _resume_command(argv, "new dir/last.ckpt", 10) == (
        "lit-balance fit --config 'my conf.yaml' --data.seed=3 '--ckpt_path=new dir/last.ckpt' --trainer.max_steps=10")
    assert _resume_command(["fit", "--ckpt_path=old.ckpt", "--trainer.max_steps=5"], "a.ckpt", None) == (
        "lit-balance fit --trainer.max_steps=5 --ckpt_path=a.ckpt")  # stopped early: the same steps


def test_skip_steps_is_a_datamodule_argument_of_the_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule,
                        args=["--config", str(FIT_CPU), "--data.skip_steps", "[[3, 5], [8, 9]]"], run=False,
                        seed_everything_default=0)
    assert cli.datamodule.skip_steps == [(3, 5), (8, 9)]


def test_max_length_schedule_is_a_datamodule_argument_of_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli = LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule,
                        args=["--config", str(FIT_CPU), "--data.max_length", "null",
                              "--data.max_length_schedule", "[[0, 32], [10, 128]]"], run=False,
                        seed_everything_default=0)
    assert cli.datamodule.max_length_schedule.points_as_given() == [(0, 32), (10, 128)]
    with pytest.raises(SystemExit):
        LitBalanceCLI(DemoTransformerLM, BalancedTextDataModule, args=["--help"], run=False)
    assert "--data.max_length_schedule" in capsys.readouterr().out
