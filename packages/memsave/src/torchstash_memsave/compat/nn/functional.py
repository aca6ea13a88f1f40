"""memsave_torch's functional names, in its argument order, over torchstash's functions.

``convMemSave``, ``batch_normMemSave``, ``dropoutMemSave``, ``maxpool2dMemSave`` and
``reluMemSave`` are memsave_torch's public functional API; the others are names its earlier
releases exported (``linearMemSave``, ``layer_normMemSave``, ``rms_normMemSave``, the
per-dimension convs). Each gives stock PyTorch's outputs and gradients bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ... import functional as ms

IntOrSeq = int | Sequence[int]


def convMemSave(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: IntOrSeq,
    padding: IntOrSeq | str,
    dilation: IntOrSeq,
    groups: int,
    transposed: bool,
    output_padding: IntOrSeq,
) -> torch.Tensor:
    """A convolution of any dimension (from ``weight``), transposed or not; all arguments
    required, ``groups`` before ``transposed`` as in memsave_torch."""
    return ms.conv(
        input,
        weight,
        bias,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        transposed=transposed,
        output_padding=output_padding,
    )


def _conv(nd: int) -> Any:
    def conv(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: IntOrSeq = 1,
        padding: IntOrSeq | str = 0,
        dilation: IntOrSeq = 1,
        groups: int = 1,
    ) -> torch.Tensor:
        _check_dim(weight, nd, f"conv{nd}dMemSave")
        return ms.conv(
            input, weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups
        )

    conv.__name__ = conv.__qualname__ = f"conv{nd}dMemSave"
    conv.__doc__ = f"``F.conv{nd}d``'s arguments (memsave_torch's earlier releases)."
    return conv


def _conv_transpose(nd: int) -> Any:
    def conv_transpose(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: IntOrSeq = 1,
        padding: IntOrSeq = 0,
        output_padding: IntOrSeq = 0,
        dilation: IntOrSeq = 1,
        groups: int = 1,
    ) -> torch.Tensor:
        _check_dim(weight, nd, f"conv_transpose{nd}dMemSave")
        return convMemSave(
            input, weight, bias, stride, padding, dilation, groups, True, output_padding
        )

    conv_transpose.__name__ = conv_transpose.__qualname__ = f"conv_transpose{nd}dMemSave"
    conv_transpose.__doc__ = f"``F.conv_transpose{nd}d``'s arguments, in their order."
    return conv_transpose


def _check_dim(weight: torch.Tensor, nd: int, name: str) -> None:
    if weight.dim() != nd + 2:
        raise ValueError(f"{name}: weight must be {nd + 2}-D, got {weight.dim()}-D")


conv1dMemSave = _conv(1)
conv2dMemSave = _conv(2)
conv3dMemSave = _conv(3)
conv_transpose1dMemSave = _conv_transpose(1)
conv_transpose2dMemSave = _conv_transpose(2)
conv_transpose3dMemSave = _conv_transpose(3)


#: ``F.batch_norm``'s arguments and defaults, as memsave_torch's
batch_normMemSave = ms.batch_norm


def dropoutMemSave(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout keeping its mask at 1 bit per element (memsave_torch's took no defaults)."""
    return ms.dropout(x, p, training)


#: ``F.max_pool2d``'s arguments and defaults, as memsave_torch's
maxpool2dMemSave = ms.max_pool2d


def reluMemSave(x: torch.Tensor) -> torch.Tensor:
    """ReLU keeping a 1-bit mask."""
    return ms.relu(x)


def linearMemSave(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` itself: stock already keeps the input only for the weight gradient and
    the weight only for the input gradient."""
    return F.linear(x, weight, bias)


def layer_normMemSave(
    input: torch.Tensor,
    normalized_shape: IntOrSeq,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm``'s arguments and defaults."""
    return ms.layer_norm(input, normalized_shape, weight, bias, eps)


def rms_normMemSave(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMS norm over ``weight``'s dimensions, as memsave_torch's (``eps`` default 1e-5)."""
    return ms.rms_norm(input, tuple(weight.shape), weight, eps)


__all__ = [
    "batch_normMemSave",
    "conv1dMemSave",
    "conv2dMemSave",
    "conv3dMemSave",
    "convMemSave",
    "conv_transpose1dMemSave",
    "conv_transpose2dMemSave",
    "conv_transpose3dMemSave",
    "dropoutMemSave",
    "layer_normMemSave",
    "linearMemSave",
    "maxpool2dMemSave",
    "reluMemSave",
    "rms_normMemSave",
]
