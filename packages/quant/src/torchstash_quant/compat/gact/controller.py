"""GACT's ``Controller(model)``: ``install_hook``, ``iterate``, ``uninstall_hook``, and
``quantize``/``dequantize`` for GACT's explicit form::

    controller = Controller(model)
    with torch.autograd.graph.saved_tensors_hooks(controller.quantize, controller.dequantize):
        ...

As in GACT, a controller changes nothing until its hooks are used (GACT's GNN benchmark
builds one for its full-precision baseline too). The level in ``gact.config`` when it is
built is applied to the model by ``install_hook``, or by the first call of ``quantize`` or
``dequantize``, through ``torchstash.apply`` (public ``saved_tensors_hooks``, sites named by
module and op, where GACT keyed tensors by call order and broke on dynamic graphs). The
model's own forward then goes through torchstash's hooks, which are innermost, so in the
explicit form ``quantize`` sees only what is saved outside the model (a loss), and keeps it as
it is; in the first forward, also what the modules already running when it was first called
save (the first layer's input, which made that call). ``iterate`` counts steps: GACT re-ran
``backprop`` three times per saved tensor to measure sensitivities, and ``quant.auto``
estimates them from the step itself, so ``backprop`` is never called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import torchstash as ts

from .conf import config, strategy


class Controller:
    def __init__(self, model: nn.Module, **options: Any) -> None:
        self.model = model
        self.options = options
        self.handle: ts.Handle | None = None
        self.iter = 0
        self.bit = config.bit
        # The level is read now, as GACT's was (a bad config fails here), and applied later.
        self._level = strategy()

    def _install(self) -> None:
        name, options = self._level
        if self.handle is None and name is not None:
            self.handle = ts.apply(self.model, name, **{**options, **self.options})

    def install_hook(self) -> None:
        """Apply the level (again, after ``uninstall_hook``)."""
        self._install()

    def uninstall_hook(self) -> None:
        """Take torchstash off the model (a later ``install_hook`` or ``quantize`` puts it
        back, as GACT's ``quantize`` kept quantizing)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def iterate(self, get_grad: Callable[[], Any] | None = None) -> None:
        """Count a step; ``get_grad`` is never called (see the module docstring)."""
        self.iter += 1

    def quantize(self, input: torch.Tensor) -> Any:
        """The explicit form's pack hook: its first call applies the level, from then on
        what the model saves goes through torchstash; anything else is kept as it is."""
        self._install()
        return input

    def dequantize(self, input: Any) -> torch.Tensor:
        self._install()
        return input

    def __del__(self) -> None:
        try:
            self.uninstall_hook()
        except Exception:  # at interpreter shutdown
            pass
