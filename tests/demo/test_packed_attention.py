"""Packed rows: each document gets the logits it gets padded (DemoTransformerLM) or alone (a Hugging Face LM)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_balance.demo.attention import block_causal_mask, packed_attention, resolve_packed_attention
from lit_balance.data.collate import PackedCollator, PadCollator
from lit_balance.demo import DemoTransformerLM
from lit_balance.lightning.loss import token_loss_sum

VOCAB = 97
IMPLEMENTATIONS = ("sdpa_groups", "sdpa_mask", "flex_attention")


def documents(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "index": i} for i, n in enumerate(lengths)]


def packed_logits(model, batch, method):
    model.hparams.packed_attention = method
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex_attention on CPU warns that it runs uncompiled
        return model(batch["input_ids"], position_ids=batch["position_ids"], cu_seq_lens=batch["cu_seq_lens_q"])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DemoTransformerLM(vocab_size=VOCAB, d_model=32, num_heads=4, num_layers=2, dim_feedforward=64).eval()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=7), st.sampled_from(IMPLEMENTATIONS), st.integers(1, 8))
def test_packed_logits_equal_padded_per_document_fp32(model, lengths, method, multiple):
    docs = documents(lengths)
    packed = PackedCollator(0, pad_to_multiple_of=multiple)(docs)
    padded = PadCollator(0)(docs)
    with torch.no_grad():
        ref = model(padded["input_ids"], padded["attention_mask"])
        out = packed_logits(model, packed, method)
    assert out.dtype == torch.float32 and out.shape == (1, packed["num_padded_tokens"], VOCAB)
    cu = packed["cu_seq_lens_q"].tolist()
    for d, n in enumerate(lengths):
        torch.testing.assert_close(out[0, cu[d]:cu[d] + n], ref[d, :n], rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["sdpa_groups", "sdpa_mask"])
def test_packed_gradients_equal_padded(model, method):
    docs = documents([5, 1, 17, 9, 33, 2], seed=3)
    grads = []
    for batch in (PadCollator(0)(docs), PackedCollator(0)(docs)):
        model.zero_grad()
        if "cu_seq_lens_q" in batch:
            logits = packed_logits(model, batch, method)
        else:
            logits = model(batch["input_ids"], batch["attention_mask"])
        loss_sum, n = token_loss_sum(logits, batch["labels"])
        assert n == sum(len(d["input_ids"]) - 1 for d in docs)
        loss_sum.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-5, msg=k)


def test_attention_masks_and_groups_cover_exactly_each_document():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    mask = block_causal_mask(cu)
    expected = torch.zeros(9, 9, dtype=torch.bool)
    for a, b in ((0, 3), (3, 4), (4, 9)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=expected)
    torch.testing.assert_close(packed_attention("sdpa_groups", cu)(q, k, v, 0.0), ref, rtol=0, atol=1e-6)


def test_auto_selects_sdpa_groups_on_cpu_and_flex_on_cuda():
    assert resolve_packed_attention("auto", torch.device("cpu")) == "sdpa_groups"
    assert resolve_packed_attention("auto", torch.device("cuda")) == "flex_attention"
    assert resolve_packed_attention("auto", torch.device("cuda"), dropout_p=0.1) == "sdpa_groups"
    assert resolve_packed_attention("sdpa_mask", torch.device("cuda")) == "sdpa_mask"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled FlexAttention kernel needs a CUDA device")
def test_flex_attention_on_cuda_equals_padded_and_trains():
    torch.manual_seed(0)
    model = DemoTransformerLM(vocab_size=VOCAB, d_model=64, num_heads=4).cuda()
    docs = documents([130, 7, 64, 200, 1])
    packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in PackedCollator(0)(docs).items()}
    padded = {k: v.cuda() if torch.is_tensor(v) else v for k, v in PadCollator(0)(docs).items()}
    out = model(**model._inputs(packed))
    ref = model(**model._inputs(padded))
    cu = packed["cu_seq_lens_q"].tolist()
    for d, doc in enumerate(docs):
        n = len(doc["input_ids"])
        torch.testing.assert_close(out[0, cu[d]:cu[d] + n], ref[d, :n], rtol=1e-4, atol=1e-4)
    token_loss_sum(out, packed["labels"])[0].backward()
    assert all(p.grad is not None for p in model.parameters())


def test_packed_forward_errors(model):
    batch = PackedCollator(0)(documents([3, 4]))
    ids, pos, cu = batch["input_ids"], batch["position_ids"], batch["cu_seq_lens_q"]
    with pytest.raises(ValueError, match="one row"):
        model(ids.repeat(2, 1), position_ids=pos.repeat(2, 1), cu_seq_lens=cu)
    with pytest.raises(ValueError, match="needs position_ids"):
        model(ids, cu_seq_lens=cu)
    with pytest.raises(ValueError, match="no attention_mask"):
        model(ids, torch.ones_like(ids), position_ids=pos, cu_seq_lens=cu)
    with pytest.raises(ValueError, match="run from 0 to N=7"):
        model(ids, position_ids=pos, cu_seq_lens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="packed_attention must be one of"):
        DemoTransformerLM(vocab_size=VOCAB, packed_attention="flash")


def test_packed_training_with_dropout_runs_and_is_random():
    torch.manual_seed(0)
    model = DemoTransformerLM(vocab_size=VOCAB, d_model=32, num_heads=4, dropout=0.5).train()
    batch = PackedCollator(0)(documents([6, 9, 4]))
    a, b = (model(**model._inputs(batch)) for _ in range(2))
    assert not torch.equal(a, b)
    token_loss_sum(a, batch["labels"])[0].backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_hugging_face_causal_lm_trains_on_the_packed_batch_directly(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attn)
    llm = LlamaForCausalLM(config).eval()
    lengths = [5, 1, 12, 8]
    docs = documents(lengths, seed=1)
    batch = PackedCollator(0)(docs)
    out = llm(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
              attention_mask=None, use_cache=False)
    cu = batch["cu_seq_lens_q"].tolist()
    for d, doc in enumerate(docs):
        alone = llm(input_ids=doc["input_ids"].unsqueeze(0), use_cache=False).logits[0]
        torch.testing.assert_close(out.logits[0, cu[d]:cu[d + 1]], alone, rtol=0, atol=1e-5)
    # the model's own loss is the mean over exactly the tokens token_loss_sum supervises: l - 1 per document
    loss_sum, n = token_loss_sum(out.logits, batch["labels"])
    assert n == sum(lengths) - len(lengths)
    torch.testing.assert_close(out.loss, loss_sum / n, rtol=1e-5, atol=1e-6)
    # and it trains on it: a few optimizer steps on the packed batch lower its loss
    optimizer = torch.optim.SGD(llm.parameters(), lr=0.5)
    llm.train()
    first = None
    for _ in range(3):
        optimizer.zero_grad()
        loss = llm(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                   attention_mask=None, use_cache=False).loss
        loss.backward()
        optimizer.step()
        first = float(loss) if first is None else first
    assert float(loss) < first
