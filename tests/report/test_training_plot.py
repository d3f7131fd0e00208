"""The training plot: a CSVLogger metrics file read back exactly and drawn per rank over steps."""

from __future__ import annotations

import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger
from PIL import Image

from lit_balance.report import read_metrics_csv, save_training_plot
from lit_balance.report.plots import STRAGGLER_MIN_SPAN, training_figure, training_plot_data


def _metrics_file(tmp_path, ranks: int = 2):
    logger = CSVLogger(save_dir=str(tmp_path), name="", version="")
    for step in (10, 20, 30):
        window = {"balance/straggler_ratio": 1.0 + step / 100}
        for r in range(ranks):
            window[f"balance/compute_s_rank{r}"] = step / 10 + r
            window[f"balance/data_wait_s_rank{r}"] = 0.1 * r
            window[f"balance/rank_wait_s_rank{r}"] = 0.2 * r
            window[f"balance/other_s_rank{r}"] = 0.3 + r
        logger.log_metrics(window, step=step)
        logger.log_metrics({"balance/padding_ratio": 0.01, "balance/real_tokens_per_s": 1000.0 + step,
                            **{f"balance/padding_ratio_rank{r}": 0.01 * r for r in range(ranks)}}, step=step)
        logger.log_metrics({"train/loss": 10.0 - step / 10}, step=step - 1)
    logger.save()
    return tmp_path / "metrics.csv"


def test_read_metrics_csv_gives_each_key_its_own_points(tmp_path):
    metrics = read_metrics_csv(_metrics_file(tmp_path))
    steps, values = metrics["balance/compute_s_rank1"]
    assert steps.tolist() == [10, 20, 30] and values.tolist() == [2.0, 3.0, 4.0]
    assert metrics["train/loss"][0].tolist() == [9, 19, 29] and metrics["train/loss"][1].tolist() == [9.0, 8.0, 7.0]
    assert metrics["balance/real_tokens_per_s"][1].tolist() == [1010.0, 1020.0, 1030.0]


def test_save_training_plot_writes_a_png_beside_the_metrics_file(tmp_path):
    path = save_training_plot(_metrics_file(tmp_path))
    assert path == tmp_path / "training.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (800, 640)  # 10 x 8 inches at 80 dpi
        assert len(np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)) > 4  # lines were drawn


def test_save_training_plot_without_the_monitors_says_what_is_missing(tmp_path):
    logger = CSVLogger(save_dir=str(tmp_path), name="", version="")
    logger.log_metrics({"train/loss": 3.0}, step=1)
    logger.save()
    out = save_training_plot(tmp_path / "metrics.csv", tmp_path / "plots" / "t.png")
    assert out.is_file()


def test_a_file_that_is_not_a_metrics_file_is_an_error(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"expected a CSVLogger metrics file with a 'step' column, got the columns "
                                         r"\['a', 'b'\]"):
        save_training_plot(bad)
    with pytest.raises(FileNotFoundError):
        save_training_plot(tmp_path / "missing.csv")


def test_the_plot_draws_the_files_points_with_a_legend_in_every_panel(tmp_path):
    metrics = read_metrics_csv(_metrics_file(tmp_path))
    panels = training_plot_data(metrics)
    assert [label.split("\n")[0] for label, _ in panels] == [
        "compute s per window", "data wait s per window", "rank wait s per window", "other s per window (validation,",
        "padding ratio", "real tokens/s (all ranks)"]
    for label, series in panels[:5]:
        assert [name for name, _, _ in series] == ["rank 0", "rank 1"], label
    (_, tokens_steps, tokens), (_, ratio_steps, ratio) = panels[5][1]
    assert tokens.tolist() == [1010.0, 1020.0, 1030.0] and ratio.tolist() == [1.1, 1.2, 1.3]
    assert tokens_steps.tolist() == ratio_steps.tolist() == [10, 20, 30]  # the file's steps, as logged
    fig = training_figure(metrics)
    axes = fig.axes
    assert len(axes) == 7  # six panels and the straggler ratio's own axis
    for ax in axes[:6]:
        assert ax.get_legend() is not None and ax.get_ylim()[0] == 0.0
    assert [t.get_text() for t in axes[5].get_legend().get_texts()] == ["real tokens/s", "straggler ratio"]
    colours = {line.get_label(): line.get_color() for ax in axes for line in ax.get_lines()}
    assert colours["real tokens/s"] not in (colours["rank 0"], colours["rank 1"])  # distinct from the ranks'
    assert axes[6].get_ylim() == (1.0, 1.3 * 1.02)  # from 1.0: no straggler at the bottom
    assert "at step 29" in fig.get_suptitle() and max(axes[0].get_xlim()) >= 30


def test_the_straggler_axis_spans_at_least_its_minimum_so_noise_stays_small(tmp_path):
    logger = CSVLogger(save_dir=str(tmp_path), name="", version="")
    for step, ratio in ((9, 1.01), (19, 1.02), (29, 1.015)):
        logger.log_metrics({"balance/real_tokens_per_s": 500.0, "balance/straggler_ratio": ratio}, step=step)
    logger.save()
    twin = training_figure(read_metrics_csv(tmp_path / "metrics.csv")).axes[6]
    assert twin.get_ylim() == (1.0, 1.0 + STRAGGLER_MIN_SPAN)  # 2 % does not fill the panel


def test_a_mixtures_file_adds_each_components_share_and_tokens_per_step(tmp_path):
    path = _metrics_file(tmp_path)
    logger = CSVLogger(save_dir=str(tmp_path), name="mix", version="")
    for step, (web, code) in enumerate([(70, 30), (66, 34), (72, 28)]):
        logger.log_metrics({"train/tokens/web": web, "train/tokens/code": code, "train/share/web": web / 100,
                            "train/share/code": code / 100, "train/tokens/web_rank0": web}, step=step)
    logger.save()
    metrics = {**read_metrics_csv(path), **read_metrics_csv(tmp_path / "mix" / "metrics.csv")}
    panels = training_plot_data(metrics)
    assert len(panels) == 8 and panels[6][0].startswith("share of each optimizer step")
    assert {name: (steps.tolist(), values.tolist()) for name, steps, values in panels[6][1]} == {
        "web": ([0, 1, 2], [0.7, 0.66, 0.72]), "code": ([0, 1, 2], [0.3, 0.34, 0.28])}  # in the file's column order
    assert {name: values.tolist() for name, _, values in panels[7][1]} == {"web": [70, 66, 72], "code": [30, 34, 28]}
    fig = training_figure(metrics)
    assert len(fig.axes) == 9  # eight panels and the straggler ratio's own axis
    assert fig.axes[6].get_ylim() == (0.0, 1.0) and fig.axes[6].get_legend() is not None
