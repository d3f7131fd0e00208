"""A small causal transformer language model for demos, recipes and tests."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn

from lit_balance._validate import check_int, check_number
from lit_balance.loss import StepTokenLoss, token_loss_sum
from lit_balance.metrics import TokenMeanLoss

__all__ = ["DemoTransformerLM"]


def _sinusoidal(length: int, dim: int, device: torch.device) -> torch.Tensor:
    """Sinusoidal position encodings ``[length, dim]`` (Vaswani et al., 2017, "Attention Is All You Need")."""
    pos = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    enc = torch.zeros(length, dim, device=device)
    enc[:, 0::2] = torch.sin(pos * freq)
    enc[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return enc


class DemoTransformerLM(L.LightningModule):
    """A pre-norm causal transformer LM trained on the batches of :class:`lit_balance.PadCollator`.

    Positions use sinusoidal encodings, so any row length works (batches are padded only to their
    longest row). The training loss is token-weighted (:class:`lit_balance.loss.StepTokenLoss`): each
    optimizer step's gradient and its logged ``train/loss`` are those of the mean next-token cross-entropy over
    all supervised tokens (labels other than -100) of all ranks and micro-batches of the step; a micro-batch
    without any (only fill rows) contributes zero, never NaN. ``val/loss`` is the exact mean next-token
    cross-entropy over all supervised validation tokens of all ranks, logged once per validation epoch: sums
    of token losses and token counts are kept in a :class:`lit_balance.metrics.TokenMeanLoss` (attribute
    ``val_loss``), summed over ranks and divided once at epoch end.

    Args:
        vocab_size: number of token ids.
        d_model: hidden size.
        num_heads: attention heads (must divide ``d_model``).
        num_layers: transformer blocks.
        dim_feedforward: feed-forward hidden size.
        dropout: dropout probability.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Shapes: ``forward(input_ids [B, T], attention_mask [B, T]) -> logits [B, T, vocab_size]``.

    Raises:
        TypeError: a size that is not an int (bools and floats such as ``2.0`` too), or a rate that is not
            a real number.
        ValueError: a size < 1, ``d_model`` not divisible by ``num_heads``, ``dropout`` outside ``[0, 1]``,
            or ``lr`` / ``weight_decay`` negative or not finite.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        num_heads: int = 4,
        num_layers: int = 2,
        dim_feedforward: int = 512,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        vocab_size = check_int("vocab_size", vocab_size, 1, "pass the data module's vocab_size (token ids)")
        d_model = check_int("d_model", d_model, 1, "set the hidden size, a multiple of num_heads")
        num_heads = check_int("num_heads", num_heads, 1, "set the attention heads, a divisor of d_model")
        num_layers = check_int("num_layers", num_layers, 1, "set the number of transformer blocks")
        dim_feedforward = check_int("dim_feedforward", dim_feedforward, 1, "set the feed-forward hidden size")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}); change d_model or "
                             "num_heads")
        dropout = check_number("dropout", dropout, 0.0, 1.0, "set dropout to a probability, e.g. 0.0 or 0.1")
        lr = check_number("lr", lr, 0.0, None, "set lr to the AdamW learning rate, e.g. 1e-3")
        weight_decay = check_number("weight_decay", weight_decay, 0.0, None, "set weight_decay to the AdamW weight decay, e.g. 0.01")
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, num_heads, dim_feedforward, dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied input and output embeddings
        # std d_model**-0.5: output logits start near unit scale (initial loss ~ ln(vocab_size)), and the
        # sqrt(d_model) input scaling in forward() gives unit-scale token embeddings
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        self.step_loss = StepTokenLoss()
        self.val_loss = TokenMeanLoss()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        d_model = self.hparams.d_model
        x = self.embed(input_ids) * math.sqrt(d_model) + _sinusoidal(t, d_model, input_ids.device)
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device, dtype=x.dtype)
        padding = torch.zeros_like(attention_mask, dtype=x.dtype).masked_fill(attention_mask == 0, float("-inf"))
        x = self.blocks(x, mask=causal, src_key_padding_mask=padding, is_causal=True)
        return self.head(self.norm(x))

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Mean next-token cross-entropy of one batch over its supervised tokens (0, with a graph, if none)."""
        loss_sum, n = token_loss_sum(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        return loss_sum / max(n, 1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss_sum, n = token_loss_sum(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        return self.step_loss.micro_batch(self, batch, loss_sum, n)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # once per optimizer step, after the last micro-batch's backward and before gradient clipping
        loss = self.step_loss.finish_step(self)
        self.log("train/loss", loss.float(), prog_bar=True, batch_size=1)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # float sums over tokens, reduced over ranks and divided once when Lightning computes the epoch value
        loss_sum, n = token_loss_sum(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        self.val_loss.update(loss_sum, n)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
