"""The pure-PyTorch definition of ``max_pool2d_code`` and its backward (the golden model of
``csrc/cpu/maxpool_cpu.cpp``): ATen's pool with indices, each index coded as its offset from
its window's first element through the caller's table, packed; and back, the positions as
indices into ATen's backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .reference import pack_bits_ref, unpack_bits_ref

__all__ = [
    "max_pool2d_code_backward_ref",
    "max_pool2d_code_ref",
    "pool_output_size",
    "window_firsts",
]

aten = torch.ops.aten


def pool_output_size(
    size: Any, kernel: int, padding: int, stride: int, dilation: int, ceil_mode: bool
) -> Any:
    """ATen's ``pooling_output_shape``: how many windows fit along a dim (symbolic sizes too)."""
    span = dilation * (kernel - 1) + 1
    out = (size + 2 * padding - span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out = out - 1
    return out


def window_firsts(
    out_sizes: Sequence[int],
    width: int,
    stride: Sequence[int],
    padding: Sequence[int],
    device: torch.device,
) -> torch.Tensor:
    """(OH, OW) int64: the flat index in the input plane of each window's first element
    (row ``oh * stride - padding``, column likewise; outside the plane where it is padded)."""
    rows = torch.arange(out_sizes[0], device=device) * stride[0] - padding[0]
    cols = torch.arange(out_sizes[1], device=device) * stride[1] - padding[1]
    return rows.view(-1, 1) * width + cols.view(1, -1)


def max_pool2d_code_ref(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    table: torch.Tensor,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pool's output, the argmax positions packed at ``bits``, the outputs' flat order)."""
    out, indices = aten.max_pool2d_with_indices(
        x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode
    )
    firsts = window_firsts(indices.shape[-2:], x.shape[-1], stride, padding, x.device)
    offsets = (indices - firsts).clamp_(0, table.numel() - 1)
    codes = table[offsets.reshape(-1)]
    return out, pack_bits_ref(codes, bits)


def max_pool2d_code_backward_ref(
    grad: torch.Tensor,
    packed: torch.Tensor,
    input_size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    bits: int,
) -> torch.Tensor:
    """The input's gradient: each position ``i * kernel_w + j`` back to the index
    ``first + i * dilation_h * W + j * dilation_w``, then ATen's backward."""
    codes = unpack_bits_ref(packed, bits, grad.numel()).view(grad.shape).long()
    width = int(input_size[-1])
    firsts = window_firsts(grad.shape[-2:], width, stride, padding, grad.device)
    rows, cols = codes // kernel[1], codes % kernel[1]
    indices = firsts + rows * (dilation[0] * width) + cols * dilation[1]
    # read for its sizes only; zero strides say 'contiguous' to ATen's memory-format guess
    shape_of_input = grad.new_empty(()).expand(*input_size)
    return aten.max_pool2d_with_indices_backward(
        grad,
        shape_of_input,
        list(kernel),
        list(stride),
        list(padding),
        list(dilation),
        ceil_mode,
        indices,
    )
