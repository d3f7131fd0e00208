"""Token-weighted loss: each optimizer step averages over every supervised token of every rank and micro-batch.

Lightning divides the loss that ``training_step`` returns by ``trainer.accumulate_grad_batches`` and DDP (FSDP2:
over the device mesh's ``data_parallel`` dimension) averages gradients over the ``num_replicas`` data-parallel ranks
(:func:`lit_balance.world.data_parallel_world`; "ranks" below are those: the processes of one tensor-parallel replica
hold the same tokens and count once). Averaging per micro-batch and then over micro-batches and ranks
weights a token of a short micro-batch more than a token of a long one. :class:`StepTokenLoss` instead makes
each optimizer step's gradient the gradient of

``sum(token losses of the step, all ranks, all micro-batches) / N``

where ``N`` counts the step's supervised tokens (labels ``!= -100``) over all ranks and micro-batches, as if
one process computed the mean over those tokens at once. Two ways to know ``N``:

* **Plan divisor** (no communication): when the batch carries ``step_supervised_tokens`` (the sampler's plan
  knows every rank's micro-batches of the step ahead, see :class:`lit_balance.PadCollator`) and accumulation is
  fixed (no callback in the Trainer that changes ``accumulate_grad_batches`` during fit, which such a callback
  declares by the class attribute ``sets_accumulate_grad_batches = True`` as
  :class:`lit_balance.callbacks.AdaptiveGradAccumulation` does; and the training sampler handed to the Trainer, if
  any (:func:`lit_balance.use_training_sampler`), planned with the Trainer's ``accumulate_grad_batches``), each
  micro-batch returns ``sum_local * num_replicas * accumulate_grad_batches / N``.
* **All-reduce divisor** (one all-reduce of two numbers per optimizer step): otherwise each micro-batch
  returns ``sum_local * accumulate_grad_batches`` and, in ``on_before_optimizer_step`` (before gradient
  clipping), ``N`` is summed over ranks and gradients are multiplied by ``num_replicas / N``. This is the
  scheme of torchtune's distributed fine-tuning recipes (``scale_grads`` by ``world_size / num_tokens``).

A step with ``N == 0`` has zero loss and zero gradient, never NaN.

Compiled models (``torch.compile(model, dynamic=False)`` handed to ``Trainer.fit``, which compiles ``training_step``
and ``validation_step``): :func:`token_loss_sum` returns its count as a tensor and reads no tensor value, so it
traces into the model's graph without a break or a guard; :meth:`StepTokenLoss.micro_batch` reads per-step Python
numbers (the batch's ``step_supervised_tokens``, the Trainer's ``accumulate_grad_batches``) and keeps running sums, so
it runs outside the compiled region (``torch.compiler.disable``): a compiler that read those ints would guard on each
step's value and compile again for every new one (docs/compiling.md).

Packed micro-batches (:class:`lit_balance.PackedCollator`, one row of whole documents) need nothing else: their
labels are -100 at each document's first token, so the shifted loss of :func:`token_loss_sum` never lets one
document predict the next one's first token, a document of ``l`` tokens supervises ``l - 1`` as a padded row
does, and the plan's ``step_supervised_tokens`` counts the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_balance.data.collate import IGNORE_INDEX
from lit_balance.data.training_sampler import training_sampler_of
from lit_balance.errors import InputTypeError, InputValueError
from lit_balance.world import data_parallel_world

__all__ = ["StepTokenLoss", "token_loss_sum"]

PLAN = "plan"
ALL_REDUCE = "all_reduce"
#: Version of :meth:`StepTokenLoss.state_dict`.
LOSS_STATE_VERSION = 1


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, *,
                   shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropy over supervised tokens, and their count (per rank, one micro-batch).

    Args:
        logits: float ``[B, T, vocab]`` (``[1, N, vocab]`` for a packed row).
        labels: int ``[B, T]``; ``-100`` marks tokens without a target (padding, fill rows; in a packed row also
            each document's first token).
        shift: causal LM: position ``t`` predicts label ``t + 1`` (as in :class:`lit_balance.demo.DemoTransformerLM`).

    Returns:
        ``(loss_sum, num_tokens)``: a float32 scalar tensor (0 with a graph when there are no supervised tokens) and
        an int64 scalar tensor on the labels' device (``int(num_tokens)`` reads it). Neither is read on the host
        here: no device sync, and under ``torch.compile`` no graph break and no guard on the count.

    Example:
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 ids: ln(4) per token
        >>> loss_sum, n = token_loss_sum(logits, torch.tensor([[1, 2, -100]]))
        >>> round(float(loss_sum), 4), int(n)
        (1.3863, 1)
    """
    if shift:  # the labels move, not the logits: no copy of the [B, T, vocab] tensor
        labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    targets = labels.reshape(-1)
    n = (targets != IGNORE_INDEX).sum()
    # a sum over no supervised token is 0 with a zero gradient for every logit (never NaN), and the graph is kept:
    # DDP needs every parameter used
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets,
                                             ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, n


class StepTokenLoss:
    """Scale each micro-batch's summed token loss so an optimizer step averages over all its supervised tokens.

    Use from a LightningModule (see :class:`lit_balance.demo.DemoTransformerLM`)::

        self.step_loss = StepTokenLoss()
        def training_step(self, batch, batch_idx):
            loss_sum, n = token_loss_sum(self(...), batch["labels"])
            return self.step_loss.micro_batch(self, batch, loss_sum, n)
        def on_before_optimizer_step(self, optimizer):
            self.log("train/loss", self.step_loss.finish_step(self))

    Args:
        sync_log: in the plan path, sum the step's loss and token count over ranks (one all-reduce of two
            numbers per optimizer step) so that :meth:`finish_step` returns the global mean; with False it
            returns this rank's own mean and the plan path uses no collective at all. The all-reduce path
            always reduces (it needs ``N``).

    Attributes:
        mode: ``"plan"`` or ``"all_reduce"``: the divisor used by the current step (None before the first).
        last_step_tokens: ``N`` of the last finished step (global, or this rank's with ``sync_log=False``).

    Raises:
        RuntimeError: micro-batches of one optimizer step disagree on the path or on ``step_supervised_tokens``
            (the sampler's ``accumulate_grad_batches`` differs from the Trainer's).
    """

    def __init__(self, sync_log: bool = True) -> None:
        self.sync_log = bool(sync_log)
        self.mode: str | None = None
        self.last_step_tokens = 0
        #: Plan-path steps whose gradients were rescaled to the tokens actually seen.
        self.num_corrected_steps = 0
        self._open = False
        self._sum: torch.Tensor | float = 0.0
        self._count: torch.Tensor | int = 0
        self._planned: int | None = None

    @staticmethod
    def _context(module: Any) -> tuple[int, int, bool]:
        """``(data-parallel ranks, accumulate_grad_batches, whether accumulation may differ from the plan's)``."""
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            return 1, 1, False
        acc = int(trainer.accumulate_grad_batches)
        # a callback that changes accumulate_grad_batches during fit says so by this class attribute
        # (AdaptiveGradAccumulation does); the plan's per-step token count then no longer matches the steps run
        adaptive = any(getattr(c, "sets_accumulate_grad_batches", False) is True for c in trainer.callbacks)
        if not adaptive:  # a training sampler planned for other optimizer steps than the Trainer's
            sampler = training_sampler_of(trainer)
            adaptive = sampler is not None and int(sampler.settings.accumulate_grad_batches) != acc
        return data_parallel_world(trainer).num_replicas, acc, adaptive

    @torch.compiler.disable
    def micro_batch(self, module: Any, batch: dict[str, Any], loss_sum: torch.Tensor,
                    num_tokens: torch.Tensor | int) -> torch.Tensor:
        """Return the loss to hand to Lightning for this micro-batch (see the module docstring for the scaling).

        Runs outside ``torch.compile`` (it reads the batch's per-step ints and the Trainer): in a compiled
        ``training_step`` the graph ends with ``loss_sum`` and this scaling runs eagerly, so no per-step number
        becomes a guard.

        Args:
            module: the LightningModule (its trainer gives the data-parallel world and ``accumulate_grad_batches``).
            batch: the micro-batch; ``step_supervised_tokens`` selects the plan divisor when accumulation is fixed.
            loss_sum: scalar tensor, sum of token losses of this micro-batch (this rank).
            num_tokens: supervised tokens of this micro-batch (this rank): an int or an integer scalar tensor (kept
                on its device until :meth:`finish_step`).
        """
        num_replicas, acc, adaptive = self._context(module)
        planned = batch.get("step_supervised_tokens") if isinstance(batch, dict) else None
        mode = PLAN if planned is not None and not adaptive else ALL_REDUCE
        if not self._open:  # first micro-batch of an optimizer step
            self.mode, self._open = mode, True
        elif mode != self.mode:
            raise RuntimeError(f"micro-batches of one optimizer step use different divisors ({self.mode}, {mode})")
        self._sum = self._sum + loss_sum.detach().double()  # stays on the device: no host sync per micro-batch
        self._count = self._count + (num_tokens.detach() if isinstance(num_tokens, torch.Tensor) else int(num_tokens))
        if mode == PLAN:
            planned = int(planned)
            if self._planned is not None and self._planned != planned:
                raise RuntimeError(
                    f"micro-batches of one optimizer step carry different step_supervised_tokens "
                    f"({self._planned}, {planned}): the sampler's accumulate_grad_batches must equal the Trainer's"
                )
            self._planned = planned
            if planned == 0:
                return loss_sum * 0.0
            return loss_sum * (num_replicas * acc / planned)
        return loss_sum * acc

    def finish_step(self, module: Any) -> torch.Tensor:
        """Finish the optimizer step: in the all-reduce path scale gradients by ``num_replicas / N``.

        Call it from ``on_before_optimizer_step`` (Lightning calls that once per optimizer step, after the
        last micro-batch's backward and before gradient clipping).

        Returns:
            The step's loss, the mean over its supervised tokens (a float64 scalar tensor; global unless
            ``sync_log=False`` in the plan path).

        In the plan path with ``sync_log=True``, a step whose ranks saw a different number of supervised
        tokens than planned (``limit_train_batches`` or ``max_steps`` cut it short) has its gradients
        rescaled by ``planned / seen``, which makes them exactly the mean over the tokens seen
        (counted in :attr:`num_corrected_steps`).
        """
        trainer = getattr(module, "_trainer", None)
        world = data_parallel_world(trainer) if trainer is not None else None
        local = torch.stack([torch.as_tensor(self._sum, dtype=torch.float64).cpu(),
                             torch.as_tensor(self._count, dtype=torch.float64).cpu()])
        reduce = self.mode == ALL_REDUCE or self.sync_log
        total = local
        if reduce and world is not None:
            total = world.all_reduce_sum(local)
        loss_sum, n = float(total[0]), round(float(total[1]))
        scale = None
        if self.mode == ALL_REDUCE:
            num_replicas = world.num_replicas if world is not None else 1
            scale = num_replicas / n if n else 0.0
        elif reduce and self._planned is not None and n != self._planned:
            # the step ran fewer micro-batches than planned (e.g. limit_train_batches cut it short):
            # gradients were divided by the planned count; this makes them the mean over the tokens seen
            scale = self._planned / n if n else 0.0
            self.num_corrected_steps += 1
        if scale is not None:
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.last_step_tokens = n
        self._sum, self._count, self._planned, self._open = 0.0, 0, None, False
        return torch.tensor(loss_sum / n if n else 0.0, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        """The loss's state: the settings, the counters and the optimizer step in progress (its loss sum, token
        count and planned tokens so far).

        The budget probe saves it before its passes and restores it after them, so the probe's micro-batches leave
        no trace in the training's steps.

        Returns:
            Plain Python types and, for the loss sum of a step in progress, a detached copy of its tensor; a
            ``version`` key (:data:`LOSS_STATE_VERSION`).
        """
        loss_sum = self._sum.detach().clone() if isinstance(self._sum, torch.Tensor) else float(self._sum)
        return {"version": LOSS_STATE_VERSION, "sync_log": self.sync_log, "mode": self.mode,
                "last_step_tokens": int(self.last_step_tokens), "num_corrected_steps": int(self.num_corrected_steps),
                "step_open": bool(self._open), "step_loss_sum": loss_sum, "step_tokens": int(self._count),
                "step_planned_tokens": self._planned}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (strict: other keys or another version raise).

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: missing or unknown keys, or another version, naming them.
        """
        if not isinstance(state_dict, dict):
            raise InputTypeError(f"StepTokenLoss.load_state_dict expects the dict its state_dict() returned, got "
                                 f"{type(state_dict).__name__}", parameter="state_dict")
        expected = set(self.state_dict())
        if set(state_dict) != expected:
            raise InputValueError(f"StepTokenLoss state_dict must have keys {sorted(expected)}, got "
                                  f"{sorted(state_dict)} (missing {sorted(expected - set(state_dict))}, unknown "
                                  f"{sorted(set(state_dict) - expected)})", parameter="state_dict")
        if state_dict["version"] != LOSS_STATE_VERSION:
            raise InputValueError(f"StepTokenLoss state_dict version {state_dict['version']!r} is not supported "
                                  f"(this version reads {LOSS_STATE_VERSION})", parameter="state_dict")
        self.sync_log, self.mode = bool(state_dict["sync_log"]), state_dict["mode"]
        self.last_step_tokens = int(state_dict["last_step_tokens"])
        self.num_corrected_steps = int(state_dict["num_corrected_steps"])
        self._open, self._sum = bool(state_dict["step_open"]), state_dict["step_loss_sum"]
        self._count, self._planned = int(state_dict["step_tokens"]), state_dict["step_planned_tokens"]
