"""The main job, recipes/train.py on conf/config.yaml, as a user runs it: a Hydra app, 2 CPU DDP ranks."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "train.py"


def _env(tmp_path: Path) -> dict[str, str]:
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # the default cache; the run below names its own, so nothing may land here
    return {**os.environ, "LIT_BALANCE_CACHE": str(tmp_path / "default_cache"), "PYTHONPATH": python_path}


def _table(out: str) -> dict[str, tuple[str, ...]]:
    """RunSummary's rows: rank -> (micro-batches, real tokens, padded slots, padding ratio, compute s, wait s, other s)."""
    return {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\s*(0|1|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)$", out,
        flags=re.MULTILINE)}


@pytest.mark.ddp
def test_train_recipe_prints_per_rank_summary(tmp_path):
    # conf/experiment/smoke.yaml: 3 steps of a tiny model, max_tokens=512; a group choice, key overrides and a
    # relative cache directory, which every rank must read from the launch directory
    overrides = ["experiment=smoke", "trainer.log_every_n_steps=1", "data.cache_dir=cache"]  # the default callbacks
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert out.startswith("data-parallel size 2 | per-rank budget 512 padded slots per micro-batch | global budget 1024 ")
    assert "standard library docstrings" in out.splitlines()[0]
    # the plan summary (BalancedTextDataModule.plan_summary) comes second and predicts the epoch's length
    plan = re.match(r"plan for 2 ranks: padding ratio (0\.\d{4}) \| useful compute fraction (0\.\d{4}|1\.0000) \| "
                    r"micro-batches per rank (\d+)$", out.splitlines()[1])
    assert plan, out.splitlines()[:3]
    assert re.search(rf"micro-batches per rank per epoch {plan.group(3)} \|", out)
    rows = _table(out)
    assert set(rows) == {"0", "1", "total"}
    for rank in ("0", "1"):
        micro, real, padded, ratio, compute, wait, _ = rows[rank]
        assert int(micro) == 3 and 0 < int(real) <= int(padded) <= 3 * 512
        assert abs(float(ratio) - (1 - int(real) / int(padded))) < 1e-4
        assert float(compute) > 0 and float(wait) >= 0
    assert int(rows["total"][1]) == int(rows["0"][1]) + int(rows["1"][1])
    assert re.search(r"^wall \d+\.\d s \| straggler ratio \d\.\d{3} ", out, flags=re.MULTILINE)
    assert re.search(r"last train/loss \d+\.\d+", out)

    # both ranks worked in the launch directory: one tokenization cache and one Hydra run directory, nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "outputs"]
    assert any((tmp_path / "cache").iterdir())
    (run_dir,) = (tmp_path / "outputs" / "train").glob("*/*")
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "logs", "train.log", "train_ddp_process_1.log"]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["checkpoints", "hparams.yaml", "metrics.csv",
                                                                    "training.png"]
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) == overrides  # rank 0's record

    # the last lines name the metrics file, the checkpoint and the plot, which exist
    named = dict(re.findall(r"^(metrics file|checkpoint|training figures)[^:]*: (\S+)$", out, flags=re.MULTILINE))
    assert set(named) == {"metrics file", "checkpoint", "training figures"}, out[-2000:]
    rel = run_dir.relative_to(tmp_path) / "logs"
    assert (named["metrics file"], named["training figures"]) == (str(rel / "metrics.csv"), str(rel / "training.png"))
    assert re.fullmatch(re.escape(str(rel / "checkpoints")) + r"/epoch=0-step=3\.ckpt", named["checkpoint"])
    assert all((tmp_path / path).is_file() for path in named.values())
    header = (run_dir / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"step", "train/loss", "balance/real_tokens_per_s", "balance/padding_ratio_rank1",
            "balance/straggler_ratio", "balance/compute_s_rank1", "balance/data_wait_s_rank0"} <= set(header)

    # the progress bar (rank 0, stdout; its last frame, wrapped at 80 columns): the epoch, the step, the figures
    bar = " ".join(out[out.rindex("Epoch "):].split())
    assert bar.startswith("Epoch 0 ") and "/-2" not in bar and "0.00it/s" not in bar, bar[:600]
    assert re.search(r"step: 3/3 tokens/s: [\d,]+ padding: 0\.\d{3} straggler: \d\.\d\d", bar), bar[:600]


@pytest.mark.slow
def test_config_dir_and_config_name_select_another_config(tmp_path):
    # Hydra's own flags: a user's directory searched first, with a primary config that extends conf/config.yaml
    my_conf = tmp_path / "my_conf"
    (my_conf / "trainer").mkdir(parents=True)
    (my_conf / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\nseed: 7\n")
    shutil.copy(ROOT / "conf" / "trainer" / "cpu_ddp.yaml", my_conf / "trainer" / "my_trainer.yaml")
    args = ["--config-dir", "my_conf", "--config-name", "mine", "trainer=my_trainer", "trainer.devices=1", "--cfg", "job"]
    proc = subprocess.run([sys.executable, str(RECIPE), *args], check=False, capture_output=True, text=True,
                          timeout=120, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["seed"] == 7 and cfg["data"]["seed"] == "${seed}" and cfg["trainer"]["devices"] == 1
    assert cfg["model"]["_target_"] == "lit_balance.demo.DemoTransformerLM"
    assert list(cfg["callbacks"]) == ["run_summary", "padding_monitor", "straggler_monitor", "progress_bar"]
    assert not (tmp_path / "outputs").exists()  # --cfg prints and exits: no run


@pytest.mark.slow
def test_a_mistyped_key_fails_with_hydras_hint(tmp_path):
    proc = subprocess.run([sys.executable, str(RECIPE), "trainer.devicez=4"], check=False, capture_output=True,
                          text=True, timeout=120, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 1 and "+trainer.devicez=4" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.ddp
def test_train_recipe_trains_packed_with_data_packing_true(tmp_path):
    overrides = ["experiment=smoke", "data.packing=true", "callbacks=[run_summary]", "data.cache_dir=cache"]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert out.startswith("data-parallel size 2 | per-rank budget 512 tokens per packed row per micro-batch | ")
    rows = _table(out)
    assert set(rows) == {"0", "1", "total"}
    for rank in ("0", "1", "total"):
        micro, real, slots, ratio = rows[rank][:4]
        assert 0 < int(real) == int(slots) and float(ratio) == 0.0  # packed rows: no padding at all
        assert int(micro) == (6 if rank == "total" else 3) and int(slots) <= int(micro) * 512
    assert re.search(r"last train/loss \d+\.\d+", out)


def test_train_recipe_runs_without_a_progress_bar_when_asked(tmp_path):
    # the default callbacks hold the live-figures bar; trainer.enable_progress_bar=false leaves it out
    overrides = ["experiment=smoke", "trainer.enable_progress_bar=false", "data.cache_dir=cache"]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert set(_table(proc.stdout)) == {"0", "1", "total"} and "Epoch 0" not in proc.stdout


@pytest.mark.ddp
@pytest.mark.slow
def test_train_recipe_with_max_tokens_auto_measures_the_budget_on_both_ranks(tmp_path):
    overrides = ["experiment=smoke", "data.max_tokens=auto", f"data.memory_limit={3 * 2**29}",
                 "callbacks=[run_summary]", "data.cache_dir=cache"]
    proc = subprocess.run([sys.executable, str(RECIPE), *overrides], check=False, capture_output=True, text=True,
                          timeout=600, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert out.startswith("data-parallel size 2 | per-rank budget: auto, measured before the first epoch"), out[:300]
    budget = re.search(r"^token budget: max_tokens=(\d+) padded token slots per micro-batch, every rank \(probe;", out,
                       flags=re.MULTILINE)
    assert budget and int(budget.group(1)) > 0, out[-3000:]
