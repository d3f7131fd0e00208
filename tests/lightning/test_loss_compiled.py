"""The token-weighted loss under ``torch.compile``: ``token_loss_sum`` gives the loss and gradients of the
cross-entropy over the supervised tokens (equal to 1e-6 to the mean over those tokens, 0 and no NaN without any), and
the demo model compiled as Lightning compiles it (``torch.compile(model, dynamic=False)``, then
``lightning.pytorch.utilities.compile.from_compiled``, what ``Trainer.fit`` does) keeps one graph for static micro-batches
whose per-step numbers (``step_supervised_tokens``, the supervised tokens) all differ, with the same loss and gradients
as the model uncompiled."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.utilities.compile import from_compiled
from torch._dynamo.testing import CompileCounter

from lit_balance.data.collate import PackedCollator, PadCollator
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum

VOCAB = 53


def reference(logits, labels):
    """The mean next-token cross-entropy's ingredients, computed on the supervised positions alone."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1).reshape(-1)
    keep = shifted != -100
    flat = logits.reshape(-1, logits.shape[-1])[keep].double()
    return torch.nn.functional.cross_entropy(flat, shifted[keep], reduction="sum"), int(keep.sum())


@pytest.mark.parametrize("ignored", [0.0, 0.5, 1.0])
def test_token_loss_sum_is_the_summed_cross_entropy_of_the_supervised_tokens(ignored):
    g = torch.Generator().manual_seed(int(ignored * 10))
    logits = torch.randn(3, 7, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[torch.rand(3, 7, generator=g) < ignored] = -100
    loss_sum, n = token_loss_sum(logits, labels)
    (grad,) = torch.autograd.grad(loss_sum, logits)
    ref, ref_n = reference(logits, labels)
    assert isinstance(n, torch.Tensor) and n.dtype == torch.int64 and int(n) == ref_n
    assert float(loss_sum.detach()) == pytest.approx(float(ref.detach()), abs=1e-6 * max(1, ref_n))
    if ref_n:
        (ref_grad,) = torch.autograd.grad(ref, logits)
        torch.testing.assert_close(grad.double(), ref_grad.double(), atol=1e-6, rtol=1e-6)
    else:  # no supervised token: zero loss, zero gradient, never NaN, and the graph is kept
        assert float(loss_sum) == 0.0 and loss_sum.requires_grad and torch.equal(grad, torch.zeros_like(grad))


def test_step_loss_scales_a_tensor_count_as_an_int_count():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 9, generator=g, requires_grad=True)
    labels = torch.randint(0, 9, (2, 6), generator=g)
    loss_sum, n = token_loss_sum(logits, labels)
    results = []
    for count in (n, int(n)):
        step = StepTokenLoss(sync_log=False)
        loss = step.micro_batch(object(), {"step_supervised_tokens": 17}, loss_sum, count)
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        results.append((float(loss), grad, float(step.finish_step(object())), step.last_step_tokens))
    assert results[0][0] == results[1][0] == pytest.approx(float(loss_sum) / 17)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=0)
    assert results[0][2:] == results[1][2:] and results[0][3] == int(n)


def static_batches(layout):
    """Five micro-batches of one static shape whose supervised tokens and step totals all differ."""
    g = torch.Generator().manual_seed(1)
    collate = (PackedCollator(pad_token_id=0, row_length=48, max_documents=6) if layout == "packed"
               else PadCollator(pad_token_id=0, shapes=((4, 12),)))
    out = []
    for k in range(5):
        lengths = [3 + k, 5, 2 + 2 * k] if layout == "packed" else [4 + k, 12 - k, 2 + k]
        docs = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g), "index": i, "step_real_tokens": 100 + k,
                 "step_rows": 3, "step_supervised_tokens": 97 + 7 * k} for i, n in enumerate(lengths)]
        out.append(collate(docs))
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_compiled_demo_model_keeps_one_graph_and_the_loss_and_gradients_of_eager(layout):
    torch.manual_seed(0)
    eager = DemoTransformerLM(vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32,
                              packed_attention="sdpa_mask")
    counter = CompileCounter()
    compiled = from_compiled(torch.compile(copy.deepcopy(eager), dynamic=False, backend=counter))
    batches = static_batches(layout)
    assert len({tuple(b["input_ids"].shape) for b in batches}) == 1
    assert len({b["step_supervised_tokens"] for b in batches}) == len({int((b["labels"] != -100).sum())
                                                                       for b in batches}) == 5
    for model in (eager, compiled):
        model.train()
    for k, batch in enumerate(batches):
        out = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model.training_step(batch, k)
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=1e-6)
        for a, b in zip(out[1][1], out[0][1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        for model in (eager, compiled):
            model.step_loss.finish_step(model)
    assert counter.frame_count == 1  # one graph: the per-step numbers never reached the compiled code
    compiled.eval()
    with torch.no_grad():
        compiled.token_loss(batches[0])
    assert counter.frame_count == 2  # eval mode: one more
