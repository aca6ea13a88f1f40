"""Drop-in for Mesa users: ``import torchstash_quant.compat.mesa as ms``.

    ms.policy.convert_by_num_groups(model, 3)
    ms.policy.deploy_on_init(model, "policy.txt", verbose=print)
    self.act = ms.GELU(quant_groups=3)          # optional: per-layer groups

and :class:`MesaQuantizer`, the ``quant.mesa`` codec.
"""

from __future__ import annotations

from ...mesa_codec import MesaQuantizer
from . import policy
from .layers import GELU, BatchNorm2d, Conv2d, LayerNorm, Linear, MatMul, ReLU, Softmax

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
    "policy",
]
