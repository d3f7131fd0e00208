"""StepTokenLoss on packed micro-batches: the plan divisor is exact and the step losses equal padded batching's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from lit_balance.data.collate import PackedCollator, PadCollator
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum

VOCAB = 61


class SumStrategy:
    """DDP's all-reduce for simulated ranks: returns the sum of what every rank handed in this round."""

    def __init__(self):
        self.result = None

    def reduce(self, tensor, reduce_op="sum"):
        return self.result.clone()


def simulate_steps(model, steps, collate, world_size, acc, lr=0.5):
    """Run optimizer steps as Lightning + DDP would, one model replica per simulated rank.

    steps[s][r][m]: the documents (dicts) of rank r's micro-batch m of optimizer step s. Returns the logged loss of
    every step and the final parameters.
    """
    strategy = SumStrategy()
    strategy.distributed_sampler_kwargs = {"num_replicas": world_size, "rank": 0}  # DDP's, as rank 0
    replicas = [copy.deepcopy(model) for _ in range(world_size)]
    losses = [StepTokenLoss() for _ in range(world_size)]
    for replica in replicas:
        replica._trainer = SimpleNamespace(world_size=world_size, global_rank=0, accumulate_grad_batches=acc,
                                           strategy=strategy, callbacks=[], train_dataloader=None)
    logged = []
    for step in steps:
        docs = [d for rank in step for micro in rank for d in micro]
        step_real = sum(len(d["input_ids"]) for d in docs if not d.get("is_fill"))
        step_rows = sum(not d.get("is_fill") for d in docs)
        local = []
        for replica, step_loss, rank in zip(replicas, losses, step):
            replica.zero_grad()
            total, count = 0.0, 0
            for micro in rank:
                batch = collate([{**d, "step_real_tokens": step_real, "step_rows": step_rows} for d in micro])
                loss_sum, n = token_loss_sum(replica(**replica._inputs(batch)), batch["labels"])
                (step_loss.micro_batch(replica, batch, loss_sum, n) / acc).backward()
                total, count = total + float(loss_sum.detach()), count + n
            local.append(torch.tensor([total, float(count)], dtype=torch.float64))
        mean_grads = [sum(ps) / world_size for ps in zip(*[[p.grad for p in r.parameters()] for r in replicas])]
        strategy.result = sum(local)
        values = []
        for replica, step_loss in zip(replicas, losses):
            for p, g in zip(replica.parameters(), mean_grads):
                p.grad = g.clone()
            values.append(float(step_loss.finish_step(replica)))
            assert step_loss.mode == "plan"
            with torch.no_grad():
                for p in replica.parameters():
                    p -= lr * p.grad
        assert values == [values[0]] * world_size
        logged.append(values[0])
    return logged, [p.detach() for p in replicas[0].parameters()]


def make_steps(seed):
    g = torch.Generator().manual_seed(seed)

    def doc(n, index, fill=False):
        return {"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "index": index, "is_fill": fill}

    # 2 optimizer steps x 2 ranks x 2 micro-batches; one fill document (a duplicate the plan marks)
    return [
        [[[doc(5, 0), doc(9, 1)], [doc(30, 2)]], [[doc(2, 3), doc(3, 4), doc(7, 5)], [doc(12, 6), doc(1, 7)]]],
        [[[doc(20, 8)], [doc(4, 9), doc(4, 10), doc(6, 11)]], [[doc(11, 12), doc(8, 13)], [doc(15, 14, True)]]],
    ]


def reference_losses(model, steps, lr=0.5):
    """One process, one optimizer step at a time, the mean over all the step's supervised tokens at once."""
    model = copy.deepcopy(model)
    out = []
    for step in steps:
        docs = [d for rank in step for micro in rank for d in micro]
        batch = PadCollator(0)(docs)
        model.zero_grad()
        loss_sum, n = token_loss_sum(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        (loss_sum / n).backward()
        out.append(float(loss_sum / n))
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return out, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("multiple", [1, 8])
def test_packed_step_losses_and_updates_equal_padded_and_a_single_process(multiple):
    torch.manual_seed(0)
    model = DemoTransformerLM(vocab_size=VOCAB, d_model=32, num_heads=4, dim_feedforward=64)
    steps = make_steps(seed=1)
    packed, packed_params = simulate_steps(model, steps, PackedCollator(0, pad_to_multiple_of=multiple), 2, 2)
    padded, padded_params = simulate_steps(model, steps, PadCollator(0, pad_to_multiple_of=multiple), 2, 2)
    reference, reference_params = reference_losses(model, steps)
    assert packed == pytest.approx(padded, rel=1e-6)
    assert packed == pytest.approx(reference, rel=1e-6)
    assert packed[1] != pytest.approx(packed[0], rel=1e-3)  # the update between the steps changed the loss
    for a, b, c in zip(packed_params, padded_params, reference_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)


def test_plan_divisor_counts_exactly_the_supervised_tokens_of_packed_rows():
    """Each packed document of l tokens supervises l - 1 (never the next document's first token); fills none."""
    docs = [{"input_ids": torch.arange(1, n + 1), "index": i, "is_fill": i == 3} for i, n in enumerate([4, 1, 6, 5])]
    step = {"step_real_tokens": 11, "step_rows": 3}
    batch = PackedCollator(0)([{**d, **step} for d in docs])
    _, n = token_loss_sum(torch.zeros(1, batch["num_padded_tokens"], 8), batch["labels"])
    assert n == batch["step_supervised_tokens"] == 3 + 0 + 5
    # the last token of document 0 (id 4) would predict document 1's first token (id 1): its target is -100
    assert batch["labels"][0, 4] == -100 and batch["input_ids"][0, 4] == 1
