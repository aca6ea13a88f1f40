"""torchstash-memsave: layers that save only what this step's gradients need.

The ``memsave`` strategy swaps each convolution, normalization, ReLU-family activation,
dropout and pooling layer for a subclass (in place: Parameters, buffers and ``state_dict``
keys are the module's own) whose autograd Function decides at run time, from
``ctx.needs_input_grad``, what to keep: a frozen conv keeps no input, an eval BatchNorm keeps
no input unless its weight trains, a ReLU keeps a 1-bit mask, a max-pool a 2 to 8-bit index.
Gradients equal stock PyTorch's bit for bit (the backward calls stock's own backward ops).

``convert_to_memory_saving(model, ...)`` and the ``MemSave*`` classes with ``from_nn_*``
constructors are the drop-in for memsave_torch's users.
"""

from __future__ import annotations

from ._version import __version__
from .compat import convert_to_memory_saving
from .modules import (
    MemSave,
    MemSaveAdaptiveAvgPool1d,
    MemSaveAdaptiveAvgPool2d,
    MemSaveAdaptiveAvgPool3d,
    MemSaveAlphaDropout,
    MemSaveAvgPool1d,
    MemSaveAvgPool2d,
    MemSaveAvgPool3d,
    MemSaveBatchNorm1d,
    MemSaveBatchNorm2d,
    MemSaveBatchNorm3d,
    MemSaveConv1d,
    MemSaveConv2d,
    MemSaveConv3d,
    MemSaveConvTranspose1d,
    MemSaveConvTranspose2d,
    MemSaveConvTranspose3d,
    MemSaveDropout,
    MemSaveGroupNorm,
    MemSaveHardtanh,
    MemSaveLayerNorm,
    MemSaveLeakyReLU,
    MemSaveMaxPool1d,
    MemSaveMaxPool2d,
    MemSaveMaxPool3d,
    MemSaveReLU,
    MemSaveReLU6,
    MemSaveRMSNorm,
    MemSaveSyncBatchNorm,
)
from .rewriter import MemSaveRewriter
from .strategies import register

__all__ = [
    "MemSave",
    "MemSaveAdaptiveAvgPool1d",
    "MemSaveAdaptiveAvgPool2d",
    "MemSaveAdaptiveAvgPool3d",
    "MemSaveAlphaDropout",
    "MemSaveAvgPool1d",
    "MemSaveAvgPool2d",
    "MemSaveAvgPool3d",
    "MemSaveBatchNorm1d",
    "MemSaveBatchNorm2d",
    "MemSaveBatchNorm3d",
    "MemSaveConv1d",
    "MemSaveConv2d",
    "MemSaveConv3d",
    "MemSaveConvTranspose1d",
    "MemSaveConvTranspose2d",
    "MemSaveConvTranspose3d",
    "MemSaveDropout",
    "MemSaveGroupNorm",
    "MemSaveHardtanh",
    "MemSaveLayerNorm",
    "MemSaveLeakyReLU",
    "MemSaveMaxPool1d",
    "MemSaveMaxPool2d",
    "MemSaveMaxPool3d",
    "MemSaveRMSNorm",
    "MemSaveReLU",
    "MemSaveReLU6",
    "MemSaveRewriter",
    "MemSaveSyncBatchNorm",
    "__version__",
    "convert_to_memory_saving",
    "register",
]
