"""``lit-balance plan`` on a mixture with a weights schedule: each step's scheduled share beside its realized share in
the JSON summary, the printed deviations taken from the scheduled shares, and the figure written."""

import json
import sys

import numpy as np
import pytest

from lit_balance.cli import build_cli
from lit_balance.report import mixture_figure


@pytest.fixture(autouse=True)
def _program_name_only(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-balance"])


def test_plan_with_a_weights_schedule_reports_and_draws_each_steps_scheduled_share(tmp_path, capsys):
    words = "the cat sat on a mat while dogs ran far away over green hills".split()
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": " ".join(words[(i + j) % 14]
                                                                             for j in range(4 + i % 9))}) + "\n"
                                                for i in range(300)))
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": " ".join(f"x{(i * j) % 7} = {j}"
                                                                              for j in range(2 + i % 20))}) + "\n"
                                                 for i in range(200)))
    corpus = {"components": {"web": {"corpus": str(tmp_path / "web.jsonl"), "weight": 1},
                             "code": {"corpus": str(tmp_path / "code.jsonl"), "weight": 1}}}
    schedule = {"points": [[0, {"web": 0.8, "code": 0.2}], [4, {"web": 0.3, "code": 0.7}]]}
    out = tmp_path / "o"
    cli = build_cli(["plan", "--corpus", json.dumps(corpus), "--cache-dir", str(tmp_path / "cache"),
                     "--max-tokens", "128", "--max-length", "64", "--num-replicas", "2",
                     "--accumulate-grad-batches", "2", "--data-kwargs", json.dumps({"weights_schedule": schedule}),
                     "--output-dir", str(out)])
    text = capsys.readouterr().out
    mix = cli.plan_summary["mixture"]
    targets, shares = np.array(mix["step_targets"]), np.array(mix["step_shares"])
    assert targets.shape == shares.shape and targets.shape[0] > 4
    want = np.array([[0.8, 0.2]] * 4 + [[0.3, 0.7]] * (targets.shape[0] - 4))
    np.testing.assert_allclose(targets, want)  # each step's share as the schedule gives it, the transition at step 4
    deviation = 100 * np.abs(shares - targets)
    np.testing.assert_allclose(mix["max_deviation_pp"], deviation.max(axis=0))
    np.testing.assert_allclose(mix["p95_deviation_pp"], np.percentile(deviation, 95, axis=0))
    assert "deviation from each step's scheduled share" in " ".join(text.split())
    for c, name in enumerate(("web", "code")):
        row = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
        assert f"{mix['max_deviation_pp'][c]:.2f}" in row and f"{mix['p95_deviation_pp'][c]:.2f}" in row
    assert (out / "mixture_shares.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the figure drawn from the written summary holds both series of every component
    fig = mixture_figure(json.loads((out / "plan_summary.json").read_text())["mixture"])
    lines = {line.get_label(): line.get_ydata() for line in fig.axes[0].get_lines()}
    for c, name in enumerate(("web", "code")):
        np.testing.assert_allclose(lines[f"{name} target"], targets[:, c])
        np.testing.assert_allclose(next(v for k, v in lines.items() if k.startswith(f"{name}: max")), shares[:, c])
