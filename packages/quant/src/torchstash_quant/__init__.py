"""torchstash-quant: activation quantization for torchstash.

Strategies: ``quant.int8``, ``quant.int4``, ``quant.int2``, ``quant.int1`` (and ``quant`` with
``bits=``), ``quant.auto`` (mixed precision under a budget), ``quant.mesa``, ``quant.fp8``. Each also stores ReLU results as exact sign bits
and bool masks as bits. Found through the ``torchstash.plugins`` entry point ``quant``.
"""

from __future__ import annotations

from ._version import __version__
from .fp8 import Fp8Quantizer
from .groupwise import GroupQuantizer
from .mesa_codec import MesaQuantizer
from .opaware import OpAware
from .strategies import register

__all__ = [
    "Fp8Quantizer",
    "GroupQuantizer",
    "MesaQuantizer",
    "OpAware",
    "__version__",
    "register",
]
