"""Real 2-process CPU DDP fits (gloo) from a Hugging Face Dataset and from prompt–completion JSONL.

Each optimizer step's loss and gradients must equal one process's mean over the same supervised tokens, with
accumulation, for both divisor paths of StepTokenLoss (the plan's ``step_supervised_tokens`` and the all-reduce).
"""

import json
from pathlib import Path

import pytest
import torch

from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import token_loss_sum
from lit_balance.data.tokenizer import builtin_tokenizer

from launch import run_ranks  # launch.py (the repository root)

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # real 2-rank CPU fits in subprocesses, seconds each

pytest.importorskip("datasets")  # the "datasets" extra; part of the test extra

SCRIPT = Path(__file__).with_name("fit_masked.py")
MODES = ("dataset", "jsonl-plan", "jsonl-allreduce")
DIVISOR = {"dataset": "plan", "jsonl-plan": "plan", "jsonl-allreduce": "all_reduce"}
from fit_masked import MODEL, records  # noqa: E402  (tests/ddp/fit_masked.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every mode, run side by side (each is 2 ranks); returns {mode: (out_dir, [rank0, rank1])}."""
    outs = {mode: tmp_path_factory.mktemp(mode) for mode in MODES}
    records = run_ranks(SCRIPT, {mode: (outs[mode], [mode]) for mode in MODES}, 420)
    return {mode: (outs[mode], records[mode]) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_every_training_document_runs_once_per_epoch_over_both_ranks(runs, mode):
    _, ranks = runs[mode]
    assert ranks[0]["num_batches"] == ranks[1]["num_batches"] == len(ranks[0]["micro_batches"])
    seen = [i for r in ranks for _, indices, fill in r["micro_batches"] for i, f in zip(indices, fill) if not f]
    assert sorted(seen) == list(range(ranks[0]["num_train"]))


def test_prompt_tokens_carry_no_loss_and_completion_tokens_do(runs):
    out, _ = runs["jsonl-plan"]
    rows = json.loads((out / "train_rows.json").read_text())
    tok = builtin_tokenizer()
    expected = set()
    for r in records():
        full = tok.encode(r["prompt"] + r["completion"], add_special_tokens=False).ids[:24]  # max_length=24
        prompt = len(tok.encode(r["prompt"], add_special_tokens=False).ids)
        expected.add((tuple(full), tuple([-100] * min(prompt, len(full)) + full[prompt:])))
    got = {(tuple(r["input_ids"]), tuple(r["labels"])) for r in rows}
    assert got == expected


@pytest.mark.parametrize("mode", MODES)
def test_the_planned_divisor_is_the_count_of_supervised_tokens_of_each_step(runs, mode):
    _, ranks = runs[mode]
    assert set(ranks[0]["modes"]) == set(ranks[1]["modes"]) == {DIVISOR[mode]}
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) >= 3
    for step0, step1 in zip(ranks[0]["steps"], ranks[1]["steps"]):
        planned, counted = step0[0], step0[1] + step1[1]
        assert planned == step1[0] == counted == step0[2] == step1[2]
        if mode == "dataset":  # no masked label: every token but a row's first is a target
            assert planned == step0[4]
        else:  # masked prompts: fewer targets than real tokens minus rows, which the divisor was before
            assert 0 < planned < step0[4]


@pytest.mark.parametrize("mode", MODES)
def test_step_loss_and_gradient_equal_one_process_over_the_same_tokens(runs, mode):
    out, ranks = runs[mode]
    model = DemoTransformerLM(vocab_size=30522, **MODEL)
    model.load_state_dict(torch.load(out / "init.pt", weights_only=True))
    steps = [torch.load(out / f"step0_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert len(steps[0]["batches"]) == len(steps[1]["batches"]) == 2  # accumulate_grad_batches=2
    total, count = torch.zeros((), dtype=torch.float64), 0
    for step in steps:
        for b in step["batches"]:
            s, n = token_loss_sum(model(b["input_ids"], b["attention_mask"]), b["labels"])
            total, count = total + s.double(), count + n
    loss = total / count
    loss.backward()
    assert steps[0]["tokens"] == steps[1]["tokens"] == count == ranks[0]["steps"][0][0]
    for step in steps:
        assert step["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(step["grads"][name], p.grad, rtol=1e-4, atol=1e-6)
