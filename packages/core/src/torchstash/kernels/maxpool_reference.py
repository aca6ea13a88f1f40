"""The pure-PyTorch definition of ``max_pool2d_code`` and its backward (the golden model of
``csrc/cpu/maxpool_cpu.cpp``): ATen's pool with indices, each index coded as its offset from
its window's first element through the caller's table, packed; and back, the positions as
indices into ATen's backward. ``window_code`` and ``window_indices`` code a stock pool's
indices so, and back (``torchstash.windows.encode_positions`` and ``decode_positions``, in
their int32 arithmetic where a plane has fewer than 2^31 elements)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .reference import pack_bits_ref, unpack_bits_ref

__all__ = [
    "max_pool2d_code_backward_ref",
    "max_pool2d_code_ref",
    "pool_output_size",
    "window_code_ref",
    "window_firsts",
    "window_indices_ref",
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


def _index_type(plane: Sequence[int]) -> torch.dtype:
    return torch.int32 if int(plane[0]) * int(plane[1]) < 2**31 else torch.int64


def _code_offsets(
    plane: Sequence[int],
    kernel: Sequence[int],
    dilation: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Position ``i * kernel_w + j`` -> its offset ``i * dilation_h * W + j * dilation_w``,
    made on ``device`` (no copy from host values: on CUDA one would wait for the device)."""
    rows = torch.arange(kernel[0], dtype=dtype, device=device) * (dilation[0] * int(plane[1]))
    cols = torch.arange(kernel[1], dtype=dtype, device=device) * dilation[1]
    return (rows.view(-1, 1) + cols.view(1, -1)).reshape(-1)


def window_code_ref(
    indices: torch.Tensor,
    table: torch.Tensor,
    plane: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the indices' positions packed at ``bits``, whether every position gives its index
    back: a 0-dim bool)."""
    itype = _index_type(plane)
    firsts = window_firsts(indices.shape[-2:], int(plane[1]), stride, padding, indices.device)
    firsts = firsts.to(itype)
    relative = indices.to(itype, copy=True).sub_(firsts).clamp_(0, table.numel() - 1)
    codes = torch.index_select(table, 0, relative.reshape(-1)).view(indices.shape)
    offsets = _code_offsets(plane, kernel, dilation, itype, indices.device)
    found = torch.index_select(offsets, 0, codes.reshape(-1).to(itype)).view(indices.shape)
    exact = found.add_(firsts).long().eq(indices).all()  # on the device: no wait here
    return pack_bits_ref(codes.reshape(-1), bits), exact


def window_indices_ref(
    packed: torch.Tensor,
    size: Sequence[int],
    plane: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    bits: int,
) -> torch.Tensor:
    """The int64 indices of :func:`window_code_ref`'s positions."""
    itype = _index_type(plane)
    numel = 1
    for n in size:
        numel *= n
    codes = unpack_bits_ref(packed, bits, numel).view(*size)
    firsts = window_firsts(codes.shape[-2:], int(plane[1]), stride, padding, packed.device)
    offsets = _code_offsets(plane, kernel, dilation, itype, packed.device)
    found = torch.index_select(offsets, 0, codes.reshape(-1).to(itype)).view(codes.shape)
    return found.add_(firsts.to(itype)).long()
