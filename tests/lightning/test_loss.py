"""StepTokenLoss: each optimizer step's loss and gradient equal a single process's mean over the same tokens."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.data.collate import IGNORE_INDEX
from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum


class FakeStrategy:
    """Stands in for DDP's reduce: returns the step's total over ranks, set by the test."""

    def __init__(self):
        self.total = None
        self.calls = 0

    def reduce(self, tensor, reduce_op="sum"):
        self.calls += 1
        return self.total.clone()


class FakeModule(torch.nn.Module):
    def __init__(self, world_size, acc, strategy, callbacks=()):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        strategy.distributed_sampler_kwargs = {"num_replicas": world_size, "rank": 0}  # DDP's, as rank 0
        self._trainer = SimpleNamespace(world_size=world_size, global_rank=0, accumulate_grad_batches=acc,
                                        strategy=strategy, callbacks=list(callbacks), train_dataloader=None)

    @property
    def device(self):
        return torch.device("cpu")


def run_step(token_losses, *, use_plan, sync_log=True):
    """Simulate Lightning + DDP for one optimizer step.

    token_losses[r][m]: float64 [n] per-token loss factors of rank r's micro-batch m (loss_i = theta * c_i).
    Returns (logged loss per rank, theta.grad after DDP averaging and finish_step, per rank).
    """
    world_size, acc = len(token_losses), len(token_losses[0])
    strategy = FakeStrategy()
    modules = [FakeModule(world_size, acc, strategy) for _ in range(world_size)]
    losses = [StepTokenLoss(sync_log=sync_log) for _ in range(world_size)]
    n_all = sum(len(c) for rank in token_losses for c in rank)
    for r, rank in enumerate(token_losses):
        for c in rank:
            batch = {"step_supervised_tokens": n_all} if use_plan else {}
            loss_sum = (modules[r].theta * torch.as_tensor(c, dtype=torch.float64)).sum()
            out = losses[r].micro_batch(modules[r], batch, loss_sum, len(c))
            (out / acc).backward()  # Lightning divides by accumulate_grad_batches
    mean_grad = sum(m.theta.grad for m in modules) / world_size  # DDP averages gradients over ranks
    strategy.total = torch.tensor([float(sum(float(sum(c)) for rank in token_losses for c in rank)), float(n_all)],
                                  dtype=torch.float64)
    logged = []
    for m, sl in zip(modules, losses):
        m.theta.grad = mean_grad.clone()
        logged.append(float(sl.finish_step(m)))
    return logged, [float(m.theta.grad) for m in modules], losses


def reference(token_losses):
    """One process, the mean over all the step's tokens at once."""
    theta = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    c = torch.cat([torch.as_tensor(x, dtype=torch.float64) for rank in token_losses for x in rank])
    if c.numel() == 0:
        return 0.0, 0.0
    loss = (theta * c).mean()
    loss.backward()
    return float(loss.detach()), float(theta.grad)


@pytest.mark.parametrize("use_plan", [True, False])
def test_case_as_written_two_ranks_two_micro_batches(use_plan):
    # supervised tokens: rank 0 [5, 10], rank 1 [20, 3] (38 in all), per-token loss 1.0
    token_losses = [[[1.0] * 5, [1.0] * 10], [[1.0] * 20, [1.0] * 3]]
    logged, grads, losses = run_step(token_losses, use_plan=use_plan)
    assert logged == pytest.approx([1.0, 1.0], abs=1e-12)
    # d loss / d theta = sum of token weights = 38 * (1/38): every token has weight 1/38
    assert grads == pytest.approx([1.0, 1.0], abs=1e-12)
    assert losses[0].mode == ("plan" if use_plan else "all_reduce")
    assert losses[0].last_step_tokens == 38


def test_each_token_weight_is_one_over_38():
    # per-token leaves: the gradient of each token's loss in the DDP-averaged objective is exactly 1/38
    counts = [[5, 10], [20, 3]]
    strategy = FakeStrategy()
    module = FakeModule(2, 2, strategy)
    weights = []
    for rank in counts:
        sl = StepTokenLoss(sync_log=False)
        for n in rank:
            leaf = torch.ones(n, dtype=torch.float64, requires_grad=True)
            out = sl.micro_batch(module, {"step_supervised_tokens": 38}, leaf.sum(), n)
            (out / 2 / 2).backward()  # Lightning's / accumulate_grad_batches, DDP's / world_size
            weights.append(leaf.grad)
    w = torch.cat(weights)
    assert w.numel() == 38
    assert torch.allclose(w, torch.full_like(w, 1 / 38), rtol=0, atol=1e-15)


@pytest.mark.parametrize("use_plan", [True, False])
def test_empty_micro_batch_adds_zero_never_nan_and_next_step_counts_its_own(use_plan):
    token_losses = [[[], [2.0, 4.0]], [[], []]]
    logged, grads, _ = run_step(token_losses, use_plan=use_plan)
    assert logged == pytest.approx([3.0, 3.0]) and grads == pytest.approx([3.0, 3.0])
    # a step with no supervised tokens at all: zero loss and gradient, no NaN
    logged, grads, _ = run_step([[[], []], [[], []]], use_plan=use_plan)
    assert logged == [0.0, 0.0] and grads == [0.0, 0.0]
    # the same StepTokenLoss object over two steps: the second divisor counts only its own tokens
    strategy = FakeStrategy()
    module = FakeModule(1, 1, strategy)
    sl = StepTokenLoss()
    for values in ([1.0, 1.0, 1.0, 1.0], [5.0]):
        module.theta.grad = None
        batch = {"step_supervised_tokens": len(values)} if use_plan else {}
        out = sl.micro_batch(module, batch, (module.theta * torch.tensor(values, dtype=torch.float64)).sum(),
                             len(values))
        out.backward()
        step = float(sl.finish_step(module))
        assert step == pytest.approx(sum(values) / len(values))
        assert float(module.theta.grad) == pytest.approx(sum(values) / len(values))
        assert sl.last_step_tokens == len(values)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4).flatmap(lambda r: st.integers(1, 4).flatmap(lambda m: st.lists(
        st.lists(st.lists(st.floats(0.0, 10.0, allow_nan=False), max_size=6), min_size=m, max_size=m),
        min_size=r, max_size=r))),
    st.booleans(),
)
def test_equals_single_process_mean_in_loss_and_gradient(token_losses, use_plan):
    logged, grads, _ = run_step(token_losses, use_plan=use_plan)
    ref_loss, ref_grad = reference(token_losses)
    assert logged == pytest.approx([ref_loss] * len(token_losses), rel=1e-9, abs=1e-12)
    assert grads == pytest.approx([ref_grad] * len(token_losses), rel=1e-9, abs=1e-12)


def test_plan_path_uses_no_collective_without_sync_log_and_rescales_a_step_cut_short():
    token_losses = [[[1.0, 2.0]], [[3.0]]]
    logged, grads, losses = run_step(token_losses, use_plan=True, sync_log=False)
    assert grads == pytest.approx([2.0, 2.0])
    assert logged == [1.5, 3.0]  # each rank's own mean: no reduce was made
    assert losses[0].last_step_tokens == 2
    strategy = FakeStrategy()
    module = FakeModule(2, 1, strategy)
    sl = StepTokenLoss()
    sl.micro_batch(module, {"step_supervised_tokens": 5}, module.theta * 1.0, 1)
    (module.theta * 2 / 5).backward()  # the gradient DDP leaves: token-loss sum over ranks (2) / planned (5)
    # the ranks saw 4 tokens, summing to 2.0, where the plan said 5 (a step cut short): rescaled to the 4 seen
    strategy.total = torch.tensor([2.0, 4.0], dtype=torch.float64)
    assert float(sl.finish_step(module)) == 0.5
    assert float(module.theta.grad) == pytest.approx(2 / 4) and sl.num_corrected_steps == 1


def test_micro_batches_of_one_step_must_agree():
    module = FakeModule(1, 2, FakeStrategy())
    sl = StepTokenLoss()
    sl.micro_batch(module, {"step_supervised_tokens": 3}, module.theta * 1.0, 1)
    with pytest.raises(RuntimeError, match="different divisors"):
        sl.micro_batch(module, {}, module.theta * 1.0, 1)
    sl = StepTokenLoss()
    sl.micro_batch(module, {"step_supervised_tokens": 3}, module.theta * 1.0, 1)
    with pytest.raises(RuntimeError, match="different step_supervised_tokens"):
        sl.micro_batch(module, {"step_supervised_tokens": 4}, module.theta * 1.0, 1)


@pytest.mark.parametrize(("planned_for", "mode"), [(2, "plan"), (1, "all_reduce"), (None, "plan")])
def test_a_training_sampler_planned_for_other_steps_than_the_trainers_selects_the_all_reduce_path(planned_for, mode):
    from lit_balance import BalancedBatchSampler, use_training_sampler

    module = FakeModule(1, 2, FakeStrategy())  # Trainer(accumulate_grad_batches=2)
    if planned_for is not None:  # None: nothing handed over, the plan's step totals are taken as they come
        use_training_sampler(module._trainer, BalancedBatchSampler([3, 5, 2], max_tokens=8, num_replicas=1, rank=0,
                                                                   accumulate_grad_batches=planned_for))
    sl = StepTokenLoss()
    sl.micro_batch(module, {"step_supervised_tokens": 3}, module.theta * 1.0, 1)
    assert sl.mode == mode


def test_adaptive_accumulation_selects_the_all_reduce_path():
    from lit_balance.callbacks import AdaptiveGradAccumulation

    module = FakeModule(1, 1, FakeStrategy(), callbacks=[AdaptiveGradAccumulation(100)])
    sl = StepTokenLoss()
    sl.micro_batch(module, {"step_supervised_tokens": 3}, module.theta * 1.0, 1)
    assert sl.mode == "all_reduce"


@pytest.mark.parametrize(("marker", "mode"), [(True, "all_reduce"), (False, "plan"), ("yes", "plan")])
def test_any_callback_declaring_it_sets_accumulate_grad_batches_selects_the_all_reduce_path(marker, mode):
    class Scheduler:  # not a lit_balance callback: only the class attribute counts, and only True
        sets_accumulate_grad_batches = marker

    module = FakeModule(1, 1, FakeStrategy(), callbacks=[Scheduler()])
    sl = StepTokenLoss()
    sl.micro_batch(module, {"step_supervised_tokens": 3}, module.theta * 1.0, 1)
    assert sl.mode == mode


def test_the_loss_module_imports_no_callback():
    import ast
    import inspect

    import lit_balance.lightning.loss as loss_module

    imported = set()
    for node in ast.walk(ast.parse(inspect.getsource(loss_module))):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert imported and not any("callbacks" in name for name in imported), sorted(imported)


def test_token_loss_sum_matches_cross_entropy_and_handles_no_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[1, 3:] = IGNORE_INDEX
    s, n = token_loss_sum(logits, labels)
    targets = labels[:, 1:]
    assert n == int((targets != IGNORE_INDEX).sum()) == 6
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), targets.reshape(-1), reduction="sum")
    assert torch.allclose(s, ref)
    # the gradient as the sliced reference's: the last position of each row predicts nothing
    mine, theirs = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    token_loss_sum(mine, labels)[0].backward()
    torch.nn.functional.cross_entropy(theirs[:, :-1].reshape(-1, 7), targets.reshape(-1), reduction="sum").backward()
    assert torch.allclose(mine.grad, theirs.grad) and float(mine.grad[:, -1].abs().sum()) == 0.0
    leaf = logits.clone().requires_grad_(True)
    s0, n0 = token_loss_sum(leaf, torch.full_like(labels, IGNORE_INDEX))
    assert n0 == 0 and float(s0.detach()) == 0.0
    s0.backward()  # keeps the graph: every parameter gets a (zero) gradient, as DDP needs
    assert leaf.grad is not None and not torch.isnan(leaf.grad).any() and float(leaf.grad.abs().sum()) == 0.0


def test_a_resume_on_fewer_ranks_inside_a_window_keeps_one_divisor_per_lightning_window():
    """2 ranks stop 3 micro-batches into an epoch with accumulate_grad_batches=2 (inside the window [2, 4)); the
    rest re-planned on 1 rank runs Lightning's windows from batch_idx 3: one divisor per window."""
    from lit_balance import BalancedBatchSampler

    lengths = [5 + (i * 37) % 120 for i in range(60)]
    before = [BalancedBatchSampler(lengths, 256, num_replicas=2, rank=r, seed=1, accumulate_grad_batches=2)
              for r in (0, 1)]
    after = BalancedBatchSampler(lengths, 256, num_replicas=1, rank=0, seed=1, accumulate_grad_batches=2)
    after.load_state_dict(before[0].state_dict(batches_consumed=3))
    module = FakeModule(1, 2, FakeStrategy())
    loss = StepTokenLoss()
    n, steps = len(after), []
    for batch_idx, mb in enumerate(after, start=3):
        supervised = int(sum(after.lengths[mb])) - len(mb)  # a row of l tokens supervises l - 1
        batch = {"step_supervised_tokens": mb.step_real_tokens - mb.step_rows}
        out = loss.micro_batch(module, batch, module.theta * float(supervised), supervised)
        (out / 2).backward()
        if (batch_idx + 1) % 2 == 0 or batch_idx + 1 == n:  # Lightning steps here
            steps.append((batch_idx, batch["step_supervised_tokens"], float(loss.finish_step(module))))
            module.theta.grad = None
    assert len(steps) == (n - 4 + 1) // 2 + 1
    # the window cut by the resume counts the old ranks' micro-batch 2 too; its gradient, which the checkpoint
    # did not keep, is left out by rescaling to the tokens seen after the resume
    assert loss.num_corrected_steps == 1 and steps[0][0] == 3
    assert all(value == pytest.approx(1.0) for *_, value in steps)  # every token's loss factor is 1
