"""What the token budget probe saves before its passes and restores after them, so that the module trains as if the
probe had not run.

:class:`ModuleSnapshot` holds, bit for bit: the parameters' gradients, every buffer (BatchNorm's running statistics and
``num_batches_tracked`` move in training mode), the training mode, every random number generator a ``training_step``
may draw from (torch's CPU generator and those of the CUDA devices in use, NumPy's global one, Python's ``random``) and
the state of every :class:`~lit_balance.lightning.loss.StepTokenLoss` attribute (through its own
``state_dict()`` / ``load_state_dict()``). While it is held, ``self.log`` and
``self.log_dict`` do nothing, and the objects alive before it are frozen (``gc.freeze``), so the garbage collection
before each pass walks only what the passes made (unless the process had frozen objects itself). Parameters are not
saved: the probe never steps an optimizer.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import numpy as np
import torch

from lit_balance.lightning.loss import StepTokenLoss

__all__ = ["ModuleSnapshot"]


def _ignore(*args: Any, **kwargs: Any) -> None:
    """``self.log`` while the probe runs: nothing is logged."""


class ModuleSnapshot:
    """Save a module's training state on entry and restore it on exit (see the module docstring).

    Args:
        module: the LightningModule (any ``torch.nn.Module``).
        devices: CUDA devices whose generators to save, e.g. ``[module.device]`` on a GPU; ``()`` on a CPU.

    Example:
        >>> layer = torch.nn.BatchNorm1d(2)
        >>> with ModuleSnapshot(layer, devices=()):
        ...     _ = layer(torch.randn(4, 2))
        >>> int(layer.num_batches_tracked), layer.running_mean.tolist()
        (0, [0.0, 0.0])
    """

    def __init__(self, module: Any, devices: list | tuple = ()) -> None:
        self.module, self.devices = module, list(devices)

    def __enter__(self) -> ModuleSnapshot:
        module = self.module
        self._grads = [(p, p.grad) for p in module.parameters()]
        self._buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self._training = module.training
        self._losses = [(obj, obj.state_dict()) for obj in vars(module).values() if isinstance(obj, StepTokenLoss)]
        self._rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices],
                     np.random.get_state(), random.getstate())
        self._patched = [name for name in ("log", "log_dict") if hasattr(module, name)]
        for name in self._patched:
            object.__setattr__(module, name, _ignore)
        self._freeze = gc.get_freeze_count() == 0
        if self._freeze:
            gc.collect()
            gc.freeze()
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.collect()  # the passes' garbage (what was frozen is not walked)
        if self._freeze:
            gc.unfreeze()
        module = self.module
        for name in self._patched:
            object.__delattr__(module, name)
        for loss, saved in self._losses:
            loss.load_state_dict(saved)
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)
        module.train(self._training)
        for p, grad in self._grads:
            p.grad = grad
        cpu, cuda, numpy_state, python_state = self._rng
        torch.set_rng_state(cpu)
        for device, state in zip(self.devices, cuda):
            torch.cuda.set_rng_state(state, device)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
