"""memsave's functional API: stock PyTorch layers that save only what this step's gradients need.

Each function takes the arguments of its ``torch.nn.functional`` namesake (``conv`` and
``module_batch_norm`` take the modules' state) and returns stock's outputs and gradients bit
for bit on CPU. It decides at run time, from which of its inputs require grad, what to keep
for the backward; where autograd records nothing (``no_grad``, nothing trainable), or where it
would keep all stock keeps (a conv or norm whose weight trains), it calls stock PyTorch
unchanged. The ``*Function`` classes behind them live in the submodules.

Not here because stock saves nothing to spare: Linear (it keeps the input only for the weight
gradient and the weight only for the input gradient), Embedding (the indices) and feature
dropout (one noise value per sample and channel).
"""

from __future__ import annotations

from .act import hardtanh, leaky_relu, relu, relu6
from .conv import conv
from .dropout import alpha_dropout, dropout
from .norm import batch_norm, group_norm, layer_norm, module_batch_norm, rms_norm
from .pool import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    avg_pool1d,
    avg_pool2d,
    avg_pool3d,
    max_pool1d,
    max_pool2d,
    max_pool3d,
)

__all__ = [
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "alpha_dropout",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "batch_norm",
    "conv",
    "dropout",
    "group_norm",
    "hardtanh",
    "layer_norm",
    "leaky_relu",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "module_batch_norm",
    "relu",
    "relu6",
    "rms_norm",
]
