"""Tokens per optimizer step on a ramp, on real 2-process CPU DDP (gloo): every optimizer step Lightning runs holds
the documents the plan gives it (tokens within one document of the ramp), and its gradient and loss are those of one
process taking the token mean over all of the step's documents."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from launch import run_scripts  # launch.py (the repository root)
from lit_balance import Schedule
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import token_loss_sum

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("fit_step_tokens.py")
_spec = importlib.util.spec_from_file_location("fit_step_tokens", SCRIPT)
fit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fit)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dirs = {layout: tmp_path_factory.mktemp(layout) for layout in ("padded", "packed")}
    # a quiet run takes about 15 s each; 300 s leaves more than 5x
    run_scripts(SCRIPT, {layout: [d, layout, 2] for layout, d in dirs.items()}, 300)
    return {layout: ([json.loads((d / f"rank{r}.json").read_text()) for r in range(2)],
                     torch.load(d / "steps.pt", weights_only=True)) for layout, d in dirs.items()}


def _step_documents(ranks):
    steps = {}
    for rank in ranks:
        for step, _, docs in rank["micro"]:
            steps.setdefault(step, []).extend(docs)
    return [sorted(steps[g]) for g in sorted(steps)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_optimizer_steps_follow_the_ramp(runs, layout):
    ranks, records = runs[layout]
    lengths, _, _ = fit.corpus()
    plan_micro = ranks[0]["step_micro_batches"]
    assert ranks[0]["global_step"] == len(plan_micro) == len(records)  # one Lightning step per planned step
    assert [h[2] for h in ranks[0]["history"]] == plan_micro
    assert ranks[0]["micro"][-1][1] + 1 == sum(plan_micro)
    assert len(ranks[0]["micro"]) == len(ranks[1]["micro"])
    steps = _step_documents(ranks)
    assert sorted(d for s in steps for d in s) == list(range(len(lengths)))  # every document once
    assert len(set(plan_micro)) > 1  # the ramp changed the accumulation
    ramp = Schedule.of(fit.RAMP, name="ramp")
    for g, docs in enumerate(steps):
        got = int(lengths[docs].sum())
        assert got == ranks[0]["step_tokens"][g]
        if g < len(steps) - 1:
            assert 0 <= ramp.value_at(g) - got < int(lengths.max())


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_each_step_is_the_one_process_token_mean(runs, layout):
    ranks, records = runs[layout]
    lengths, tokens, offsets = fit.corpus()
    model = DemoTransformerLM(vocab_size=50, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
    for g, docs in enumerate(_step_documents(ranks)):
        before, grads, loss = records[g]
        model.load_state_dict(before, strict=False)
        model.zero_grad()
        total, count = 0.0, 0
        for d in docs:  # one document at a time, one process: the plain token mean of the step
            ids = torch.as_tensor(tokens[offsets[d]:offsets[d + 1]]).unsqueeze(0)
            s, n = token_loss_sum(model(input_ids=ids, attention_mask=torch.ones_like(ids)), ids)
            total = total + s
            count += int(n)
        (total / count).backward()
        assert float((total / count).detach()) == pytest.approx(loss, rel=1e-4)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-3, atol=1e-6)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    stop, resume = tmp_path_factory.mktemp("stop"), tmp_path_factory.mktemp("resume")
    run_scripts(SCRIPT, {"stop": [stop, "packed", 2, "stop"]}, 300)
    (resume / "mid.ckpt").write_bytes((stop / "mid.ckpt").read_bytes())
    run_scripts(SCRIPT, {"resume": [resume, "packed", 3, "resume"]}, 300)
    return ([json.loads((stop / f"rank{r}.json").read_text()) for r in range(2)],
            [json.loads((resume / f"rank{r}.json").read_text()) for r in range(3)])


def test_a_resume_on_three_ranks_trains_the_uninterrupted_steps(runs, resumed):
    full, _ = runs["packed"]
    stopped, continued = resumed
    whole = _step_documents(full)
    before = _step_documents(stopped)
    assert len(before) == fit.STOP_STEPS
    after = _step_documents(continued)
    assert continued[0]["first_step"] == fit.STOP_STEPS  # the rest planned on 3 ranks from the step reached
    assert len({len(rank["micro"]) for rank in continued}) == 1  # equal counts on the new ranks
    assert before + after == whole  # step by step, the documents of the uninterrupted run
    assert [h[2] for h in continued[0]["history"]] == continued[0]["step_micro_batches"]
