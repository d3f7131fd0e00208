"""Causal attention within each document of a packed row: three implementations, chosen at run time.

Each ``attend(q, k, v, dropout_p)`` takes ``[1, heads, N, head_dim]`` tensors of one packed row whose documents
are delimited by ``cu_seq_lens`` (int ``[D + 1]``, ``0 ... N``) and returns the output of causal attention in which
each token sees only the earlier tokens of its own document: the block-diagonal causal mask of padding-free
training (Hugging Face's ``DataCollatorWithFlattening``; flash-attn's ``flash_attn_varlen_func``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from lit_balance.errors import InputValueError

PACKED_ATTENTION = ("sdpa_groups", "sdpa_mask", "flex_attention")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_packed_attention(name: str, device: torch.device, dropout_p: float = 0.0) -> str:
    """The implementation ``"auto"`` stands for on ``device``: FlexAttention on CUDA when present (and no attention
    dropout is asked for, which it lacks), else SDPA groups.

    Raises:
        RuntimeError: ``"flex_attention"`` asked for where this PyTorch has none.
    """
    if name == "auto":
        flex = device.type == "cuda" and dropout_p == 0 and _flex_available()
        return "flex_attention" if flex else "sdpa_groups"
    if name == "flex_attention" and not _flex_available():
        raise RuntimeError("packed_attention='flex_attention' needs torch.nn.attention.flex_attention (PyTorch >= 2.5);"
                           " use 'sdpa_groups' or 'auto'")
    return name


def document_ids(cu_seq_lens: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Document number of each token, LongTensor ``[N]``, from cumulative lengths ``[D + 1]`` (zero-length segments
    allowed: they hold no token).

    A search of each token's position in the boundaries, so the output's shape is ``[N]`` whatever the lengths
    (``N = cu_seq_lens[-1]``, or ``n`` when given: no value is read, and ``torch.compile`` keeps one graph).
    """
    cu = cu_seq_lens.reshape(-1)
    n = int(cu[-1]) if n is None else int(n)
    positions = torch.arange(n, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), positions, right=True)


def block_causal_mask(cu_seq_lens: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """BoolTensor ``[N, N]``: True where query ``i`` may attend key ``j`` (same document, ``j <= i``); ``n``: as for
    :func:`document_ids`."""
    doc = document_ids(cu_seq_lens, n)
    n = doc.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
    return (doc.unsqueeze(1) == doc.unsqueeze(0)) & causal


def _sdpa_mask(cu_seq_lens: torch.Tensor, n: int | None = None) -> Attend:
    mask = block_causal_mask(cu_seq_lens, n)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    return attend


def _length_groups(cu_seq_lens: torch.Tensor) -> tuple[list[tuple[torch.Tensor, int]], torch.Tensor]:
    """Documents grouped by length (powers of 2): per group the token index ``[G, L]`` of its padded documents.

    Returns ``(groups, slot)``: ``groups`` lists ``(index [G, L], L)`` with ``index[g, t]`` the row position of
    token ``t`` of the group's ``g``-th document (its last token repeated past its end); ``slot[n]`` is where row
    token ``n`` lands in the concatenation of the groups' flattened outputs.
    """
    cu = cu_seq_lens.long().cpu()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]  # zero-length segments (static rows) hold no token
    bucket = torch.ceil(torch.log2(lengths.double())).long()
    n = int(cu[-1])
    slot = torch.empty(n, dtype=torch.long)
    groups, offset = [], 0
    for b in torch.unique(bucket).tolist():
        members = torch.nonzero(bucket == b).flatten()
        longest = int(lengths[members].max())
        steps = torch.arange(longest)
        within = torch.minimum(steps.unsqueeze(0), lengths[members].unsqueeze(1) - 1)
        index = starts[members].unsqueeze(1) + within  # [G, L]
        real = steps.unsqueeze(0) < lengths[members].unsqueeze(1)
        flat = offset + torch.arange(index.numel()).reshape(index.shape)
        slot[index[real]] = flat[real]
        offset += index.numel()
        groups.append((index.to(cu_seq_lens.device), longest))
    return groups, slot.to(cu_seq_lens.device)


def _sdpa_groups(cu_seq_lens: torch.Tensor, n: int | None = None) -> Attend:
    groups, slot = _length_groups(cu_seq_lens)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[3]
        outs = []
        for index, longest in groups:
            g = index.shape[0]
            # [1, H, N, E] -> [G, H, L, E]: each document of the group padded to L at its end (causal attention
            # keeps the repeated tail tokens out of every real token's output)
            q_g, k_g, v_g = (t[0][:, index].permute(1, 0, 2, 3) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q_g, k_g, v_g, dropout_p=dropout_p, is_causal=True)
            outs.append(out.permute(1, 0, 2, 3).reshape(heads, g * longest, dim))
        return torch.cat(outs, dim=1)[:, slot].unsqueeze(0)

    return attend


_COMPILED: dict[str, Any] = {}


def _flex(cu_seq_lens: torch.Tensor, n: int | None = None) -> Attend:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = document_ids(cu_seq_lens, n)
    n = doc.numel()

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(mask_mod, None, None, n, n, device=str(doc.device))
    if doc.device.type == "cuda":
        if "flex" not in _COMPILED:
            _COMPILED["flex"] = torch.compile(flex_attention)
        kernel = _COMPILED["flex"]
    else:  # eager: materialises the scores (a reference path; PyTorch has no CPU backward for it)
        kernel = flex_attention

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        if dropout_p:
            raise InputValueError("packed_attention='flex_attention' has no attention dropout; set the model's dropout "
                                  "to 0 "
                                  "or use 'sdpa_groups'")
        return kernel(q, k, v, block_mask=block_mask)

    return attend


def packed_attention(name: str, cu_seq_lens: torch.Tensor, n: int | None = None) -> Attend:
    """The ``attend(q, k, v, dropout_p)`` function of implementation ``name`` for one packed row of ``n`` tokens
    (None: ``cu_seq_lens[-1]``, read from the tensor).

    Built once per forward pass (the masks or groups depend only on ``cu_seq_lens``) and used by every layer.

    Raises:
        ValueError: an unknown ``name``.
    """
    builders = {"sdpa_mask": _sdpa_mask, "sdpa_groups": _sdpa_groups, "flex_attention": _flex}
    if name not in builders:
        raise InputValueError(f"packed attention must be one of {PACKED_ATTENTION}, got {name!r}")
    return builders[name](cu_seq_lens, n)
