"""Drop-in for Mesa users: ``import torchstash_quant.compat.mesa as ms``.

    ms.policy.convert_by_num_groups(model, 3)
    ms.policy.deploy_on_init(model, "policy.txt", verbose=print)
    self.act = ms.GELU(quant_groups=3)          # optional: per-layer groups

with Mesa's modules ``custom_quant`` (``Quant`` for layers of one's own), ``packbit`` and
``cc`` (``custom_conv``), and :class:`MesaQuantizer`, the ``quant.mesa`` codec.
"""

from __future__ import annotations

from ...mesa_codec import MesaQuantizer
from . import custom_conv, custom_quant, packbit, policy
from .layers import GELU, BatchNorm2d, Conv2d, LayerNorm, Linear, MatMul, ReLU, Softmax

cc = custom_conv
version = 1.0

__all__ = [
    "GELU",
    "BatchNorm2d",
    "Conv2d",
    "LayerNorm",
    "Linear",
    "MatMul",
    "MesaQuantizer",
    "ReLU",
    "Softmax",
    "cc",
    "custom_conv",
    "custom_quant",
    "packbit",
    "policy",
    "version",
]
