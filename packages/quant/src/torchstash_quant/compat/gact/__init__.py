"""Drop-in for GACT users: ``import torchstash_quant.compat.gact as gact``.

    gact.set_optimization_level("L2")
    controller = gact.controller.Controller(model)   # also gact.Controller
    controller.install_hook()
    for batch in loader:
        ...; loss.backward(); optimizer.step()
        controller.iterate(backprop)
    controller.uninstall_hook()

with GACT's ``config``, ``set_adapt_interval`` and the submodules ``controller``, ``conf``
and ``utils`` (``get_memory_usage``, ``compute_tensor_bytes``, ``exp_recorder``).
"""

from __future__ import annotations

from . import conf, controller, utils
from .conf import LEVELS, QuantizationConfig, config, set_adapt_interval, set_optimization_level
from .controller import Controller

__all__ = [
    "LEVELS",
    "Controller",
    "QuantizationConfig",
    "conf",
    "config",
    "controller",
    "set_adapt_interval",
    "set_optimization_level",
    "utils",
]
