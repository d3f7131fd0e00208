"""The training plot: a CSVLogger metrics file read back exactly and drawn per rank over steps."""

from __future__ import annotations

import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger
from PIL import Image

from lit_balance.report import read_metrics_csv, save_training_plot


def _metrics_file(tmp_path, ranks: int = 2):
    logger = CSVLogger(save_dir=str(tmp_path), name="", version="")
    for step in (10, 20, 30):
        window = {"balance/straggler_ratio": 1.0 + step / 100}
        for r in range(ranks):
            window[f"balance/compute_s_rank{r}"] = step / 10 + r
            window[f"balance/data_wait_s_rank{r}"] = 0.1 * r
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
        assert image.format == "PNG" and image.size == (720, 480)  # 9 x 6 inches at 80 dpi
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
