"""research/packed_vs_padded.py: the pair summary, the table, the command line and one small end-to-end run.

Run:
    python -m pytest research/tests/test_packed_vs_padded.py -q
"""

from __future__ import annotations

import doctest
import json
import math

import pytest

from research import packed_vs_padded as pvp

pytestmark = pytest.mark.benchmark


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def run(pair, variant, tps, val, tokens=1000, status="ok"):
    return {"run": f"pair{pair}_{variant}", "pair": pair, "variant": variant, "status": status,
            "real_tokens_per_s": tps, "train_real_tokens": tokens, "val_loss": val, "padding_ratio": 0.0,
            "micro_batches_per_rank": 5, "optimizer_steps": 5, "load_avg_1min_before": 2.0}


def test_summary_median_min_max_real_tokens_and_noise_rule():
    results = [run(0, "padded", 100, 6.00), run(0, "packed", 105, 6.02), run(1, "padded", 100, 6.10),
               run(1, "packed", 95, 6.09), run(2, "padded", 80, 6.05), run(2, "packed", 100, 6.05)]
    s = pvp.summarise(results)
    assert s["speedups"] == [1.05, 0.95, 1.25]
    assert (s["median_speedup"], s["min_speedup"], s["max_speedup"]) == (1.05, 0.95, 1.25)
    assert s["faster"] and s["same_real_tokens"] and s["pairs"] == 3 and s["failed_pairs"] == 0
    assert s["val_loss_noise"] == pytest.approx(0.05)
    assert s["val_loss_mean_difference"] == pytest.approx(0.01 / 3)
    assert s["val_loss_equal_within_noise"]
    # a loss gap beyond twice the noise, a failed run, unequal tokens
    results[1]["val_loss"] = 6.40
    results[3]["status"] = "timeout"
    results[4]["train_real_tokens"] = 999
    s = pvp.summarise(results)
    assert s["pairs"] == 2 and s["failed_pairs"] == 1 and s["speedups"] == [1.05, 1.25]
    assert not s["same_real_tokens"] and not s["val_loss_equal_within_noise"]
    table = pvp.markdown_table(results, s)
    assert "| pair1_packed | timeout |" in table and "median 1.150 (min 1.050, max 1.250) over 2" in table


def test_docstring_examples():
    assert doctest.testmod(pvp).failed == 0


@pytest.mark.parametrize(("argv", "message"), [(["--num-docs", "-1"], "--num-docs must be >= 0"),
                                               (["--val-fraction", "1.5"], "--val-fraction must be in"),
                                               (["--pairs", "0"], "expected a positive integer")])
def test_bad_command_line_input_is_a_clear_error(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        pvp.main([*argv, "--output-dir", str(tmp_path)])
    assert message in capsys.readouterr().err


@pytest.mark.ddp
def test_end_to_end_small_pair_trains_the_same_real_tokens_and_writes_the_table(tmp_path, cache_dir):
    summary = pvp.main(["--output-dir", str(tmp_path), "--pairs", "1", "--num-docs", "120", "--model-size", "tiny",
                        "--max-tokens", "256", "--max-length", "64", "--cache-dir", str(cache_dir),
                        "--timeout-s", "300"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in results] == ["pair0_padded", "pair0_packed"]  # padded first, then packed
    assert all(r["status"] == "ok" for r in results), results
    padded, packed = results
    assert packed["padding_ratio"] == 0.0 and padded["padding_ratio"] > 0.0
    assert packed["train_real_tokens"] == padded["train_real_tokens"] > 0
    assert summary["same_real_tokens"] and summary["pairs"] == 1 and summary["speedups"][0] > 0
    assert math.isfinite(packed["val_loss"]) and math.isfinite(padded["val_loss"])
    assert "pair0_packed" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["command"].startswith("python -m research.packed_vs_padded ")
