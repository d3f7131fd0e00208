"""A small causal transformer language model for demos, recipes and tests."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn

from lit_balance._checks import check_int, check_number
from lit_balance.demo.attention import PACKED_ATTENTION, packed_attention, resolve_packed_attention
from lit_balance.errors import InputValueError
from lit_balance.lightning.loss import StepTokenLoss, token_loss_sum
from lit_balance.lightning.metrics import TokenMeanLoss
from lit_balance.world import data_parallel_world

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
    """A pre-norm causal transformer LM trained on the batches of :class:`lit_balance.PadCollator` or
    :class:`lit_balance.PackedCollator`.

    Positions use sinusoidal encodings, so any row length works (batches are padded only to their
    longest row). A packed batch (one row of whole documents, ``cu_seq_lens_q`` giving their boundaries) is
    attended within each document only, and each position's encoding is that of its ``position_ids`` (restarting
    at 0 per document), so every document gets the logits it gets alone or in a padded batch (equal within float
    rounding). How a packed row is attended is chosen at run time (``packed_attention``):

    * ``"sdpa_mask"``: :func:`torch.nn.functional.scaled_dot_product_attention` with a block-diagonal causal mask
      ``[N, N]`` (any device; its work grows with ``N**2``).
    * ``"sdpa_groups"``: documents grouped by length (lengths within a factor of 2 share a group), each group one
      causal SDPA call over its documents padded to the group's longest; outputs gathered back into the row (any
      device; work about ``sum(l**2)``, within 4x).
    * ``"flex_attention"``: :func:`torch.nn.attention.flex_attention.flex_attention` with a document mask (the
      varlen kernel of PyTorch; compiled on CUDA; on CPU it has no backward pass).
    * ``"auto"`` (default): ``"flex_attention"`` on a CUDA device when PyTorch provides it (and, in training, dropout
      is 0: FlexAttention has no attention dropout), else ``"sdpa_groups"``.

    The training loss is token-weighted (:class:`lit_balance.lightning.loss.StepTokenLoss`): each
    optimizer step's gradient and its logged ``train/loss`` are those of the mean next-token cross-entropy over
    all supervised tokens (labels other than -100) of all ranks and micro-batches of the step; a micro-batch
    without any (only fill rows) contributes zero, never NaN. ``val/loss`` is the exact mean next-token
    cross-entropy over all supervised validation tokens of all ranks, logged once per validation epoch: sums
    of token losses and token counts are kept in a :class:`lit_balance.lightning.metrics.TokenMeanLoss` (attribute
    ``val_loss``), summed over the data-parallel ranks (:func:`lit_balance.world.data_parallel_world`; its process
    group is set at ``setup``) and divided once at epoch end. With several validation loaders (one per component of
    a :class:`~lit_balance.Mixture`), it also logs ``val/loss/<name>`` per loader, named by the DataModule's
    ``val_names`` (:class:`~lit_balance.BalancedTextDataModule` has them).

    Args:
        vocab_size: number of token ids.
        d_model: hidden size.
        num_heads: attention heads (must divide ``d_model``).
        num_layers: transformer blocks.
        dim_feedforward: feed-forward hidden size.
        dropout: dropout probability.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        packed_attention: how packed rows are attended: ``"auto"``, ``"sdpa_groups"``, ``"sdpa_mask"`` or
            ``"flex_attention"`` (see above).

    Shapes: ``forward(input_ids [B, T], attention_mask [B, T]) -> logits [B, T, vocab_size]`` (padded);
    ``forward(input_ids [1, N], position_ids=[1, N], cu_seq_lens=int [D + 1]) -> logits [1, N, vocab_size]``
    (packed). Static shapes (``BatchingSettings(static_packing=True)`` or ``padded_shapes``) work on every path:
    zero-length segments at the end of ``cu_seq_lens`` and empty padded rows are allowed, and with
    ``packed_attention="sdpa_mask"`` (or ``"flex_attention"``) the packed forward has no graph break, so
    ``torch.compile(dynamic=False)`` keeps one graph for every ``[1, max_tokens]`` micro-batch (docs/compiling.md).

    Raises:
        TypeError: a size that is not an int (bools and floats such as ``2.0`` too), or a rate that is not
            a real number.
        ValueError: a size < 1, ``d_model`` not divisible by ``num_heads``, ``dropout`` outside ``[0, 1]``,
            or ``lr`` / ``weight_decay`` negative or not finite; an unknown ``packed_attention``.
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
        packed_attention: str = "auto",
    ) -> None:
        super().__init__()
        vocab_size = check_int("vocab_size", vocab_size, 1, "pass the data module's vocab_size (token ids)")
        d_model = check_int("d_model", d_model, 1, "set the hidden size, a multiple of num_heads")
        num_heads = check_int("num_heads", num_heads, 1, "set the attention heads, a divisor of d_model")
        num_layers = check_int("num_layers", num_layers, 1, "set the number of transformer blocks")
        dim_feedforward = check_int("dim_feedforward", dim_feedforward, 1, "set the feed-forward hidden size")
        if d_model % num_heads:
            raise InputValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}); change d_model "
                                  "or "
                                  "num_heads")
        dropout = check_number("dropout", dropout, 0.0, 1.0, "set dropout to a probability, e.g. 0.0 or 0.1")
        lr = check_number("lr", lr, 0.0, None, "set lr to the AdamW learning rate, e.g. 1e-3")
        weight_decay = check_number("weight_decay", weight_decay, 0.0, None, "set weight_decay to the AdamW weight "
                                                                             "decay, e.g. 0.01")
        if packed_attention not in ("auto", *PACKED_ATTENTION):
            raise InputValueError(f"packed_attention must be one of {('auto', *PACKED_ATTENTION)}, got "
                                  f"{packed_attention!r}")
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
        #: One :class:`TokenMeanLoss` per validation loader of a mixture (``val/loss/<name>``), filled at setup.
        self.val_component_loss = nn.ModuleDict()
        self._val_names: list[str] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, cu_seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]``: padded rows with ``attention_mask``, or one packed row with ``cu_seq_lens``.

        Raises:
            ValueError: a packed call with more than one row, without ``position_ids``, with ``cu_seq_lens`` that
                do not run from 0 to ``N``, or with an ``attention_mask``.
        """
        if cu_seq_lens is not None:
            return self._packed_forward(input_ids, position_ids, cu_seq_lens, attention_mask)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        t = input_ids.shape[1]
        d_model = self.hparams.d_model
        x = self.embed(input_ids) * math.sqrt(d_model) + _sinusoidal(t, d_model, input_ids.device)
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device, dtype=x.dtype)
        padding = torch.zeros_like(attention_mask, dtype=x.dtype).masked_fill(attention_mask == 0, float("-inf"))
        # a row without real tokens (a static shape's empty row) attends over its padding rather than to nothing
        # (NaN); its labels are all -100, so it adds nothing to the loss or the gradients
        padding = torch.where((attention_mask == 0).all(dim=1, keepdim=True), torch.zeros_like(padding), padding)
        x = self.blocks(x, mask=causal, src_key_padding_mask=padding, is_causal=True)
        return self.head(self.norm(x))

    def _packed_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cu_seq_lens: torch.Tensor,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise InputValueError(f"a packed batch is one row: input_ids [1, N], got shape {tuple(input_ids.shape)}; "
                                  "collate with lit_balance.PackedCollator")
        if attention_mask is not None:
            raise InputValueError("a packed batch takes no attention_mask (documents are delimited by cu_seq_lens); "
                                  "pass attention_mask=None")
        if position_ids is None or position_ids.shape != input_ids.shape:
            raise InputValueError(f"a packed batch needs position_ids of shape {tuple(input_ids.shape)} (0 at each "
                                  f"document's start), got "
                                  f"{None if position_ids is None else tuple(position_ids.shape)}")
        n = input_ids.shape[1]
        cu = cu_seq_lens.reshape(-1)
        # the check reads values: skipped while torch.compile traces (no graph break, one graph per shape)
        if not torch.compiler.is_compiling() and (cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n):
            raise InputValueError(f"cu_seq_lens must run from 0 to N={n} (cumulative document lengths), got "
                                  f"{cu.tolist()[:4]}...{cu.tolist()[-2:]}")
        d_model = self.hparams.d_model
        positions = _sinusoidal(n, d_model, input_ids.device)[position_ids]  # position_ids < N: a table of the row
        x = self.embed(input_ids) * math.sqrt(d_model) + positions
        dropout = self.hparams.dropout if self.training else 0.0
        method = resolve_packed_attention(self.hparams.packed_attention, input_ids.device, dropout)
        attend = packed_attention(method, cu.to(input_ids.device), n)
        for layer in self.blocks.layers:
            x = _packed_layer(layer, x, attend)
        return self.head(self.norm(x))

    @staticmethod
    def _inputs(batch: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of :meth:`forward` for a padded or a packed batch."""
        if "cu_seq_lens_q" in batch:
            return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
                    "cu_seq_lens": batch["cu_seq_lens_q"]}
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Mean next-token cross-entropy of one batch over its supervised tokens (0, with a graph, if none)."""
        loss_sum, n = token_loss_sum(self(**self._inputs(batch)), batch["labels"])
        return loss_sum / max(n, 1)

    def setup(self, stage: str) -> None:
        # the metric sums over the data-parallel ranks: tensor-parallel peers of one replica hold the same tokens
        self.val_loss.process_group = data_parallel_world(self.trainer).process_group

    def on_validation_start(self) -> None:
        # several validation loaders: one per component of a blend, named by the DataModule's val_names
        self._val_names = []
        if len(self.trainer.num_val_batches) > 1:
            self._val_names = list(self.trainer.datamodule.val_names)
        for name in self._val_names:
            if name not in self.val_component_loss:
                self.val_component_loss[name] = TokenMeanLoss().to(self.device)
            self.val_component_loss[name].process_group = self.val_loss.process_group

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss_sum, n = token_loss_sum(self(**self._inputs(batch)), batch["labels"])
        return self.step_loss.micro_batch(self, batch, loss_sum, n)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # once per optimizer step, after the last micro-batch's backward and before gradient clipping
        loss = self.step_loss.finish_step(self)
        self.log("train/loss", loss.float(), prog_bar=True, batch_size=1)

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        # float sums over tokens, reduced over ranks and divided once when Lightning computes the epoch value
        loss_sum, n = token_loss_sum(self(**self._inputs(batch)), batch["labels"])
        self.val_loss.update(loss_sum, n)
        if self._val_names:  # one loader per mixture component: logged at the epoch's end, without loader suffixes
            self.val_component_loss[self._val_names[dataloader_idx]].update(loss_sum, n)
        else:
            self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        if self._val_names:
            self.log("val/loss", self.val_loss)
            for name in self._val_names:
                self.log(f"val/loss/{name}", self.val_component_loss[name])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def _packed_layer(layer: nn.TransformerEncoderLayer, x: torch.Tensor, attend: Any) -> torch.Tensor:
    """One pre-norm ``TransformerEncoderLayer`` on a packed row ``[1, N, d]``, its attention done by ``attend``.

    The same parameters and operations as the layer's own forward (``norm_first=True``), with
    ``attend(q, k, v, dropout_p)`` (``[1, heads, N, head_dim]`` each) in place of the masked attention.
    """
    mha = layer.self_attn
    h = layer.norm1(x)
    n, d = h.shape[1], h.shape[2]
    heads = mha.num_heads
    q, k, v = nn.functional.linear(h, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.reshape(1, n, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    out = attend(q, k, v, mha.dropout if mha.training else 0.0)
    x = x + layer.dropout1(mha.out_proj(out.transpose(1, 2).reshape(1, n, d)))
    h = layer.norm2(x)
    return x + layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(h)))))
