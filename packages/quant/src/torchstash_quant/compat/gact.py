"""Drop-in for GACT users: ``Controller(model)`` with ``install_hook``, ``iterate``, ``uninstall_hook``.

    import torchstash_quant.compat.gact as gact
    gact.set_optimization_level("L1")        # 4-bit
    controller = gact.Controller(model)
    controller.install_hook()
    for batch in loader:
        ...; loss.backward(); optimizer.step()
        controller.iterate(backprop)          # kept for compatibility
    controller.uninstall_hook()

GACT registered private hook APIs and keyed tensors by call order; here the model goes through
``torchstash.apply`` (public ``saved_tensors_hooks``, sites named by module and op). GACT's
adaptive levels (L2, L2.1, L2.2: budgets of 4, 3 and 2 bits) are ``quant.auto``; its
allocation needs no extra backward passes, so ``iterate``'s ``backprop`` is never called. L3
adds swapping to host memory (``offload.cpu``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

import torchstash as ts
from torchstash.errors import OptionError

#: GACT level -> torchstash strategy and options.
LEVELS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "L0": None,
    "L1": ("quant.int4", {}),
    "L1.1": ("quant.int8", {}),
    "L1.2": ("quant.int2", {}),
    "L2": ("quant.auto", {"budget": 4}),
    "L2.1": ("quant.auto", {"budget": 3}),
    "L2.2": ("quant.auto", {"budget": 2}),
    "L3": ("quant.auto>offload.cpu", {"quant.auto": {"budget": 4}}),
}


class _Config:
    level = "L1"


config = _Config()


def set_optimization_level(level: str) -> None:
    if level not in LEVELS:
        raise OptionError(f"unknown GACT level {level!r}; use one of {', '.join(LEVELS)}")
    config.level = level


class Controller:
    def __init__(self, model: nn.Module, **options: Any) -> None:
        self.model = model
        self.options = options
        self.handle: ts.Handle | None = None
        self.iterations = 0

    def install_hook(self) -> None:
        chosen = LEVELS[config.level]
        if self.handle is None and chosen is not None:
            strategy, options = chosen
            self.handle = ts.apply(self.model, strategy, **{**options, **self.options})

    def iterate(self, backprop: Callable[[], Any] | None = None) -> None:
        """Counts steps. GACT re-ran ``backprop`` to measure sensitivities; ``quant.auto``
        estimates them from the step itself, so ``backprop`` is never called."""
        self.iterations += 1

    def uninstall_hook(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
