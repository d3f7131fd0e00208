"""``lit-balance plan`` on a mixture: the per-component share of every optimizer step against its target (table, JSON
summary, plot), from ``--corpus``, a LightningCLI fit config and a Hydra recipe's composed config; and the report's
shares against the DataModule's own plan summary."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lit_balance import BalancedTextDataModule, Mixture
from lit_balance.cli import build_cli, main
from lit_balance.plan.cost import CostModel
from lit_balance.plan.mixture import plan_mixture
from lit_balance.report import plan_report

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _program_name_only(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-balance"])


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two JSONL components (short and long documents) and a tokenization cache shared by the tests."""
    root = tmp_path_factory.mktemp("mixture")
    words = "the cat sat on a mat while dogs ran far away over green hills".split()
    (root / "web.jsonl").write_text("".join(json.dumps({"text": " ".join(words[(i + j) % 14] for j in range(4 + i % 9))})
                                            + "\n" for i in range(120)))
    (root / "code.jsonl").write_text("".join(json.dumps({"text": " ".join(f"x{(i * j) % 7} = {j}"
                                                                          for j in range(2 + i % 20))}) + "\n"
                                             for i in range(80)))
    return root


def _components(root):
    return {"web": {"corpus": str(root / "web.jsonl"), "weight": 0.7},
            "code": {"corpus": str(root / "code.jsonl"), "weight": 0.3}}


def _check_report(summary, out: Path, text: str, ranks: int, accumulate: int):
    mix = summary["mixture"]
    assert mix["names"] == ["web", "code"] and mix["target"] == pytest.approx([0.7, 0.3]) and mix["unit"] == "tokens"
    units = np.array(mix["step_units"])
    assert units.shape == (summary["balanced"]["optimizer_steps"], 2) and units.shape[0] >= 2
    # every real token of the balanced plan is some component's, in some step
    assert units.sum() == sum(r["real_tokens"] for r in summary["balanced"]["ranks"])
    shares = units / units.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(mix["step_shares"], shares)
    deviation = 100 * np.abs(shares - [0.7, 0.3])
    np.testing.assert_allclose(mix["max_deviation_pp"], deviation.max(axis=0))
    np.testing.assert_allclose(mix["p95_deviation_pp"], np.percentile(deviation, 95, axis=0))
    assert summary["settings"]["num_replicas"] == ranks
    assert summary["settings"]["accumulate_grad_batches"] == accumulate
    assert json.loads((out / "plan_summary.json").read_text())["mixture"] == mix
    png = out / "mixture_shares.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "mixture: each component's share of tokens per optimizer step" in text
    for c, name in enumerate(("web", "code")):
        row = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
        assert row.split()[1:2] == [f"{(0.7, 0.3)[c]:.4f}"]
        assert f"{mix['max_deviation_pp'][c]:.2f}" in row and f"{mix['p95_deviation_pp'][c]:.2f}" in row
    assert "mixture: each component's share of tokens per optimizer step" in (out / "plan_table.txt").read_text()


def test_plan_of_a_mixture_corpus_reports_the_shares_per_step_and_plots_them(corpora, tmp_path, capsys):
    out = tmp_path / "o"
    corpus = json.dumps({"components": _components(corpora)})
    cli = build_cli(["plan", "--corpus", corpus, "--cache-dir", str(corpora / "cache"), "--max-tokens", "128",
                     "--max-length", "64", "--num-replicas", "2", "--accumulate-grad-batches", "2",
                     "--output-dir", str(out)])
    text = capsys.readouterr().out
    assert text.startswith("plan of mixture of web 0.7, code 0.3 (shares of tokens)")
    _check_report(cli.plan_summary, out, text, ranks=2, accumulate=2)


def test_plan_of_a_fit_config_with_a_mixture(corpora, tmp_path, capsys):
    config = yaml.safe_load((ROOT / "conf" / "cli" / "fit_cpu.yaml").read_text())
    config["data"].update(corpus={"components": _components(corpora)}, cache_dir=str(corpora / "cache"),
                          max_tokens=128, max_length=64)
    config["trainer"].update(devices=3, accumulate_grad_batches=1)
    path = tmp_path / "fit_mixture.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / "o"
    assert main(["plan", "--config", str(path), "--output-dir", str(out)]) is None
    summary = json.loads((out / "plan_summary.json").read_text())
    _check_report(summary, out, capsys.readouterr().out, ranks=3, accumulate=1)


def test_plan_of_a_hydra_recipes_composed_config_with_data_mixture(corpora, tmp_path, capsys):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = ["data=mixture", f"data.corpus.components.web.corpus={corpora / 'web.jsonl'}",
                 f"data.corpus.components.code.corpus={corpora / 'code.jsonl'}", f"data.cache_dir={corpora / 'cache'}",
                 "data.max_tokens=128", "data.max_length=64", "trainer.accumulate_grad_batches=2"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    path = tmp_path / "run.yaml"  # as `python recipes/train.py <overrides> --cfg job` prints it (unresolved)
    path.write_text(OmegaConf.to_yaml(cfg))
    out = tmp_path / "o"
    assert main(["plan", "--config", str(path), "--output-dir", str(out)]) is None
    summary = json.loads((out / "plan_summary.json").read_text())
    _check_report(summary, out, capsys.readouterr().out, ranks=2, accumulate=2)
    assert summary["settings"]["pad_to_multiple_of"] == 8  # the mixture group's own settings


def test_a_hydra_group_file_alone_is_refused_with_what_to_do(tmp_path, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["plan", "--config", str(ROOT / "conf" / "data" / "mixture.yaml"), "--plots", "false",
              "--output-dir", str(tmp_path / "o")])
    assert excinfo.value.code == 2
    assert "is a Hydra group file" in capsys.readouterr().err


def test_the_datamodules_plan_summary_counts_the_mixture_planners_own_step_units(corpora):
    """Two computations: plan_summary (the report) counts the training sampler's plan row by row; the mixture planner
    keeps its own step units. The steps run in a shuffled order, so they agree as sets of steps."""
    dm = BalancedTextDataModule(Mixture(_components(corpora)), max_tokens=128, max_length=64, val_fraction=0.05,
                                cache_dir=corpora / "cache")
    dm.prepare_data()
    dm.setup("fit")
    settings = dm.settings.replace(accumulate_grad_batches=2)
    train = dm.train_dataset
    lengths = train.layout.tile(np.minimum(train.lengths, settings.truncate_to))
    planned = plan_mixture(lengths, train.layout, dm.mixture.settings, settings, num_replicas=2, epoch=0,
                           cost_model=CostModel())
    summary = dm.plan_summary(2, 2)["mixture"]
    np.testing.assert_array_equal(np.sort(np.array(summary["step_units"]), axis=0),
                                  np.sort(planned.step_units, axis=0))
    np.testing.assert_allclose(np.array(summary["max_deviation_pp"]) / 100, summary["max_step_deviation"])
    report = plan_report(None, num_replicas=2, sampler=dm.training_sampler(settings, 2, cost_model=CostModel()))
    assert report.mixture == {k: v for k, v in summary.items() if k != "max_step_deviation"}
