"""Drop-in for ActNN users: ``import torchstash_quant.compat.actnn as actnn``.

    actnn.set_optimization_level("L3")
    model = actnn.QModule(model)          # weights kept (ActNN built fresh layers)
    layer = actnn.QConv2d(3, 64, 3)       # quantizes its own saves, as ActNN's did

with ActNN's ``config``, ``QScheme``/``QBNScheme`` (the class attributes its users set),
``get_memory_usage``, ``compute_tensor_bytes``, ``exp_recorder`` and ``DataLoader``, and its
submodules ``conf``, ``layers``, ``module``, ``qscheme``, ``qbnscheme``, ``utils``,
``dataloader``.
"""

from __future__ import annotations

from . import conf, dataloader, layers, module, qbnscheme, qscheme, utils
from .conf import QuantizationConfig, config, set_optimization_level
from .dataloader import DataLoader
from .layers import *  # noqa: F403 (the Q-layers: layers.__all__)
from .module import QModule
from .qbnscheme import QBNScheme
from .qscheme import QScheme
from .utils import compute_tensor_bytes, exp_recorder, get_memory_usage

__all__ = [
    *layers.__all__,
    "DataLoader",
    "QBNScheme",
    "QModule",
    "QScheme",
    "QuantizationConfig",
    "compute_tensor_bytes",
    "conf",
    "config",
    "dataloader",
    "exp_recorder",
    "get_memory_usage",
    "layers",
    "module",
    "qbnscheme",
    "qscheme",
    "set_optimization_level",
    "utils",
]
