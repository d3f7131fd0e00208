"""Static shapes train like free ones and compile once: the demo model and a Hugging Face causal LM give the same
loss and gradients on a static packed row as on the same documents unpadded, and ``torch.compile(dynamic=False)``
keeps one graph for two epochs of static packed micro-batches (at most K for K padded shapes)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from lit_balance import BalancedBatchSampler
from lit_balance.data.collate import PackedCollator, PadCollator, collator_for
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import token_loss_sum

VOCAB = 61
LENGTHS = [5, 1, 17, 9, 12, 2]


def documents(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g), "index": i} for i, n in enumerate(lengths)]


def tiny_demo(method):
    torch.manual_seed(0)
    return DemoTransformerLM(vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=2, dim_feedforward=32,
                             packed_attention=method)


def loss_and_grads(model, batch):
    model.zero_grad()
    loss_sum, n = token_loss_sum(model(**model._inputs(batch)), batch["labels"])
    loss = loss_sum / n
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("method", ["sdpa_mask", "sdpa_groups"])
def test_demo_static_packed_loss_and_grads_equal_unpadded(method):
    model = tiny_demo(method)
    docs = documents(LENGTHS)
    free = PackedCollator(0)(docs)
    static = PackedCollator(0, row_length=64, max_documents=9)(docs)  # 46 real tokens, 3 zero-length segments
    loss_free, grads_free = loss_and_grads(model, free)
    loss_static, grads_static = loss_and_grads(model, static)
    torch.testing.assert_close(loss_static, loss_free, rtol=0, atol=1e-6)
    for k in grads_free:
        torch.testing.assert_close(grads_static[k], grads_free[k], rtol=0, atol=1e-6, msg=k)


def test_demo_static_packed_flex_attention_logits_equal_unpadded():
    model = tiny_demo("flex_attention").eval()
    docs = documents(LENGTHS)
    free, static = PackedCollator(0)(docs), PackedCollator(0, row_length=64, max_documents=9)(docs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex_attention on CPU warns that it runs uncompiled
        a, b = model(**model._inputs(free)), model(**model._inputs(static))
    torch.testing.assert_close(b[:, :sum(LENGTHS)], a, rtol=0, atol=1e-6)


def test_demo_padded_shape_loss_and_grads_equal_free_padding():
    model = tiny_demo("sdpa_mask")
    docs = documents(LENGTHS)
    loss_free, grads_free = loss_and_grads(model, PadCollator(0)(docs))
    shaped = PadCollator(0, shapes=[(8, 20)])(docs)  # two empty rows, three more columns
    assert shaped["input_ids"].shape == (8, 20)
    loss_shaped, grads_shaped = loss_and_grads(model, shaped)
    torch.testing.assert_close(loss_shaped, loss_free, rtol=0, atol=1e-6)
    for k in grads_free:
        torch.testing.assert_close(grads_shaped[k], grads_free[k], rtol=0, atol=1e-6, msg=k)


def test_hugging_face_causal_lm_static_packed_loss_and_grads_equal_unpadded():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    llm = LlamaForCausalLM(config).train()
    docs = documents(LENGTHS, seed=1)
    results = []
    for batch in (PackedCollator(0)(docs), PackedCollator(0, row_length=64, max_documents=9)(docs)):
        llm.zero_grad()
        loss = llm(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                   attention_mask=None, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in llm.named_parameters()}))
    (loss_free, grads_free), (loss_static, grads_static) = results
    torch.testing.assert_close(loss_static, loss_free, rtol=0, atol=1e-6)
    for k in grads_free:
        torch.testing.assert_close(grads_static[k], grads_free[k], rtol=0, atol=1e-6, msg=k)


def compiles_over_two_epochs(**batching):
    """Graphs ``torch.compile(dynamic=False)`` builds for the demo model's forward and backward over two epochs of
    one rank's micro-batches (CompileCounter: graphs are counted, not compiled), and the distinct input shapes."""
    torch._dynamo.reset()
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 90)
    tokens = [rng.integers(1, VOCAB, n) for n in lengths]
    sampler = BalancedBatchSampler(lengths, 128, num_replicas=2, rank=0, seed=1, **batching)
    collate = collator_for(sampler.settings, pad_token_id=0)
    model = tiny_demo("sdpa_mask")
    counter = CompileCounter()
    forward = torch.compile(lambda batch: model(**model._inputs(batch)), backend=counter, dynamic=False)
    shapes = set()
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        for micro in sampler:
            batch = collate([{"input_ids": tokens[i], "index": i} for i in micro])
            shapes.add(tuple(batch["input_ids"].shape))
            token_loss_sum(forward(batch), batch["labels"])[0].backward()
    torch._dynamo.reset()
    return counter.frame_count, shapes


def test_static_packed_micro_batches_compile_once():
    frames, shapes = compiles_over_two_epochs(packing=True, static_packing=True)
    assert shapes == {(1, 128)} and frames == 1
    # the same documents in free rows: a graph per row length, and per number of documents (cu_seq_lens) too
    free_frames, free_shapes = compiles_over_two_epochs(packing=True)
    assert free_frames >= min(len(free_shapes), 8) and free_frames > 1


def test_k_padded_shapes_compile_at_most_k_times():
    frames, shapes = compiles_over_two_epochs(padded_shapes=4)
    assert len(shapes) <= 4 and frames == len(shapes)
